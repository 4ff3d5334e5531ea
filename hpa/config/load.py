"""YAML + dotted overrides -> a validated, frozen ``Config``.

Every key is checked against the dataclasses in ``schema``: an unknown key names the closest valid
ones, a wrong type names the expected one, and both say where the value came from (``file:line`` or
``command line``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import yaml

import hpa

from .errors import ConfigError, closest
from .schema import Config, to_dict, validate
from .startup import check_paths, config_warnings
from .values import check_field

__all__ = ["load_config", "build", "parse_overrides", "write_resolved", "default_config_path"]

_Sources = Dict[str, str]  # dotted key -> "file:line" or "command line"


class _Empty:
    """The value of ``key=`` on the command line (often an unset shell variable): the empty string for a
    string key, an error for any other, never a silent null (``key=null`` is null)."""

    def __repr__(self) -> str:
        return "''"


EMPTY = _Empty()


def default_config_path() -> Path:
    """The embedded default, ``configs/tiny_cpu.yaml``.

    Installed wheels carry ``configs/`` as the package ``hpa.configs``; an editable install (or a
    source checkout) reads it next to the ``hpa`` package.
    """
    import importlib.util

    source_tree = Path(hpa.__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"
    if source_tree.is_file():
        return source_tree
    spec = importlib.util.find_spec("hpa.configs")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("--config", "the embedded default configs are not installed; pass --config")
    return Path(list(spec.submodule_search_locations)[0]) / "tiny_cpu.yaml"


def _yaml_with_lines(path: Path) -> Tuple[dict, _Sources]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc}", source="command line") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError("<yaml>", f"cannot parse YAML: {exc}", source=where) from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError("<root>", "the top level must be a mapping of sections", source=str(path))
    sources: _Sources = {}

    def walk(n, prefix):
        if isinstance(n, yaml.MappingNode):
            for key_node, value_node in n.value:
                key = f"{prefix}{key_node.value}"
                sources[key] = f"{path}:{key_node.start_mark.line + 1}"
                walk(value_node, key + ".")

    walk(node, "")
    return data, sources


def parse_overrides(overrides: Iterable[str]) -> List[Tuple[str, Any]]:
    """``["a.b=1", "c=[1, 2]"]`` -> ``[("a.b", 1), ("c", [1, 2])]``; values are parsed as YAML, an empty one
    (``a.b=``) is ``EMPTY``."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "a command-line override must look like section.key=value",
                              source="command line")
        key, _, raw = item.partition("=")
        key = key.strip()
        if not key:
            raise ConfigError(item, "empty key in override", source="command line")
        try:
            value = yaml.safe_load(raw) if raw.strip() else EMPTY
        except yaml.YAMLError as exc:
            raise ConfigError(key, f"cannot parse value {raw!r}: {exc}", source="command line") from None
        parsed.append((key, value))
    return parsed


def _set_dotted(data: dict, key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(key, f"'{part}' is a value, not a section", source="command line")
        node = child
    node[parts[-1]] = value


def _strip_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp, key: str, sources: _Sources):
    src = sources.get(key)
    tp, optional = _strip_optional(tp)
    if value is EMPTY:  # a required string may be empty; anything else is an error, never a silent null
        if tp is str and not optional:
            return ""
        raise ConfigError(key, f"is empty on the command line (an unset shell variable?); give a "
                               f"{_type_name(tp)}" + (f", or {key}=null for null" if optional else ""), source=src)
    if value is None:
        if optional:
            return None
        raise ConfigError(key, f"must be a {_type_name(tp)}, not null", source=src)
    if value is False and key in OFF_WORDS:  # YAML 1.1 reads an unquoted `off` as false
        return "off"
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a section (mapping) of {tp.__name__}, got "
                                   f"{type(value).__name__} {value!r}", source=src)
        return _build_dataclass(tp, value, key + ".", sources)
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"must be a list, got {type(value).__name__} {value!r}", source=src)
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        return tuple(_convert(v, item_tp, f"{key}[{i}]", {**sources, f"{key}[{i}]": src})
                     for i, v in enumerate(value))
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise TypeError(f"unsupported config field type {tp!r} at {key}")
    raise ConfigError(key, f"must be of type {_type_name(tp)}, got {type(value).__name__} {value!r}",
                      source=src)


# keys that moved, with where they went: a config written for an older hpa gets told
MOVED_KEYS = {
    "reward.filter": "the rollout filter is algorithm.rollout_filter now (reward.filter.mode: top_std is "
                     "algorithm.rollout_filter.name: reward_above_mean_std, with k; see docs/training.md)",
    "algorithm.ppo.rollout_is_threshold": "the truncated importance weight is algorithm.rollout_correction now "
                                          "(the same weights: algorithm.rollout_correction.rollout_is=token and "
                                          "algorithm.rollout_correction.rollout_is_threshold=<the value>; they "
                                          "also weight the KL terms; see docs/objective.md)",
}

_REGIME = ("algorithm.hpa.trust.regime (auto: each controller where its inputs are given, as enabled: null did; "
           "gate | coverage: that one alone; off: neither)")
# str keys with the choice "off", which YAML reads as false unquoted
OFF_WORDS = ("algorithm.hpa.trust.regime",)

# the trust sections folded into algorithm.hpa.trust: each old leaf, and its key there or the constant it became
MOVED_SECTIONS = {
    "algorithm.hpa.gate": {
        "enabled": _REGIME, "signal": "algorithm.hpa.trust.signal", "slack": "algorithm.hpa.trust.slack",
        **{k: f"the constant {c} of hpa.algorithms.gate (delete the key)" for k, c in (
            ("kp", "GATE_KP"), ("ki", "GATE_KI"), ("reward_ema", "GATE_REWARD_EMA"),
            ("baseline_steps", "GATE_BASELINE_STEPS"), ("baseline_prompts", "GATE_BASELINE_PROMPTS"),
            ("headroom_scale", "GATE_HEADROOM_SCALE"))},
    },
    "algorithm.hpa.coverage": {
        "enabled": _REGIME,
        **{k: f"algorithm.hpa.trust.{k}" for k in ("margin", "kl_boost", "hold_min_skill", "released_kl",
                                                  "released_pairs")},
        **{k: f"the constant {c} of hpa.algorithms.coverage (delete the key)" for k, c in (
            ("space", "COVERAGE_SPACE"), ("k", "COVERAGE_K"), ("low_quantile", "COVERAGE_LOW_QUANTILE"),
            ("high_quantile", "COVERAGE_HIGH_QUANTILE"), ("kl_boost_shape", "KL_BOOST_SHAPE"),
            ("kl_boost_target", "KL_BOOST_TARGET"))},
    },
}


def _moved_section(full: str, value: Any, sources: _Sources) -> ConfigError:
    """The error for the first key of a section folded into another (``MOVED_SECTIONS``), naming where it went."""
    leaves = MOVED_SECTIONS[full]
    leaf = str(next(iter(value))) if isinstance(value, dict) and value else next(iter(leaves))
    key = f"{full}.{leaf}"
    where = leaves.get(leaf, f"algorithm.hpa.trust (the keys of {full} that remain)")
    return ConfigError(key, f"was removed; it is now {where}", source=sources.get(key) or sources.get(full))


def build_section(cls, data: dict, prefix: str = ""):
    """One section of a config (``cls``, e.g. ``ModelConfig``) from plain nested data, checked as the YAML's
    keys are: a recorded section (a converted checkpoint's model) gets its nested dataclasses back."""
    return _build_dataclass(cls, data, prefix, {})


def _build_dataclass(cls, data: dict, prefix: str, sources: _Sources):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            full = f"{prefix}{key}"
            if full in MOVED_KEYS:
                raise ConfigError(full, f"unknown key: {MOVED_KEYS[full]}", source=sources.get(full))
            if full in MOVED_SECTIONS:
                raise _moved_section(full, data[key], sources)
            raise ConfigError(full, f"unknown key; closest valid keys: "
                                    f"{', '.join(prefix + c for c in closest(str(key), fields))}",
                              source=sources.get(full))
    kwargs = {}
    for name, f in fields.items():
        full = f"{prefix}{name}"
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], full, sources)
            try:
                check_field(f, kwargs[name], full)
            except ConfigError as exc:
                raise ConfigError(exc.key, exc.message, source=sources.get(full)) from None
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(full, "is required and has no default; set it in the YAML or as "
                                    f"{full}=VALUE", source=sources.get(prefix.rstrip(".")))
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        full = f"{prefix}{exc.key}"
        raise ConfigError(full, exc.message, source=exc.source or source_of(full, sources)) from None


def source_of(key: str, sources: _Sources, origin: Optional[str] = None) -> str:
    """Where ``key``'s value came from: its own line or the command line; else the nearest section's;
    else ``origin`` (the config file) as a default."""
    parts = key.split(".")
    while parts:
        found = sources.get(".".join(parts))
        if found:
            return found
        parts.pop()
    return f"{origin} (default value)" if origin else "default value"


def build(data: dict, sources: Optional[_Sources] = None, world_size: Optional[int] = None,
          origin: Optional[str] = None) -> Config:
    """Turn plain nested data into a ``Config`` and run ``validate``: every check that needs no world size,
    and with ``world_size`` the layout checks too. Every error names its key's source (``origin``: the
    config file, for keys left at their default)."""
    sources = sources or {}
    try:
        cfg = _build_dataclass(Config, data, "", sources)
        validate(cfg, world_size)
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.message, source=exc.source or source_of(exc.key, sources, origin)) from None
    return cfg


def _resolve_paths(data: dict, base: Path) -> None:
    """Relative data paths are taken relative to the config file's directory."""
    section = data.get("data")
    if not isinstance(section, dict):
        return
    for key, value in section.items():
        if key.endswith("_path") and isinstance(value, str) and value and not os.path.isabs(value):
            candidate = base / value
            if candidate.exists():
                section[key] = str(candidate.resolve())


def load_config(path: Optional[os.PathLike] = None, overrides: Iterable[str] = (),
                world_size: Optional[int] = None, command: Optional[str] = None, warn: bool = True) -> Config:
    """Load ``path`` (default: the embedded tiny_cpu.yaml), apply dotted overrides and validate.

    Args:
        path: a YAML file. Relative ``data.*_path`` values are resolved against its directory when
            the file exists there, else against the working directory.
        overrides: ``section.key=value`` strings, applied in order (values parsed as YAML).
        world_size: when given, the data-parallel checks (batch sizes divisible by DP) run too; every other
            check always runs.
        command: ``train``, ``sft``, ``train-rm``, ``generate`` or ``serve``: also check the paths that command reads
            (``hpa.config.startup.check_paths``) and, with ``warn``, print the warnings of ``config_warnings``
            (rank 0).
    """
    path = Path(path) if path is not None else default_config_path()
    if path.is_dir():
        raise ConfigError("--config", f"{path} is a directory; give a YAML file", source="command line")
    if not path.is_file():
        raise ConfigError("--config", f"no such config file: {path}", source="command line")
    data, sources = _yaml_with_lines(path)
    _resolve_paths(data, path.parent)
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
        sources[key] = "command line"
    cfg = build(data, sources, world_size, origin=str(path))
    if command is not None:
        _startup(cfg, command, sources, str(path), warn)
    return cfg


def _startup(cfg: Config, command: str, sources: _Sources, origin: str, warn: bool) -> None:
    try:
        check_paths(cfg, command)
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.message, source=source_of(exc.key.split("[")[0], sources, origin)) from None
    if warn and os.environ.get("RANK", "0") == "0":
        for key, message in config_warnings(cfg):
            print(f"hpa {command}: warning: {source_of(key, sources, origin)}: config key '{key}': {message}",
                  file=sys.stderr, flush=True)


def write_resolved(cfg: Config, run_dir: os.PathLike) -> Path:
    """Write the resolved config to ``run_dir/config.yaml`` (loadable again with load_config)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    tmp = out.with_suffix(f".yaml.tmp{os.getpid()}")  # one per process: ranks may write the same file
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    os.replace(tmp, out)
    return out
