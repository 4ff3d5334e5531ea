"""Masked reductions used by the trainer, with verl's numerics (``verl/utils/torch_functional.py``).

``masked_sum`` zeroes values outside the mask before summing, so NaN/inf in padding cannot leak in;
``masked_mean`` divides by ``count + 1e-8`` (an empty mask gives 0); ``masked_var`` is unbiased by
default and refuses fewer than two masked elements; ``masked_whiten`` uses that unbiased variance.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten", "mean_pool"]

Dim = Optional[Union[int, Sequence[int]]]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set (weighted by ``mask`` when it holds numbers).

    Args:
        x: any shape.
        mask: broadcastable to ``x``; bool or 0/1 (or weights).
        dim: dimension(s) to reduce; all when None.
    """
    valid = torch.where(mask.bool(), x, 0.0) * mask
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """``masked_sum / (mask count + 1e-8)``; 0 where nothing is masked in."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / (count + 1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked elements; Bessel-corrected when ``unbiased``.

    Raises:
        ValueError: when ``unbiased`` and fewer than two elements are masked in.
    """
    mean = masked_mean(x, mask)
    variance = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_var: the mask is empty; at least two elements must be masked in "
                             "(use a larger (mini-)batch)")
        if count == 1:
            raise ValueError("masked_var: only one element is masked in, the unbiased variance divides by "
                             "zero; use a larger (mini-)batch or unbiased=False")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(x − mean)·rsqrt(var + 1e-8)`` with the masked mean and unbiased masked variance.

    Every element is transformed (those outside the mask too, not zeroed), as in verl. With
    ``shift_mean=False`` the mean is added back: only the scale is normalised.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``hidden`` over the masked positions of each sequence.

    Args:
        hidden: ``[b, s, h]``.
        mask: ``[b, s]``, bool or 0/1.

    Returns:
        ``[b, h]``; zeros for a row whose mask is all zero (not NaN).
    """
    if hidden.dim() != 3 or mask.shape != hidden.shape[:2]:
        raise ValueError(f"mean_pool wants hidden [b, s, h] and mask [b, s], got {tuple(hidden.shape)} and "
                         f"{tuple(mask.shape)}")
    weights = mask.to(hidden.dtype).unsqueeze(-1)  # [b, s, 1]
    total = torch.where(weights.bool(), hidden, 0.0).mul(weights).sum(dim=1)  # [b, h]
    count = weights.sum(dim=1).clamp_min(1.0)  # [b, 1]
    return total / count
