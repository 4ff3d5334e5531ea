"""The coefficients of a step: the scheduled weights (each a schedule of training progress
``p = step / total_steps``) and the factors the controllers set (``StepFactors``), which travel with them."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import torch

from hpa.algorithms.kl import kl_warmup_scale
from hpa.algorithms.schedules import make_schedule
from hpa.config.algorithm import AlgorithmConfig


@dataclasses.dataclass(frozen=True)
class StepFactors:
    """What the controllers (``hpa.trainer.objective.controllers``) set for a step; 1 (or None) where no
    controller acts.

    Args:
        reward_kl: the in-reward KL coefficient, before its warm-up (the KL controller).
        learned_advantage: the weight of the learned component of the advantages (the trust gate).
        pairs: the factor on the pair stream's weight (the automatic balance's, times the coverage trust's
            ``released_pairs`` where it releases the hold): a ``Term`` whose ``factor`` names it has its
            weight multiplied by it.
        kl: the factor on the hierarchical KL's weight (the coverage trust's ``released_kl`` where it releases
            the hold), so the objective table and ``hpa/kl_factor`` show the KL weight the loss applies.
        far_kl_boost: the hold of the rows no reward supports (the coverage trust's ``kl_boost``, 0 where it
            releases the hold): each such row's hierarchical KL weighs ``1 + far_kl_boost``
            (``hpa.algorithms.coverage.abstention_kl_weights``, written to the step's rollouts as ``kl_weights``
            by ``phases.apply_row_factors``); 0: every row weighs 1.
        learned_trust: the per-row weight of the learned advantage component as a function of a
            ``RolloutBatch`` (``[b]``; the coverage trust), evaluated on the held-out prompts too.
    """

    reward_kl: float = 1.0
    learned_advantage: float = 1.0
    pairs: float = 1.0
    kl: float = 1.0
    far_kl_boost: float = 0.0
    learned_trust: Optional[Callable[[object], torch.Tensor]] = None

    def scales(self) -> Dict[str, float]:
        """The scalar factors by name (what ``hpa_objective`` and ``describe`` read through a term's ``factor``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.type == "float"}


@dataclasses.dataclass(frozen=True)
class StepWeights:
    """The scheduled coefficients of one step (progress p = step / total_steps) and the controllers' factors.
    ``reward_kl_coef`` is fixed at the step's start; ``factors`` are replaced when a controller updates
    within the step (``with_factors``)."""

    w_ppo: float
    w_dpo: float
    w_kl: float
    lambda_token: float
    lambda_semantic: float
    entropy_coef: float
    reward_kl_coef: float
    factors: StepFactors = StepFactors()

    def with_factors(self, factors: StepFactors) -> "StepWeights":
        return dataclasses.replace(self, factors=factors)

    def scheduled(self) -> Dict[str, float]:
        """The scheduled weights by name (the ``weight`` fields of ``TERMS`` index it)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "factors"}


class WeightSchedules:
    """The schedules of the step weights (``algorithm.hpa`` and the entropy coefficient)."""

    NAMES = ("w_ppo", "w_dpo", "w_kl", "lambda_token", "lambda_semantic")

    def __init__(self, algo: AlgorithmConfig):
        self.algo = algo
        self.schedules = {name: make_schedule(**dataclasses.asdict(getattr(algo.hpa, name))) for name in self.NAMES}
        self.schedules["entropy_coef"] = make_schedule(**dataclasses.asdict(algo.ppo.entropy_coef))

    def at(self, p: float, factors: StepFactors) -> StepWeights:
        """The weights at progress ``p`` with the controllers' ``factors``; the in-reward KL coefficient is
        their ``reward_kl`` times the KL warm-up scale."""
        values = {name: schedule(p) for name, schedule in self.schedules.items()}
        return StepWeights(**values, factors=factors,
                           reward_kl_coef=factors.reward_kl * kl_warmup_scale(p, self.algo.kl.warmup_fraction))

    def metrics(self, w: StepWeights) -> Dict[str, float]:
        """The scheduled weights and ``hpa/kl_factor``: the KL term weighs ``hpa/w_kl`` times it."""
        return {"hpa/w_ppo": w.w_ppo, "hpa/w_dpo": w.w_dpo, "hpa/w_kl": w.w_kl, "hpa/kl_factor": w.factors.kl,
                "hpa/lambda_token": w.lambda_token, "hpa/lambda_semantic": w.lambda_semantic}
