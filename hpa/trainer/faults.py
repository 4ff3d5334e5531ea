"""Fault injection for the fault-tolerance tests (and for drills on a real cluster).

``HPA_INJECT_FAULT`` holds comma-separated ``kind@step`` or ``kind@step:rank`` entries:

- ``nan_loss@3``: the policy loss of step 3 is NaN (the guard must skip the step);
- ``save_fail@3`` / ``save_fail@3:1``: saving the checkpoint of step 3 fails with "No space left on
  device" on every rank / on rank 1, after the model shards are written (the previous checkpoint and
  ``latest`` must stay intact);
- ``hang@3:1``: rank 1 stops answering (sleeps for good) at the start of step 3 (the other ranks'
  collectives must time out and exit naming the phase and rank 1); ``hang@0:1``: during the trainer's
  start-up (building the models, loading weights and the checkpoint);
- ``nan_reward@3``: one response's raw reward at step 3 is NaN (it must be dropped and counted);
- ``kl_spike@3``: the guard sees an infinite token KL after step 3 (it must roll back);
- ``kill@3:1``: rank 1 kills itself with SIGKILL in the middle of step 3 (after the rollout, the
  reward and the reference forwards, before the policy update).
  A rollout rank of a disaggregated run (``rollout.placement: disaggregated``; its global rank, after the
  trainer ranks) kills itself as step 3's weight push arrives, before it takes the weights.

Steps count from 1 (0 is the start-up, for ``hang``). Each fault fires once per run and rank, not once
per process: the trainer calls ``record_in(run_dir)``, and a fault that fires leaves a marker
``<run_dir>/faults_fired/kind@step.rankR`` (written before the fault acts), so the workers a launcher restarts after ``kill`` (and a rolled-back
step) do not fault again. Without ``record_in`` (a unit test) a fault fires once per process.
Nothing happens when the variable is unset.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import Optional, Set, Tuple

ENV = "HPA_INJECT_FAULT"


def _parse() -> Set[Tuple[str, int, Optional[int]]]:
    out = set()
    for item in filter(None, (x.strip() for x in os.environ.get(ENV, "").split(","))):
        try:
            kind, _, where = item.partition("@")
            step, _, rank = where.partition(":")
            out.add((kind, int(step), int(rank) if rank else None))
        except ValueError:
            raise ValueError(f"{ENV}: cannot parse {item!r}; use kind@step or kind@step:rank") from None
    return out


_FIRED: Set[Tuple[str, int, int]] = set()
_MARKER_DIR: Optional[Path] = None


def record_in(run_dir: os.PathLike) -> None:
    """Remember fired faults under ``run_dir`` (they then fire once per run, across restarts)."""
    global _MARKER_DIR
    _MARKER_DIR = Path(run_dir) / "faults_fired"


def _marker(kind: str, step: int, rank: int) -> Optional[Path]:
    return _MARKER_DIR / f"{kind}@{step}.rank{rank}" if _MARKER_DIR is not None else None


def active(kind: str, step: int, rank: int) -> bool:
    if (kind, step, rank) in _FIRED or not any(
            k == kind and s == step and (r is None or r == rank) for k, s, r in _parse()):
        return False
    _FIRED.add((kind, step, rank))
    marker = _marker(kind, step, rank)
    if marker is None:
        return True
    if marker.exists():  # fired in an earlier process of this run
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(marker, "w") as f:  # on disk before the fault acts: a SIGKILL follows
        f.write(f"{os.getpid()}\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def maybe_kill(step: int, rank: int) -> None:
    if active("kill", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_fail_save(step: int, rank: int) -> None:
    if active("save_fail", step, rank):
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV})")


def maybe_hang(step: int, rank: int) -> None:
    if active("hang", step, rank):
        while True:  # signals are received but change nothing: a hung rank does not answer
            time.sleep(3600)


def nan_first_reward(shaped_reward):
    """A copy of an ``UncertaintyAwareReward`` whose base reward is NaN for the first response."""
    import copy

    base = shaped_reward.base

    def poisoned(inputs):
        out = base(inputs)
        out.rewards = out.rewards.clone()
        out.rewards[0] = float("nan")
        return out

    clone = copy.copy(shaped_reward)
    clone.base = poisoned
    return clone


def maybe_nan_loss(loss_fn, step: int, rank: int):
    """``loss_fn`` with a NaN loss when ``nan_loss`` fires at ``step`` (the first update of the step), else
    ``loss_fn`` itself."""
    if not active("nan_loss", step, rank):
        return loss_fn

    def poisoned(batch, output, hidden):
        loss, metrics = loss_fn(batch, output, hidden)
        return loss * float("nan"), metrics

    return poisoned
