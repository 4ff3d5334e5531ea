"""The configuration reference (docs/configuration.md), generated from the schema's dataclasses.

``python -m hpa.config.reference docs/configuration.md`` rewrites it (no argument: print it). Every key is
listed as a dotted path with its type, its default and one line of meaning. The meaning is the field's entry
in its class docstring's ``Args:`` or ``Attributes:`` section, else the comment on the lines right above the
field or at the end of its line; a nested section without one takes its class docstring's first sentence.
A field with no description stops the generator with its key, so a new key cannot go undocumented.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from typing import Dict, Iterator, List, Optional, Tuple

from .errors import ConfigError
from .errors import SEED_MAX
from .schema import Config
from .values import infinity_meaning, is_seed

_REQUIRED = "required"
_SECTION_HEADERS = ("Args:", "Attributes:")


def _docstring_entries(cls) -> Dict[str, str]:
    """``name: text`` entries of the class docstring's Args/Attributes section, continuation lines joined."""
    doc = inspect.getdoc(cls) or ""
    entries: Dict[str, str] = {}
    in_section, current, indent = False, None, None
    for line in doc.splitlines():
        if line.strip() in _SECTION_HEADERS:
            in_section, current, indent = True, None, None
            continue
        if not in_section:
            continue
        if not line.strip():
            current = None
            continue
        width = len(line) - len(line.lstrip())
        if width == 0:  # the section ended
            in_section, current = False, None
            continue
        match = re.match(r"(\w+):\s*(.*)", line.strip())
        if match and (indent is None or width == indent):
            indent, current = width, match.group(1)
            entries[current] = match.group(2)
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def _comment_entries(cls) -> Dict[str, str]:
    """For each field of ``cls``, the ``#`` comment on the lines right above it or at the end of its line."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    trailing: Dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][:tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    entries: Dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, n = [], node.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, lines[n - 1].strip().lstrip("#").strip())
            n -= 1
        text = " ".join(above + ([trailing[node.lineno]] if node.lineno in trailing else []))
        if text:
            entries[node.target.id] = text
    return entries


def _summary(cls) -> str:
    """The class docstring's first sentence."""
    first = (inspect.getdoc(cls) or "").split("\n\n", 1)[0]
    return " ".join(first.split())


def _yaml_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    return str(value)


def _type_name(annotation) -> str:
    if isinstance(annotation, str):
        text = annotation
    else:
        text = annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
    optional = re.fullmatch(r"Optional\[(.*)\]", text)
    text = f"{optional.group(1)} or null" if optional else text
    return re.sub(r"Tuple\[(\w+), \.\.\.\]", r"list of \1", text)


@dataclasses.dataclass(frozen=True)
class Entry:
    key: str  # dotted path
    type: str  # "section" for a nested dataclass
    default: str
    meaning: str
    infinity: str = ""  # what .inf means, for the few keys that accept it (the field's metadata)


def entries(cls=Config, prefix: str = "", instance=None) -> Iterator[Entry]:
    """Every key of ``cls`` (sections first, then their keys, in field order), with ``instance``'s values as
    the defaults (a nested section's defaults are those of its parent's default instance)."""
    docs, comments = _docstring_entries(cls), _comment_entries(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if instance is not None:
            value = getattr(instance, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = dataclasses.MISSING
        nested = _nested_class(cls, f)
        meaning = docs.get(f.name) or comments.get(f.name) or (_summary(nested) if nested else "")
        if not meaning:
            raise ConfigError(key, f"has no description: add '{f.name}: <one line>' to the Attributes: section "
                                   f"of {cls.__name__}'s docstring (hpa/config), then run "
                                   f"`python -m hpa.config.reference docs/configuration.md`")
        meaning = " ".join(meaning.split())
        if nested:
            yield Entry(key, "section", _REQUIRED if value is dataclasses.MISSING else "", meaning)
            yield from entries(nested, key + ".", None if value is dataclasses.MISSING else value)
        else:
            yield Entry(key, _type_name(f.type), _REQUIRED if value is dataclasses.MISSING else _yaml_value(value),
                        meaning, infinity_meaning(f))


def _nested_class(cls, f) -> Optional[type]:
    """The dataclass a field holds, if it holds one."""
    hint = typing.get_type_hints(cls, vars(sys.modules[cls.__module__])).get(f.name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _cell(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|")


def _checks(all_entries: List[Entry]) -> List[str]:
    """The rules every key obeys, with the keys that accept infinity listed and what infinity means there."""
    infinite = [e for e in all_entries if e.infinity]
    seeds = [e.key for e in all_entries if is_seed(e.key.rsplit(".", 1)[-1]) and e.type != "section"]
    if infinite:
        inf = ", except in these keys, where `.inf` means: " + "; ".join(f"`{e.key}`: {e.infinity}" for e in infinite)
    else:
        inf = ": no key accepts infinity (where a key can be switched off, `null` or `0` does it, as its row says)"
    return [
        "Every check runs wherever a config is accepted: `hpa check-config` (with or without `--world-size`), "
        "`hpa ablate`'s pre-check of every variant and seed, and the start of `hpa train`, `sft`, `train-rm`, "
        "`generate` and `serve`; only the data-parallel checks (batch sizes divisible by the DP size) need the "
        "world size. The start of a command also checks the paths it reads, naming the key, and warns (naming "
        "the key) about valid values that make a run pathological: a token budget below one row, held-out pairs "
        "that are the training pairs, `algorithm.hpa.balance.measure_steps` beyond `trainer.total_steps`.",
        "",
        f"Numbers are finite: `.nan`, `.inf` and `-.inf` are refused{inf}. "
        f"Seeds ({', '.join(f'`{k}`' for k in seeds)}, "
        f"and `hpa ablate`'s `ablate.seeds`) lie in [0, {SEED_MAX}]. An empty value on the command line (`key=`, "
        "often an unset shell variable) is the empty string for a string key that cannot be null and an error "
        "for any other key; `key=null` is null. Secrets (`serve.api_key`) may not begin or end with whitespace.",
    ]


def render() -> str:
    """The whole page."""
    out: List[str] = [
        "# Configuration reference",
        "",
        "<!-- generated by `python -m hpa.config.reference docs/configuration.md` from the dataclasses in "
        "hpa/config; do not edit by hand -->",
        "",
        "A run is one YAML file plus dotted overrides on the command line (`hpa train --config FILE "
        "trainer.total_steps=4`). Every key below is checked against the schema: an unknown key or a wrong "
        "type is an error naming the key, the file and line (or \"command line\") and the closest valid keys. "
        "`required`: the key has no default. A schedule (`type: section` holding `name`, `value`, `start`, "
        "...) is a value as a function of training progress. What the keys that shape a run do, and the "
        "recipe's defaults: [training.md](training.md).",
        "",
        *_checks(list(entries())),
        "",
    ]
    rows: List[Tuple[str, List[Entry]]] = []
    for e in entries():
        if "." not in e.key:
            rows.append((e.key, [e]))
        else:
            rows[-1][1].append(e)
    out.append("Sections: " + ", ".join(f"[`{name}`](#{name})" for name, _ in rows) + ".")
    for name, section in rows:
        out += ["", f"## {name}", "", _cell(section[0].meaning), "",
                "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for e in section[1:]:
            default = f"`{_cell(e.default)}`" if e.default else ""
            meaning = e.meaning + (f" `.inf`: {e.infinity}." if e.infinity else "")
            out.append(f"| `{e.key}` | {_cell(e.type)} | {default} | {_cell(meaning)} |")
    return "\n".join(out) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m hpa.config.reference [PAGE]   (PAGE: the file to write, e.g. docs/configuration.md; " \
            "none: print the page)\n"
    if argv and argv[0] in ("-h", "--help"):
        sys.stdout.write(usage)
        return 0
    if argv and argv[0].startswith("-"):
        sys.stderr.write(f"unknown option {argv[0]}\n{usage}")
        return 2
    text = render()
    if argv:
        with open(argv[0], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
