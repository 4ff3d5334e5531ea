"""The HPA objective: one table of named terms (``TERMS``), composed here and nowhere else::

    L = w_ppo·(L_ppo + L_ent) + w_dpo·b·(L_dpo + α·NLL_chosen) + w_kl·L_hier_kl

Each row says which micro-batches carry the term (``group``: the step's rollouts or the offline
pairs), which scheduled step weight multiplies it (``weight``, a ``StepWeights`` field), the global
count it is normalised by (``normaliser``, a ``GlobalCounts`` field, so a weight is the share of its
term whatever the batch sizes), what else scales it (``scaled_by``) and the function that computes
it. ``b`` is the automatic balance's factor on the pair group (``hpa.trainer.balance``, 1 unless
``algorithm.hpa.balance``); the trust gate does not scale a loss: it weights the learned component of
the advantages the PPO term reads (``hpa.algorithms.gate``). ``L_ent = -c·H`` belongs to the PPO term
(it keeps the policy that PPO updates exploring), so ``w_ppo = 0`` removes both and
``w_ppo = w_kl = 0`` is plain DPO. A new term is a row here and its value in the loss closures
(``hpa.trainer.objective``).

A micro-batch carries rollouts or preference pairs; the terms it does not carry are left out of
``values``: they contribute nothing and are not logged.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Tuple

import torch

Metrics = Dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of the objective (see the module docstring)."""

    name: str
    group: str
    weight: str
    normaliser: str
    scaled_by: str
    source: str


TERMS: Tuple[Term, ...] = (
    Term("ppo", "rollout", "w_ppo", "tokens", "trust gate (learned advantage component)", "ppo.policy_loss"),
    Term("dpo", "pairs", "w_dpo", "pairs (anchor: chosen_tokens)", "balance factor",
         "dpo.dpo_loss + dpo.anchor_nll"),
    Term("hier_kl", "rollout", "w_kl", "tokens (semantic: sequences)", "lambda_token, lambda_semantic",
         "kl.hierarchical_kl"),
    Term("entropy", "rollout", "w_ppo", "tokens", "entropy_coef", "ppo.entropy_bonus"),
)
GROUPS = ("rollout", "pairs")


def hpa_objective(values: Mapping[str, Optional[torch.Tensor]], weights: Mapping[str, float], *,
                  group_scale: Optional[Mapping[str, float]] = None) -> Tuple[torch.Tensor, Metrics]:
    """Combine the terms of ``TERMS`` present in ``values``.

    Args:
        values: term name -> its 0-dim value (already normalised by its global count), or None / absent.
        weights: the step weights by name (``w_ppo``, ``w_dpo``, ``w_kl``; other keys are ignored).
        group_scale: a factor per group (``pairs``: the balance factor); 1 where absent.

    Returns:
        ``(total, metrics)``: metrics ``loss`` (the total), each present term's value
        (``<name>_loss``) and weighted contribution (``weighted_<name>``), and the weights used
        (``w_ppo``, ``w_dpo``, ``w_kl``, the group scale included).
    """
    unknown = set(values) - {t.name for t in TERMS}
    if unknown:
        raise ValueError(f"unknown objective terms {sorted(unknown)}; the terms are {[t.name for t in TERMS]}")
    present = [t for t in TERMS if values.get(t.name) is not None]
    if not present:
        raise ValueError("hpa_objective needs at least one loss term")
    reference = values[present[0].name]
    scale = dict(group_scale or {})
    total = torch.zeros((), dtype=reference.dtype, device=reference.device)
    metrics: Metrics = {}
    for term in TERMS:
        weight = weights[term.weight] * scale[term.group] if term.group in scale else weights[term.weight]
        metrics[term.weight] = torch.tensor(float(weight), dtype=reference.dtype)
        value = values.get(term.name)
        if value is None:
            continue
        weighted = weight * value
        total = total + weighted
        metrics[f"{term.name}_loss"] = value.detach()
        metrics[f"weighted_{term.name}"] = weighted.detach()
    metrics["loss"] = total.detach()
    return total, metrics


def describe(weights: Mapping[str, float], group_scale: Optional[Mapping[str, float]] = None,
             gate: Optional[float] = None) -> str:
    """The table of terms with this step's weights (a Markdown table, logged when a run starts)."""
    scale = dict(group_scale or {})
    lines = ["| term | group | weight | normaliser | scaled by | source |", "| --- | --- | --- | --- | --- | --- |"]
    for t in TERMS:
        w = weights[t.weight] * scale.get(t.group, 1.0)
        extra = f" (gate {gate:.3g})" if t.name == "ppo" and gate is not None else ""
        lines.append(f"| {t.name} | {t.group} | {t.weight} = {w:.4g} | {t.normaliser} | {t.scaled_by}{extra} | "
                     f"{t.source} |")
    return "\n".join(lines)
