"""The trust gate on the learned reward: a PI Lagrangian controller.

A learned reward can be exploited (reward hacking) while the verifiable (rule) reward cannot. The gate
decides how far to trust the learned part of the advantage from a signal that needs no gold labels:
the policy's per-token NLL of the chosen responses of held-out preference pairs (never trained on).
While the policy follows the preferences, that NLL stays at or below its best value so far; when it
regresses while the learned reward keeps rising, the policy is buying learned reward with behaviour
the preferences reject, so the learned component is down-weighted.

The controller is the PI form of the Lagrangian method of Stooke et al. (ICML 2020) with one multiplier
per gated component (Moskovitz et al., ICLR 2024): with the relative regression beyond the slack

    e_t = (nll_t - best_t) / best_t - slack        (counted only up to 0 while the learned reward is not rising)
    I_t = max(0, I_{t-1} + e_t)
    λ_t = max(0, kp·e_t + ki·I_t)
    gate_t = 1 / (1 + λ_t)

the gate closes in proportion to a regression and keeps closing while it lasts (the integral), and
reopens as the NLL recovers (a negative error drains the integral). The error is relative, so the
constants do not depend on the model or the task's NLL scale: with kp = 10 a regression 10 % beyond
the slack halves the learned component at once, and with ki = 1 each step it persists adds 0.1 to λ.
"""

from __future__ import annotations

import math
from typing import Dict, Optional


class TrustGate:
    """The state and update of the gate (plain floats; every DP rank updates it with the same inputs).

    Args:
        slack: relative regression of the NLL over its best that costs nothing.
        kp: proportional gain.
        ki: integral gain.
        reward_ema: smoothing factor of the learned reward (EMA) whose rise is watched.
    """

    def __init__(self, *, slack: float = 0.02, kp: float = 10.0, ki: float = 1.0, reward_ema: float = 0.9):
        if slack < 0 or kp < 0 or ki < 0 or not 0 <= reward_ema < 1:
            raise ValueError(f"TrustGate needs slack, kp, ki >= 0 and 0 <= reward_ema < 1; got slack={slack}, "
                             f"kp={kp}, ki={ki}, reward_ema={reward_ema}")
        self.slack, self.kp, self.ki, self.reward_ema = slack, kp, ki, reward_ema
        self.best: Optional[float] = None  # the lowest held-out NLL seen
        self.reward_at_best: Optional[float] = None  # the learned-reward EMA when it was seen
        self.reward: Optional[float] = None  # the learned-reward EMA
        self.integral = 0.0
        self.lam = 0.0

    @property
    def gate(self) -> float:
        """The weight of the learned component, ``1/(1+λ)``."""
        return 1.0 / (1.0 + self.lam)

    def update(self, nll: float, learned_reward: float) -> Dict[str, float]:
        """One step: the held-out NLL of the current policy and the mean learned reward of its rollouts.

        Returns:
            ``gate/*`` metrics: ``nll``, ``best_nll``, ``regression`` (relative, before the slack),
            ``error``, ``rising`` (1 when the learned reward is above its value at the best NLL),
            ``integral``, ``lambda``, ``gate`` and ``reward_ema`` (the smoothed learned reward).
        """
        if not (math.isfinite(nll) and math.isfinite(learned_reward)):  # nothing learned from a bad step
            return self.metrics(nll, float("nan"), float("nan"), float("nan"))
        a = self.reward_ema
        self.reward = learned_reward if self.reward is None else a * self.reward + (1 - a) * learned_reward
        if self.best is None or nll < self.best:
            self.best, self.reward_at_best = nll, self.reward
        regression = (nll - self.best) / max(abs(self.best), 1e-8)
        error = regression - self.slack
        rising = self.reward > self.reward_at_best
        if not rising:
            error = min(error, 0.0)
        self.integral = max(0.0, self.integral + error)
        self.lam = max(0.0, self.kp * error + self.ki * self.integral)
        return self.metrics(nll, regression, error, float(rising))

    def metrics(self, nll: float, regression: float, error: float, rising: float) -> Dict[str, float]:
        return {"gate/nll": nll, "gate/best_nll": self.best if self.best is not None else float("nan"),
                "gate/regression": regression, "gate/error": error, "gate/rising": rising,
                "gate/integral": self.integral, "gate/lambda": self.lam, "gate/gate": self.gate,
                "gate/reward_ema": self.reward if self.reward is not None else float("nan")}

    def state_dict(self) -> Dict[str, Optional[float]]:
        return {"best": self.best, "reward_at_best": self.reward_at_best, "reward": self.reward,
                "integral": self.integral, "lam": self.lam}

    def load_state_dict(self, state: Dict[str, Optional[float]]) -> None:
        self.best, self.reward_at_best, self.reward = state["best"], state["reward_at_best"], state["reward"]
        self.integral, self.lam = state["integral"], state["lam"]
