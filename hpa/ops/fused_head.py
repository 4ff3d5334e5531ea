"""Label log-probs and entropy of vocab-parallel logits in one chunked pass.

The same statistics as ``hpa.ops.vocab_parallel`` (a max, then sums of ``e^z``, the label logit and
``e^z·z``), computed ``chunk_tokens`` rows at a time: each chunk is upcast to fp32 on its own, so no
fp32 tensor larger than ``chunk_tokens × v/tp`` exists, in the forward or the backward (which
recomputes each chunk's softmax from the saved input and ``[N]``-shaped statistics). On GPUs the
input is the model's bf16 logits, read once per pass; the gradient is written in the input dtype.
Given ``positions``, only those rows are computed, each chunk read out of the full logits, so that
selecting the positions a loss reads copies nothing larger than a chunk either.

Each rank reduces its shard against its own max; one MAX and one SUM all-reduce of ``[N]``-shaped
statistics then merge the shards (the local sums rescaled by ``e^(m_local − m)``), the same
collectives as the separate ops. Gradient convention, padding and temperature as in
``hpa.ops.vocab_parallel``: every TP rank computes the same scalar, the forward all-reduces have an
identity backward, columns with global id ≥ ``vocab_size`` are excluded and get zero gradient.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .vocab_parallel import _all_reduce_, _check_temperature, _compute_dtype, _local_max, _shard_layout

__all__ = ["CHUNK_ELEMENTS", "fused_log_probs_entropy"]

# The default chunk: 1 GiB of fp32 (1,766 rows of a 151,936-token vocabulary at TP1), large enough that
# the per-chunk ops are few beside the model's, small beside a GPU's memory.
CHUNK_ELEMENTS = 2 ** 28


def _chunk(logits: torch.Tensor, positions: Optional[torch.Tensor], rows: slice, num_valid: int,
           temperature: float) -> torch.Tensor:
    """A fresh compute-dtype copy of ``logits[positions[rows], :num_valid] / temperature`` (``positions`` None:
    ``logits[rows]``)."""
    dtype = _compute_dtype(logits)
    if positions is None:
        z = logits[rows, :num_valid].to(dtype, copy=True)
    else:  # advanced indexing copies the chunk's rows only, whatever the strides of the leading dims
        z = logits[..., :num_valid][_leading_index(positions[rows], logits.shape[:-1])]  # [c, n_valid], input dtype
        z = z.to(dtype) if z.dtype != dtype else z
    return z.div_(temperature) if temperature != 1.0 else z


def _leading_index(positions: torch.Tensor, shape: torch.Size) -> Tuple[torch.Tensor, ...]:
    """Indices into the leading dims ``shape`` of positions in their flattening, by division with the sizes as
    Python ints (``torch.unravel_index`` copies the shape to the device, a blocking copy on CUDA)."""
    index = []
    for size in reversed(shape[1:]):
        index.append(positions % size)
        positions = torch.div(positions, size, rounding_mode="floor")
    return (positions, *reversed(index))


def _label_index(labels: torch.Tensor, start: int, num_valid: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(local column of each label clamped into the shard [N, 1], whether this shard holds it [N])``."""
    local = labels.long() - start
    on_shard = (local >= 0) & (local < num_valid)
    return local.clamp(0, max(num_valid - 1, 0)).unsqueeze(-1), on_shard


def merge_shards(local: torch.Tensor, tp_group, with_entropy: bool):
    """Each shard's ``[4, N]`` statistics (local max, Σ e^t, label logit or 0, Σ e^t·t; t = z − local max) ->
    ``(max m [N], log Σ e^(z−m) [N], label log-probs [N], entropy [N] or None)`` over every shard."""
    n = local.shape[1]
    m = _all_reduce_(local[0].clone(), dist.ReduceOp.MAX, tp_group) if n else local[0]  # [N]
    shift = local[0] - m  # ≤ 0; −inf on an all-padding shard, whose sums are 0
    scale = shift.exp()
    stats = torch.stack([local[1] * scale, local[2],
                         torch.where(local[1] > 0, (local[3] + shift * local[1]) * scale, 0.0)])  # [3, N]
    if n:
        _all_reduce_(stats, dist.ReduceOp.SUM, tp_group)
    log_s = stats[0].log()  # logsumexp = m + log_s, kept apart so no rounding at |m| ~ 1e4 enters
    log_probs = (stats[1] - m) - log_s
    entropy = log_s - stats[2] / stats[0] if with_entropy else None
    return m, log_s, log_probs, entropy


class _FusedHead(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, positions, labels, tp_group, vocab_size, temperature, chunk_tokens, with_entropy):
        ctx.set_materialize_grads(False)
        start, num_valid = _shard_layout(logits, tp_group, vocab_size)
        n = labels.shape[0]
        dtype = _compute_dtype(logits)
        index, on_shard = _label_index(labels, start, num_valid)
        local = logits.new_zeros((4, n), dtype=dtype)  # local max, Σ e^t, label logit, Σ e^t·t (t = z − local max)
        local[0] = float("-inf")
        if num_valid > 0:
            for begin in range(0, n, chunk_tokens):
                rows = slice(begin, min(begin + chunk_tokens, n))
                t = _chunk(logits, positions, rows, num_valid, temperature)  # [c, n_valid]
                m = _local_max(t)
                local[2, rows] = torch.where(on_shard[rows], t.gather(-1, index[rows]).squeeze(-1), 0.0)
                t.sub_(m.unsqueeze(-1))
                e = t.exp()
                local[0, rows], local[1, rows] = m, e.sum(dim=-1)
                if with_entropy:
                    local[3, rows] = e.mul_(t).sum(dim=-1)
                del t, e
        m, log_s, log_probs, entropy = merge_shards(local, tp_group, with_entropy)
        ctx.save_for_backward(logits, positions, labels, m, log_s, entropy)
        ctx.layout = (start, num_valid, temperature, chunk_tokens)
        return (log_probs, entropy) if with_entropy else log_probs

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy=None):
        logits, positions, labels, m, log_s, entropy = ctx.saved_tensors
        start, num_valid, temperature, chunk_tokens = ctx.layout
        none = (None,) * 7
        if grad_log_probs is None and grad_entropy is None:
            return (None,) + none
        dense = positions is None and num_valid == logits.shape[-1]
        # contiguous whatever the input's strides: position p of the flattened leading dims is row p of a flat view
        grad = logits.new_empty(logits.shape) if dense else logits.new_zeros(logits.shape)  # [M, v/tp], input dtype
        if num_valid == 0:
            return (grad,) + none
        index, on_shard = _label_index(labels, start, num_valid)
        for begin in range(0, labels.shape[0], chunk_tokens):
            rows = slice(begin, min(begin + chunk_tokens, labels.shape[0]))
            log_p = _chunk(logits, positions, rows, num_valid, temperature)  # [c, n_valid]
            log_p.sub_(m[rows].unsqueeze(-1)).sub_(log_s[rows].unsqueeze(-1))
            p = log_p.exp()
            # d log p_y/dz = onehot(y) − p;  dH/dz = −p·(log p + H);  both times dz/dlogits = 1/T.
            if grad_entropy is not None:
                coef = log_p.add_(entropy[rows].unsqueeze(-1)).mul_(grad_entropy[rows].unsqueeze(-1))
                if grad_log_probs is not None:
                    coef.add_(grad_log_probs[rows].unsqueeze(-1))
                chunk_grad = p.mul_(coef).neg_()
            else:
                chunk_grad = p.mul_(-grad_log_probs[rows].unsqueeze(-1))
            del log_p
            if grad_log_probs is not None:
                g = grad_log_probs[rows]
                chunk_grad.scatter_add_(-1, index[rows], torch.where(on_shard[rows], g, 0.0).unsqueeze(-1))
            if temperature != 1.0:
                chunk_grad.div_(temperature)
            if positions is None:
                grad[rows, :num_valid] = chunk_grad
            else:  # a position selected twice gets both gradients; index_add_ checks no index range on the host
                grad.view(-1, grad.shape[-1])[:, :num_valid].index_add_(0, positions[rows], chunk_grad.to(grad.dtype))
            del chunk_grad, p
        return (grad,) + none


def fused_log_probs_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group, vocab_size: Optional[int] = None,
                            temperature: float = 1.0, *, positions: Optional[torch.Tensor] = None,
                            entropy: bool = False,
                            chunk_tokens: Optional[int] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``log softmax(logits / temperature)`` at the labels, and optionally the entropy, chunk by chunk.

    Args:
        logits: local vocab shard, ``[M, v/tp]``; with ``positions``, any ``[..., v/tp]`` (e.g. a model's
            ``[b, s, v/tp]`` output, a view need not be contiguous); any float dtype; not modified.
        labels: global token ids ``[N]`` in ``[0, vocab_size)`` (an id outside yields ``−logsumexp``).
        tp_group: the tensor-model-parallel group the vocab is split over; None for one process.
        vocab_size: true vocabulary size; padded columns (global id ≥ vocab_size) are excluded.
        temperature: logits are divided by it before the softmax.
        positions: ``[N]`` rows of ``logits`` to compute at, indices into its leading dims flattened (read
            one chunk at a time, never gathered whole; a row may repeat); None: every row, ``N = M``. Other
            rows get zero gradient.
        entropy: also return the entropy.
        chunk_tokens: rows upcast at a time; bounds every fp32 temporary to ``chunk_tokens × v/tp``.
            None: ``CHUNK_ELEMENTS // (v/tp)``.

    Returns:
        ``(log_probs [N], entropy [N] or None)``, fp32 (fp64 for fp64 input); gradients as
        ``vocab_parallel_log_probs`` and ``vocab_parallel_entropy``, in the input dtype.
    """
    _check_temperature(temperature)
    rows = logits.shape[:1] if positions is None else positions.shape
    if (logits.dim() != 2 and positions is None) or logits.dim() < 2 or len(rows) != 1 or labels.shape != rows:
        raise ValueError(f"logits must be [M, v/tp] (or [..., v/tp] with positions), positions [N] or None "
                         f"(N = M) and labels [N], got logits "
                         f"{tuple(logits.shape)}, positions {None if positions is None else tuple(positions.shape)} "
                         f"and labels {tuple(labels.shape)}")
    if chunk_tokens is None:
        chunk_tokens = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1 (or None for the default), got {chunk_tokens}")
    out = _FusedHead.apply(logits, None if positions is None else positions.long(), labels, tp_group, vocab_size,
                           float(temperature), int(chunk_tokens), entropy)
    return out if entropy else (out, None)
