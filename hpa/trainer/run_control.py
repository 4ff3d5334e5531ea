"""When an HPA run stops, and what it leaves behind for the next launch.

A run stops at ``trainer.total_steps``, on a launcher's signal (SIGTERM, SIGUSR1: checkpoint at the end
of the step, then exit), on an early stop (the guard's patience, or the hacking monitor with
``guard.early_stop_on_hacking``), or after ``trainer.max_steps_per_run``. Every rank takes the same
decision at the same step. ``<run_dir>/exit_status.json`` says why and where the latest process stopped,
``exit_history.jsonl`` every process's stop in turn.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
from pathlib import Path
from typing import Dict, Optional

import torch

from hpa.config.schema import GuardConfig, TrainerConfig
from hpa.distributed import comm
from hpa.trainer.guard import Guard

logger = logging.getLogger("hpa")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class RunControl:
    def __init__(self, trainer: TrainerConfig, guard_cfg: GuardConfig, guard: Guard, run_dir: Path, *,
                 is_main: bool):
        self.trainer, self.guard_cfg, self.guard = trainer, guard_cfg, guard
        self.run_dir, self.is_main = run_dir, is_main
        self.signal: Optional[int] = None

    @contextlib.contextmanager
    def catching_signals(self):
        """Record SIGTERM/SIGUSR1 instead of dying of them (restored on exit)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        logger.warning("received signal %d: checkpointing at the end of this step, then exiting", signum)
        self.signal = signum

    def due(self, step: int, interval: int) -> bool:
        """Every ``interval`` steps and at the last step (never with ``interval`` 0)."""
        return interval > 0 and (step % interval == 0 or step == self.trainer.total_steps)

    def stop_reason(self, step: int, metrics: Dict[str, float], steps_this_run: int) -> Optional[str]:
        """``signal``, ``early_stop``, ``max_steps_per_run`` or None (go on), the same on every rank."""
        flags = torch.tensor([float(self.signal is not None)])
        comm.all_reduce_max(flags, None)  # any rank signalled: every rank stops at this step
        if flags.item() > 0:
            return "signal"
        if self.guard_cfg.early_stop_on_hacking and metrics.get("hacking/alert_count", 0.0) > 0:
            logger.warning("early stop at step %d: the reward-hacking monitor alerted (guard.early_stop_on_hacking); "
                           "best step %d", step, self.guard.best_step)
            return "early_stop"
        if self.guard.should_stop(step, metrics.get("reward/raw_mean", 0.0), metrics.get("reward/shaped_std", 0.0),
                                  metrics.get("kl/token", 0.0)):
            logger.info("early stop at step %d: no improvement of the stop metric for %d steps; best step %d "
                        "(metric %.4g)", step, self.guard_cfg.early_stop_patience, self.guard.best_step,
                        self.guard.best_metric)
            return "early_stop"
        limit = self.trainer.max_steps_per_run
        if limit is not None and steps_this_run >= limit and step < self.trainer.total_steps:
            return "max_steps_per_run"
        return None

    def write_exit_status(self, reason: str, step: int) -> None:
        if self.is_main:
            write_exit_status(self.run_dir, reason, step, self.guard.best_step)


def write_exit_status(run_dir: Path, reason: str, step: int, best_step: int) -> None:
    """``<run_dir>/exit_status.json``: why this process stopped and where (``done``: at ``total_steps``);
    every process of the run also appends its line to ``<run_dir>/exit_history.jsonl``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    status = json.dumps({"reason": reason, "step": step, "resumable": reason not in ("done", "early_stop", "all_skipped"),
                         "best_step": best_step})
    (run_dir / "exit_status.json").write_text(status)
    with open(run_dir / "exit_history.jsonl", "a") as f:
        f.write(status + "\n")
