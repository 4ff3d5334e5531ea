"""Naming a hung collective: the phase each rank is in, and the rank a timed-out rank waited for.

Every rank publishes its position (step, phase, and how many phases it has entered) to the process
group's key-value store whenever it enters a phase. All ranks go through the same phases in the
same order, so a rank that has entered fewer has not reached the collective the others wait in.

When a collective fails (gloo raises a ``RuntimeError`` "Timed out waiting <ms> for recv operation"
in the calling thread after ``parallel.timeout_minutes``, or "Connection closed by peer" when a
peer died), ``collective_failure_message`` reads every rank's position and names the phase this
rank was in and the ranks it waited for; the caller exits with ``EXIT_COLLECTIVE_FAILURE``
(EX_TEMPFAIL: torchrun restarts a worker group that exits non-zero while ``--max-restarts`` lasts,
and the restart resumes from the newest checkpoint). The store is served by a thread of rank 0's
process, so it answers while rank 0's Python is stuck; when rank 0 is dead the positions are
reported as unknown.

No watchdog thread is needed on gloo: it enforces the timeout on every collective and raises where
the phase is known. NCCL's own watchdog aborts the process at the timeout instead (with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, as ``launch/slurm.sbatch`` sets it), which the launcher also
restarts, without this message.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import time
from typing import Dict, List, Optional

import torch.distributed as dist

EXIT_COLLECTIVE_FAILURE = 75  # EX_TEMPFAIL: try again

_KEY = "hpa/progress/{rank}"
_FAILURE = re.compile(r"timed out|connection closed by peer|connection reset by peer|pair closure", re.IGNORECASE)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that timed out or lost a peer (gloo's and the store's errors)."""
    return isinstance(exc, RuntimeError) and bool(_FAILURE.search(str(exc)))


def _default_store():
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer; the message is ``StepProgress.collective_failure_message``'s
    (the caller logs it and exits with ``EXIT_COLLECTIVE_FAILURE``)."""


class StepProgress:
    """Where this rank is: the step, the stack of phases it is in, and the count of phases entered.

    Args:
        rank, world_size: this process and the job size (nothing is published for one process).
        timeout_minutes: ``parallel.timeout_minutes``, quoted in the failure message.
        store: where positions are published; default the default process group's store.
    """

    def __init__(self, rank: int, world_size: int, timeout_minutes: float, store=None):
        self.rank, self.world_size, self.timeout_minutes = rank, world_size, timeout_minutes
        self.step = 0
        self.entered = 0
        self._stack: List[str] = []
        self._last: Optional[str] = None
        self._failed_where: Optional[str] = None
        self._store = store if store is not None else _default_store() if world_size > 1 else None

    def where(self) -> str:
        """``step 3, phase 'step/reference'`` (or ``... (after 'rollout')`` between phases)."""
        if self._failed_where is not None:
            return self._failed_where
        if self._stack:
            phase = "/".join(self._stack)
            return f"step {self.step}, phase {phase!r}" + (f" (after {self._last!r})" if self._last else "")
        return f"step {self.step}, between phases" + (f" (after {self._last!r})" if self._last else "")

    @contextlib.contextmanager
    def phase(self, name: str):
        """Mark the block as phase ``name``; published to the other ranks on entry."""
        self._stack.append(name)
        self._last = None
        self.entered += 1
        self._publish()
        try:
            yield
        except RuntimeError as exc:
            if self._failed_where is None and is_collective_failure(exc):  # the innermost phase it left
                self._failed_where = self.where()
            raise
        finally:
            self._stack.pop()
            self._last = name

    def _publish(self) -> None:
        if self._store is None:
            return
        position = {"step": self.step, "phase": "/".join(self._stack), "entered": self.entered, "time": time.time()}
        try:
            self._store.set(_KEY.format(rank=self.rank), json.dumps(position))
        except RuntimeError:  # the store is gone with rank 0; the collective that follows will say so
            pass

    def positions(self, timeout_s: float = 10.0) -> Dict[int, Optional[dict]]:
        """Every rank's last published position (None where unknown)."""
        out: Dict[int, Optional[dict]] = {r: None for r in range(self.world_size)}
        if self._store is None:
            return out
        try:
            self._store.set_timeout(datetime.timedelta(seconds=timeout_s))
            keys = [_KEY.format(rank=r) for r in range(self.world_size)]
            present = [r for r, key in enumerate(keys) if self._store.check([key])]
            for r, value in zip(present, self._store.multi_get([keys[r] for r in present])):
                out[r] = json.loads(value)
        except RuntimeError:  # rank 0, which serves the store, is gone
            pass
        return out

    def collective_failure_message(self, exc: BaseException) -> str:
        """What this rank was doing when a collective failed, and which ranks it waited for."""
        where = self.where()
        error = " ".join(str(exc).split())
        head = (f"rank {self.rank}: a collective in {where} failed after waiting up to "
                f"parallel.timeout_minutes={self.timeout_minutes:g}: {error}")
        positions = self.positions()
        now = time.time()

        def seen(r):
            p = positions[r]
            return (f"rank {r} (last seen entering step {p['step']}, phase {p['phase']!r}, "
                    f"{now - p['time']:.0f} s ago)")

        others = [r for r in range(self.world_size) if r != self.rank]
        unknown = [r for r in others if positions[r] is None]
        behind = [r for r in others if positions[r] is not None and positions[r]["entered"] < self.entered]
        if behind:
            waited = "It waited for " + ", ".join(seen(r) for r in behind) + ": it never reached this phase."
        elif unknown and len(unknown) == len(others):
            waited = (f"The other ranks' positions cannot be read (rank 0 serves them and may be gone): "
                      f"it waited for one of ranks {others}.")
        else:
            same = [r for r in others if positions[r] is not None and positions[r]["entered"] == self.entered]
            waited = ("Every other rank reached this phase; the one that stopped answering is inside it: "
                      + ", ".join(seen(r) for r in same) + "." if same else f"Ranks {unknown} are unknown.")
        if unknown and (behind or len(unknown) < len(others)):
            waited += f" Ranks {unknown} published no position."
        return (f"{head}. {waited} Exiting with status {EXIT_COLLECTIVE_FAILURE} so that the launcher restarts "
                "the job (torchrun --max-restarts, or a Slurm requeue), which resumes from the newest checkpoint.")
