"""The table of the objective's terms (``TERMS``): the step's loss is computed from it and nowhere else::

    L = w_ppo·(L_ppo + L_ent) + w_dpo·b·(L_dpo + α·NLL_chosen) + w_kl·k·L_hier_kl + w_dpo·b·γ·NLL_replay

Each entry owns everything about its term: the stream whose micro-batches carry it (``stream``: the
step's rollouts, the offline pairs or the replayed SFT examples, ``hpa.trainer.objective.streams``), its per-micro-batch loss
(``loss``: ``loss(batch, outputs, inputs) -> (value, metrics)``, the value already normalised by its
global count), the scheduled step weight that multiplies it (``weight``, a ``StepWeights`` field), the
global count it is normalised by (``normaliser``, a ``GlobalCounts`` field), the controller factor that
multiplies its weight (``factor``, a ``StepFactors`` field, or none) and which of its metrics are shares
of a globally normalised loss (``shares``: summed over micro-batches, not averaged). ``b`` is the
automatic balance's factor on the pair stream (1 unless ``algorithm.hpa.balance``), ``k`` the coverage trust's on
the KL (``trust.released_kl`` where it releases the hold, else 1); the trust gate does
not scale a loss: it weights the learned component of the advantages the PPO term reads.
``L_ent = -c·H`` belongs to the PPO weight (it keeps the policy PPO updates exploring), so ``w_ppo = 0``
removes both and ``w_ppo = w_kl = 0`` is plain DPO. The SFT replay (``algorithm.replay``, γ its ``coef``; off by
default) is part of the offline stream as the anchor is: under ``w_dpo`` and ``b``. The tensor math of each loss is ``hpa.algorithms``.

A micro-batch carries one stream; the terms of the other streams are left out of its values: they
contribute nothing and are not logged.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from hpa.algorithms.dpo import anchor_nll, dpo_loss
from hpa.algorithms.kl import hierarchical_kl
from hpa.algorithms.ppo import entropy_bonus, policy_loss
from hpa.engine.micro_batch import MicroBatch
from hpa.trainer.objective.streams import STREAMS, LossInputs

Metrics = Dict[str, torch.Tensor]
LossFn = Callable[[MicroBatch, Dict[str, torch.Tensor], LossInputs], Tuple[torch.Tensor, Metrics]]


def ppo_term(batch: MicroBatch, out, inputs: LossInputs):
    """Decoupled PPO (``hpa.algorithms.rollout_correction.decoupled_policy_loss``, its parts computed once per step
    by ``phases.rollout_correction``): the ratio and clip around the old policy π_old, each token's loss times
    ``is_weights`` (π_old/π_behaviour, truncated; present with ``algorithm.rollout_correction.rollout_is``), the
    rejected tokens already out of ``mask``."""
    ppo = inputs.algo.ppo
    old = batch.get("old_log_probs")
    if old is None:  # an on-policy step (``old_log_probs_from_update``): the old policy is this forward's
        old = out["log_probs"].detach()
    pg, m = policy_loss(old, out["log_probs"], batch["advantages"], batch["mask"],
                        name=ppo.policy_loss, clip_ratio=ppo.clip_ratio, clip_ratio_low=ppo.clip_ratio_low,
                        clip_ratio_high=ppo.clip_ratio_high, clip_ratio_c=ppo.clip_ratio_c,
                        aggregation=inputs.aggregation, importance_weights=batch.get("is_weights"))
    return pg, {f"actor/{k}": v for k, v in m.items()}


def hier_kl_term(batch: MicroBatch, out, inputs: LossInputs):
    algo, w = inputs.algo, inputs.weights
    hier, m = hierarchical_kl(out["log_probs"], batch["ref_log_probs"], batch["mask"], out["pooled"],
                              batch["ref_pooled"], lambda_token=w.lambda_token, lambda_semantic=w.lambda_semantic,
                              kind=algo.kl.estimator, distance=algo.hpa.semantic_distance,
                              aggregation=inputs.aggregation, row_weights=batch.get("kl_weights"),
                              token_weights=batch.get("is_weights"))
    if not algo.kl.use_kl_loss:
        hier = hier * 0.0
    # actor/kl_loss: the KL term as it enters the loss (before w_kl): kl/hier, or 0 without the KL loss
    return hier, {"kl/token": m["token_kl"], "kl/semantic": m["semantic_distance"], "kl/hier": m["hier_kl"],
                  "actor/kl_loss": hier.detach()}


def entropy_term(batch: MicroBatch, out, inputs: LossInputs):
    ent, m = entropy_bonus(out["entropy"], batch["mask"], inputs.weights.entropy_coef,
                           aggregation=inputs.aggregation)
    return ent, {"actor/entropy": m["entropy"]}


def dpo_term(batch: MicroBatch, out, inputs: LossInputs):
    """DPO over the pairs and, with ``algorithm.dpo.rpo_alpha``, its anchor (α·NLL of the chosen rows per token)."""
    dpo, counts = inputs.algo.dpo, inputs.counts
    logp_s, label_mask = out["token_log_probs"], batch["label_mask"]
    seq = (logp_s * label_mask).sum(dim=1)  # [2m]
    m = seq.shape[0] // 2
    lengths = label_mask.sum(dim=1)
    loss, d_m = dpo_loss(seq[:m], seq[m:], batch["ref_seq_logp"][:m], batch["ref_seq_logp"][m:],
                         beta=dpo.beta, variant=dpo.loss, label_smoothing=dpo.label_smoothing,
                         chosen_lengths=lengths[:m], rejected_lengths=lengths[m:],
                         num_global_pairs=counts.pairs, dp_size=1)
    metrics = {"dpo/loss": d_m["dpo_loss"], "dpo/reward_acc": d_m["dpo_reward_accuracy"],
               "dpo/margin": d_m["dpo_reward_margin"], "dpo/chosen_reward": d_m["dpo_chosen_reward"],
               "dpo/rejected_reward": d_m["dpo_rejected_reward"]}
    if dpo.rpo_alpha is not None:
        anchor, a_m = anchor_nll(logp_s[:m], label_mask[:m], alpha=dpo.rpo_alpha,
                                 num_global_tokens=counts.chosen_tokens, dp_size=1)
        loss = loss + anchor
        metrics["dpo/anchor_nll"] = a_m["anchor_nll"]
    return loss, metrics


def replay_term(batch: MicroBatch, out, inputs: LossInputs):
    """γ·NLL per token of the replayed SFT examples (``algorithm.replay``): the anchor's math on every row of
    the micro-batch, normalised by the replayed tokens of the whole step (all micro-batches and DP ranks)."""
    loss, m = anchor_nll(out["token_log_probs"], batch["label_mask"], alpha=inputs.algo.replay.coef,
                         num_global_tokens=inputs.counts.replay_tokens, dp_size=1)
    return loss, {"replay/nll": m["anchor_nll"]}


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of the objective (see the module docstring); ``source`` and ``scaled_by`` describe it in
    the table logged at the start of a run; ``enabled(algo)`` says whether a run with ``algo`` (an
    ``AlgorithmConfig``) computes it at all (an optional term, off by default, has no row and no stream)."""

    name: str
    stream: str
    loss: LossFn
    weight: str
    normaliser: str
    factor: str = ""
    shares: Tuple[str, ...] = ()
    scaled_by: str = ""
    source: str = ""
    enabled: Callable[[object], bool] = lambda algo: True

    @property
    def group(self) -> str:
        return self.stream


# the order is the order of the sum (it fixes the rounding of the total)
TERMS: Tuple[Term, ...] = (
    Term("ppo", "rollout", ppo_term, "w_ppo", "tokens",
         shares=("actor/pg_loss",), scaled_by="trust gate (learned advantage component)", source="ppo.policy_loss"),
    Term("dpo", "pairs", dpo_term, "w_dpo", "pairs (anchor: chosen_tokens)", factor="pairs",
         shares=("dpo/loss", "dpo/anchor_nll"), scaled_by="balance factor, trust.released_pairs",
         source="dpo.dpo_loss + dpo.anchor_nll"),
    Term("hier_kl", "rollout", hier_kl_term, "w_kl", "tokens (semantic: sequences)", factor="kl",
         shares=("kl/token", "kl/semantic", "kl/hier", "actor/kl_loss"),
         scaled_by="lambda_token, lambda_semantic, trust.released_kl", source="kl.hierarchical_kl"),
    Term("entropy", "rollout", entropy_term, "w_ppo", "tokens", shares=("actor/entropy",), scaled_by="entropy_coef",
         source="ppo.entropy_bonus"),
    Term("replay", "replay", replay_term, "w_dpo", "replay_tokens", factor="pairs", shares=("replay/nll",),
         scaled_by="balance factor, trust.released_pairs, replay.coef", source="dpo.anchor_nll",
         enabled=lambda algo: algo.replay.enabled),
)
GROUPS = tuple(STREAMS)


def active_terms(algo) -> Tuple[Term, ...]:
    """The terms a run with ``algo`` (an ``AlgorithmConfig``) computes (``Term.enabled``): the SFT replay only
    when it is on."""
    return tuple(t for t in TERMS if t.enabled(algo))


def hpa_objective(values: Mapping[str, Optional[torch.Tensor]], weights: Mapping[str, float], *,
                  factors: Optional[Mapping[str, float]] = None) -> Tuple[torch.Tensor, Metrics]:
    """Combine the terms of ``TERMS`` present in ``values``.

    Args:
        values: term name -> its 0-dim value (already normalised by its global count), or None / absent.
        weights: the step weights by name (``w_ppo``, ``w_dpo``, ``w_kl``; other keys are ignored).
        factors: the controllers' factors by name (``StepFactors`` fields: ``pairs``, the balance factor times
            ``trust.released_pairs`` where the hold is released; ``kl``, ``trust.released_kl`` there);
            a term's ``factor`` multiplies its weight, 1 where absent.

    Returns:
        ``(total, metrics)``: metrics ``loss`` (the total), each present term's value
        (``<name>_loss``) and weighted contribution (``weighted_<name>``), and the weights used
        (``w_ppo``, ``w_dpo``, ``w_kl``, the factor included).
    """
    unknown = set(values) - {t.name for t in TERMS}
    if unknown:
        raise ValueError(f"unknown objective terms {sorted(unknown)}; the terms are {[t.name for t in TERMS]}")
    present = [t for t in TERMS if values.get(t.name) is not None]
    if not present:
        raise ValueError("hpa_objective needs at least one loss term")
    reference = values[present[0].name]
    scale = dict(factors or {})
    total = torch.zeros((), dtype=reference.dtype, device=reference.device)
    metrics: Metrics = {}
    for term in TERMS:
        weight = weights[term.weight] * scale[term.factor] if term.factor in scale else weights[term.weight]
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


def describe(weights: Mapping[str, float], factors: Optional[Mapping[str, float]] = None,
             terms: Sequence[Term] = TERMS) -> str:
    """The table of ``terms`` with this step's weights and factors (a Markdown table, logged when a run starts);
    the trust gate's ``learned_advantage`` is shown on the term its advantages feed (``ppo``), the coverage
    hold's ``far_kl_boost`` on the KL term (the far rows' weight)."""
    scale = dict(factors or {})
    lines = ["| term | group | weight | normaliser | scaled by | source |", "| --- | --- | --- | --- | --- | --- |"]
    for t in terms:
        w = weights[t.weight] * scale.get(t.factor, 1.0)
        gate = scale.get("learned_advantage") if t.name == "ppo" else None
        extra = f" (gate {gate:.3g})" if gate is not None else ""
        if t.name == "hier_kl" and scale.get("far_kl_boost", 0.0) > 0:  # the hold: far rows' KL weighs 1 + boost
            extra += f" (far rows x{1 + scale['far_kl_boost']:.4g})"
        lines.append(f"| {t.name} | {t.group} | {t.weight} = {w:.4g} | {t.normaliser} | {t.scaled_by}{extra} | "
                     f"{t.source} |")
    return "\n".join(lines)
