"""Loss aggregation (token-mean, seq-mean, ...), exact under DP and micro-batching.

The aggregation modes and their numerics follow verl 0.9.1 ``core_algos.agg_loss``. A mode reduces a
per-token loss matrix ``# [b, r]`` under a response mask to a scalar. Cross-rank facts (the token or
sequence count of the whole global batch, the DP size) are arguments: when the trainer passes the
global count, the losses of all micro-batches on all DP ranks add up (after DDP's gradient averaging
over ``dp_size`` ranks) to the loss of the one big batch.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from hpa.algorithms.masked import masked_sum
from hpa.registry import Registry

Count = Union[int, float, torch.Tensor]

AGG_MODES = Registry("loss aggregation mode")
"""Signature: ``fn(loss_mat, mask, *, num_global_tokens, num_global_seqs, dp_size, loss_scale_factor) -> loss``."""


def _local_count(count: torch.Tensor, dp_size: int, what: str) -> torch.Tensor:
    # verl divides by the raw count; clamping at 1 only changes the all-masked case (NaN -> 0).
    if dp_size > 1:
        # A local count times dp_size is the global mean only if every rank has the same count.
        raise ValueError(f"dp_size={dp_size} > 1 needs the global count: pass {what}")
    return count.clamp(min=1)


@AGG_MODES.register("token-mean")
def _token_mean(loss_mat, mask, *, num_global_tokens, num_global_seqs, dp_size, loss_scale_factor):
    if num_global_tokens is None:
        num_global_tokens = _local_count(mask.sum(), dp_size, "num_global_tokens")
    return masked_sum(loss_mat, mask) / num_global_tokens * dp_size


@AGG_MODES.register("token-sum")
def _token_sum(loss_mat, mask, *, num_global_tokens, num_global_seqs, dp_size, loss_scale_factor):
    # times dp_size: after DDP averages over the ranks, the gradient is that of the global token sum
    return masked_sum(loss_mat, mask) * dp_size


def _seq_mean_of_token_sums(loss_mat, mask, num_global_seqs, dp_size):
    seq_losses = torch.sum(loss_mat * mask, dim=-1)  # [b]
    seq_mask = (torch.sum(mask, dim=-1) > 0).float()  # [b], fully masked rows do not count
    if num_global_seqs is None:
        num_global_seqs = _local_count(seq_mask.sum(), dp_size, "num_global_seqs")
    return masked_sum(seq_losses, seq_mask) / num_global_seqs * dp_size


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, *, num_global_tokens, num_global_seqs, dp_size, loss_scale_factor):
    return _seq_mean_of_token_sums(loss_mat, mask, num_global_seqs, dp_size)


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, *, num_global_tokens, num_global_seqs, dp_size, loss_scale_factor):
    seq_tokens = torch.sum(mask, dim=-1)  # [b]
    seq_losses = torch.sum(loss_mat * mask, dim=-1) / (seq_tokens + 1e-8)  # [b]
    seq_mask = (seq_tokens > 0).float()
    if num_global_seqs is None:
        num_global_seqs = _local_count(seq_mask.sum(), dp_size, "num_global_seqs")
    return masked_sum(seq_losses, seq_mask) / num_global_seqs * dp_size


@AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, *, num_global_tokens, num_global_seqs, dp_size, loss_scale_factor):
    if loss_scale_factor is None:
        loss_scale_factor = mask.shape[-1]
    return _seq_mean_of_token_sums(loss_mat, mask, num_global_seqs, dp_size) / loss_scale_factor


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_global_tokens: Optional[Count] = None,
    num_global_seqs: Optional[Count] = None,
    dp_size: int = 1,
    loss_scale_factor: Optional[float] = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar.

    Modes (verl 0.9.1 ``agg_loss``; ``N_tok``/``N_seq`` default to this micro-batch's counts):

    - ``token-mean``: ``sum(loss·mask) / N_tok · dp_size``.
    - ``token-sum``: ``sum(loss·mask) · dp_size`` (no normalisation by a count).
    - ``seq-mean-token-sum``: per-sequence token sums, ``sum / N_seq · dp_size``.
    - ``seq-mean-token-mean``: per-sequence token means (``/(n_i + 1e-8)``), ``sum / N_seq · dp_size``.
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): ``seq-mean-token-sum / loss_scale_factor`` (default:
      the padded length ``r``; set a constant for consistent scaling across steps).

    Pass ``num_global_tokens`` (valid tokens of the global batch: all DP ranks and all micro-batches)
    or ``num_global_seqs`` (non-empty sequences of the global batch) and ``dp_size`` to make the
    micro-batch losses add up exactly to the loss of the whole batch once DDP averages over DP ranks.
    Fully masked sequences do not count in the seq-mean modes. As in verl, ``dp_size > 1`` without
    the global count a mode needs raises ``ValueError``.

    Deliberate difference from verl: without a global count, an all-masked micro-batch gives 0
    instead of NaN (the local count is clamped at 1; identical otherwise).

    Args:
        loss_mat: per-token losses. # [b, r]
        mask: valid tokens, bool or 0/1. # [b, r]
        mode: a name in ``AGG_MODES``.
        num_global_tokens: global valid-token count (int or 0-dim tensor), for the token modes.
        num_global_seqs: global non-empty sequence count, for the seq-mean modes.
        dp_size: data-parallel size whose gradient average the loss undoes.
        loss_scale_factor: divisor of ``seq-mean-token-sum-norm``.

    Returns:
        A 0-dim loss tensor.

    Raises:
        ValueError: when ``dp_size > 1`` and the mode's global count is not given.
    """
    mask = mask.to(loss_mat.dtype)
    return AGG_MODES.get(mode)(
        loss_mat,
        mask,
        num_global_tokens=num_global_tokens,
        num_global_seqs=num_global_seqs,
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
    )


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """How one micro-batch's per-token losses become a scalar: the mode plus the cross-rank facts.

    The trainer builds one per micro-batch (after counting tokens over DP ranks) and passes it to
    every loss of the step, so all terms are normalised the same way. Not a config object: it holds
    the same arguments ``agg_loss`` takes.
    """

    mode: str = "token-mean"
    num_global_tokens: Optional[Count] = None
    num_global_seqs: Optional[Count] = None
    dp_size: int = 1
    loss_scale_factor: Optional[float] = None

    def __post_init__(self):
        AGG_MODES.get(self.mode)  # unknown mode: fail here, naming the valid ones

    def __call__(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return agg_loss(
            loss_mat,
            mask,
            self.mode,
            num_global_tokens=self.num_global_tokens,
            num_global_seqs=self.num_global_seqs,
            dp_size=self.dp_size,
            loss_scale_factor=self.loss_scale_factor,
        )

    def seq_mean(self, seq_values: torch.Tensor, seq_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean of per-sequence values ``# [b]`` over ``num_global_seqs`` (or the local count), times dp_size.

        Raises:
            ValueError: when ``dp_size > 1`` and ``num_global_seqs`` is not set.
        """
        if seq_mask is None:
            seq_mask = torch.ones_like(seq_values)
        seq_mask = seq_mask.to(seq_values.dtype)
        count = self.num_global_seqs
        if count is None:
            count = _local_count(seq_mask.sum(), self.dp_size, "num_global_seqs")
        return masked_sum(seq_values, seq_mask) / count * self.dp_size


TOKEN_MEAN = Aggregation()
