"""The objective of an HPA step: one table of terms (``terms.TERMS``) from which the step's loss is
computed, the data streams its terms live on (``streams``), their scheduled weights (``weights``), the
loss closures (``loss``) and the controllers that act on the terms (``controllers``). docs/objective.md
shows how to add a term or a controller.
"""

from hpa.trainer.objective.controllers import (CONTROLLERS, Controller, ControllerInputs, Controllers,
                                               GradientBalance, StepSignals)
from hpa.trainer.objective.loss import SHARE_KEYS, average, make_critic_loss, make_policy_loss, step_metrics
from hpa.trainer.objective.streams import STREAMS, GlobalCounts, global_counts
from hpa.trainer.objective.terms import GROUPS, TERMS, Term, active_terms, describe, hpa_objective
from hpa.trainer.objective.weights import StepFactors, StepWeights, WeightSchedules

__all__ = [
    "CONTROLLERS", "Controller", "ControllerInputs", "Controllers", "GradientBalance", "StepSignals", "SHARE_KEYS", "average",
    "make_critic_loss", "make_policy_loss", "step_metrics", "STREAMS", "GlobalCounts", "global_counts", "GROUPS",
    "TERMS", "Term", "active_terms", "describe", "hpa_objective", "StepFactors", "StepWeights", "WeightSchedules",
]
