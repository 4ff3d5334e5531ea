"""Start-up checks of a config against the file system, and warnings for values that are valid but make a
run pathological. Both name the key; ``hpa.config.load.load_config(command=...)`` runs them with the keys'
sources (file:line or command line).
"""

from __future__ import annotations

import filecmp
import json
import math
import os
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

from .errors import ConfigError
from .schema import Config, demonstrations_needed

# what each command reads: (dotted key, "file" | "dir" | "any"); an unset optional key is skipped
_TOKENIZER = ("data.tokenizer_path", "any")
_POLICY = (("model.policy_path", "any"), ("model.lora.adapter_path", "dir"))
PATHS_READ = {
    "train": (_TOKENIZER, ("data.prompt_path", "file"), ("data.preference_path", "file"),
              ("data.eval_prompt_path", "file"), ("data.adversarial_prompt_path", "file"),
              ("data.heldout_preference_path", "file"), ("reward.model_paths", "dir"), *_POLICY,
              ("model.reference_path", "any"), ("model.critic_path", "any")),
    "sft": (_TOKENIZER, ("data.sft_path", "file"), *_POLICY),
    "train-rm": (_TOKENIZER, ("data.preference_path", "file"), ("reward.training.eval_path", "file"),
                 ("reward.training.init_path", "dir"), ("reward.training.backbone_path", "any")),
    "serve": (_TOKENIZER, *_POLICY, ("model.reference_path", "any")),
    "generate": (_TOKENIZER, *_POLICY, ("model.reference_path", "any")),
}
REQUIRED = {"sft": ("data.sft_path",), "serve": ("model.policy_path",), "generate": ("model.policy_path",)}
# the adapter checkpoint's record beside its shards (hpa.models.lora.MARKER); a run checkpoint holds it in policy/
LORA_RECORD = "lora.json"
RUN_CHECKPOINT_MANIFEST = "manifest.json"  # hpa.models.weights.MANIFEST
LATEST = "latest"  # the pointer to the newest run checkpoint (hpa.trainer.checkpoint)
# what a command reads only when a feature is on: (command, the feature's test, the path's entry)
PATHS_READ_WHEN = (("train", demonstrations_needed, ("data.sft_path", "file")),)
_KIND_WORD = {"file": "a file", "dir": "a directory", "any": "a file or directory"}


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_paths(cfg: Config, command: str) -> None:
    """Raise a ConfigError naming the key of the first path ``command`` reads that does not exist or is
    of the wrong kind."""
    for key in REQUIRED.get(command, ()):
        if _get(cfg, key) is None:
            raise ConfigError(key, f"hpa {command} reads it and it is not set; give a path")
    when = tuple(entry for name, on, entry in PATHS_READ_WHEN if name == command and on(cfg))
    for key, kind in PATHS_READ[command] + when:
        value = _get(cfg, key)
        values = value if isinstance(value, tuple) else (value,)
        for i, path in enumerate(values):
            if path is None:
                continue
            item = f"{key}[{i}]" if isinstance(value, tuple) else key
            if not os.path.exists(path):
                raise ConfigError(item, f"{path!r} does not exist (relative paths: to the config file's "
                                        f"directory for data.*, else to the working directory {os.getcwd()}); "
                                        f"give {_KIND_WORD[kind]} that hpa {command} reads")
            if kind == "file" and not os.path.isfile(path):
                raise ConfigError(item, f"{path!r} is a directory; give a file")
            if kind == "dir" and not os.path.isdir(path):
                raise ConfigError(item, f"{path!r} is a file; give a checkpoint directory")
    _check_adapters(cfg, command)
    _check_resume(cfg, command)
    _check_reward_models(cfg)


def _check_adapters(cfg: Config, command: str) -> None:
    """``model.lora.adapter_path`` is an adapter checkpoint of ``model.lora``'s rank, scaling and targets over a
    base of ``model``'s shape (its record, as ``hpa.models.lora_io.load_adapters`` reads it), and ``hpa
    generate``/``serve`` with LoRA on have one: told before the base loads, which on a large base takes minutes."""
    lora, key = cfg.model.lora, "model.lora.adapter_path"
    if command in ("generate", "serve") and lora.enabled:
        if lora.adapter_path is None:
            raise ConfigError(key, f"hpa {command} with model.lora.rank {lora.rank} serves trained adapters and it "
                                   "is not set; give a LoRA run's checkpoint (<run_dir>/checkpoints/step_N), or "
                                   "model.lora.rank=0 to use the base alone")
    if lora.adapter_path is None:
        return
    path = lora.adapter_path
    if os.path.isfile(os.path.join(path, RUN_CHECKPOINT_MANIFEST)) and os.path.isdir(os.path.join(path, "policy")):
        path = os.path.join(path, "policy")
    if not os.path.isfile(os.path.join(path, LORA_RECORD)):
        raise ConfigError(key, f"{lora.adapter_path!r} is not a LoRA adapter checkpoint (no {LORA_RECORD}); give a "
                               "LoRA run's checkpoint (<run_dir>/checkpoints/step_N) or an 'hpa convert "
                               "peft-to-megatron' output")
    mismatch = lora_record_mismatch(_read_record(key, path), path, rank=lora.rank, scaling=lora.scaling,
                                    targets=lora.target_modules, shape=base_shape(cfg.model))
    if mismatch is not None:
        raise ConfigError(key, "%s: %s" % mismatch)


def _check_resume(cfg: Config, command: str) -> None:
    """The checkpoint ``checkpoint.resume`` loads exists and holds what ``model`` and ``model.lora`` build: a LoRA
    checkpoint's record (``lora.json``) gives its adapters' rank, scaling, targets and base shape, so another
    setting is told before any model is built (``hpa.trainer.checkpoint.CheckpointManager.load`` checks again,
    with the base's weights, after the build)."""
    resume = cfg.checkpoint.resume
    if command != "train" or resume == "never":
        return
    if resume != "auto" and not os.path.isfile(os.path.join(resume, RUN_CHECKPOINT_MANIFEST)):
        raise ConfigError("checkpoint.resume", f"{resume!r} is not a complete run checkpoint (no "
                                               f"{RUN_CHECKPOINT_MANIFEST}); give <run_dir>/checkpoints/step_N, "
                                               "'auto' or 'never'")
    path = resume_checkpoint(cfg.checkpoint.resume, cfg.checkpoint.dir, cfg.trainer.run_dir)
    if path is None:
        return
    lora = cfg.model.lora
    loads = f"checkpoint.resume={resume} loads {path}" if resume == "auto" else f"checkpoint.resume gives {path}"
    new_run = "or set checkpoint.resume=never (or another trainer.run_dir) to start a new run"
    loaded = ("policy", "critic") if cfg.algorithm.advantage.estimator == "gae" else ("policy",)
    for directory in (os.path.join(path, name) for name in loaded):
        if not os.path.isdir(directory):
            continue
        if not os.path.isfile(os.path.join(directory, LORA_RECORD)):
            if lora.enabled:
                raise ConfigError("model.lora.rank", f"{lora.rank}, but {loads}, a full-model checkpoint (no "
                                                     f"{LORA_RECORD} in {directory}); resume it with model.lora.rank: "
                                                     f"0, start a LoRA run from it with model.policy_path, {new_run}")
            continue
        info = _read_record("checkpoint.resume", directory)
        if not lora.enabled:
            raise ConfigError("model.lora.rank", f"0, but {loads}, whose {directory} holds LoRA adapters "
                                                 f"({LORA_RECORD}); set model.lora.rank: {info.get('rank')} and the "
                                                 f"alpha and target_modules of its run's config.yaml, {new_run}")
        mismatch = lora_record_mismatch(info, directory, rank=lora.rank, scaling=lora.scaling,
                                        targets=lora.target_modules, shape=base_shape(cfg.model))
        if mismatch is not None:
            raise ConfigError(mismatch[0], f"{mismatch[1]}, {new_run} ({loads})")


def checkpoint_candidates(root) -> List[Path]:
    """The run checkpoints ``step_N`` under ``root``, newest first (the ``latest`` pointer's target first); those
    of saves that did not finish (``.tmp``) are none."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
                   key=lambda p: p.name, reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if target in found:
            found.remove(target)
            found.insert(0, target)
    return found


def checkpoint_root(checkpoint_dir: Optional[str], run_dir) -> Path:
    """Where a run's checkpoints go: ``checkpoint.dir``, else ``<trainer.run_dir>/checkpoints``."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / "checkpoints"


def resume_checkpoint(resume: str, checkpoint_dir: Optional[str], run_dir: str) -> Optional[Path]:
    """The checkpoint ``checkpoint.resume`` loads, as far as its files tell without reading the shards: a path
    as given, ``auto`` the first candidate with a manifest, ``never`` None. (``CheckpointManager.find_resumable``
    also verifies every file's checksum and, under ``auto``, falls back to an older one when one fails.)"""
    if resume == "never":
        return None
    if resume != "auto":
        return Path(resume)
    return next((p for p in checkpoint_candidates(checkpoint_root(checkpoint_dir, run_dir)) if (p / RUN_CHECKPOINT_MANIFEST).is_file()), None)


def _read_record(key: str, directory: str) -> dict:
    record = os.path.join(directory, LORA_RECORD)
    try:
        with open(record) as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"{record}: unreadable ({type(exc).__name__}: {exc}); it marks an adapter checkpoint "
                               f"and records its LoRA settings") from None
    if not isinstance(info, dict):
        raise ConfigError(key, f"{record}: not a JSON object; it records an adapter checkpoint's LoRA settings")
    return info


def base_shape(model) -> dict:
    """The shape of ``model`` (a ``ModelConfig``) as an adapter record's base fingerprint gives it
    (``hpa.models.lora.base_fingerprint``: megatron's config, defaults resolved)."""
    return {"num_layers": model.num_layers, "hidden_size": model.hidden_size,
            "ffn_hidden_size": model.ffn_hidden_size or 4 * model.hidden_size,
            "num_attention_heads": model.num_attention_heads, "num_query_groups": model.kv_heads}


def lora_record_mismatch(info: Mapping, directory, *, rank: int, scaling: float, targets: Sequence[str],
                         shape: Optional[Mapping] = None) -> Optional[Tuple[str, str]]:
    """``(key, message)`` of the first setting that differs from the adapters an adapter checkpoint's record
    (``lora.json`` in ``directory``) describes, None when none does: the rank, the scaling (alpha / rank, or /
    sqrt(rank) with rsLoRA), the targets and, with ``shape`` (``base_shape``), the base's shape. A record without
    the targets or the base (an older hpa's) is not checked for them. The one comparison of a record with
    settings: at start-up (the config's) and on load (``hpa.models.lora.check_marker``, the model's)."""
    path = os.path.join(str(directory), LORA_RECORD)
    if info.get("rank") != rank:
        return "model.lora.rank", (f"{rank}, but the adapters of {directory} have rank {info.get('rank')} ({path}); "
                                   f"use the rank they were trained with (their run's config.yaml)")
    recorded = info.get("scaling")
    if not isinstance(recorded, (int, float)) or not math.isclose(recorded, scaling, rel_tol=1e-6):
        return "model.lora.alpha", (f"scales the adapters by {scaling} (alpha / rank, or alpha / sqrt(rank) with "
                                    f"model.lora.rslora), but those of {directory} were trained at {recorded} "
                                    f"({path}); use the alpha and rslora they were trained with (their run's "
                                    f"config.yaml)")
    theirs = info.get("target_modules")
    if theirs is not None and sorted(theirs) != sorted(targets):
        return "model.lora.target_modules", (f"{sorted(targets)}, but {directory} holds adapters on {sorted(theirs)} "
                                             f"({path}); use the targets they were trained with")
    base = (info.get("base") or {}).get("config") if isinstance(info.get("base"), dict) else None
    for name, value in (base or {}).items() if shape is not None else ():
        if name in shape and shape[name] != value:
            return f"model.{name}", (f"{shape[name]}, but the adapters of {directory} were trained over a base "
                                     f"with {name} {value} ({path}); give the shape of the base they were trained "
                                     f"on (their run's config.yaml)")
    return None


def _check_reward_models(cfg: Config) -> None:
    """A reward model directory is a megatron checkpoint (``metadata.json``) with the heads the config says
    (``hpa_reward_model.json``, written by ``hpa train-rm``), as ``hpa.reward.model.load_reward_model`` reads it."""
    for i, path in enumerate(cfg.reward.model_paths):
        key = f"reward.model_paths[{i}]"
        if not any(os.path.isfile(os.path.join(path, *p)) for p in (("metadata.json",), ("policy", "metadata.json"))):
            raise ConfigError(key, f"{path!r} is not a reward model checkpoint (no metadata.json); give the "
                                   "reward_model/ directory that hpa train-rm wrote")
        info = os.path.join(path, "hpa_reward_model.json")
        try:
            with open(info) as f:
                heads = json.load(f).get("num_heads")
        except (OSError, ValueError):
            continue  # a checkpoint without the record: its heads are checked when it loads
        if heads is not None and heads != cfg.reward.num_heads:
            raise ConfigError("reward.num_heads", f"{cfg.reward.num_heads}, but the reward model {path} has {heads} "
                                                  f"heads; set reward.num_heads: {heads}")


def serve_api_key(serve, environ: Mapping[str, str], env_name: str) -> Optional[str]:
    """``serve.api_key``, else the environment variable ``env_name``, else None (no key). A set but empty
    variable or one with stray whitespace is an error: it would silently mean no key, or a key no client can
    match."""
    env = environ.get(env_name)
    if serve.api_key is None and env is not None and (not env or env != env.strip()):
        what = "is set but empty (unset it for no key)" if not env else \
            "has leading or trailing whitespace, so no client's key can ever match it"
        raise ConfigError("serve.api_key", f"its fallback, the environment variable {env_name}, {what}",
                          source=f"environment variable {env_name}")
    return serve.api_key or env or None


def _row_tokens(cfg: Config) -> int:
    return min(cfg.data.max_prompt_length + cfg.rollout.max_new_tokens, cfg.model.max_sequence_length)


def config_warnings(cfg: Config) -> List[Tuple[str, str]]:
    """``(key, message)`` for every valid value that makes a run pathological."""
    out = []
    t, row = cfg.trainer, _row_tokens(cfg)
    for key in ("ppo_max_token_len_per_rank", "log_prob_max_token_len_per_rank"):
        budget = getattr(t, key)
        if budget is not None and budget < row:
            out.append((f"trainer.{key}", f"{budget} tokens are fewer than one rollout row can hold "
                        f"({row} = data.max_prompt_length + rollout.max_new_tokens, at most "
                        f"model.max_sequence_length): a long row gets a micro-batch of its own, many small "
                        f"forwards instead of a few; raise it to {row} or more"))
    balance = cfg.algorithm.hpa.balance
    if balance.enabled and balance.measure_steps > t.total_steps:
        out.append(("algorithm.hpa.balance.measure_steps", f"{balance.measure_steps} measured steps are more than "
                    f"trainer.total_steps={t.total_steps}: the balance factor is never frozen and every step "
                    f"runs two backward passes; lower it or turn the balance off"))
    same = _same_file(cfg.data.heldout_preference_path, cfg.data.preference_path)
    if same:
        out.append(("data.heldout_preference_path", f"{same} data.preference_path: the held-out pairs are the "
                    f"training pairs, so the trust gate's and the coverage calibration's held-out numbers "
                    f"measure nothing held out; give pairs kept out of training"))
    return out


def _same_file(a: Optional[str], b: Optional[str]) -> str:
    if a is None or b is None:
        return ""
    if os.path.abspath(a) == os.path.abspath(b):
        return "is the same path as"
    if os.path.isfile(a) and os.path.isfile(b) and filecmp.cmp(a, b, shallow=False):
        return "has the same content as"
    return ""
