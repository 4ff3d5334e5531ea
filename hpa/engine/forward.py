"""Forward-only passes of a Megatron model through the pipeline schedule.

Every result is computed on the last pipeline stage and broadcast to the other stages of the replica,
so every rank of a model replica holds the same rows afterwards. Used by training (reference, old
policy, critic values), evaluation, generation, scoring and reward models.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from hpa.algorithms.kl import kl_penalty
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.engine.head import HeadInput, label_log_probs, response_log_probs
from hpa.engine.micro_batch import MicroBatch
from hpa.engine.step import forward_backward
from hpa.algorithms.masked import mean_pool
from hpa.engine.batching import Batching
from hpa.engine.collate import TokenRows, collate, row_groups
from hpa.engine.sequences import TrainingSequences
from hpa.models import unwrap


def response_token_mask(ts: TrainingSequences, response_mask: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` mask of the input positions that hold response tokens (for mean pooling)."""
    s = ts.input_ids.shape[1]
    out = torch.zeros_like(ts.input_ids, dtype=torch.float32)
    return out.scatter_(1, (ts.response_index + 1).clamp(max=s - 1), response_mask.float())


@contextlib.contextmanager
def no_dropout(model) -> Iterator[None]:
    """Run ``model`` without dropout inside the block (every module in eval mode), each module's own mode back
    after, also on error. Every forward-only pass (old policy, reference, values, reward scores, evaluation)
    runs so, as the sampler does: verl and OpenRLHF compute log-probs in eval mode too. Reaches the policy's
    GPTModel under a ``BaseView`` (whose ``train()`` leaves the policy alone) and under a ``CriticView`` (which
    holds the base outside its module tree)."""
    inner = unwrap(model)
    roots = [model, inner] + [m for m in (getattr(inner, "base", None),) if isinstance(m, torch.nn.Module)]
    modules = {id(m): m for root in roots for m in root.modules()}
    before = {key: m.training for key, m in modules.items()}
    for m in modules.values():
        m.training = False  # set, not .eval(): a view's train() is deliberately a no-op
    try:
        yield
    finally:
        for key, m in modules.items():
            m.training = before[key]


def forward_only(model, micro_batches: Sequence[dict], groups: ParallelGroups,
                 fn: Callable[[dict, torch.Tensor, Optional[torch.Tensor]], Dict[str, torch.Tensor]],
                 shapes: Dict[str, Tuple[int, ...]], *, capture_hidden: bool = True,
                 hidden_head: bool = False) -> Dict[str, torch.Tensor]:
    """Run ``fn(batch, output, hidden)`` on every micro-batch, concatenate along rows, return on the host.

    Args:
        shapes: each output's trailing shape (after the row dimension), so stages that are not last
            can receive the broadcast.
        capture_hidden: hand the final hidden states to ``fn`` (otherwise ``hidden`` is None).
        hidden_head: hand ``fn`` the LM head's input in place of the logits (``forward_backward``).
    """
    def loss_fn(batch, output, hidden):
        like = output.hidden if isinstance(output, HeadInput) else output
        return like.new_zeros(()), fn(batch, output, hidden)

    with torch.no_grad(), no_dropout(model):
        results = forward_backward(model, micro_batches, loss_fn, groups, forward_only=True,
                                   capture_hidden=capture_hidden, hidden_head=hidden_head)
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


def sequence_rows(ts: TrainingSequences, lengths: Optional[torch.Tensor], **positional: torch.Tensor) -> TokenRows:
    """The rows of ``ts`` for ``collate``: ``lengths`` the positions of every row (None: the whole width),
    ``positional`` tensors ``[b, s, ...]`` cut with them."""
    s = ts.input_ids.shape[1]
    lengths = torch.full((ts.input_ids.shape[0],), s, dtype=torch.long) if lengths is None else lengths.long()
    return TokenRows(input_ids=ts.input_ids, labels=ts.labels, lengths=lengths, response_index=ts.response_index,
                     positional=positional)


def _forward_groups(ts: TrainingSequences, lengths: Optional[torch.Tensor], batching: Batching) -> List[List[int]]:
    """The rows of each forward-only micro-batch (``batching.forward_token_budget``)."""
    return row_groups(ts.input_ids.shape[0], micro_batch_size=batching.micro_batch_size,
                      lengths=None if lengths is None else lengths.tolist(),
                      token_budget=batching.forward_token_budget, packed=batching.packed)


def in_row_order(out: Dict[str, torch.Tensor], rows: List[List[int]]) -> Dict[str, torch.Tensor]:
    """Outputs concatenated in the order of ``rows`` -> the rows' own order."""
    order = torch.tensor([i for group in rows for i in group])
    if torch.equal(order, torch.arange(order.numel())):
        return out
    inverse = torch.argsort(order)
    return {k: v[inverse] for k, v in out.items()}


def sequence_log_probs(model, ts: TrainingSequences, response_mask: torch.Tensor, groups: ParallelGroups, *,
                       batching: Batching, vocab_size: int, temperature: float,
                       hidden_size: Optional[int] = None, lengths: Optional[torch.Tensor] = None
                       ) -> Dict[str, torch.Tensor]:
    """Per-response-token log-probs ``[b, r]`` (and the pooled response hidden state ``[b, h]``).

    Args:
        batching: micro-batches of ``micro_batch_size`` rows or ``forward_token_budget`` tokens, ``packed``
            (which needs ``lengths`` to save anything).
        lengths: ``[b]`` positions of each row (prompt + response); None: every row is the whole width.
    """
    rows = _forward_groups(ts, lengths, batching)
    mbs = collate("rollout", sequence_rows(ts, lengths, pool_mask=response_token_mask(ts, response_mask)), rows,
                  packed=batching.packed)
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
    return in_row_order(forward_only(model, mbs, groups, fn, shapes, capture_hidden=hidden_size is not None,
                                     hidden_head=True), rows)


def sequence_values(critic, ts: TrainingSequences, groups: ParallelGroups, *, batching: Batching,
                    lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Critic values ``[b, r]``: the value of the state before each response token (as verl)."""
    rows = _forward_groups(ts, lengths, batching)
    mbs = collate("rollout", sequence_rows(ts, lengths), rows, packed=batching.packed)

    def fn(batch, values, hidden):
        return {"values": batch.response(batch.unpack(values[..., 0]))}

    return in_row_order(forward_only(critic, mbs, groups, fn, {"values": (ts.response_index.shape[1],)},
                                     capture_hidden=False), rows)["values"]


def pair_sequence_log_probs(model, micro_batches: List[MicroBatch], groups: ParallelGroups, *,
                            vocab_size: int) -> torch.Tensor:
    """Summed response log-probs of every row of ``micro_batches`` (reference side of DPO), in the micro-batches'
    row order, or, where every micro-batch has its rows' ``source_row`` (pair micro-batches), in that order."""
    def fn(batch, logits, hidden):
        batch = MicroBatch.of(batch)
        logp = label_log_probs(batch, logits, groups.tp_group, vocab_size=vocab_size)  # [b, s]
        return {"seq_logp": (logp * batch["label_mask"]).sum(dim=1, keepdim=True)}

    rows = forward_only(model, micro_batches, groups, fn, {"seq_logp": (1,)}, capture_hidden=False,
                        hidden_head=True)["seq_logp"][:, 0]
    if micro_batches and all("source_row" in mb for mb in micro_batches):
        order = torch.cat([mb["source_row"].cpu() for mb in micro_batches])
        rows = torch.empty_like(rows).index_copy_(0, order.to(rows.device), rows)
    return rows


def response_kl(policy, reference, batch, groups: ParallelGroups, *, batching: Batching,
                vocab_size: int) -> torch.Tensor:
    """The k1 KL to the reference of every sampled response token ``[b, r]`` (temperature 1; 0 on padding).

    ``batch`` is a ``RolloutBatch``; with ``reference is policy`` the KL is 0 without a second forward.
    Each micro-batch is cut to its longest row, or packed (``batching``).
    """
    kw = dict(batching=batching, vocab_size=vocab_size, temperature=1.0, lengths=batch.sequence_lengths)
    ts = batch.sequences
    logp = sequence_log_probs(policy, ts, batch.response_mask, groups, **kw)["log_probs"].cpu()  # [b, r]
    ref = logp if reference is policy else \
        sequence_log_probs(reference, ts, batch.response_mask, groups, **kw)["log_probs"].cpu()  # [b, r]
    mask = batch.response_mask.float().cpu()  # [b, r]
    return torch.where(mask.bool(), kl_penalty(logp, ref, kind="k1"), 0.0)


def response_top_log_probs(model, batch, groups: ParallelGroups, *, batching: Batching, vocab_size: int,
                           k: int) -> Dict[str, torch.Tensor]:
    """Log-probs at temperature 1 at the response positions only (never the whole ``[b, s, v]``): the
    sampled tokens' ``log_probs`` ``[b, r]`` and the ``k`` most likely tokens, ``top_values`` ``[b, r, k]``
    and ``top_ids`` ``[b, r, k]`` (long). ``batch`` is a ``RolloutBatch``; the logits must hold the whole
    vocabulary (tensor parallel size 1, as ``hpa serve``)."""
    if groups.tensor_model_parallel_size != 1:
        raise NotImplementedError("the top-k log-probs need the whole vocabulary on one rank (TP 1)")
    ts = batch.sequences
    mbs = collate("rollout", sequence_rows(ts, batch.sequence_lengths), _forward_groups(ts, None, batching))
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
