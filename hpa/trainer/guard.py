"""The stability guard: skip bad steps, detect spikes, roll back, stop early.

Every decision is taken from numbers that are identical on all ranks (the grad norm is reduced over
the whole model; the KL and reward are DP-reduced metrics), so all ranks always agree.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Deque, Dict, Optional

from hpa.config.schema import GuardConfig

STEP, SKIP, CLIP = "step", "skip", "clip"


class Guard:
    """Decides, step by step, whether to apply the update, and when to roll back or stop.

    Args:
        cfg: the ``guard`` section.
    """

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.grad_norms: Deque[float] = deque(maxlen=cfg.grad_spike_window)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.applied_this_launch = 0  # not saved: a launch that applies no update has learned nothing
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.history: Deque[tuple] = deque(maxlen=cfg.early_stop_window)
        self.best_metric = -math.inf
        self.best_step = 0
        self.evals_since_best = 0

    # -- per optimizer step

    def grad_norm_action(self, grad_norm: float) -> str:
        """``skip`` for a non-finite norm or a spike (when so configured), ``clip`` for a spike to clip."""
        if not math.isfinite(grad_norm):
            return SKIP
        enough = len(self.grad_norms) >= self.cfg.grad_spike_min_history
        if enough and self.cfg.grad_spike_action != "none":
            median = statistics.median(self.grad_norms)
            if median > 0 and grad_norm > self.cfg.grad_spike_factor * median:
                return SKIP if self.cfg.grad_spike_action == "skip" else CLIP
        self.grad_norms.append(grad_norm)
        return STEP

    def spike_clip_value(self) -> float:
        """The norm a clipped spike is scaled down to: the running median."""
        return statistics.median(self.grad_norms)

    def record(self, updated: bool) -> None:
        if updated:
            self.consecutive_skips = 0
            self.applied_this_launch += 1
        else:
            self.skipped_steps += 1
            self.consecutive_skips += 1

    # -- per training step

    def rollback_reason(self, token_kl: Optional[float]) -> Optional[str]:
        """Why the run must roll back now, or None."""
        if self.rollbacks >= self.cfg.max_rollbacks:
            return None
        limit = self.cfg.kl_rollback_threshold
        if limit is not None and token_kl is not None and (not math.isfinite(token_kl) or token_kl > limit):
            return f"token KL {token_kl:.4g} above guard.kl_rollback_threshold={limit}"
        if self.consecutive_skips >= self.cfg.max_consecutive_skips:
            return f"{self.consecutive_skips} consecutive skipped steps (guard.max_consecutive_skips)"
        return None

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.consecutive_skips = 0
        self.lr_scale *= self.cfg.rollback_lr_factor

    def should_stop(self, step: int, reward_mean: float, reward_std: float, kl: float) -> bool:
        """The recipe's early stop on mean(reward) - a·mean(KL) - b·std(reward) over the window."""
        if self.cfg.early_stop_patience is None:
            return False
        self.history.append((reward_mean, reward_std, kl))
        metric = self.early_stop_metric()
        if metric > self.best_metric + self.cfg.early_stop_min_delta:
            self.best_metric, self.best_step, self.evals_since_best = metric, step, 0
        else:
            self.evals_since_best += 1
        return self.evals_since_best >= self.cfg.early_stop_patience

    def early_stop_metric(self) -> float:
        if not self.history:
            return -math.inf
        n = len(self.history)
        reward = sum(h[0] for h in self.history) / n
        kl = sum(h[2] for h in self.history) / n
        std = sum(h[1] for h in self.history) / n
        return reward - self.cfg.early_stop_kl_coef * kl - self.cfg.early_stop_std_coef * std

    def metrics(self) -> Dict[str, float]:
        return {"guard/skipped_steps": float(self.skipped_steps), "guard/rollbacks": float(self.rollbacks),
                "guard/lr_scale": self.lr_scale}

    def state_dict(self) -> Dict:
        return {"grad_norms": list(self.grad_norms), "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips, "rollbacks": self.rollbacks,
                "lr_scale": self.lr_scale, "history": [list(h) for h in self.history],
                "best_metric": self.best_metric, "best_step": self.best_step,
                "evals_since_best": self.evals_since_best}

    def load_state_dict(self, state: Dict) -> None:
        self.grad_norms = deque(state["grad_norms"], maxlen=self.cfg.grad_spike_window)
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skips = state["consecutive_skips"]
        self.rollbacks = state["rollbacks"]
        self.lr_scale = state["lr_scale"]
        self.history = deque((tuple(h) for h in state["history"]), maxlen=self.cfg.early_stop_window)
        self.best_metric = state["best_metric"]
        self.best_step = state["best_step"]
        self.evals_since_best = state["evals_since_best"]
