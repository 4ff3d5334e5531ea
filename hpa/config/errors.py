"""The one error type of the config layer."""

from __future__ import annotations

import difflib
from typing import Iterable, Optional


class ConfigError(ValueError):
    """A bad config value. The message names the dotted key, where it came from and the fix.

    Args:
        key: dotted key, e.g. ``algorithm.ppo.clip_ratio``.
        message: what is wrong and what to do.
        source: file (and line) or ``"command line"`` the value came from, when known.
    """

    def __init__(self, key: str, message: str, *, source: Optional[str] = None):
        self.key = key
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}config key '{key}': {message}")


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list:
    """The closest valid names to ``name``, best first (for 'did you mean' messages)."""
    candidates = list(candidates)
    found = difflib.get_close_matches(name, candidates, n=n, cutoff=0.5)
    return found or sorted(candidates)[:n]


def check_choice(key: str, value: str, choices: Iterable[str]) -> None:
    """Raise a ConfigError naming the valid choices when ``value`` is not one of them."""
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(key, f"unknown value {value!r}; valid: {', '.join(choices)} "
                               f"(closest: {', '.join(closest(value, choices))})")


def check_range(key: str, value: float, *, low=None, high=None, low_open=False, high_open=False) -> None:
    """Raise a ConfigError when ``value`` lies outside [low, high] (or the open variants)."""
    bad = (low is not None and (value <= low if low_open else value < low)) or \
          (high is not None and (value >= high if high_open else value > high))
    if bad:
        lo = "" if low is None else ("(" if low_open else "[") + str(low)
        hi = "" if high is None else str(high) + (")" if high_open else "]")
        raise ConfigError(key, f"value {value!r} is out of range {lo or '(-inf'}, {hi or 'inf)'}")
