"""Pure tensor math of HPA: advantages, PPO, DPO, KL, loss aggregation, schedules.

No ``torch.distributed``, no config objects: tensors and plain numbers in, ``(loss, metrics)`` out.
Cross-rank facts (global token/sequence counts, DP size) are arguments. Components are chosen by
name from the registries below.
"""

from hpa.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, compute_gae, compute_group_advantages
from hpa.algorithms.dpo import DPO_LOSSES, dpo_loss
from hpa.algorithms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    SEMANTIC_DISTANCES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    hierarchical_kl,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from hpa.algorithms.losses import AGG_MODES, Aggregation, agg_loss
from hpa.algorithms.ppo import POLICY_LOSSES, entropy_bonus, policy_loss, value_loss
from hpa.algorithms.schedules import SCHEDULES, make_schedule

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "DPO_LOSSES",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "SCHEDULES",
    "SEMANTIC_DISTANCES",
    "AdaptiveKLController",
    "Aggregation",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantages",
    "compute_gae",
    "compute_group_advantages",
    "dpo_loss",
    "entropy_bonus",
    "hierarchical_kl",
    "kl_loss",
    "kl_penalty",
    "make_kl_controller",
    "make_schedule",
    "policy_loss",
    "value_loss",
]
