"""The trust gate (``algorithm.hpa.trust``, ``hpa.algorithms.gate``) as a controller, and what each of its
signals needs from the run (``GATE_SIGNAL_INPUTS``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Dict, Optional

from hpa.algorithms.gate import (GATE_BASELINE_PROMPTS, GATE_BASELINE_STEPS, GATE_HEADROOM_SCALE, GATE_KI, GATE_KP,
                                 GATE_REWARD_EMA, TrustGate)
from hpa.config.algorithm import TrustConfig
from hpa.config.schema import RolloutConfig
from hpa.data.sampler import evenly_spaced
from hpa.reward.embeddings import greedy_and_sampled_reward, heldout_reward_ceiling, mean_learned_reward
from hpa.rollout.base import SamplingParams
from hpa.trainer.objective.controllers.base import Controller, ControllerInputs, StepSignals
from hpa.trainer.objective.weights import StepFactors

logger = logging.getLogger("hpa")

# the start_rollouts baseline's generate calls: at most this many prompts each (rollout.n responses a prompt)
BASELINE_PROMPTS_PER_CALL = 64


@dataclasses.dataclass(frozen=True)
class GateSignal:
    """What a trust-gate signal needs from the run: ``start(gate, run, rollout, baseline_prompts)`` once, at
    start-up, and ``measure(run)`` each step (the held-out NLL, or None)."""

    start: Callable[[TrustGate, ControllerInputs, RolloutConfig, int], None]
    measure: Callable[[ControllerInputs], Optional[float]]


def _set_ceiling(gate: TrustGate, run: ControllerInputs, rollout: RolloutConfig, baseline_prompts: int) -> None:
    gate.set_ceiling(*heldout_reward_ceiling(run.model_reward, run.heldout_pairs, pad_id=run.pad_id))
    logger.info("trust gate: the held-out chosen responses' learned reward is %.4f, margin %.4f", gate.ceiling,
                gate.margin)


def _set_sampled_ceiling(gate: TrustGate, run: ControllerInputs, rollout: RolloutConfig,
                         baseline_prompts: int) -> None:
    chosen, margin = heldout_reward_ceiling(run.model_reward, run.heldout_pairs, pad_id=run.pad_id)
    greedy, sampled = greedy_and_sampled_reward(run.model_reward, run.tokenizer, run.heldout_pairs, run.generate,
                                                rollout, run.groups)
    gate.set_ceiling(chosen, margin, offset=greedy - sampled)
    logger.info("trust gate: the held-out chosen responses' learned reward is %.4f, margin %.4f; the start "
                "policy's greedy responses score %.4f, its sampled ones %.4f: the ceiling on the rollouts' scale "
                "is %.4f", chosen, margin, greedy, sampled, gate.ceiling)


def _set_headroom(gate: TrustGate, run: ControllerInputs, rollout: RolloutConfig, baseline_prompts: int) -> None:
    chosen, margin = heldout_reward_ceiling(run.model_reward, run.heldout_pairs, pad_id=run.pad_id)
    greedy, sampled = greedy_and_sampled_reward(run.model_reward, run.tokenizer, run.heldout_pairs, run.generate,
                                                rollout, run.groups)
    gate.set_headroom(chosen, greedy, margin)
    logger.info("trust gate: on the held-out prompts the chosen responses' learned reward is %.4f (margin %.4f), "
                "the start policy's greedy responses' %.4f (sampled %.4f): headroom %.4f above the start's own "
                "rollouts on the training prompts", chosen, margin, greedy, sampled, gate.headroom)
    if not baseline_prompts:
        logger.info("trust gate: the baseline is the first %d updates' rollouts", gate.baseline_steps)
    elif not run.prompts:
        raise ValueError("the start_rollouts gate's baseline needs training prompts (data.prompt_path has none)")


def _measure_baseline(gate: TrustGate, run: ControllerInputs, rollout: RolloutConfig, baseline_prompts: int) -> None:
    """start_rollouts with ``baseline_prompts`` > 0: the start policy's sampled rollouts on that many training
    prompts (evenly spaced over the file), their mean learned reward the baseline. Run at the first update, on
    the start weights, when the run state holds no baseline: a resumed run's saved one wins, so it samples
    nothing."""
    prompts = [e.prompt_ids for e in evenly_spaced(run.prompts, baseline_prompts)]
    # the steps' seeds are rollout.seed + step * DP + rank: this stream lies far from them
    params = SamplingParams.from_config(rollout, seed=rollout.seed + 2_000_003 + run.groups.dp_rank)
    with run.timer("gate"):
        baseline = mean_learned_reward(run.model_reward, run.tokenizer, prompts, run.generate, params, run.groups,
                                       prompts_per_call=BASELINE_PROMPTS_PER_CALL)
    gate.set_baseline(baseline)
    logger.info("trust gate: the start policy's sampled rollouts on %d training prompts score %.4f (the "
                "baseline); the ceiling is %.4f", len(prompts), baseline, gate.ceiling)


def _heldout_nll(run: ControllerInputs) -> float:
    with run.timer("gate"):
        return run.policy_nll(run.heldout_pairs)


GATE_SIGNAL_INPUTS: Dict[str, GateSignal] = {
    "reward_ceiling": GateSignal(start=_set_ceiling, measure=lambda run: None),
    "sampled_ceiling": GateSignal(start=_set_sampled_ceiling, measure=lambda run: None),
    "start_rollouts": GateSignal(start=_set_headroom, measure=lambda run: None),
    "heldout_nll": GateSignal(start=lambda gate, run, rollout, baseline_prompts: None, measure=_heldout_nll),
}


class TrustGateController(Controller):
    """The weight of the learned component of the advantages (``learned_advantage``), from the signal
    ``GATE_SIGNAL_INPUTS`` names. ``signal`` and ``slack`` are ``algorithm.hpa.trust``'s; the rest are
    ``hpa.algorithms.gate``'s constants, arguments here for the tests (``baseline_prompts`` 0: the baseline
    is the first ``baseline_steps`` updates' batches)."""

    name, observes = "trust_gate", "rollouts"

    def __init__(self, t: TrustConfig, rollout: RolloutConfig, run: ControllerInputs, *,
                 baseline_prompts: int = GATE_BASELINE_PROMPTS, baseline_steps: int = GATE_BASELINE_STEPS):
        self.gate = TrustGate(signal=t.signal, slack=t.slack, kp=GATE_KP, ki=GATE_KI, reward_ema=GATE_REWARD_EMA,
                              baseline_steps=baseline_steps, headroom_scale=GATE_HEADROOM_SCALE)
        signal = GATE_SIGNAL_INPUTS[t.signal]
        signal.start(self.gate, run, rollout, baseline_prompts)
        self.measure = functools.partial(signal.measure, run)  # what it reads each step, nothing else of the run
        # the start-up baseline (baseline_prompts > 0), measured at the first update while the gate needs one:
        # a restored run state brings its own
        self.measure_baseline = (functools.partial(_measure_baseline, self.gate, run, rollout, baseline_prompts)
                                 if t.signal == "start_rollouts" and baseline_prompts else None)

    def update(self, s: StepSignals) -> Dict[str, float]:
        if self.measure_baseline is not None and self.gate.needs_baseline:
            self.measure_baseline()
        # every row's learned reward, also with the coverage trust on: the covered rows' alone (the metric
        # coverage/learned_reward) kept the gate open where it should close (docs/objective.md)
        return self.gate.update(self.measure(), s.metrics["reward/learned_mean"])

    def act(self, factors: StepFactors) -> StepFactors:
        return dataclasses.replace(factors, learned_advantage=self.gate.gate * factors.learned_advantage)

    def state_dict(self) -> Dict:
        return self.gate.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        self.gate.load_state_dict(state)
