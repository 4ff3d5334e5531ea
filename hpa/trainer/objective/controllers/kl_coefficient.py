"""The in-reward KL coefficient (``algorithm.kl.controller``)."""

from __future__ import annotations

import dataclasses
from typing import Dict

from hpa.algorithms.kl import kl_penalty, make_kl_controller
from hpa.algorithms.masked import masked_mean
from hpa.config.algorithm import KLConfig
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.trainer.objective.controllers.base import Controller, StepSignals
from hpa.trainer.objective.weights import StepFactors


class KLCoefficient(Controller):
    """It follows the DP-mean KL between the rollout policy and the reference (the checkpoint keeps the
    controller's own state) and sets ``reward_kl``."""

    name, observes = "kl_ctrl", "rollouts"

    def __init__(self, kl: KLConfig, groups: ParallelGroups, after_update: bool = False):
        self.reward_estimator, self.groups = kl.reward_estimator, groups
        if after_update:  # an on-policy step's old log-probs come from the update (no in-reward KL reads them)
            self.observes = "updated_rollouts"
        self.controller = make_kl_controller(kl.controller, kl_coef=kl.init_kl_coef, target_kl=kl.target_kl,
                                             horizon=kl.horizon)

    def update(self, s: StepSignals) -> Dict[str, float]:
        batch = s.batch
        kl = masked_mean(kl_penalty(batch.get("old_log_probs"), batch.get("ref_log_probs"), self.reward_estimator),
                         batch.get("mask"))
        current = comm.all_reduce_mean(kl.reshape(1).double(), self.groups.dp_group).item()
        self.controller.update(current, batch.batch_size * self.groups.data_parallel_size)
        return {"actor/kl_coef": s.weights.reward_kl_coef, "actor/reward_kl": current}

    def act(self, factors: StepFactors) -> StepFactors:
        return dataclasses.replace(factors, reward_kl=self.controller.value * factors.reward_kl)

    def state_dict(self) -> Dict:
        return self.controller.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        self.controller.load_state_dict(state)
