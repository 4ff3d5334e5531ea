"""The automatic balance of the rollout and pair gradients (``algorithm.hpa.balance``).

A step's gradient is the sum of the rollout group's (PPO, entropy, hierarchical KL, all on rollouts)
and the pair group's (DPO and its anchor, on the offline pairs). Their norms differ by a factor the
weights do not know about (at the SFT start of the demo tasks the PPO term's gradient per unit weight
is about 4× the DPO term's, which β = 0.1 scales down), so ``w_ppo : w_dpo`` is not the split of the
update. For the first ``measure_steps`` steps the two groups run as two backward passes and their
gradient norms are measured with gradient clipping's own reductions; the pair term is then scaled by

    factor = (w_dpo / w_ppo) · Σ ‖g_rollout‖ / Σ ‖g_pairs‖

so that ``w_dpo : w_ppo`` is the ratio of the two groups' gradient norms, and the factor is frozen
(saved in checkpoints). On a measured step the factor already applies (the pair gradients are scaled
before the two are added). The cost: on a measured step, a second pipeline flush (under PP) and one
copy of the grad buffers (4 bytes per parameter of the rank's shard: at 70B over TP 8 × PP 4, about
8.8 GB per GPU for those steps only); the other steps cost nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict

from hpa.trainer.objective.controllers.base import Controller, StepSignals
from hpa.trainer.objective.weights import StepFactors


class GradientBalance(Controller):
    """The factor on the pair stream (``pairs``) and its measurement, from the two gradient norms of a
    measured update.

    Args:
        measure_steps: steps measured before the factor is frozen.
    """

    name, observes = "balance", "gradients"

    def __init__(self, measure_steps: int):
        if measure_steps < 1:
            raise ValueError(f"measure_steps must be >= 1, got {measure_steps}")
        self.measure_steps = measure_steps
        self.measured = 0
        self.sum_rollout = 0.0
        self.sum_pairs = 0.0
        self.factor = 1.0

    def measuring(self) -> bool:
        return self.measured < self.measure_steps

    def record(self, rollout_norm: float, pairs_norm: float, w_ppo: float, w_dpo: float) -> float:
        """Add one measured step (norms as the configured weights give them); returns the factor to use.

        A step with a non-finite norm or no gradient in a group is not counted."""
        if all(math.isfinite(x) for x in (rollout_norm, pairs_norm)) and rollout_norm > 0 and pairs_norm > 0 \
                and w_ppo > 0 and w_dpo > 0:
            self.measured += 1
            self.sum_rollout += rollout_norm
            self.sum_pairs += pairs_norm
            self.factor = (w_dpo / w_ppo) * self.sum_rollout / self.sum_pairs
        return self.factor

    def update(self, s: StepSignals) -> Dict[str, float]:
        self.record(s.grad_norms["rollout"], s.grad_norms["pairs"], s.weights.w_ppo, s.weights.w_dpo)
        return self.metrics()

    def act(self, factors: StepFactors) -> StepFactors:
        return dataclasses.replace(factors, pairs=self.factor * factors.pairs)

    def metrics(self) -> Dict[str, float]:
        return {"hpa/balance_factor": self.factor}

    def state_dict(self) -> Dict[str, float]:
        return {"measured": self.measured, "sum_rollout": self.sum_rollout, "sum_pairs": self.sum_pairs,
                "factor": self.factor}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.measured, self.factor = int(state["measured"]), state["factor"]
        self.sum_rollout, self.sum_pairs = state["sum_rollout"], state["sum_pairs"]
