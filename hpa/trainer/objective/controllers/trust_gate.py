"""The trust gate (``algorithm.hpa.trust``, ``hpa.algorithms.gate``) as a controller: set up from the start-up
probes' record (``StartMeasures``), updated from what each step measured."""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict

from hpa.algorithms.gate import (GATE_BASELINE_STEPS, GATE_HEADROOM_SCALE, GATE_KI, GATE_KP, GATE_REWARD_EMA,
                                 TrustGate)
from hpa.config.algorithm import TrustConfig
from hpa.trainer.objective.controllers.base import Controller, ControllerInputs, StepSignals
from hpa.trainer.objective.weights import StepFactors
from hpa.trainer.startup_probes import StartMeasures

logger = logging.getLogger("hpa")


def start_gate(gate: TrustGate, start: StartMeasures) -> None:
    """The gate's start-up constants from the record: the ceiling and its unit (``reward_ceiling``), lowered by
    the start's greedy - sampled offset (``sampled_ceiling``), or the headroom and, when measured, the baseline
    (``start_rollouts``); ``heldout_nll`` needs none."""
    if gate.signal == "heldout_nll":
        return
    if start.chosen_reward is None:
        raise ValueError(f"the {gate.signal} trust gate needs the start-up probes' held-out ceiling; the record "
                         f"has none ({start})")
    if gate.signal == "reward_ceiling":
        gate.set_ceiling(start.chosen_reward, start.margin)
    elif gate.signal == "sampled_ceiling":
        gate.set_ceiling(start.chosen_reward, start.margin, offset=start.offset)
        logger.info("trust gate: the ceiling on the rollouts' scale is %.4f (offset %.4f)", gate.ceiling,
                    gate.offset)
    else:
        gate.set_headroom(start.chosen_reward, start.greedy_reward, start.margin)
        logger.info("trust gate: headroom %.4f above the start's own rollouts on the training prompts",
                    gate.headroom)
        if start.baseline is not None:
            gate.set_baseline(start.baseline)
            logger.info("trust gate: the baseline is %.4f; the ceiling is %.4f", gate.baseline, gate.ceiling)


class TrustGateController(Controller):
    """The weight of the learned component of the advantages (``learned_advantage``), from the signal
    ``algorithm.hpa.trust.signal`` names. ``signal`` and ``slack`` are ``algorithm.hpa.trust``'s; the rest are
    ``hpa.algorithms.gate``'s constants (``baseline_steps`` an argument for the tests: the baseline counted
    from the first updates' batches where the record holds none). The start-up constants come from the record
    (``start_gate``); a restored run state brings its own. ``heldout_nll`` reads the held-out NLL the trainer
    measures each step (``reads``). Where the gate starts closing or opens again a WARNING gives the numbers."""

    name, observes = "trust_gate", "rollouts"

    def __init__(self, t: TrustConfig, run: ControllerInputs, *, baseline_steps: int = GATE_BASELINE_STEPS):
        self.gate = TrustGate(signal=t.signal, slack=t.slack, kp=GATE_KP, ki=GATE_KI, reward_ema=GATE_REWARD_EMA,
                              baseline_steps=baseline_steps, headroom_scale=GATE_HEADROOM_SCALE)
        start_gate(self.gate, run.start)
        self.reads = frozenset({"heldout_nll"}) if t.signal == "heldout_nll" else frozenset()

    def update(self, s: StepSignals) -> Dict[str, float]:
        was_open = self.gate.lam == 0
        # every row's learned reward, also with the coverage trust on: the covered rows' alone (the metric
        # coverage/learned_reward) kept the gate open where it should close (docs/objective.md)
        metrics = self.gate.update(s.heldout_nll, s.metrics["reward/learned_mean"])
        if was_open != (self.gate.lam == 0):
            numbers = ", ".join(f"{k[len('gate/'):]} {v:.4g}" for k, v in metrics.items()
                                if k not in ("gate/gate", "gate/lambda"))
            logger.warning("trust gate: %s (gate %.4g, lambda %.4g): %s", "closing" if was_open else "open again",
                           self.gate.gate, self.gate.lam, numbers)
        return metrics

    def act(self, factors: StepFactors) -> StepFactors:
        return dataclasses.replace(factors, learned_advantage=self.gate.gate * factors.learned_advantage)

    def state_dict(self) -> Dict:
        return self.gate.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        self.gate.load_state_dict(state)
