"""The HPA objective, composed here and nowhere else::

    L = w_ppo·(L_ppo + L_ent) + w_dpo·L_dpo + w_kl·L_hier_kl

``L_ent = -c·H`` is the entropy bonus of the sampling policy; it belongs to the PPO term (it keeps the
policy that PPO updates exploring) and is weighted with it, so ``w_ppo = 0`` removes both and
``w_ppo = w_kl = 0`` is plain DPO. The weights come from schedules of the training progress (recipe:
0.4 / 0.4 / 0.2, constant); the components come from ``ppo.policy_loss``, ``ppo.entropy_bonus``,
``dpo.dpo_loss`` and ``kl.hierarchical_kl``, each normalised by its own global count (PPO, entropy
and token KL by response tokens, the semantic distance by responses, DPO by pairs), so a weight is
the share of its term whatever the batch sizes. A micro-batch carries rollouts or preference pairs;
pass ``None`` for the terms it does not carry: they contribute nothing and are not logged.
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
        entropy_term: the entropy term as returned by ``ppo.entropy_bonus`` (``-coef·H``, not yet
            weighted), or None; it enters as ``w_ppo·entropy_term``.

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
        weighted = w_ppo * entropy_term
        total = total + weighted
        metrics["entropy_term"] = entropy_term.detach()
        metrics["weighted_entropy"] = weighted.detach()
    metrics["loss"] = total.detach()
    return total, metrics
