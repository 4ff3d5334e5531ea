"""Softmax statistics of vocab-parallel logits: label log-probs, entropy and KL.

Megatron's output layer shards the logits along the vocabulary: TP rank r holds the contiguous ids
``[r·v/tp, (r+1)·v/tp)`` as a local ``[..., v/tp]`` tensor. Each op here all-reduces only
``[...]``-shaped statistics (a max for stability, then sums) and never gathers the vocabulary.

Gradient convention: every TP rank computes the same scalar loss from the (replicated) outputs, and
each rank's shard receives the true partial derivative of that loss w.r.t. the shard. The forward
all-reduces therefore have an identity backward; no collective runs in backward.

Numerics: bf16/fp16/fp32 inputs are computed in fp32 and return fp32 (fp64 stays fp64, for
gradcheck). Columns whose global id is ≥ ``vocab_size`` (megatron's vocab padding) are excluded, as
if their logits were −inf, and get zero gradient. Inputs are never modified in place. Each op saves
only its input logits and ``[...]``-shaped statistics; backward recomputes the softmax.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_entropy", "vocab_parallel_kl", "vocab_parallel_log_probs"]


def _tp_size(tp_group) -> int:
    if tp_group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(tp_group)


def _tp_rank(tp_group) -> int:
    if tp_group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(tp_group)


def _all_reduce_(tensor: torch.Tensor, op, tp_group) -> torch.Tensor:
    """In-place all-reduce over the TP group (no autograd: only used inside Functions' forward)."""
    if _tp_size(tp_group) > 1:
        dist.all_reduce(tensor, op=op, group=tp_group)
    return tensor


def _shard_layout(logits: torch.Tensor, tp_group, vocab_size: Optional[int]) -> Tuple[int, int]:
    """``(first global id of this shard, number of real, unpadded columns in it)``."""
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocab) dim, got shape {tuple(logits.shape)}")
    partition = logits.shape[-1]
    padded_vocab_size = partition * _tp_size(tp_group)
    start = _tp_rank(tp_group) * partition
    if vocab_size is None:
        return start, partition
    if not 0 < vocab_size <= padded_vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} must be in [1, {padded_vocab_size}] (the padded vocab: {partition} "
            f"columns per shard × tensor_model_parallel_size {_tp_size(tp_group)}); pass the tokenizer's "
            f"true vocab size, or None when the logits are unpadded")
    return start, max(0, min(partition, vocab_size - start))


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _scaled(logits: torch.Tensor, temperature: float, *, fresh: bool) -> torch.Tensor:
    """``logits / temperature`` in the compute dtype. A new tensor when ``fresh`` (safe to modify in
    place); otherwise it may be ``logits`` itself, which must then not be written to."""
    dtype = _compute_dtype(logits)
    if logits.dtype != dtype:
        z = logits.to(dtype)
        return z.div_(temperature) if temperature != 1.0 else z
    if temperature != 1.0:
        return logits / temperature
    return logits.clone() if fresh else logits


def _aliases_input(logits: torch.Tensor, temperature: float) -> bool:
    """Whether ``_scaled(logits, temperature, fresh=False)`` may return a view of ``logits``."""
    return logits.dtype == _compute_dtype(logits) and temperature == 1.0


def _local_max(z: torch.Tensor) -> torch.Tensor:
    """Max over the last dim; −inf for a shard that is all padding."""
    if z.shape[-1] == 0:
        return z.new_full(z.shape[:-1], float("-inf"))
    return z.max(dim=-1).values


def _log_softmax_(z: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
    """In place ``(z − m) − log_s``: z − m is exact near the max, where precision matters."""
    return z.sub_(m.unsqueeze(-1)).sub_(log_s.unsqueeze(-1))


def _pad_vocab(grad: torch.Tensor, partition: int, dtype: torch.dtype) -> torch.Tensor:
    """Zero gradient for the padded columns, cast to the input dtype."""
    if grad.shape[-1] < partition:
        grad = torch.nn.functional.pad(grad, (0, partition - grad.shape[-1]))
    return grad.to(dtype)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


class _VocabParallelLogProbs(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, labels, tp_group, vocab_size, temperature):
        start, num_valid = _shard_layout(logits, tp_group, vocab_size)
        z = _scaled(logits[..., :num_valid], temperature, fresh=False)  # [..., n]
        owned = not _aliases_input(logits, temperature)

        m = _all_reduce_(_local_max(z), dist.ReduceOp.MAX, tp_group)  # [...]

        # Label logit from the one rank that holds it; other ranks contribute 0.
        local_labels = labels.long() - start
        on_shard = (local_labels >= 0) & (local_labels < num_valid)
        label_logit = torch.zeros_like(m)
        if num_valid > 0:
            index = local_labels.clamp(0, num_valid - 1).unsqueeze(-1)
            label_logit = torch.where(on_shard, z.gather(-1, index).squeeze(-1), label_logit)

        e = z.sub_(m.unsqueeze(-1)) if owned else z - m.unsqueeze(-1)
        stats = torch.stack([e.exp_().sum(dim=-1), label_logit])  # [2, ...]
        del e, z
        _all_reduce_(stats, dist.ReduceOp.SUM, tp_group)
        log_s = stats[0].log()  # logsumexp = m + log_s; kept apart so no rounding at |m| ~ 1e4 enters
        ctx.save_for_backward(logits, labels, m, log_s)
        ctx.layout = (start, num_valid, temperature)
        return (stats[1] - m) - log_s

    @staticmethod
    def backward(ctx, grad_output):
        logits, labels, m, log_s = ctx.saved_tensors
        start, num_valid, temperature = ctx.layout
        g = grad_output / temperature  # [...]
        if num_valid == 0:
            return torch.zeros_like(logits), None, None, None, None
        # d(z_y − lse)/dz = onehot(y) − softmax(z), times dz/dlogits = 1/T.
        z = _scaled(logits[..., :num_valid], temperature, fresh=True)
        grad = _log_softmax_(z, m, log_s).exp_().mul_(-g.unsqueeze(-1))  # [..., n]
        local_labels = labels.long() - start
        on_shard = (local_labels >= 0) & (local_labels < num_valid)
        index = local_labels.clamp(0, num_valid - 1).unsqueeze(-1)
        grad.scatter_add_(-1, index, torch.where(on_shard, g, torch.zeros_like(g)).unsqueeze(-1))
        return _pad_vocab(grad, logits.shape[-1], logits.dtype), None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, tp_group, vocab_size, temperature):
        _, num_valid = _shard_layout(logits, tp_group, vocab_size)
        z = _scaled(logits[..., :num_valid], temperature, fresh=False)  # [..., n]
        m = _all_reduce_(_local_max(z), dist.ReduceOp.MAX, tp_group)  # [...]
        owned = not _aliases_input(logits, temperature)
        # With t = z − m ≤ 0 and s = Σ e^t:  H = log s − Σ e^t·t / s, free of the size of z.
        t = z.sub_(m.unsqueeze(-1)) if owned else z - m.unsqueeze(-1)
        del z
        e = t.exp()
        stats = torch.stack([e.sum(dim=-1), e.mul_(t).sum(dim=-1)])  # [2, ...]
        del e, t
        _all_reduce_(stats, dist.ReduceOp.SUM, tp_group)
        log_s = stats[0].log()
        entropy = log_s - stats[1] / stats[0]
        ctx.save_for_backward(logits, m, log_s, entropy)
        ctx.layout = (num_valid, temperature)
        return entropy

    @staticmethod
    def backward(ctx, grad_output):
        logits, m, log_s, entropy = ctx.saved_tensors
        num_valid, temperature = ctx.layout
        if num_valid == 0:
            return torch.zeros_like(logits), None, None, None
        # dH/dz = −p·(log p + H), times 1/T.
        log_p = _log_softmax_(_scaled(logits[..., :num_valid], temperature, fresh=True), m, log_s)
        p = log_p.exp()
        grad = log_p.add_(entropy.unsqueeze(-1)).mul_(p).mul_((-grad_output / temperature).unsqueeze(-1))
        return _pad_vocab(grad, logits.shape[-1], logits.dtype), None, None, None


class _VocabParallelKL(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits_p, logits_q, tp_group, vocab_size, temperature):
        if logits_p.shape != logits_q.shape:
            raise ValueError(f"logits_p {tuple(logits_p.shape)} and logits_q {tuple(logits_q.shape)} must have "
                             f"the same shape (the same vocab shard of the same tokens)")
        _, num_valid = _shard_layout(logits_p, tp_group, vocab_size)
        zp = _scaled(logits_p[..., :num_valid], temperature, fresh=True)  # [..., n]
        zq = _scaled(logits_q[..., :num_valid], temperature, fresh=True)  # [..., n]
        m = _all_reduce_(torch.stack([_local_max(zp), _local_max(zq)]), dist.ReduceOp.MAX, tp_group)  # [2, ...]
        shifted_p = zp.sub_(m[0].unsqueeze(-1))  # tp = zp − mp
        shifted_q = zq.sub_(m[1].unsqueeze(-1))  # tq = zq − mq
        sum_q = shifted_q.exp().sum(dim=-1)
        exp_p = shifted_p.exp()
        sum_p = exp_p.sum(dim=-1)
        # KL = Σ p·(log p − log q) = Σ e^tp·(tp − tq) / sp − log sp + log sq.
        cross = exp_p.mul_(shifted_p.sub_(shifted_q)).sum(dim=-1)
        del zp, zq, shifted_p, shifted_q, exp_p
        stats = _all_reduce_(torch.stack([sum_p, sum_q, cross]), dist.ReduceOp.SUM, tp_group)  # [3, ...]
        log_sp, log_sq = stats[0].log(), stats[1].log()
        kl = stats[2] / stats[0] - log_sp + log_sq
        ctx.save_for_backward(logits_p, logits_q, m, torch.stack([log_sp, log_sq]), kl)
        ctx.layout = (num_valid, temperature)
        return kl

    @staticmethod
    def backward(ctx, grad_output):
        logits_p, logits_q, m, log_s, kl = ctx.saved_tensors
        num_valid, temperature = ctx.layout
        need_p, need_q = ctx.needs_input_grad[:2]
        grad_p = grad_q = None
        if num_valid == 0:
            return (torch.zeros_like(logits_p) if need_p else None,
                    torch.zeros_like(logits_q) if need_q else None, None, None, None)
        g = (grad_output / temperature).unsqueeze(-1)
        log_p = _log_softmax_(_scaled(logits_p[..., :num_valid], temperature, fresh=True), m[0], log_s[0])
        log_q = _log_softmax_(_scaled(logits_q[..., :num_valid], temperature, fresh=True), m[1], log_s[1])
        p = log_p.exp()
        if need_q:
            # dKL/dzq = q − p.
            grad_q = _pad_vocab(log_q.exp().sub_(p).mul_(g), logits_q.shape[-1], logits_q.dtype)
        if need_p:
            # dKL/dzp = p·(log p − log q − KL).
            grad = log_p.sub_(log_q).sub_(kl.unsqueeze(-1)).mul_(p).mul_(g)
            grad_p = _pad_vocab(grad, logits_p.shape[-1], logits_p.dtype)
        return grad_p, grad_q, None, None, None


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, tp_group,
                             vocab_size: Optional[int] = None, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)`` at the label ids, over the full (sharded) vocabulary.

    Args:
        logits: local vocab shard, ``[..., v/tp]``; any float dtype; not modified.
        labels: global token ids, ``[...]``, in ``[0, vocab_size)``. An id outside that range yields
            ``−logsumexp`` (no label term) rather than an error, so mask such positions out.
        tp_group: the tensor-model-parallel group the vocab is split over; None for one process.
        vocab_size: true vocabulary size; padded columns (global id ≥ vocab_size) are excluded.
        temperature: logits are divided by it before the softmax.

    Returns:
        ``[...]`` log-probs, fp32 (fp64 for fp64 input). Gradient to the shard:
        ``(onehot(label) − softmax)·grad / temperature``.
    """
    _check_temperature(temperature)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without the "
                         f"vocab dim")
    return _VocabParallelLogProbs.apply(logits, labels, tp_group, vocab_size, float(temperature))


def vocab_parallel_entropy(logits: torch.Tensor, tp_group, vocab_size: Optional[int] = None,
                           temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the full (sharded) vocabulary.

    Args:
        logits: local vocab shard, ``[..., v/tp]``; not modified.
        tp_group: tensor-model-parallel group; None for one process.
        vocab_size: true vocabulary size; padded columns are excluded.
        temperature: logits are divided by it before the softmax.

    Returns:
        ``[...]`` entropy, fp32 (fp64 for fp64 input). Gradient: ``−p·(log p + H)·grad / temperature``.
    """
    _check_temperature(temperature)
    return _VocabParallelEntropy.apply(logits, tp_group, vocab_size, float(temperature))


def vocab_parallel_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, tp_group,
                      vocab_size: Optional[int] = None, temperature: float = 1.0) -> torch.Tensor:
    """Full-distribution ``KL(p ‖ q)`` between two vocab-sharded logit tensors.

    Args:
        logits_p: local shard of p's logits (e.g. the policy), ``[..., v/tp]``; not modified.
        logits_q: local shard of q's logits (e.g. the reference), same shape; may be detached.
        tp_group: tensor-model-parallel group; None for one process.
        vocab_size: true vocabulary size; padded columns are excluded.
        temperature: both logits are divided by it before the softmax.

    Returns:
        ``[...]`` KL, fp32 (fp64 for fp64 input). Gradients: ``p·(log p − log q − KL)`` to p and
        ``q − p`` to q, each times ``grad / temperature``; only for inputs that require grad.
    """
    _check_temperature(temperature)
    return _VocabParallelKL.apply(logits_p, logits_q, tp_group, vocab_size, float(temperature))
