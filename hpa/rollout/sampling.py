"""Pure sampling math over full-vocabulary logits: temperature, top-k, top-p, seeded draws.

The engines gather the last-position logits of every TP shard (``[b, v]``, small) and call
``sample_tokens`` with a generator seeded identically on every rank, so that every layout draws the
same tokens from the same distribution.

Log-prob convention: the log-prob returned for a sampled token is ``log softmax(logits / T)`` over
the whole (true, unpadded) vocabulary, i.e. of the temperature-scaled distribution, *before* top-k /
top-p truncation. That is exactly what the training forward computes with
``vocab_parallel_log_probs(..., temperature=T)``, so rollout and training log-probs agree whatever
the truncation. Greedy decoding (``T = 0``) returns the ``T = 1`` log-probs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["apply_temperature", "filter_logits", "sample_tokens", "top_k_mask", "top_p_mask"]


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in fp32 (fp64 stays fp64); ``temperature`` 0 (greedy) divides by 1."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    z = logits.float() if logits.dtype != torch.float64 else logits
    return z / temperature if temperature not in (0.0, 1.0) else z.clone()


def top_k_mask(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """True where a logit is *removed* by top-k: below the k-th largest of its row (ties kept).

    Args:
        logits: ``[b, v]``.
        top_k: -1 (or >= v) keeps everything.

    Returns:
        ``[b, v]`` bool.
    """
    if top_k == -1 or top_k >= logits.shape[-1]:
        return torch.zeros_like(logits, dtype=torch.bool)
    if top_k <= 0:
        raise ValueError(f"top_k must be -1 (off) or positive, got {top_k}")
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [b, 1]
    return logits < kth


def top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """True where a logit is *removed* by nucleus (top-p) filtering.

    Keeps the smallest set of most likely tokens whose probability reaches ``top_p``: a token is
    kept when the mass of the strictly more likely tokens (in sorted order) is below ``top_p``. The
    most likely token is always kept. ``top_p = 1`` keeps everything.

    Args:
        logits: ``[b, v]`` (already temperature-scaled and top-k filtered, -inf = removed).
        top_p: in ``(0, 1]``.

    Returns:
        ``[b, v]`` bool.
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_p >= 1.0:
        return torch.zeros_like(logits, dtype=torch.bool)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [b, v]
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [b, v]
    removed_sorted = mass_before >= top_p
    removed_sorted[..., 0] = False
    return torch.zeros_like(removed_sorted).scatter(-1, order, removed_sorted)


def filter_logits(logits: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then top-p (the order vLLM and HF apply them); removed entries become -inf."""
    out = logits.masked_fill(top_k_mask(logits, top_k), float("-inf"))
    return out.masked_fill(top_p_mask(out, top_p), float("-inf"))


def sample_tokens(logits: torch.Tensor, *, temperature: float, top_k: int = -1, top_p: float = 1.0,
                  generator: Optional[torch.Generator] = None,
                  vocab_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Sampling is Gumbel-max over the filtered, temperature-scaled log-probs with uniform noise from
    ``generator``: the noise is ``[b, vocab_size]`` every call, so the random stream does not depend
    on the logits, the TP size (padded vocab columns are dropped first) or which rows are finished.

    Args:
        logits: ``[b, v_padded]`` full-vocabulary logits (any float dtype).
        temperature: 0 means greedy (argmax, first index on ties; no noise is drawn).
        top_k: -1 for off.
        top_p: 1.0 for off.
        generator: on ``logits.device``; required when ``temperature > 0``.
        vocab_size: true vocabulary size; columns at or above it are never sampled.

    Returns:
        ``tokens [b]`` int64 and ``log_probs [b]`` fp32: ``log softmax(logits / T)`` of the token over
        the true vocabulary (see the module docstring; ``T = 1`` when greedy).
    """
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    if temperature == 0:
        z = apply_temperature(logits, 1.0)
        tokens = torch.argmax(z, dim=-1)
    else:
        if generator is None:
            raise ValueError("sampling with temperature > 0 needs a seeded generator")
        z = apply_temperature(logits, temperature)
        filtered = filter_logits(z, top_k, top_p)
        u = torch.rand(z.shape, generator=generator, device=z.device, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(u.clamp_(min=1e-300)))  # [b, v], finite
        tokens = torch.argmax(torch.log_softmax(filtered.double(), dim=-1) + gumbel, dim=-1)
    log_probs = torch.log_softmax(z, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, log_probs.float()
