"""The controller protocol: the base class every controller extends, what a controller reads at its point of
the step (``StepSignals``) and what it is built from at start-up (``ControllerInputs``)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, FrozenSet, Mapping, Optional

from hpa.distributed.groups import ParallelGroups
from hpa.reward.coverage import CoverageEstimator
from hpa.rollout.base import RolloutBatch
from hpa.trainer.objective.weights import StepFactors, StepWeights
from hpa.trainer.startup_probes import StartMeasures


@dataclasses.dataclass(frozen=True)
class StepSignals:
    """What a controller reads at its point of the step: what the step measured, not the run.

    Args:
        batch: the step's scored, filtered rollouts (``rollouts``).
        metrics: the step's metrics so far (``reward/learned_mean``, ...).
        weights: the step's ``StepWeights``.
        grad_norms: ``rollout`` and ``pairs`` gradient norms of a measured update (``gradients``).
        heldout_nll: the policy's NLL per token of the held-out chosen responses, measured by the trainer for a
            controller that ``reads`` it (``rollouts``), else None.
    """

    batch: Optional[RolloutBatch] = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    weights: Optional[StepWeights] = None
    grad_norms: Mapping[str, float] = dataclasses.field(default_factory=dict)
    heldout_nll: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class ControllerInputs:
    """What a controller is built from besides its own config section: the run's start as measured once
    (``StartMeasures``, from the start-up probes or a checkpoint) and the coverage estimator. A controller runs
    no policy forward and samples nothing: what it reads each step comes in ``StepSignals``.

    Args:
        groups: the run's parallel groups (a controller reduces its measurements over DP).
        timer: ``timer(name)`` adds a block's wall time to ``timing_s/<name>``.
        start: the start-up probes' record (``hpa.trainer.startup_probes``).
        coverage: the coverage estimator (``hpa.reward.coverage``), None when the coverage trust is off.
    """

    groups: ParallelGroups
    timer: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()
    start: StartMeasures = StartMeasures()
    coverage: Optional[CoverageEstimator] = None


class Controller:
    """State that each step updates from what the step measured and that acts on the step's factors.

    A controller sets ``name`` (its key in the checkpoint's run state) and ``observes`` (the point whose
    signals it reads: ``rollouts``, once the step's rollouts are scored, ``updated_rollouts``, once the policy
    update has given an on-policy step's old log-probs, or ``gradients``, between the two backward passes of
    a measured update), and overrides ``update``; the rest has defaults: it sets no
    factor, logs nothing beyond its updates' metrics, has no state, reads nothing the trainer must measure for
    it and always measures. It acts on the step only through ``act`` (the step's typed factors).
    """

    name: str = ""
    observes: str = "rollouts"
    # what the trainer measures for it at its point (``StepSignals`` fields: ``heldout_nll``)
    reads: FrozenSet[str] = frozenset()

    def update(self, signals: StepSignals) -> Dict[str, float]:
        """State in (the step's signals), metrics out."""
        raise NotImplementedError(f"{type(self).__name__} does not update")

    def act(self, factors: StepFactors) -> StepFactors:
        """The step's factors with this controller's applied."""
        return factors

    def measuring(self) -> bool:
        """Whether it reads its signal this step (a measured update runs only while one does)."""
        return True

    def metrics(self) -> Dict[str, float]:
        """Logged after every update of the policy."""
        return {}

    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state: Dict) -> None:
        pass
