"""Megatron layer specs: Transformer Engine on GPUs when importable, megatron's local spec otherwise."""

from __future__ import annotations

from typing import Optional

import torch


def transformer_engine_import_error() -> Optional[str]:
    """None when Transformer Engine's PyTorch layers import on a CUDA machine, else why not.

    The package being present is not enough: a TE built against another torch, or without its
    CUDA libraries, fails only when ``transformer_engine.pytorch`` is imported.
    """
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or OSError/RuntimeError from its compiled extension
        return f"import transformer_engine.pytorch failed: {type(exc).__name__}: {exc}"
    return None


def transformer_engine_available() -> bool:
    return transformer_engine_import_error() is None


def use_transformer_engine(transformer_impl: str) -> bool:
    """Resolve ``model.transformer_impl`` (auto | local | transformer_engine) to a yes/no."""
    if transformer_impl == "local":
        return False
    error = transformer_engine_import_error()
    if transformer_impl == "transformer_engine" and error is not None:
        raise RuntimeError(f"model.transformer_impl=transformer_engine but Transformer Engine is not usable "
                           f"({error}); run `hpa doctor` for the install command, or use 'auto'/'local'")
    return error is None


def gpt_layer_spec(*, use_te: bool, normalization: str):
    """The ModuleSpec of one decoder layer; megatron's local spec takes hpa's ``PackedLocalAttention``
    as its core attention (the same kernel, which also accepts packed sequences)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization)
    spec.submodules.self_attention.submodules.core_attention = packed_local_attention()
    return spec


# rows of a pack are attended to in chunks of consecutive rows of at most this many tokens (a longer row is a
# chunk of its own): one kernel call per chunk with a block-diagonal causal mask
ATTENTION_CHUNK_TOKENS = 256


def packed_local_attention():
    """megatron's local ``DotProductAttention``, extended to packed sequences (THD).

    megatron 0.16's local attention refuses ``packed_seq_params`` (only Transformer Engine's takes them).
    Given packed sequences, this runs megatron's own kernel on chunks of consecutive rows of the pack
    (``ATTENTION_CHUNK_TOKENS``), each with a block-diagonal causal mask, so attention stays inside each row
    and every row sees the arithmetic of a padded row (masked scores are exactly 0 after the softmax; the
    rotary embedding restarts per row in megatron's THD path before this is called). The chunks bound the
    cost between the two extremes: one call per row pays a kernel launch per row (slow for many short
    rows: measured 0.94x the padded update at ~10-token rows), one call for the whole pack pays ``T^2``
    (slow for long rows); chunks cost at most ``ATTENTION_CHUNK_TOKENS`` times the tokens more than
    ``sum(L_i^2)``. Without ``packed_seq_params`` it is megatron's class unchanged.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    global _PackedLocalAttention
    if _PackedLocalAttention is None:
        class PackedLocalAttention(DotProductAttention):
            def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                        packed_seq_params=None):
                if packed_seq_params is None:
                    return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                           attention_bias=attention_bias)
                if packed_seq_params.qkv_format != "thd":
                    raise ValueError(f"packed sequences in the {packed_seq_params.qkv_format!r} format; "
                                     f"hpa packs them as 'thd'")
                out = []
                for start, end, mask in _chunks(packed_seq_params, query.device):  # query/key/value: [t, heads, d]
                    q, k, v = (x[start:end].unsqueeze(1) for x in (query, key, value))
                    out.append(super().forward(q, k, v, mask, attn_mask_type=AttnMaskType.causal))  # [L, 1, hp]
                return torch.cat(out, dim=0)  # [t, 1, hp]

        _PackedLocalAttention = PackedLocalAttention
    return _PackedLocalAttention


def _chunks(packed_seq_params, device):
    """``(start, end, mask)`` of each chunk of consecutive rows of a pack: ``mask`` ``[1, 1, L, L]`` (True =
    masked: another row, or a later position) or None for a chunk of one row (megatron's causal mask).
    Computed once per forward pass and kept on ``packed_seq_params`` for every layer."""
    cache = packed_seq_params.__dict__.setdefault("_hpa_chunks", {})
    if device not in cache:
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        groups, current = [], [bounds[0]]
        for end in bounds[1:]:
            if len(current) > 1 and end - current[0] > ATTENTION_CHUNK_TOKENS:
                groups.append(current)
                current = [current[-1]]
            current.append(end)
        groups.append(current)
        chunks = []
        for g in groups:
            mask = None
            if len(g) > 2:
                lengths = torch.tensor([b - a for a, b in zip(g[:-1], g[1:])])
                row = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [L]
                pos = torch.arange(g[-1] - g[0])
                allowed = (row[:, None] == row[None, :]) & (pos[None, :] <= pos[:, None])
                mask = (~allowed)[None, None].to(device)
            chunks.append((g[0], g[-1], mask))
        cache[device] = chunks
    return cache[device]


_PackedLocalAttention = None
