"""Forward-only passes of a Megatron model through the pipeline schedule.

Every result is computed on the last pipeline stage and broadcast to the other stages of the replica,
so every rank of a model replica holds the same rows afterwards. Used by training (reference, old
policy, critic values), evaluation, generation, scoring and reward models.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.engine.head import label_log_probs, response_log_probs
from hpa.engine.micro_batch import MicroBatch
from hpa.engine.step import forward_backward
from hpa.algorithms.masked import mean_pool
from hpa.data.collate import token_budget_micro_batches
from hpa.engine.sequences import TrainingSequences


def chunks(n: int, size: int) -> List[List[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def response_token_mask(ts: TrainingSequences, response_mask: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` mask of the input positions that hold response tokens (for mean pooling)."""
    s = ts.input_ids.shape[1]
    out = torch.zeros_like(ts.input_ids, dtype=torch.float32)
    return out.scatter_(1, (ts.response_index + 1).clamp(max=s - 1), response_mask.float())


def forward_only(model, micro_batches: Sequence[dict], groups: ParallelGroups,
                 fn: Callable[[dict, torch.Tensor, Optional[torch.Tensor]], Dict[str, torch.Tensor]],
                 shapes: Dict[str, Tuple[int, ...]], *, capture_hidden: bool = True) -> Dict[str, torch.Tensor]:
    """Run ``fn(batch, output, hidden)`` on every micro-batch, concatenate along rows, return on the host.

    Args:
        shapes: each output's trailing shape (after the row dimension), so stages that are not last
            can receive the broadcast.
        capture_hidden: hand the final hidden states to ``fn`` (otherwise ``hidden`` is None).
    """
    def loss_fn(batch, output, hidden):
        return output.new_zeros(()), fn(batch, output, hidden)

    with torch.no_grad():
        results = forward_backward(model, micro_batches, loss_fn, groups, forward_only=True,
                                   capture_hidden=capture_hidden)
    rows = sum(MicroBatch.of(mb).num_rows for mb in micro_batches)
    out = {}
    for key, trailing in shapes.items():
        if groups.is_last_stage:
            value = torch.cat([r[key] for r in results]).float().contiguous()
        else:
            value = torch.empty((rows, *trailing), dtype=torch.float32, device=groups.device)
        if groups.pipeline_model_parallel_size > 1:
            comm.broadcast_tensor(value, src=groups.last_stage_global_rank(), group=groups.pp_group)
        out[key] = value.cpu()  # the one device-to-host point: callers combine results with host tensors
    return out


def sequence_micro_batches(ts: TrainingSequences, rows: Sequence[Sequence[int]], lengths: Optional[torch.Tensor],
                           *, packed: bool = False, **per_row: torch.Tensor) -> List[MicroBatch]:
    """Micro-batches of the rows ``rows[j]`` of ``ts``, each cut to its longest sequence (``lengths``, the
    positions of every row; None: the whole width), padded or ``packed``; ``per_row`` tensors ``[b, ...]``
    go with their rows, position-aligned ones cut to the same width."""
    s = ts.input_ids.shape[1]
    lengths = torch.full((ts.input_ids.shape[0],), s, dtype=torch.long) if lengths is None else lengths.long()
    out = []
    for r in rows:
        idx = torch.as_tensor(list(r), dtype=torch.long)
        width = int(lengths[idx].max())
        extra = {k: (v[idx][:, :width] if v.dim() > 1 and v.shape[1] == s else v[idx]) for k, v in per_row.items()}
        out.append(MicroBatch.from_padded("rollout", ts.input_ids[idx, :width], ts.labels[idx, :width],
                                          lengths[idx], packed=packed,
                                          response_index=ts.response_index[idx].clamp(max=width - 1), **extra))
    return out


def row_groups(num_rows: int, micro_batch_size: int, lengths: Optional[torch.Tensor],
               token_budget: Optional[int], packed: bool) -> List[List[int]]:
    """The rows of each forward-only micro-batch: ``micro_batch_size`` consecutive rows, or, with a
    ``token_budget`` (and ``lengths``), rows of similar lengths grouped up to that many tokens (real tokens
    ``packed``, padded ones otherwise; ``hpa.data.collate.token_budget_micro_batches``)."""
    if token_budget is None or lengths is None:
        return chunks(num_rows, micro_batch_size)
    return token_budget_micro_batches(lengths.tolist(), token_budget, packed=packed)


def in_row_order(out: Dict[str, torch.Tensor], rows: List[List[int]]) -> Dict[str, torch.Tensor]:
    """Outputs concatenated in the order of ``rows`` -> the rows' own order."""
    order = torch.tensor([i for group in rows for i in group])
    if torch.equal(order, torch.arange(order.numel())):
        return out
    inverse = torch.argsort(order)
    return {k: v[inverse] for k, v in out.items()}


def sequence_log_probs(model, ts: TrainingSequences, response_mask: torch.Tensor, groups: ParallelGroups, *,
                       micro_batch_size: int, vocab_size: int, temperature: float,
                       hidden_size: Optional[int] = None, lengths: Optional[torch.Tensor] = None,
                       packed: bool = False, token_budget: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Per-response-token log-probs ``[b, r]`` (and the pooled response hidden state ``[b, h]``).

    Args:
        lengths: ``[b]`` positions of each row (prompt + response); None: every row is the whole width.
        packed: pack each micro-batch's rows (needs ``lengths`` to save anything).
        token_budget: group rows by tokens (``row_groups``) instead of ``micro_batch_size`` rows.
    """
    pool_mask = response_token_mask(ts, response_mask)
    rows = row_groups(ts.input_ids.shape[0], micro_batch_size, lengths, token_budget, packed)
    mbs = sequence_micro_batches(ts, rows, lengths, packed=packed, pool_mask=pool_mask)
    r = ts.response_index.shape[1]

    def fn(batch, logits, hidden):
        logp, _ = response_log_probs(batch, logits, groups.tp_group, vocab_size=vocab_size, temperature=temperature)
        out = {"log_probs": logp}  # [b, r]
        if hidden_size is not None:
            out["pooled"] = mean_pool(batch.unpack(hidden).float(), batch["pool_mask"])  # [b, h]
        return out

    shapes = {"log_probs": (r,)}
    if hidden_size is not None:
        shapes["pooled"] = (hidden_size,)
    return in_row_order(forward_only(model, mbs, groups, fn, shapes, capture_hidden=hidden_size is not None), rows)


def sequence_values(critic, ts: TrainingSequences, groups: ParallelGroups, *, micro_batch_size: int,
                    lengths: Optional[torch.Tensor] = None, packed: bool = False,
                    token_budget: Optional[int] = None) -> torch.Tensor:
    """Critic values ``[b, r]``: the value of the state before each response token (as verl)."""
    rows = row_groups(ts.input_ids.shape[0], micro_batch_size, lengths, token_budget, packed)
    mbs = sequence_micro_batches(ts, rows, lengths, packed=packed)

    def fn(batch, values, hidden):
        return {"values": batch.response(batch.unpack(values[..., 0]))}

    return in_row_order(forward_only(critic, mbs, groups, fn, {"values": (ts.response_index.shape[1],)},
                                     capture_hidden=False), rows)["values"]


def pair_sequence_log_probs(model, micro_batches: List[MicroBatch], groups: ParallelGroups, *,
                            vocab_size: int) -> torch.Tensor:
    """Summed response log-probs of every row of ``micro_batches`` (reference side of DPO)."""
    def fn(batch, logits, hidden):
        batch = MicroBatch.of(batch)
        logp = label_log_probs(batch, logits, groups.tp_group, vocab_size=vocab_size)  # [b, s]
        return {"seq_logp": (logp * batch["label_mask"]).sum(dim=1, keepdim=True)}

    return forward_only(model, micro_batches, groups, fn, {"seq_logp": (1,)}, capture_hidden=False)["seq_logp"][:, 0]


def response_kl(policy, reference, batch, groups: ParallelGroups, *, micro_batch_size: int,
                vocab_size: int, packed: bool = False) -> torch.Tensor:
    """The k1 KL to the reference of every sampled response token ``[b, r]`` (temperature 1; 0 on padding).

    ``batch`` is a ``RolloutBatch``; with ``reference is policy`` the KL is 0 without a second forward.
    Each micro-batch is cut to its longest row, or ``packed``.
    """
    from hpa.algorithms.kl import kl_penalty

    kw = dict(micro_batch_size=micro_batch_size, vocab_size=vocab_size, temperature=1.0,
              lengths=batch.sequence_lengths, packed=packed)
    ts = batch.sequences
    logp = sequence_log_probs(policy, ts, batch.response_mask, groups, **kw)["log_probs"].cpu()  # [b, r]
    ref = logp if reference is policy else \
        sequence_log_probs(reference, ts, batch.response_mask, groups, **kw)["log_probs"].cpu()  # [b, r]
    mask = batch.response_mask.float().cpu()  # [b, r]
    return torch.where(mask.bool(), kl_penalty(logp, ref, kind="k1"), 0.0)


def response_top_log_probs(model, batch, groups: ParallelGroups, *, micro_batch_size: int, vocab_size: int,
                           k: int) -> Dict[str, torch.Tensor]:
    """Log-probs at temperature 1 at the response positions only (never the whole ``[b, s, v]``): the
    sampled tokens' ``log_probs`` ``[b, r]`` and the ``k`` most likely tokens, ``top_values`` ``[b, r, k]``
    and ``top_ids`` ``[b, r, k]`` (long). ``batch`` is a ``RolloutBatch``; the logits must hold the whole
    vocabulary (tensor parallel size 1, as ``hpa serve``)."""
    if groups.tensor_model_parallel_size != 1:
        raise NotImplementedError("the top-k log-probs need the whole vocabulary on one rank (TP 1)")
    ts = batch.sequences
    mbs = sequence_micro_batches(ts, chunks(ts.input_ids.shape[0], micro_batch_size), batch.sequence_lengths)
    r = ts.response_index.shape[1]

    def fn(mb, logits, hidden):
        logp = torch.log_softmax(mb.response(mb.unpack(logits))[..., :vocab_size].float(), dim=-1)  # [n, r, v]
        values, ids = logp.topk(k, dim=-1)  # [n, r, k]
        sampled = logp.gather(2, mb.response(mb.labels).unsqueeze(2))[..., 0]  # [n, r]
        return {"log_probs": sampled, "top_values": values, "top_ids": ids}

    out = forward_only(model, mbs, groups, fn, {"log_probs": (r,), "top_values": (r, k), "top_ids": (r, k)},
                       capture_hidden=False)
    out["top_ids"] = out["top_ids"].long()  # exact: ids below 2**24 survive the float32 of the broadcast
    return out
