"""The scheduled coefficients of a step: each a schedule of training progress ``p = step / total_steps``."""

from __future__ import annotations

import dataclasses
from typing import Dict

from hpa.algorithms.kl import kl_warmup_scale
from hpa.algorithms.schedules import make_schedule
from hpa.config.algorithm import AlgorithmConfig


@dataclasses.dataclass(frozen=True)
class StepWeights:
    """The scheduled coefficients of one step (progress p = step / total_steps)."""

    w_ppo: float
    w_dpo: float
    w_kl: float
    lambda_token: float
    lambda_semantic: float
    entropy_coef: float
    reward_kl_coef: float


class WeightSchedules:
    """The schedules of the step weights (``algorithm.hpa`` and the entropy coefficient)."""

    NAMES = ("w_ppo", "w_dpo", "w_kl", "lambda_token", "lambda_semantic")

    def __init__(self, algo: AlgorithmConfig):
        self.algo = algo
        self.schedules = {name: make_schedule(**dataclasses.asdict(getattr(algo.hpa, name))) for name in self.NAMES}
        self.schedules["entropy_coef"] = make_schedule(**dataclasses.asdict(algo.ppo.entropy_coef))

    def at(self, p: float, kl_coef: float) -> StepWeights:
        """The weights at progress ``p``; the in-reward KL coefficient is the controller's ``kl_coef``
        times the KL warm-up scale."""
        values = {name: schedule(p) for name, schedule in self.schedules.items()}
        return StepWeights(**values, reward_kl_coef=kl_coef * kl_warmup_scale(p, self.algo.kl.warmup_fraction))

    def metrics(self, w: StepWeights) -> Dict[str, float]:
        return {"hpa/w_ppo": w.w_ppo, "hpa/w_dpo": w.w_dpo, "hpa/w_kl": w.w_kl,
                "hpa/lambda_token": w.lambda_token, "hpa/lambda_semantic": w.lambda_semantic}
