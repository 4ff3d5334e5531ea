"""The coverage trust (``algorithm.hpa.trust``, ``hpa.algorithms.coverage``) as a controller: the coverage
estimator (``hpa.reward.coverage``) weighs each rollout row's learned advantage, and the hold (or its release)
decided from the start-up probes' record sets the KL and pair factors."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Dict, Optional

import torch

from hpa.algorithms.coverage import (KL_BOOST_TARGET, TRUST_METRICS, adapt_kl_boost, far_kl_sums, far_rows,
                                     trust_stats)
from hpa.config.algorithm import TrustConfig
from hpa.distributed import comm
from hpa.trainer.objective.controllers.base import Controller, ControllerInputs, StepSignals
from hpa.trainer.objective.weights import StepFactors

logger = logging.getLogger("hpa")


def covered_reward_sums(batch, trust: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The learned part of the rollouts' reward (r̂ minus the rule) summed with each row's coverage trust
    as its weight over the rows that train (``valid``), and the weights' sum: ``[sum, weight]`` (float64,
    to be summed over DP ranks). Their ratio is ``coverage/learned_reward`` (logged; NaN when no row is
    covered). Not the gate's input: measured as one, it kept the gate open where every row's learned
    reward closed it (docs/objective.md). # [b], [b] bool -> [2]"""
    learned = torch.where(valid, batch.get("raw_rewards").double() - batch.get("rule_scores").double(),
                          torch.zeros((), dtype=torch.float64))  # [b]
    weight = trust.double() * valid.double()  # [b]
    return torch.stack([(weight * learned).sum(), weight.sum()])


class CoverageTrust(Controller):
    """Each rollout row's weight of the learned advantage component and the hold of the far rows, as step
    factors: ``learned_trust`` (the estimator's trust of a batch's rows, which the trainer writes to the step's
    rollouts and the evaluation reads on its prompts) and ``far_kl_boost`` (each far row's KL to the reference
    weighs ``1 + far_kl_boost``: ``abstention_kl_weights``; a row a rule judges, ``rule_judged``, keeps weight 1).

    Each step it logs the trust's distribution over the rollouts, the covered rows' learned reward, the far
    rows' KL to the reference (``coverage/far_kl``, in a step that has far rows) and the boost
    (``coverage/kl_boost``). With ``kl_boost_target`` the boost adapts to that KL each step before the
    factors are read (``adapt_kl_boost``); it is then run state (saved; a checkpoint without it resumes at
    ``kl_boost``). With ``hold_min_skill``, where the record holds the start's skill on the demonstrations no
    pair covers (the start-up probes) and it is below, the far rows are not held for the run (boost 0): every
    row's KL weighs ``released_kl`` times ``w_kl`` (the step factor ``kl``, which the objective table and
    ``hpa/kl_factor`` show) and the pair stream ``released_pairs`` times what the balance set (``pairs``); the
    release is a WARNING with the numbers that decided it.

    ``kl_boost``, ``hold_min_skill``, ``released_kl`` and ``released_pairs`` are ``algorithm.hpa.trust``'s;
    ``kl_boost_target`` is ``hpa.algorithms.coverage``'s constant, an argument here for the tests and probes.
    """

    name, observes = "coverage", "rollouts"

    def __init__(self, c: TrustConfig, run: ControllerInputs, *, kl_boost_target: Optional[float] = KL_BOOST_TARGET):
        if run.coverage is None:
            raise ValueError("the coverage trust needs a coverage estimator (ControllerInputs.coverage)")
        self.estimator, self.dp_group, self.timer = run.coverage, run.groups.dp_group, run.timer
        self.config_boost, self.kl_boost = c.kl_boost, c.kl_boost
        self.kl_boost_target, self.kl_boost_ceiling = kl_boost_target, 10.0 * c.kl_boost
        self.min_skill, self.released_kl, self.released_pairs = c.hold_min_skill, c.released_kl, c.released_pairs
        self.start_skill, self.far_demonstrations = run.start.start_skill, run.start.far_demonstrations
        self.observed = None  # (weakref to the batch of the last update, its trust [b])
        self._decide_hold()

    def _decide_hold(self) -> None:
        if self.start_skill is None:
            return
        if self.holds():
            logger.info("coverage trust: the start's skill on the %d demonstrations no pair covers is %.3f (greedy; "
                        "the graded rule's mean where reward.rules has one), at least %g (trust.hold_min_skill): the "
                        "far rows are held (boost %g)",
                        self.far_demonstrations, self.start_skill, self.min_skill, self.kl_boost)
            return
        if self.kl_boost > 0:
            logger.warning("coverage trust: the hold is released: the start's skill on the %d demonstrations no "
                           "pair covers is %.3f (greedy; the graded rule's mean where reward.rules has one), below %g "
                           "(trust.hold_min_skill); the far rows "
                           "are not held (boost %g -> 0), every row's KL to the reference weighs %g "
                           "(trust.released_kl) and the pairs' terms %g times as much (trust.released_pairs)",
                           self.far_demonstrations, self.start_skill, self.min_skill, self.kl_boost,
                           self.released_kl, self.released_pairs)
        self.kl_boost = 0.0

    def holds(self) -> bool:
        """Whether the far rows are held: always, unless the start's skill was measured and is below
        ``hold_min_skill``."""
        return self.min_skill is None or self.start_skill is None or not self.start_skill < self.min_skill

    @property
    def low(self) -> float:
        return self.estimator.low

    @property
    def high(self) -> float:
        return self.estimator.high

    def trust(self, batch) -> torch.Tensor:
        """The trust of each row of a rollout batch ``[b]``: the one the last update computed when ``batch`` is
        its batch, else the estimator's now (the evaluation's prompts)."""
        if self.observed is not None and self.observed[0]() is batch:
            return self.observed[1]
        return self.estimator.batch_trust(batch)

    def update(self, s: StepSignals) -> Dict[str, float]:
        batch = s.batch
        with self.timer("coverage"):
            trust = self.estimator.batch_trust(batch)  # [b]
        self.observed = (weakref.ref(batch), trust)
        mask, judged = batch.get("mask"), batch.extras.get("rule_judged")
        valid = mask.sum(dim=1) > 0  # the rows that train (not dropped by the filter)
        far = far_rows(trust, judged)  # [b]: what the boost holds, and what coverage/far_share counts
        far_sums = torch.zeros(2, dtype=torch.float64, device=trust.device)
        if self.kl_boost > 0:  # the far rows' KL (logged; the adaptive boost's input)
            far_sums = far_kl_sums(batch.get("old_log_probs"), batch.get("ref_log_probs"), mask, far)
        sums = comm.all_reduce_sum(torch.cat([covered_reward_sums(batch, trust, valid), far_sums]), self.dp_group)
        rows = comm.all_gather_cat(torch.stack([trust.double(), valid.double(), far.double()], dim=1),
                                   self.dp_group)  # [B, 3]
        # every number logged below, and the adaptive boost's input, in the step's one read of the device
        read = torch.cat([sums, trust_stats(rows[:, 0], rows[:, 1] > 0, rows[:, 2] > 0)]).cpu().tolist()
        reward_sum, weight, kl_sum, kl_tokens, *stats = read
        nan = float("nan")
        metrics = {f"coverage/{k}": v for k, v in zip(TRUST_METRICS, stats)}
        if self.start_skill is not None:  # measured (hold_min_skill): the boost it set, 0 included
            metrics["coverage/start_skill"], metrics["coverage/kl_boost"] = self.start_skill, self.kl_boost
        if self.kl_boost > 0:
            far_kl = kl_sum / kl_tokens if kl_tokens > 0 else nan
            if self.kl_boost_target is not None:
                self.kl_boost = adapt_kl_boost(self.kl_boost, far_kl, self.kl_boost_target,
                                               ceiling=self.kl_boost_ceiling)
            metrics["coverage/kl_boost"] = self.kl_boost
            if kl_tokens > 0:  # a step with no far row (every row covered or judged by a rule) logs none
                metrics["coverage/far_kl"] = far_kl
        return {**metrics, "coverage/low": self.low, "coverage/high": self.high,
                "perf/coverage_cached_prompts": float(len(self.estimator.cache)),  # a cache, not state: not resumed
                "coverage/learned_reward": reward_sum / weight if weight > 0 else nan}

    def act(self, factors: StepFactors) -> StepFactors:
        if self.holds():
            return dataclasses.replace(factors, learned_trust=self.trust, far_kl_boost=self.kl_boost)
        # released: the pair stream (DPO, its anchor, the replay) weighs released_pairs times what the balance set,
        # and every row's KL released_kl times w_kl (a step factor, not a column: the logged table shows it)
        return dataclasses.replace(factors, learned_trust=self.trust, far_kl_boost=0.0,
                                   pairs=factors.pairs * self.released_pairs, kl=factors.kl * self.released_kl)

    def state_dict(self) -> Dict:
        state = self.estimator.state_dict()
        if self.kl_boost_target is not None:  # adapted: run state; a constant boost is the config's
            state["kl_boost"] = self.kl_boost
        return state

    def load_state_dict(self, state: Dict) -> None:
        self.estimator.load_state_dict(state)
        if "start_skill" in state:  # a checkpoint from before the start-up record kept the skill here
            self.start_skill, self.kl_boost = state["start_skill"], self.config_boost
            self._decide_hold()
        if self.kl_boost_target is not None and self.holds():  # adapted (a checkpoint from before resumes at kl_boost)
            self.kl_boost = state.get("kl_boost", self.kl_boost)
