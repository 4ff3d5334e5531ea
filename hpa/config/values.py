"""Checks that hold for every key of a class, found by walking the dataclasses, so a new key is covered
without an edit: numbers are finite (unless the field's ``metadata["infinity"]`` says what infinity means),
seeds lie in [0, 2^32 - 1], secrets carry no stray whitespace.

A key that accepts infinity says what it means in its field, ``field(default=..., metadata={"infinity": "no
limit"})``, and passes ``allow_inf=True`` to its own ``check_range``; the generated reference lists it.

``check_field`` runs while the loader builds each section (so the error names the file and line);
``check_values`` walks a built config (the same checks for configs made in code).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Iterator, Tuple, Union

from .errors import ConfigError, check_seed

# a seed: a field named seed, *_seed or seeds (and its items)
_SEED_NAME = re.compile(r"^(seed|.*_seed|seeds)$")
# secrets: compared byte for byte with what a client sends, so a stray space can never match
SECRET_NAMES = ("api_key",)


def infinity_meaning(f: dataclasses.Field) -> str:
    """What infinity means for this field (``metadata={"infinity": ...}``); "" when it is not allowed."""
    return f.metadata.get("infinity", "")


def is_seed(name: str) -> bool:
    return bool(_SEED_NAME.match(name))


def _items(value: Any):
    return value if isinstance(value, (tuple, list)) else (value,)


def check_field(f: dataclasses.Field, value: Any, key: str) -> None:
    """The per-key checks of one field's value (``key``: its dotted name, for the message)."""
    for item in _items(value):
        if isinstance(item, float) and not math.isfinite(item):
            meaning = infinity_meaning(f)
            if math.isnan(item) or not meaning:
                raise ConfigError(key, f"must be a finite number, got {item!r}")
            if item < 0:
                raise ConfigError(key, f"accepts +infinity ({meaning}), not {item!r}")
        if is_seed(f.name) and isinstance(item, int) and not isinstance(item, bool):
            check_seed(key, item)
    if f.name in SECRET_NAMES and isinstance(value, str) and value != value.strip():
        raise ConfigError(key, "has leading or trailing whitespace, so no client's key can ever match it; "
                               "remove the spaces (quote the value in YAML if it must contain inner ones)")


def check_values(cfg: Any, prefix: str = "") -> None:
    """``check_field`` on every field of ``cfg`` and of the dataclasses inside it."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        for i, item in enumerate(_items(value)):
            if dataclasses.is_dataclass(item):
                check_values(item, f"{key}[{i}]." if isinstance(value, (tuple, list)) else f"{key}.")
        check_field(f, value, key)


def _strip(tp) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = args[0] if len(args) == 1 else tp
            if len(args) != 1:
                return tp
        elif origin in (tuple, list):
            tp = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        else:
            return tp


def leaf_fields(cls, prefix: str = "") -> Iterator[Tuple[str, dataclasses.Field, Any, bool]]:
    """``(dotted key, field, element type, is a sequence)`` of every non-section field under ``cls`` (Optional
    and tuples stripped from the element type; the last item says whether the value is a tuple or list), for
    the tests that walk every key."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _strip(hints[f.name])
        if dataclasses.is_dataclass(tp):
            yield from leaf_fields(tp, f"{prefix}{f.name}.")
        else:
            args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            optional = typing.get_origin(hints[f.name]) in (Union, types.UnionType) and len(args) == 1
            yield f"{prefix}{f.name}", f, tp, typing.get_origin(args[0] if optional else hints[f.name]) in (tuple, list)
