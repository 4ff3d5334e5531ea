"""Label log-probs and entropy from hidden states and the output weight, without the logits in memory.

The LM head and the statistics of ``hpa.ops.fused_head`` as one autograd function. Chunked: for ``chunk_tokens``
positions at a time the forward computes the chunk's logits ``x·Wᵀ`` in the weight's dtype (bf16 on GPUs),
reads them once to reduce them to four ``[c]`` statistics (local max, Σ e^t, label logit, Σ e^t·t) and drops
them; only ``[N]``-shaped statistics are saved. The backward recomputes each chunk's logits, writes its
``d logits`` once (log-prob and entropy gradients together, in the weight's dtype) and accumulates
``d hidden = d logits · W`` and ``d W = d logitsᵀ · x`` chunk by chunk. No ``[N, V]`` tensor exists beyond a
chunk, and the logits of positions no loss reads are never computed.

Several paths compute it (``kernel``). On CUDA by default the forward runs the matmul-fused Triton kernel
(``hpa.ops.linear_head_triton.fused_stats``, after verl's ``efficient_entropy`` kernels): the logits of every
read position are formed tile by tile in registers and never reach memory, every position in one launch. The
backward keeps the matmuls as cuBLAS calls (recompute a chunk's logits, ``d hidden``, ``d W``) and makes the
per-chunk elementwise work one Triton kernel (``chunk_grad``), so a chunk's logits are written once and read
once. ``fused`` also fuses the backward (``fused_grads``); it is not the default, as its programs each recompute
their logits tiles: 2·ceil(h/128) logits computations a backward plus the two gradient products, 16 matmuls'
FLOPs at h = 896 against the regions backward's 3 (recompute, ``d hidden``, ``d W``).
``regions`` runs the forward as the backward: a cuBLAS matmul, then one Triton kernel (``chunk_stats``).
Elsewhere (and as the last fallback) the same chunked math in torch (``torch.compile(fullgraph=True)`` traces
both regions without graph breaks). ``fused_stats`` / ``fused_grads`` here are the torch references of the
fused kernels' contracts.

Vocab parallel: ``weight`` is this rank's ``[v/tp, h]`` shard and ``hidden`` the replicated input of
megatron's ``ColumnParallelLinear`` (its region functions reduce ``d hidden`` over TP, as for the linear);
the shards' statistics merge with one MAX and one SUM all-reduce over ``tp_group``, as in
``hpa.ops.fused_head``. Temperature and vocab padding as in ``hpa.ops.vocab_parallel``: padded rows of the
weight (global id ≥ ``vocab_size``) take no part and get zero gradient.

The gradients: ``d log p_y / dz = onehot(y) − p`` and ``dH/dz = −p·(log p + H)``, times ``1/T``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .fused_head import CHUNK_ELEMENTS, _label_index, merge_shards
from .vocab_parallel import _check_temperature, _compute_dtype, _shard_layout

__all__ = ["KERNELS", "chunk_grad", "chunk_stats", "fused_grads", "fused_stats", "linear_log_probs_entropy"]


def chunk_stats(z: torch.Tensor, index: torch.Tensor, on_shard: torch.Tensor, temperature: float,
                with_entropy: bool) -> torch.Tensor:
    """A chunk's logits ``[c, n]`` -> ``[4, c]``: max, Σ e^t, label logit (0 off the shard), Σ e^t·t (0 without
    entropy), t = z/T − max; in the compute dtype. ``z`` (a fresh matmul output) may be overwritten."""
    t = z.to(_compute_dtype(z))
    if temperature != 1.0:
        t.div_(temperature)
    m = t.amax(dim=-1)
    label = torch.where(on_shard, t.gather(-1, index).squeeze(-1), 0.0)
    t.sub_(m.unsqueeze(-1))
    e = t.exp()
    total = e.sum(dim=-1)
    cross = e.mul_(t).sum(dim=-1) if with_entropy else torch.zeros_like(total)
    return torch.stack([m, total, label, cross])


def chunk_grad(z: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor, entropy: Optional[torch.Tensor],
               grad_log_probs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], index: torch.Tensor,
               on_shard: torch.Tensor, temperature: float) -> torch.Tensor:
    """A chunk's logits ``[c, n]`` and ``[c]`` statistics -> ``d loss / d logits`` ``[c, n]`` in ``z``'s dtype.
    ``z`` (a fresh matmul output) may be overwritten."""
    log_p = z.to(_compute_dtype(z))
    if temperature != 1.0:
        log_p.div_(temperature)
    log_p.sub_(m.unsqueeze(-1)).sub_(log_s.unsqueeze(-1))
    p = log_p.exp()
    if grad_entropy is not None:
        coef = log_p.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
        if grad_log_probs is not None:
            coef.add_(grad_log_probs.unsqueeze(-1))
        grad = p.mul_(coef).neg_()
    else:
        grad = p.mul_(-grad_log_probs.unsqueeze(-1))
    if grad_log_probs is not None:
        grad.scatter_add_(-1, index, torch.where(on_shard, grad_log_probs, 0.0).unsqueeze(-1))
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(z.dtype)


def fused_stats(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor, on_shard: torch.Tensor, temperature: float,
                with_entropy: bool) -> torch.Tensor:
    """The forward of the matmul-fused head: rows ``x [N, h]`` and the shard's weight ``w [n, h]`` -> the ``[4, N]``
    statistics of ``chunk_stats`` over the logits ``x·wᵀ``. The Triton kernel
    (``hpa.ops.linear_head_triton.fused_stats``) never writes the logits; this torch reference forms them a chunk
    at a time (the tests and the byte-count proxy use it)."""
    out = torch.empty((4, x.shape[0]), dtype=_compute_dtype(w), device=x.device)
    step = max(1, CHUNK_ELEMENTS // max(1, w.shape[0]))
    for begin in range(0, x.shape[0], step):
        rows = slice(begin, begin + step)
        out[:, rows] = chunk_stats(torch.mm(x[rows], w.t()), index[rows], on_shard[rows], temperature, with_entropy)
    return out


def fused_grads(x: torch.Tensor, w: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor,
                entropy: Optional[torch.Tensor], grad_log_probs: Optional[torch.Tensor],
                grad_entropy: Optional[torch.Tensor], index: torch.Tensor, on_shard: torch.Tensor,
                temperature: float, need_hidden: bool, need_weight: bool):
    """The backward of the matmul-fused head: ``(d x [N, h] or None, d w [n, h] or None)`` in ``w``'s dtype, from
    the global statistics and the upstream gradients. The Triton kernels recompute each logits tile in registers;
    this torch reference goes a chunk at a time through ``chunk_grad``."""
    grad_x = x.new_empty(x.shape, dtype=w.dtype) if need_hidden else None
    total = torch.zeros(w.shape, dtype=torch.float32 if w.dtype != torch.float64 else w.dtype,
                        device=w.device) if need_weight else None
    step = max(1, CHUNK_ELEMENTS // max(1, w.shape[0]))

    def part(g, rows):
        return None if g is None else g[rows]
    for begin in range(0, x.shape[0], step):
        rows = slice(begin, begin + step)
        dz = chunk_grad(torch.mm(x[rows], w.t()), m[rows], log_s[rows], part(entropy, rows),
                        part(grad_log_probs, rows), part(grad_entropy, rows), index[rows], on_shard[rows],
                        temperature)
        if need_hidden:
            grad_x[rows] = torch.mm(dz, w)
        if need_weight:
            total.add_(torch.mm(dz.t(), x[rows]))
    return grad_x, None if total is None else total.to(w.dtype)


KERNELS = ("auto", "fused_forward", "fused", "regions", "torch")
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what tl.dot takes


def _kernels(device: torch.device, kernel: str = "auto", dtype: torch.dtype = torch.float32):
    """``(fused_forward, stats, fused_backward, grad)``: whether the forward and the backward run matmul-fused, and
    their functions (``fused_stats`` or ``chunk_stats``; ``fused_grads`` or ``chunk_grad``).

    ``auto``: on CUDA the forward by the Triton matmul-fused kernel if it passes its check against the torch path,
    else by the Triton region kernel if that passes its check, else torch; the backward by the Triton region
    kernel between cuBLAS matmuls if it passes its check, else torch; torch elsewhere. The fused backward is not
    the default: each of its programs writes 128 columns of ``d hidden`` / ``d W`` and recomputes its logits
    tiles, so it forms the logits 2·ceil(h/128) times (14 at h = 896) against the regions path's 2.
    ``fused_forward`` / ``fused`` (both halves fused) / ``regions``: those Triton kernels on any device,
    unchecked (on a CPU under ``TRITON_INTERPRET=1``). ``torch``: the torch path."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "torch" or (kernel == "auto" and device.type != "cuda"):
        return False, chunk_stats, False, chunk_grad
    try:
        from . import linear_head_triton  # optional: triton; never imported on a CPU by default
    except ImportError as error:
        if kernel != "auto":
            raise ValueError(f"kernel={kernel!r} needs Triton, which does not import ({error})") from None
        return False, chunk_stats, False, chunk_grad
    if kernel == "fused":
        return True, linear_head_triton.fused_stats, True, linear_head_triton.fused_grads
    regions = kernel != "auto" or linear_head_triton.usable(device, chunk_stats, chunk_grad)
    stats, grad = (linear_head_triton.chunk_stats, linear_head_triton.chunk_grad) if regions else \
        (chunk_stats, chunk_grad)
    if kernel == "fused_forward" or (kernel == "auto" and dtype in _FUSED_DTYPES
                                     and linear_head_triton.fused_usable(device, linear_log_probs_entropy)):
        return True, linear_head_triton.fused_stats, False, grad
    return False, stats, False, grad


class _LinearHead(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, positions, labels, tp_group, vocab_size, temperature, chunk_tokens,
                with_entropy, kernel):
        ctx.set_materialize_grads(False)
        start, num_valid = _shard_layout(weight.t(), tp_group, vocab_size)  # [h, v/tp]: the vocab last
        n = labels.shape[0]
        dtype = _compute_dtype(weight)
        fused, stats_fn, _, _ = _kernels(weight.device, kernel, weight.dtype)
        index, on_shard = _label_index(labels, start, num_valid)
        flat = hidden.reshape(-1, hidden.shape[-1])  # [M, h]
        w = weight[:num_valid]  # [n_valid, h]
        if num_valid > 0 and fused:  # every row at once: no logits in memory
            local = stats_fn(_rows(flat, positions, slice(0, n), weight.dtype), w, index, on_shard, temperature,
                             with_entropy).to(dtype)
        else:
            local = weight.new_zeros((4, n), dtype=dtype)  # see chunk_stats
            local[0] = float("-inf")
        if num_valid > 0 and not fused:
            for begin in range(0, n, chunk_tokens):
                rows = slice(begin, min(begin + chunk_tokens, n))
                x = _rows(flat, positions, rows, weight.dtype)  # [c, h]
                z = torch.mm(x, w.t())  # [c, n_valid], the weight's dtype
                local[:, rows] = stats_fn(z, index[rows], on_shard[rows], temperature, with_entropy)
                del z
        m, log_s, log_probs, entropy = merge_shards(local, tp_group, with_entropy)
        ctx.save_for_backward(hidden, weight, positions, labels, m, log_s, entropy)
        ctx.layout = (start, num_valid, temperature, chunk_tokens, kernel)
        return (log_probs, entropy) if with_entropy else log_probs

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy=None):
        hidden, weight, positions, labels, m, log_s, entropy = ctx.saved_tensors
        start, num_valid, temperature, chunk_tokens, kernel = ctx.layout
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        none = (None,) * 8
        if (grad_log_probs is None and grad_entropy is None) or not (need_hidden or need_weight):
            return (None, None) + none
        _, _, fused, grad_fn = _kernels(weight.device, kernel, weight.dtype)
        flat = hidden.reshape(-1, hidden.shape[-1])  # [M, h]
        w = weight[:num_valid]  # [n_valid, h]
        n = labels.shape[0]
        if fused and num_valid > 0 and n > 0:
            return _fused_backward(grad_fn, hidden, flat, weight, w, positions, labels, m, log_s, entropy,
                                   grad_log_probs, grad_entropy, start, temperature, need_hidden,
                                   need_weight) + none
        grad_hidden = torch.zeros_like(flat) if need_hidden else None  # [M, h]
        grad_weight = weight.new_zeros(weight.shape) if need_weight and n == 0 else \
            weight.new_empty(weight.shape) if need_weight else None  # [v/tp, h]
        if need_weight:
            grad_weight[num_valid:].zero_()  # vocab padding
        # several chunks of a low-precision weight accumulate d W in fp32 (one rounding, as one matmul)
        accumulate = need_weight and weight.dtype != _compute_dtype(weight) and n > chunk_tokens and num_valid > 0
        index, on_shard = _label_index(labels, start, num_valid)
        for begin in range(0, n if num_valid > 0 else 0, chunk_tokens):
            rows = slice(begin, min(begin + chunk_tokens, n))
            x = _rows(flat, positions, rows, weight.dtype)  # [c, h]
            z = torch.mm(x, w.t())  # [c, n_valid]
            dz = grad_fn(z, m[rows], log_s[rows], None if entropy is None else entropy[rows],
                         None if grad_log_probs is None else grad_log_probs[rows],
                         None if grad_entropy is None else grad_entropy[rows], index[rows], on_shard[rows],
                         temperature)  # [c, n_valid], the weight's dtype
            del z
            if need_hidden:
                dx = torch.mm(dz, w).to(flat.dtype)  # [c, h]
                if positions is None:
                    grad_hidden[rows] += dx
                else:  # a position selected twice gets both gradients
                    grad_hidden.index_add_(0, positions[rows], dx)
            if need_weight:  # the first chunk writes d W, the others add to it
                if accumulate:
                    part = torch.mm(dz.t(), x)  # [n_valid, h]
                    total = part.float() if begin == 0 else total.add_(part)
                elif begin == 0:
                    torch.mm(dz.t(), x, out=grad_weight[:num_valid])
                else:
                    grad_weight[:num_valid].addmm_(dz.t(), x)
            del dz
        if accumulate:
            grad_weight[:num_valid] = total
        elif need_weight and num_valid == 0:
            grad_weight.zero_()
        if need_hidden:
            grad_hidden = grad_hidden.view(hidden.shape)
        return (grad_hidden, grad_weight) + none


def _fused_backward(grad_fn, hidden, flat, weight, w, positions, labels, m, log_s, entropy, grad_log_probs,
                    grad_entropy, start, temperature, need_hidden, need_weight):
    """The matmul-fused backward over every row at once: ``(d hidden or None, d weight or None)``."""
    num_valid = w.shape[0]
    index, on_shard = _label_index(labels, start, num_valid)
    dx, dw = grad_fn(_rows(flat, positions, slice(0, labels.shape[0]), weight.dtype), w, m, log_s, entropy,
                     grad_log_probs, grad_entropy, index, on_shard, temperature, need_hidden, need_weight)
    grad_hidden = grad_weight = None
    if need_hidden:
        if positions is None:
            grad_hidden = dx.to(flat.dtype).view(hidden.shape)
        else:  # a position selected twice gets both gradients; the others none
            grad_hidden = torch.zeros_like(flat).index_add_(0, positions, dx.to(flat.dtype)).view(hidden.shape)
    if need_weight:
        if num_valid == weight.shape[0]:
            grad_weight = dw
        else:
            grad_weight = weight.new_empty(weight.shape)
            grad_weight[:num_valid] = dw
            grad_weight[num_valid:].zero_()  # vocab padding
    return grad_hidden, grad_weight


def _rows(flat: torch.Tensor, positions: Optional[torch.Tensor], rows: slice, dtype: torch.dtype) -> torch.Tensor:
    """The chunk's hidden states ``[c, h]`` in ``dtype``."""
    x = flat[rows] if positions is None else flat.index_select(0, positions[rows])
    return x.to(dtype)


def linear_log_probs_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tp_group,
                             vocab_size: Optional[int] = None, temperature: float = 1.0, *,
                             positions: Optional[torch.Tensor] = None, entropy: bool = False,
                             chunk_tokens: Optional[int] = None,
                             kernel: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``log softmax(hidden·weightᵀ / temperature)`` at the labels, and optionally the entropy, chunk by chunk.

    Args:
        hidden: the output layer's input, ``[M, h]``; with ``positions``, any ``[..., h]`` (e.g. a model's
            ``[b, s, h]``); replicated over TP; any float dtype (cast to the weight's per chunk).
        weight: the output layer's local vocab shard ``[v/tp, h]``.
        labels: global token ids ``[N]`` in ``[0, vocab_size)`` (an id outside yields ``−logsumexp``).
        tp_group: the tensor-model-parallel group the vocab is split over; None for one process.
        vocab_size: true vocabulary size; padded rows of the weight (global id ≥ vocab_size) are excluded.
        temperature: logits are divided by it before the softmax.
        positions: ``[N]`` rows of ``hidden``'s leading dims flattened to compute at (a row may repeat); None:
            every row, ``N = M``. Other rows get zero gradient.
        entropy: also return the entropy.
        chunk_tokens: positions at a time; bounds every ``[·, v/tp]`` temporary to ``chunk_tokens × v/tp``.
            None: ``CHUNK_ELEMENTS // (v/tp)``. The matmul-fused kernels take every position at once.
        kernel: ``auto`` (on CUDA the forward by the Triton matmul-fused kernel for a bf16/fp16/fp32 weight, else
            the Triton region kernel; the backward by the Triton region kernel between cuBLAS matmuls; each if it
            passes its first-use check, else torch; torch elsewhere), ``fused_forward`` (that, unchecked),
            ``fused`` (forward and backward matmul-fused), ``regions`` (those Triton kernels unchecked, on any
            device Triton runs on) or ``torch``.

    Returns:
        ``(log_probs [N], entropy [N] or None)``, fp32 (fp64 for an fp64 weight); gradients to ``hidden`` (its
        dtype) and ``weight`` (its dtype) as ``vocab_parallel_log_probs`` and ``vocab_parallel_entropy`` of
        the logits ``hidden·weightᵀ`` give through the linear.
    """
    _check_temperature(temperature)
    rows = hidden.shape[:1] if positions is None else positions.shape
    if (weight.dim() != 2 or hidden.dim() < 2 or hidden.shape[-1] != weight.shape[-1]
            or (hidden.dim() != 2 and positions is None) or len(rows) != 1 or labels.shape != rows):
        raise ValueError(f"hidden must be [M, h] (or [..., h] with positions), weight [v/tp, h], positions [N] "
                         f"or None (N = M) and labels [N], got hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)}, positions {None if positions is None else tuple(positions.shape)} "
                         f"and labels {tuple(labels.shape)}")
    if chunk_tokens is None:
        chunk_tokens = max(1, CHUNK_ELEMENTS // max(1, weight.shape[0]))
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1 (or None for the default), got {chunk_tokens}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    out = _LinearHead.apply(hidden, weight, None if positions is None else positions.long(), labels, tp_group,
                            vocab_size, float(temperature), int(chunk_tokens), entropy, kernel)
    return out if entropy else (out, None)
