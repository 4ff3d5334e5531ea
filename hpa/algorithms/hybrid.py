"""The HPA objective: ``w_ppo·L_ppo + w_dpo·L_dpo + w_kl·L_hier_kl (+ entropy term)``.

The weights come from schedules of the training progress (recipe: 0.4 / 0.4 / 0.2, constant); the
components come from ``ppo.policy_loss``, ``dpo.dpo_loss``, ``kl.hierarchical_kl`` and
``ppo.entropy_bonus``. In a step whose micro-batch carries no rollouts (or no preference pairs),
pass ``None`` for the missing term: it contributes nothing and is not logged.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

Metrics = Dict[str, torch.Tensor]


def hpa_objective(
    ppo_loss: Optional[torch.Tensor],
    dpo_loss: Optional[torch.Tensor],
    hier_kl_loss: Optional[torch.Tensor],
    *,
    w_ppo: float,
    w_dpo: float,
    w_kl: float,
    entropy_term: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """Combine the HPA loss components.

    Args:
        ppo_loss: PPO policy loss (0-dim), or None.
        dpo_loss: DPO-family loss (0-dim), or None.
        hier_kl_loss: hierarchical KL (0-dim), or None.
        w_ppo: weight of the PPO loss.
        w_dpo: weight of the DPO loss.
        w_kl: weight of the hierarchical KL.
        entropy_term: the entropy term as returned by ``ppo.entropy_bonus`` (already ``-coef·H``),
            added unweighted, or None.

    Returns:
        ``(total, metrics)``: metrics ``loss`` (the total), each present component (``ppo_loss``,
        ``dpo_loss``, ``hier_kl_loss``, ``entropy_term``), its weighted contribution
        (``weighted_ppo``, ...) and the weights ``w_ppo``, ``w_dpo``, ``w_kl``.
    """
    parts = (
        ("ppo", "w_ppo", ppo_loss, w_ppo),
        ("dpo", "w_dpo", dpo_loss, w_dpo),
        ("hier_kl", "w_kl", hier_kl_loss, w_kl),
    )
    if all(p[2] is None for p in parts) and entropy_term is None:
        raise ValueError("hpa_objective needs at least one loss component")
    reference = next(t for t in (ppo_loss, dpo_loss, hier_kl_loss, entropy_term) if t is not None)
    total = torch.zeros((), dtype=reference.dtype, device=reference.device)
    metrics: Metrics = {}
    for name, weight_name, term, weight in parts:
        metrics[weight_name] = torch.tensor(float(weight), dtype=reference.dtype)
        if term is None:
            continue
        weighted = weight * term
        total = total + weighted
        metrics[f"{name}_loss"] = term.detach()
        metrics[f"weighted_{name}"] = weighted.detach()
    if entropy_term is not None:
        total = total + entropy_term
        metrics["entropy_term"] = entropy_term.detach()
    metrics["loss"] = total.detach()
    return total, metrics
