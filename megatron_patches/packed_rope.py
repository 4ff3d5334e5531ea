"""Patch: RoPE of packed sequences (THD) from per-token positions, without host reads.

What: ``megatron.core.transformer.attention.apply_rotary_pos_emb``, for THD inputs (``cu_seqlens`` given)
  on megatron's unfused path (no ``apply_rope_fusion``, no context parallelism, no multi-latent
  attention), gathers the rotary table at each token's position within its row (positions computed on
  the device from ``cu_seqlens``, once per forward pass: every layer's query and key share them) and
  applies the table as megatron's BSHD path does. Any other call goes to megatron's function.
Why: megatron's unfused THD path loops over the rows and reads ``cu_seqlens`` on the host (``.tolist()``,
  a tensor-valued ``if``) for the query and the key of every layer: 4 host-device syncs per layer and
  about 10 operations per row and layer.
Numerics: unchanged (the same table entries multiply the same values).
Upstream: megatron-core 0.16.x (``megatron/core/models/common/embeddings/rope_utils.py``,
  ``_apply_rotary_pos_emb_thd``).
Remove when: megatron's unfused THD RoPE takes per-token positions without reading ``cu_seqlens`` on the host.
"""

from __future__ import annotations

import functools

import torch

_APPLIED = False
# (cu_seqlens, freqs, tokens, per-token freqs) of the latest calls: one forward pass's layers share them (the
# query's and the key's ``cu_seqlens`` may be two tensors)
_recent = []


def per_token_freqs(freqs: torch.Tensor, cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """``freqs`` ``[s, 1, 1, d]`` (positions 0..s-1) at the position of each of ``tokens`` packed tokens
    within its row: ``[tokens, 1, d]``. Device operations only.

    Inside a compiled layer (``hpa.models.compile``) nothing is cached: the cache is Python state across
    calls, which the compiler would guard on (a recompile per micro-batch); the gather is fused there."""
    compiling = torch.compiler.is_compiling()
    for cu, table, n, out in ([] if compiling else _recent):
        if cu is cu_seqlens and table is freqs and n == tokens:
            return out
    index = torch.arange(tokens, device=cu_seqlens.device)
    row_start = cu_seqlens[torch.searchsorted(cu_seqlens, index, right=True) - 1]
    out = freqs[(index - row_start).to(freqs.device), 0]
    if not compiling:
        _recent[:] = [(cu_seqlens, freqs, tokens, out)] + _recent[:1]
    return out


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    original = attention.apply_rotary_pos_emb

    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        if (cu_seqlens is None or config.apply_rope_fusion or config.multi_latent_attention
                or config.context_parallel_size != 1 or t.dim() != 3):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        table = per_token_freqs(freqs, cu_seqlens, t.shape[0])  # [t, 1, d] against t's [t, heads, d]
        return rope_utils._apply_rotary_pos_emb_bshd(t, table, rotary_interleaved=config.rotary_interleaved,
                                                     mscale=mscale)

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    _APPLIED = True
