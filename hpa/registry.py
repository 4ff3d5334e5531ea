"""Name -> callable registries, one per family; an unknown name lists the valid
ones.

Every family (advantage estimators, policy losses, DPO variants, KL estimators, schedules, rollout
engines, rule rewards, ...) has one ``Registry``; components are chosen by the name written in YAML.
"""

from __future__ import annotations

import difflib
from typing import Callable, Dict, Iterator, Tuple


class UnknownNameError(ValueError):
    """A name that no entry of a registry carries; the message lists the valid names."""


class Registry:
    """A family of interchangeable callables that share one signature.

    Args:
        family: what the entries are, used in error messages (e.g. ``"advantage estimator"``).
    """

    def __init__(self, family: str):
        self.family = family
        self._entries: Dict[str, Callable] = {}

    def register(self, name: str, *aliases: str) -> Callable[[Callable], Callable]:
        """Decorator that registers ``fn`` under ``name`` and any aliases."""

        def wrap(fn: Callable) -> Callable:
            for key in (name, *aliases):
                if key in self._entries:
                    raise ValueError(f"{self.family} {key!r} is registered twice")
                self._entries[key] = fn
            return fn

        return wrap

    def get(self, name: str) -> Callable:
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._entries, n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise UnknownNameError(
                f"unknown {self.family} {name!r}; valid: {', '.join(self.names())}.{hint}"
            ) from None

    def names(self) -> Tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
