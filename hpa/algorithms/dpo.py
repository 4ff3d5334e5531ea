"""The DPO family on sequence log-probs: sigmoid (with label smoothing), IPO, hinge and robust.

Numerics follow TRL 0.28 ``DPOTrainer.dpo_loss`` with
``logits = (π_chosen - π_rejected) - (ref_chosen - ref_rejected)``:

- ``sigmoid``: ``-(1-ε)·logσ(β·logits) - ε·logσ(-β·logits)``; ε = ``label_smoothing`` > 0 is
  conservative DPO (cDPO, for noisy labels), ε = 0 the original DPO.
- ``ipo``: ``(logits - 1/(2β))²`` on length-normalised log-probs (each log-prob divided by its
  response's token count, as TRL does before calling ``dpo_loss``; an empty response counts as
  length 1 where TRL would divide by 0).
- ``hinge``: ``relu(1 - β·logits)`` (SLiC).
- ``robust``: ``((1-ε)·(-logσ(β·logits)) + ε·logσ(-β·logits)) / (1 - 2ε)`` (rDPO, unbiased under
  label-flip rate ε < 0.5).

Deliberate differences from TRL: a non-zero ``label_smoothing`` with ``ipo``/``hinge`` raises
(TRL warns and ignores it), and ``robust`` requires ``0 <= ε < 0.5`` (TRL does not check).

DPO variants share one signature (``DPO_LOSSES``)::

    fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta,
       label_smoothing, chosen_lengths, rejected_lengths) -> per-pair losses  # [b]
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from hpa.registry import Registry

DPO_LOSSES = Registry("DPO loss")

Metrics = Dict[str, torch.Tensor]
Count = Union[int, float, torch.Tensor]


def _logits(chosen, rejected, ref_chosen, ref_rejected) -> torch.Tensor:
    return (chosen - rejected) - (ref_chosen - ref_rejected)


def _no_smoothing(name: str, label_smoothing: float) -> None:
    if label_smoothing != 0.0:
        raise ValueError(f"DPO loss {name!r} does not use label_smoothing; set it to 0 or use 'sigmoid'/'robust'")


@DPO_LOSSES.register("sigmoid")
def sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected, *, beta, label_smoothing, chosen_lengths, rejected_lengths):
    logits = _logits(chosen, rejected, ref_chosen, ref_rejected)
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


@DPO_LOSSES.register("robust")
def robust_loss(chosen, rejected, ref_chosen, ref_rejected, *, beta, label_smoothing, chosen_lengths, rejected_lengths):
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    logits = _logits(chosen, rejected, ref_chosen, ref_rejected)
    return (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing) + F.logsigmoid(-beta * logits) * label_smoothing
    ) / (1 - 2 * label_smoothing)


@DPO_LOSSES.register("hinge")
def hinge_loss(chosen, rejected, ref_chosen, ref_rejected, *, beta, label_smoothing, chosen_lengths, rejected_lengths):
    _no_smoothing("hinge", label_smoothing)
    return torch.relu(1 - beta * _logits(chosen, rejected, ref_chosen, ref_rejected))


@DPO_LOSSES.register("ipo")
def ipo_loss(chosen, rejected, ref_chosen, ref_rejected, *, beta, label_smoothing, chosen_lengths, rejected_lengths):
    _no_smoothing("ipo", label_smoothing)
    if chosen_lengths is None or rejected_lengths is None:
        raise ValueError("DPO loss 'ipo' is length-normalised: pass chosen_lengths and rejected_lengths")
    chosen_lengths = chosen_lengths.clamp(min=1)
    rejected_lengths = rejected_lengths.clamp(min=1)
    logits = _logits(
        chosen / chosen_lengths,
        rejected / rejected_lengths,
        ref_chosen / chosen_lengths,
        ref_rejected / rejected_lengths,
    )
    return (logits - 1 / (2 * beta)) ** 2


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    variant: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Optional[torch.Tensor] = None,
    rejected_lengths: Optional[torch.Tensor] = None,
    num_global_pairs: Optional[Count] = None,
    dp_size: int = 1,
) -> Tuple[torch.Tensor, Metrics]:
    """DPO-family loss on summed response log-probs, averaged over pairs.

    Args:
        chosen_logps: policy log-prob of each chosen response (sum over its tokens). # [b]
        rejected_logps: policy log-prob of each rejected response. # [b]
        ref_chosen_logps: reference log-prob of the chosen responses. # [b]
        ref_rejected_logps: reference log-prob of the rejected responses. # [b]
        beta: β (the recipe: 0.1); for IPO it is τ.
        variant: a name in ``DPO_LOSSES``.
        label_smoothing: ε, the assumed label-flip rate (``sigmoid`` and ``robust`` only).
        chosen_lengths: response token counts of the chosen responses (``ipo`` needs them). # [b]
        rejected_lengths: same for the rejected responses. # [b]
        num_global_pairs: pairs in the global batch (all DP ranks, all micro-batches); without it
            the loss is the mean over this micro-batch (TRL's ``losses.mean()``).
        dp_size: data-parallel size whose gradient average the loss undoes; > 1 needs
            ``num_global_pairs`` (ValueError otherwise, as ``agg_loss``).

    Returns:
        ``(loss, metrics)``. Metrics (micro-batch means): ``dpo_loss``, ``dpo_chosen_reward`` and
        ``dpo_rejected_reward`` (implicit rewards ``β·(log π - log π_ref)``), ``dpo_reward_accuracy``
        (fraction with chosen reward > rejected reward) and ``dpo_reward_margin``. The rewards always
        use the summed log-probs (TRL 0.28 reports length-normalised rewards under IPO).
    """
    losses = DPO_LOSSES.get(variant)(
        chosen_logps,
        rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        beta=beta,
        label_smoothing=label_smoothing,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
    )  # [b]
    if num_global_pairs is None:
        if dp_size > 1:
            raise ValueError(f"dp_size={dp_size} > 1 needs the global count: pass num_global_pairs")
        loss = losses.mean()
    else:
        loss = losses.sum() / num_global_pairs * dp_size
    with torch.no_grad():
        chosen_rewards = beta * (chosen_logps - ref_chosen_logps)  # [b]
        rejected_rewards = beta * (rejected_logps - ref_rejected_logps)  # [b]
        metrics = {
            "dpo_loss": loss.detach(),
            "dpo_chosen_reward": chosen_rewards.mean(),
            "dpo_rejected_reward": rejected_rewards.mean(),
            "dpo_reward_accuracy": (chosen_rewards > rejected_rewards).float().mean(),
            "dpo_reward_margin": (chosen_rewards - rejected_rewards).mean(),
        }
    return loss, metrics


def anchor_nll(chosen_token_logps: torch.Tensor, chosen_mask: torch.Tensor, *, alpha: float,
               num_global_tokens: Optional[Count] = None, dp_size: int = 1) -> Tuple[torch.Tensor, Metrics]:
    """The preference anchor of RPO (Pang et al., NeurIPS 2024): ``α · NLL`` of the chosen responses per token.

    As TRL's ``rpo_alpha``: the NLL is the mean over all chosen-response tokens of the batch (TRL's
    ``cross_entropy`` over the flattened chosen half), not a mean of per-response means as the RPO
    paper writes it (the two agree when the chosen responses have equal lengths). With
    ``num_global_tokens`` the mean is over the chosen tokens of all DP ranks and micro-batches, so it is
    exact whatever the micro-batching. The log-probs are at temperature 1 over the true vocabulary (TRL's
    cross-entropy also covers the embedding's padding rows, which hold no probability after SFT).

    Args:
        chosen_token_logps: policy log-prob of every label token of the chosen rows. # [m, s]
        chosen_mask: 1 on the chosen responses' tokens. # [m, s]
        alpha: α (1.0 in RPO and TRL's recommendation).
        num_global_tokens: chosen-response tokens in the global batch; None: this micro-batch's.
        dp_size: the data-parallel size whose gradient average the loss undoes (> 1 needs the count).

    Returns:
        ``(loss, metrics)`` with ``anchor_nll`` (the NLL per token, before α).
    """
    total = -(chosen_token_logps * chosen_mask).sum()
    if num_global_tokens is None:
        if dp_size > 1:
            raise ValueError(f"dp_size={dp_size} > 1 needs the global count: pass num_global_tokens")
        nll = total / chosen_mask.sum().clamp(min=1)
    else:
        nll = total / num_global_tokens * dp_size
    return alpha * nll, {"anchor_nll": nll.detach()}
