"""Schedules: functions of training progress ``p = step / total_steps`` in [0, 1].

They drive λ_token (recipe: linear 1.0 -> 0.2), λ_semantic (linear 0.2 -> 1.0), the mixing weights
w_ppo / w_dpo / w_kl (constant 0.4 / 0.4 / 0.2), the KL warmup and the entropy coefficient.
Progress outside [0, 1] is clamped.

Every factory in ``SCHEDULES`` has one signature and ignores the keywords it does not use::

    factory(*, value, start, end, warmup_fraction, boundaries, values) -> Callable[[float], float]

Build one with ``make_schedule(name, **kwargs)``; the trainer passes ``dataclasses.asdict`` of a
``ScheduleConfig``.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Sequence

from hpa.registry import Registry

Schedule = Callable[[float], float]

SCHEDULES = Registry("schedule")

_DEFAULTS = dict(value=0.0, start=0.0, end=0.0, warmup_fraction=0.0, boundaries=(), values=())


def _clamp(progress: float) -> float:
    return min(max(float(progress), 0.0), 1.0)


@SCHEDULES.register("constant")
def constant(*, value, start, end, warmup_fraction, boundaries, values) -> Schedule:
    """``f(p) = value``."""
    return lambda progress: float(value)


@SCHEDULES.register("linear")
def linear(*, value, start, end, warmup_fraction, boundaries, values) -> Schedule:
    """``f(p) = start + (end - start)·p``: ``start`` at p = 0, ``end`` at p = 1."""
    start, end = float(start), float(end)

    def schedule(progress: float) -> float:
        p = _clamp(progress)
        return end if p == 1.0 else start + (end - start) * p

    return schedule


@SCHEDULES.register("cosine")
def cosine(*, value, start, end, warmup_fraction, boundaries, values) -> Schedule:
    """Half-cosine from ``start`` (p = 0) to ``end`` (p = 1): ``end + (start - end)·(1 + cos πp)/2``."""
    start, end = float(start), float(end)

    def schedule(progress: float) -> float:
        p = _clamp(progress)
        if p in (0.0, 1.0):  # exact endpoints
            return start if p == 0.0 else end
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * p))

    return schedule


@SCHEDULES.register("warmup_constant")
def warmup_constant(*, value, start, end, warmup_fraction, boundaries, values) -> Schedule:
    """``start`` while ``p < warmup_fraction``, then ``value`` (a hold, not a ramp: the recipe's KL warmup
    keeps the coefficient at 0 for the first 20% of training)."""
    start, value, warmup_fraction = float(start), float(value), float(warmup_fraction)
    return lambda progress: start if _clamp(progress) < warmup_fraction else value


@SCHEDULES.register("piecewise")
def piecewise(*, value, start, end, warmup_fraction, boundaries: Sequence[float], values: Sequence[float]) -> Schedule:
    """Piecewise constant: ``values[i]`` for ``boundaries[i-1] <= p < boundaries[i]``.

    ``boundaries`` are strictly increasing progress points; ``len(values) == len(boundaries) + 1``.
    """
    boundaries, values = tuple(float(b) for b in boundaries), tuple(float(v) for v in values)
    if len(values) != len(boundaries) + 1:
        raise ValueError(f"piecewise needs len(values) == len(boundaries) + 1, got {len(values)} and {len(boundaries)}")
    if any(b2 <= b1 for b1, b2 in zip(boundaries, boundaries[1:])):
        raise ValueError(f"piecewise boundaries must be strictly increasing, got {boundaries}")
    return lambda progress: values[bisect.bisect_right(boundaries, _clamp(progress))]


def make_schedule(name: str, **kwargs) -> Schedule:
    """Build the schedule registered as ``name``.

    Args:
        name: a name in ``SCHEDULES``.
        **kwargs: any of ``value``, ``start``, ``end``, ``warmup_fraction``, ``boundaries``,
            ``values``; missing ones take neutral defaults, unknown ones are an error.

    Returns:
        ``f(progress) -> float``.
    """
    unknown = set(kwargs) - set(_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown schedule argument(s) {sorted(unknown)}; valid: {sorted(_DEFAULTS)}")
    return SCHEDULES.get(name)(**{**_DEFAULTS, **kwargs})


def progress(step: int, total_steps: int) -> float:
    """``step / total_steps`` clamped to [0, 1]."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    return _clamp(step / total_steps)
