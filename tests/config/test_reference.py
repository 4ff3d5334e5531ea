"""docs/configuration.md: generated from the schema, up to date, and listing every key."""

import dataclasses
import pathlib
import sys
import typing
from typing import Optional

import pytest

from hpa.config import ConfigError
from hpa.config.reference import entries, render
from hpa.config.schema import Config

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
FIX = "run `python -m hpa.config.reference docs/configuration.md` and commit the page"


def _leaf_keys(cls, prefix=""):
    """Every dotted key of the schema, walked here apart from the generator."""
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from _leaf_keys(hint, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_the_page_is_up_to_date():
    assert PAGE.read_text() == render(), f"docs/configuration.md is out of date: {FIX}"


def test_the_page_lists_every_key_of_the_schema():
    text = PAGE.read_text()
    keys = list(_leaf_keys(Config))
    assert len(keys) > 200
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert missing == [], f"keys missing from docs/configuration.md: {missing}; {FIX}"


def test_nested_defaults_are_those_of_the_parent_default():
    rows = {e.key: e for e in entries()}
    assert rows["algorithm.hpa.lambda_token.start"].default == "1.0"  # linear 1.0 -> 0.2
    assert rows["algorithm.hpa.w_ppo.value"].default == "0.4"
    assert rows["model.num_layers"].default == "required"
    assert rows["reward.model_paths"].default == "[]" and rows["reward.model_paths"].type == "list of str"
    assert rows["algorithm.hpa.trust"].type == "section"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Documented:
    """A section.

    Attributes:
        a: from the docstring,
            on two lines.
    """

    a: int = 1
    # from the comment above
    b: Optional[int] = None
    c: str = "x"  # from the end of the line


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Undocumented:
    """A section with a key nobody described."""

    new_key: int = 3


def test_descriptions_come_from_docstring_or_comments():
    rows = {e.key: e for e in entries(_Documented)}
    assert rows["a"].meaning == "from the docstring, on two lines."
    assert rows["b"].meaning == "from the comment above" and rows["b"].type == "int or null"
    assert rows["c"].meaning == "from the end of the line" and rows["c"].default == "x"


def test_an_undocumented_key_stops_the_generator():
    with pytest.raises(ConfigError, match="new_key.*has no description.*hpa.config.reference"):
        list(entries(_Undocumented))


def test_an_option_is_not_taken_for_the_page_to_write(tmp_path, monkeypatch, capsys):
    """``python -m hpa.config.reference --help`` prints the usage; it once wrote the page to a file named
    ``--help``."""
    from hpa.config.reference import main

    monkeypatch.chdir(tmp_path)
    assert main(["--help"]) == 0 and "docs/configuration.md" in capsys.readouterr().out
    assert main(["--page"]) == 2 and "--page" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main(["out.md"]) == 0 and (tmp_path / "out.md").read_text() == render()
