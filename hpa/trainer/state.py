"""The state of an HPA run and what is done to it as a whole: save, restore, roll back.

``RunState`` holds the step counter, the trained models (``trainables``) and every other stateful part
(``parts``: samplers, LR schedulers, KL controller, guard, reward shaping, hacking monitor; each has
``state_dict`` / ``load_state_dict``). Save, restore and rollback loop over them, so a new stateful part
is one entry in ``parts``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, Optional

import torch

from hpa.config.schema import Config
from hpa.distributed.groups import ParallelGroups
from hpa.engine.optimizer import Trainable, scale_lr
from hpa.trainer.checkpoint import EXIT_SAVE_FAILED, CheckpointManager, CheckpointSaveError
from hpa.trainer.guard import Guard

logger = logging.getLogger("hpa")


class RunState:
    """
    Args:
        trainables: name -> trained model (``policy``, ``critic``); saved with their optimizers.
        parts: name -> stateful part; the names are the checkpoint's keys.
        guard: the stability guard (also in ``parts``); a rollback keeps its own count and LR scale.
    """

    def __init__(self, cfg: Config, groups: ParallelGroups, trainables: Dict[str, Trainable], parts: Dict[str, object],
                 guard: Guard):
        self.cfg, self.groups = cfg, groups
        self.trainables, self.parts, self.guard = trainables, parts, guard
        self.ckpt = CheckpointManager(cfg.checkpoint, Path(cfg.trainer.run_dir), groups)
        self.step = 0
        self.last_eval: Optional[float] = None  # the latest eval/score (a checkpoint's score for retention)
        self.save_failures = 0  # in this process
        self.last_save_ok = True

    def state_dict(self) -> Dict:
        """Everything besides models and optimizers that exact resume needs (identical on all ranks)."""
        return {"step": self.step, "layout": self.groups.layout, "last_eval": self.last_eval,
                # the frozen models are recorded by path (their weights are not copied into the checkpoint)
                "reference_path": self.cfg.model.reference_path or self.cfg.model.policy_path,
                "reward_model_paths": list(self.cfg.reward.model_paths),
                **{name: part.state_dict() for name, part in self.parts.items()}}

    def _models(self) -> Dict:
        return {name: trainable.state() for name, trainable in self.trainables.items()}

    def save(self) -> bool:
        """Checkpoint this step; a failed save (previous checkpoint and ``latest`` intact) is logged,
        counted in ``save_failures`` and returns False."""
        try:
            self.ckpt.save(self.step, self._models(), self.state_dict(), score=self.last_eval)
            self.last_save_ok = True
            return True
        except CheckpointSaveError as exc:
            self.last_save_ok = False
            self.save_failures += 1
            then = ("training continues (checkpoint.on_save_failure=continue)"
                    if self.cfg.checkpoint.on_save_failure == "continue" else
                    f"stopping with status {EXIT_SAVE_FAILED} (checkpoint.on_save_failure=stop)")
            logger.warning("NO CHECKPOINT for step %d: %s; %s; %d failed save(s) in this process",
                           self.step, exc, then, self.save_failures)
            return False

    def restore(self, path: Path) -> None:
        state = self.ckpt.load(path, self._models())
        self.step, self.last_eval = state["step"], state["last_eval"]
        for name, part in self.parts.items():
            if name not in state:  # the run that saved it had no such part (a feature turned on since)
                logger.warning("%s holds no state for %r (the run that saved it did not have it): it starts fresh",
                               path, name)
                continue
            part.load_state_dict(state[name])

    def add_parts(self, parts: Dict[str, object]) -> None:
        """More stateful parts (those built from what a checkpoint holds: ``saved_state``)."""
        self.parts.update(parts)

    def resumable(self) -> Optional[Path]:
        """The checkpoint ``checkpoint.resume`` names, if any (the same on every rank)."""
        return self.ckpt.find_resumable(self.cfg.checkpoint.resume)

    @staticmethod
    def saved_state(path: Optional[Path]) -> Optional[Dict]:
        """The run state checkpoint ``path`` holds (its ``trainer_state.pt``: no model is loaded), None without
        one: what a part built before the restore reads (the start-up record)."""
        return torch.load(path / "trainer_state.pt", weights_only=True) if path is not None else None

    def resume(self, path: Optional[Path]) -> bool:
        """Restore checkpoint ``path`` (``resumable``), if any; True when one was restored."""
        if path is not None:
            self.restore(path)
            logger.info("resumed from %s at step %d", path, self.step)
        return path is not None

    def rollback(self, reason: str) -> bool:
        """Back to the newest good checkpoint with the LR scaled down; the guard keeps its own count.
        False when there is no checkpoint (training continues).

        The LR becomes the schedule's × the guard's cumulative ``lr_scale``: the checkpoint's schedulers
        carry the scale of their save, so a second rollback to the same checkpoint lowers the LR again
        (a fixed factor on the restored schedule would replay the same trajectory)."""
        path = self.ckpt.find_resumable("auto")
        if path is None:
            logger.warning("guard: %s, but there is no checkpoint to roll back to; continuing", reason)
            return False
        guard_state = self.guard.state_dict()
        self.restore(path)
        saved_scale = self.guard.lr_scale  # the scale the checkpoint's schedulers were saved with
        self.guard.load_state_dict(guard_state)
        self.guard.rolled_back()
        for trainable in self.trainables.values():
            scale_lr(trainable.scheduler, self.guard.lr_scale / saved_scale)
        logger.warning("guard: %s; rolled back to %s (step %d), LR x%.3g (rollback %d)", reason, path, self.step,
                       self.guard.lr_scale, self.guard.rollbacks)
        return True
