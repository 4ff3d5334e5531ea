"""The controllers of the objective: state that each step updates from what the step measured and that
acts on the step's factors (``StepFactors``), saved with the run state.

Every controller extends ``base.Controller`` (``name``, ``observes``, ``update(signals) -> metrics``,
``act(factors) -> factors``; the rest has defaults). ``Controllers`` holds a run's controllers: the trainer
updates them at their point of the step and reads their factors as one ``StepFactors``, which travels
with the step weights; ``RunState`` saves them as its other parts. A new controller is its class (its own
module) and one entry of ``CONTROLLERS``; a new factor is also a ``StepFactors`` field (and, when it scales a
term's weight, that term's ``factor``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterator, List

from hpa.config.schema import Config, coverage_enabled, old_log_probs_from_update, trust_gate_enabled
from hpa.reward.rules import graded_rule
from hpa.trainer.objective.controllers.balance import GradientBalance
from hpa.trainer.objective.controllers.base import Controller, ControllerInputs, StepSignals
from hpa.trainer.objective.controllers.coverage import CoverageTrust
from hpa.trainer.objective.controllers.kl_coefficient import KLCoefficient
from hpa.trainer.objective.controllers.trust_gate import GATE_SIGNAL_INPUTS, TrustGateController
from hpa.trainer.objective.weights import StepFactors


@dataclasses.dataclass(frozen=True)
class ControllerEntry:
    """A controller of the registry: how it is built from its config section and the start-up inputs, and
    whether a run's config turns it on."""

    build: Callable[[Config, ControllerInputs], Controller]
    enabled: Callable[[Config], bool]


CONTROLLERS: Dict[str, ControllerEntry] = {
    "kl_ctrl": ControllerEntry(lambda cfg, run: KLCoefficient(cfg.algorithm.kl, run.groups,
                                                              after_update=old_log_probs_from_update(cfg)),
                               lambda cfg: True),
    "trust_gate": ControllerEntry(lambda cfg, run: TrustGateController(cfg.algorithm.hpa.trust, cfg.rollout, run),
                                  trust_gate_enabled),
    "balance": ControllerEntry(lambda cfg, run: GradientBalance(cfg.algorithm.hpa.balance.measure_steps),
                               lambda cfg: cfg.algorithm.hpa.balance.enabled),
    "coverage": ControllerEntry(lambda cfg, run: CoverageTrust(cfg.algorithm.hpa.trust, run, cfg.rollout,
                                                               skill_rule=graded_rule(cfg.reward.rules)),
                                coverage_enabled),
}


class Controllers:
    """A run's controllers (those of ``CONTROLLERS`` its config turns on), in registry order."""

    def __init__(self, cfg: Config, run: ControllerInputs):
        self.items: List[Controller] = [e.build(cfg, run) for e in CONTROLLERS.values() if e.enabled(cfg)]

    def __iter__(self) -> Iterator[Controller]:
        return iter(self.items)

    def update(self, point: str, signals: StepSignals) -> Dict[str, float]:
        """Update the controllers that observe ``point``; their metrics."""
        metrics: Dict[str, float] = {}
        for c in self.items:
            if c.observes == point:
                metrics.update(c.update(signals))
        return metrics

    def measuring(self, point: str) -> bool:
        """Whether a controller that observes ``point`` reads its signal this step."""
        return any(c.measuring() for c in self.items if c.observes == point)

    def factors(self) -> StepFactors:
        """The step's factors: each controller's applied, in registry order."""
        factors = StepFactors()
        for c in self.items:
            factors = c.act(factors)
        return factors

    def metrics(self) -> Dict[str, float]:
        return {k: v for c in self.items for k, v in c.metrics().items()}

    def state_parts(self) -> Dict[str, Controller]:
        """Name -> controller: the run state's stateful parts (the checkpoint's keys)."""
        return {c.name: c for c in self.items}


__all__ = ["CONTROLLERS", "Controller", "ControllerEntry", "ControllerInputs", "Controllers", "CoverageTrust",
           "GATE_SIGNAL_INPUTS", "GradientBalance", "KLCoefficient", "StepSignals", "TrustGateController"]
