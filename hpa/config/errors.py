"""The one error type of the config layer."""

from __future__ import annotations

import difflib
import math
from typing import Iterable, Optional

SEED_MAX = 2 ** 32 - 1  # numpy's and torch's seeds: [0, 2^32 - 1]


class UserError(ValueError):
    """A mistake a user made and can fix (a config value, a file, a checkpoint of the wrong kind, a launcher
    variable). Its message says what is wrong and what to do; the command line prints it as one line."""


class ConfigError(UserError):
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


def check_finite(key: str, value: float) -> None:
    """Raise a ConfigError for NaN or ±infinity (a comparison with NaN is always false: no range stops it)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")


def check_seed(key: str, value: int) -> None:
    """Raise a ConfigError for a seed outside numpy's and torch's [0, 2^32 - 1]."""
    check_range(key, value, low=0, high=SEED_MAX)


def check_range(key: str, value: float, *, low=None, high=None, low_open=False, high_open=False,
                allow_inf=False) -> None:
    """Raise a ConfigError when ``value`` lies outside [low, high] (or the open variants), or is NaN, or is
    infinite (unless ``allow_inf``: only for a key whose docs say what infinity means)."""
    if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not allow_inf)):
        check_finite(key, value)
    bad = (low is not None and (value <= low if low_open else value < low)) or \
          (high is not None and (value >= high if high_open else value > high))
    if bad:
        lo = "" if low is None else ("(" if low_open else "[") + str(low)
        hi = "" if high is None else str(high) + (")" if high_open else "]")
        raise ConfigError(key, f"value {value!r} is out of range {lo or '(-inf'}, {hi or 'inf)'}")
