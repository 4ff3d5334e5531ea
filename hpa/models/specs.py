"""Megatron layer specs: Transformer Engine on GPUs when importable, megatron's local spec otherwise."""

from __future__ import annotations

import functools
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
    as its core attention (one fused call per layer, which also accepts packed sequences) and RoPE from
    per-token positions for packed rows (``megatron_patches.packed_rope``)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    import megatron_patches

    megatron_patches.apply_model_patches()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization)
    spec.submodules.self_attention.submodules.core_attention = packed_local_attention()
    return spec


def packed_local_attention():
    """megatron's local ``DotProductAttention`` with one fused attention call per layer, padded or packed.

    megatron 0.16's local attention runs an unfused softmax (about 40 operations per call, a K/V head
    expansion for grouped-query attention and an RNG fork) and refuses ``packed_seq_params`` (only
    Transformer Engine's takes them). This class computes the same attention in one kernel:

    * padded rows (``[s, b, heads, d]``, causal, no mask given): ``scaled_dot_product_attention`` with
      ``is_causal``;
    * packed rows (THD ``[t, heads, d]`` with ``cu_seqlens``): on CUDA in fp16/bf16, torch's
      variable-length flash attention (``torch.nn.attention.varlen``, causal within each row); elsewhere
      one ``scaled_dot_product_attention`` over chunks of consecutive rows batched together, each with a
      block-diagonal causal mask (``ChunkLayout``, laid out on the host once per micro-batch; exact, so
      packed = padded is a CPU test).

    Grouped-query attention is the kernels' own (``enable_gqa``), without expanding K/V. Anything else
    (an explicit mask, attention bias, query-key layer scaling, a learned softmax offset, a KV cache whose
    keys outnumber the queries) is megatron's class unchanged.
    """
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    global _PackedLocalAttention
    if _PackedLocalAttention is None:
        class PackedLocalAttention(DotProductAttention):
            def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                        packed_seq_params=None):
                if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
                    raise ValueError(f"packed sequences in the {packed_seq_params.qkv_format!r} format; "
                                     f"hpa packs them as 'thd'")
                fused = (attention_mask is None and attention_bias is None and self.softmax_offset is None
                         and not self.config.apply_query_key_layer_scaling and self.config.window_size is None
                         and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
                         and query.shape[0] == key.shape[0])
                if not fused:
                    if packed_seq_params is not None:
                        raise ValueError("packed sequences need causal self-attention without a mask, bias, "
                                         "query-key layer scaling or softmax offset")
                    return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                           attention_bias=attention_bias)
                dropout = self.config.attention_dropout if self.training else 0.0
                gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
                if dropout > 0.0 and not self.config.sequence_parallel:  # megatron's RNG stream for dropout
                    with tensor_parallel.get_cuda_rng_tracker().fork():
                        return self._attend(query, key, value, packed_seq_params, dropout, gqa)
                return self._attend(query, key, value, packed_seq_params, dropout, gqa)

            def _attend(self, query, key, value, packed_seq_params, dropout, gqa):
                sdpa = torch.nn.functional.scaled_dot_product_attention
                if packed_seq_params is None:  # [s, b, heads, d] -> [b, heads, s, d]
                    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
                    out = sdpa(q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
                               enable_gqa=gqa)
                    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)  # [s, b, hp]
                if uses_varlen_attention(query, dropout):
                    out = varlen_causal_attention(query, key, value, packed_seq_params, scale=self.softmax_scale)
                else:
                    out = chunked_causal_attention(query, key, value, packed_seq_params, dropout=dropout,
                                                   scale=self.softmax_scale, gqa=gqa)
                return out.reshape(query.shape[0], 1, -1)  # [t, 1, hp]

        _PackedLocalAttention = PackedLocalAttention
    return _PackedLocalAttention


def uses_varlen_attention(query: torch.Tensor, dropout: float) -> bool:
    """Whether packed rows take torch's variable-length flash attention (else ``chunked_causal_attention``)."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0


# packed rows attended to without the varlen kernel are cut into chunks of consecutive rows of at most this many
# tokens (or the longest row), each padded to the longest chunk and attended in one batched call
ATTENTION_CHUNK_TOKENS = 512


class ChunkLayout:
    """Where each packed token sits in a batch of chunks of consecutive rows, laid out on the host from the
    rows' lengths and copied with ``moved``'s function (``MicroBatch.packed_seq_params``: the micro-batch's
    host-to-device copy). Built at the first read of a tensor, so the varlen path, which never reads one,
    builds and copies nothing.

    Attributes:
        index: ``[n, c]`` token of each chunk slot (token 0 in pad slots: they attend to themselves only, and
            their outputs are dropped).
        rows: ``[n, c]`` row of each slot; every pad slot has a row of its own (it sees only itself).
        inverse: ``[t]`` flat slot of each token.
        whole: one chunk without pads (no gather needed).
    """

    def __init__(self, lengths, budget: int = ATTENTION_CHUNK_TOKENS):
        self._lengths, self._budget = tuple(int(n) for n in lengths), budget
        self._source, self._move, self._tensors, self._whole = None, None, None, None

    def moved(self, move) -> "ChunkLayout":
        """This layout with ``move(tensor)`` of each tensor, applied at the first read (to this layout's tensors,
        which are built, and moved, once)."""
        out = ChunkLayout(self._lengths, self._budget)
        out._source, out._move = self, move
        return out

    def _layout(self) -> dict:
        if self._tensors is None:
            if self._source is None:
                host = _chunk_layout(self._lengths, self._budget)
                self._whole = host.pop("whole")
                self._tensors = host
            else:
                self._tensors = {k: self._move(v) for k, v in self._source._layout().items()}
        return self._tensors

    @property
    def index(self) -> torch.Tensor:
        return self._layout()["index"]

    @property
    def rows(self) -> torch.Tensor:
        return self._layout()["rows"]

    @property
    def inverse(self) -> torch.Tensor:
        return self._layout()["inverse"]

    @property
    def whole(self) -> bool:
        if self._source is not None:
            return self._source.whole
        self._layout()
        return self._whole

    def mask(self) -> torch.Tensor:
        """``[n, 1, c, c]`` bool, True where slot i may attend to slot j: the same row and ``j <= i``."""
        if not hasattr(self, "_mask"):
            width = self.rows.shape[1]
            position = torch.arange(width, device=self.rows.device)
            same = self.rows[:, :, None] == self.rows[:, None, :]
            self._mask = (same & (position[None, None, :] <= position[None, :, None]))[:, None]
        return self._mask


def _chunk_layout(lengths, budget: int) -> dict:
    """``ChunkLayout``'s host tensors."""
    budget = max(budget, max(lengths, default=1))
    chunks, current, size = [], [], 0
    for row, n in enumerate(lengths):
        if current and size + n > budget:
            chunks.append(current)
            current, size = [], 0
        current.append(row)
        size += n
    chunks.append(current)
    width = max(sum(lengths[r] for r in chunk) for chunk in chunks)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    # Python lists, not tensor ops: this may run inside a model's forward, where the ops would stand for the
    # device's (``hpa.distributed.sync_ops``); it is host work on host values
    index = torch.zeros((len(chunks), width), dtype=torch.long)
    rows = -1 - torch.arange(len(chunks) * width).view(len(chunks), width)  # pads: a row each
    inverse = []  # slots in token order (chunks keep it)
    for c, chunk in enumerate(chunks):
        first, last = starts[chunk[0]], starts[chunk[-1] + 1]
        index[c, :last - first] = torch.arange(first, last)
        rows[c, :last - first] = torch.tensor([r for r in chunk for _ in range(lengths[r])], dtype=torch.long)
        inverse.extend(range(c * width, c * width + last - first))
    return {"index": index, "rows": rows, "inverse": torch.tensor(inverse, dtype=torch.long),
            "whole": len(chunks) == 1 and width == starts[-1]}


def chunked_causal_attention(query, key, value, packed_seq_params, *, dropout: float, scale: float, gqa: bool):
    """Causal attention within each packed row as one ``scaled_dot_product_attention`` call over chunks of
    consecutive rows (``ChunkLayout``, kept on ``packed_seq_params`` as ``hpa_chunks``): ``[t, heads, d]`` in
    and out, no host read. Exact (every row sees its own keys only); costs ``t · c`` scores for chunks of
    ``c`` tokens, where one mask over the whole pack would cost ``t^2``."""
    layout = packed_seq_params.hpa_chunks

    def chunked(x):  # [t, heads, d] -> [n, heads, c, d]
        return x.transpose(0, 1)[None] if layout.whole else x[layout.index].transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(
        chunked(query), chunked(key), chunked(value), attn_mask=layout.mask(), dropout_p=dropout, scale=scale,
        enable_gqa=gqa)  # [n, heads, c, d]
    if layout.whole:
        return out[0].transpose(0, 1)
    return out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[-1])[layout.inverse]  # [t, heads, d]


def varlen_causal_attention(query, key, value, packed_seq_params, *, scale: float):
    """Causal attention within each packed row with ``torch.nn.attention.varlen.varlen_attn``:
    ``[t, heads, d]`` in, ``[t, heads, d]`` out.

    torch 2.10/2.11 take causality as ``is_causal=True``, later versions as ``window_size=(-1, 0)``; without
    ``enable_gqa`` the K/V heads are repeated to the query heads."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_parameters(varlen_attn)
    kwargs = {"scale": scale}
    kwargs.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    p = packed_seq_params
    return varlen_attn(query, key, value, p.cu_seqlens_q, p.cu_seqlens_kv, p.max_seqlen_q, p.max_seqlen_kv,
                       **kwargs)


@functools.lru_cache(maxsize=None)
def _varlen_parameters(fn) -> frozenset:
    """The kernel's parameter names, read once (``inspect.signature`` costs more than a small layer's kernels)."""
    import inspect

    return frozenset(inspect.signature(fn).parameters)


_PackedLocalAttention = None
