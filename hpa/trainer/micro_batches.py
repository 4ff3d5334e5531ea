"""The trainer's streams as rows for ``hpa.engine.collate`` (the one place that builds micro-batches).

A rollout micro-batch carries the training sequences of its rows plus every per-row tensor the policy
and critic losses read (``ROLLOUT_ROW_KEYS``, taken from the ``RolloutBatch``); a pair micro-batch
carries ``m`` preference pairs as ``2m`` rows (chosen rows, then rejected rows); a replay micro-batch carries SFT
examples, one a row. With an update token budget (``trainer.ppo_max_token_len_per_rank``) every stream is cut
by tokens: rollout rows by ``row_groups``, pairs (a pair's two rows together) and SFT examples by
``budget_groups``; without one, by ``micro_batch_size`` rows (pairs). Packed, an offline micro-batch then rides
in a rollout micro-batch where both fit the budget (``ride_along``: one forward and backward for both). Every DP rank gets the
same number of micro-batches, as megatron's pipeline schedule and DDP require.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from hpa.engine.batching import Batching
from hpa.engine.collate import TokenRows, budget_groups, chunks, collate, pair_micro_batches, row_groups
from hpa.distributed import comm
from hpa.engine.forward import response_token_mask
from hpa.engine.micro_batch import MicroBatch
from hpa.rollout.base import RolloutBatch

# per-row tensors of a RolloutBatch that the losses read; "values" (GAE critic) and "is_weights"
# (the rollout correction's importance weights) and "kl_weights" (the coverage trust's abstention) are present only when
# configured; on an on-policy step "old_log_probs" is absent (the update's forward gives it) and "row_ids" (each
# row's index in the batch) says where the update's log-probs go
ROLLOUT_ROW_KEYS = ("mask", "old_log_probs", "ref_log_probs", "ref_pooled", "advantages", "returns", "values",
                    "is_weights", "kl_weights", "row_ids")
OPTIONAL_ROW_KEYS = frozenset({"old_log_probs", "values", "is_weights", "kl_weights", "row_ids"})


def mini_batches(num_rows: int, num_mini_batches: int) -> List[List[int]]:
    """``num_rows`` split into ``num_mini_batches`` equal, contiguous row lists (one optimizer update each)."""
    size = num_rows // num_mini_batches
    return [list(range(i * size, (i + 1) * size)) for i in range(num_mini_batches)]


def rollout_micro_batches(batch: RolloutBatch, rows: Sequence[int], batching: Batching,
                          dp_group) -> List[MicroBatch]:
    """Micro-batches of ``rows`` of ``batch``: ``micro_batch_size`` rows each, or, with an update token budget,
    groups of balanced token counts near that budget, as many as the DP rank that needs most
    (``hpa.engine.collate.row_groups``). Padded, each is cut to its own longest sequence and the budget counts
    padded tokens; packed, the budget counts real tokens."""
    ts = batch.sequences
    lengths = batch.sequence_lengths.tolist()
    local = row_groups(len(rows), micro_batch_size=batching.micro_batch_size, lengths=[lengths[r] for r in rows],
                       token_budget=batching.update_token_budget, packed=batching.packed, dp_group=dp_group)
    keys = [k for k in ROLLOUT_ROW_KEYS if k in batch.extras or k not in OPTIONAL_ROW_KEYS]
    token_rows = TokenRows(input_ids=ts.input_ids, labels=ts.labels, lengths=batch.sequence_lengths.long(),
                           response_index=ts.response_index,
                           positional={"pool_mask": response_token_mask(ts, batch.response_mask)},
                           per_row={k: batch.get(k) for k in keys})
    return collate("rollout", token_rows, [[rows[i] for i in g] for g in local], packed=batching.packed)


def ride_along(rollout_mbs: Sequence[MicroBatch], offline_mbs: Sequence[MicroBatch], token_budget: Optional[int],
               dp_group=None) -> List[MicroBatch]:
    """The micro-batches of one optimizer update with the offline ones (pairs, replay) riding in the rollout
    micro-batches where they fit: each offline micro-batch in turn joins the rollout micro-batch of fewest tokens
    when the two together stay within ``token_budget`` (``MicroBatch.concat``: one forward and backward, each
    stream's loss on its own rows); the others stay micro-batches of their own. Every DP rank merges as many as
    the rank that merges fewest (they must run as many micro-batches). Packed micro-batches only; without a
    budget, or padded, ``rollout_mbs + offline_mbs`` unchanged."""
    rollout_mbs, offline_mbs = list(rollout_mbs), list(offline_mbs)
    if token_budget is None or not rollout_mbs or not offline_mbs or \
            not all(mb.packed for mb in rollout_mbs + offline_mbs):
        return rollout_mbs + offline_mbs
    loads = [mb.tokens for mb in rollout_mbs]
    riders = []  # (offline index, rollout index), in the order they were placed
    for j, mb in enumerate(offline_mbs):
        i = min(range(len(loads)), key=loads.__getitem__)
        if loads[i] + mb.tokens <= token_budget:
            riders.append((j, i))
            loads[i] += mb.tokens
    count = len(riders)
    if dp_group is not None:
        count = -int(comm.all_reduce_max(torch.tensor([-count]), dp_group).item())
    riders = riders[:count]
    parts = [[mb] for mb in rollout_mbs]
    for j, i in riders:
        parts[i].append(offline_mbs[j])
    placed = {j for j, _ in riders}
    return ([MicroBatch.concat(p) if len(p) > 1 else p[0] for p in parts]
            + [mb for j, mb in enumerate(offline_mbs) if j not in placed])


def preference_micro_batches(examples, batching: Batching, ref_log_probs: Optional[torch.Tensor] = None,
                             micro_batch_size: Optional[int] = None, *, min_count: int = 1,
                             dp_group=None) -> List[MicroBatch]:
    """Preference examples -> pair micro-batches, each with its rows' ``ref_seq_logp`` when ``ref_log_probs``
    ``[m, 2]`` (chosen, rejected) is given: ``micro_batch_size`` pairs each when it is given (a forward of its
    own for every pair: the reference), else grouped by tokens up to ``batching.update_token_budget``
    (``hpa.engine.collate.budget_groups``: at least ``min_count``, as many on every rank of ``dp_group``), else
    ``batching.micro_batch_size`` pairs each."""
    per_row = {} if ref_log_probs is None else {"ref_seq_logp": torch.cat([ref_log_probs[:, 0], ref_log_probs[:, 1]])}
    budget = batching.update_token_budget if micro_batch_size is None else None
    return pair_micro_batches(examples, micro_batch_size=micro_batch_size or batching.micro_batch_size,
                              pad_id=batching.pad_id, packed=batching.packed, token_budget=budget,
                              min_count=min_count, dp_group=dp_group, **per_row)


def chosen_micro_batches(examples, batching: Batching) -> List[MicroBatch]:
    """The chosen rows of preference examples alone (the trust gate's held-out NLL)."""
    rows = TokenRows.next_token([e.chosen_input_ids for e in examples], [e.chosen_response_mask for e in examples],
                                batching.pad_id)
    return collate("rows", rows, chunks(len(examples), batching.micro_batch_size), packed=batching.packed)


def sft_micro_batches(examples, batching: Batching, kind: str = "sft", *, min_count: int = 1,
                      dp_group=None) -> List[MicroBatch]:
    """SFT examples -> micro-batches with ``input_ids``/``labels`` and ``label_mask`` rows (``kind``: ``sft`` for
    ``hpa sft``, ``replay`` for the SFT replay of an HPA step): grouped by tokens up to
    ``batching.update_token_budget`` (``hpa.engine.collate.budget_groups``: at least ``min_count``, as many on every
    rank of ``dp_group``), else ``batching.micro_batch_size`` examples each."""
    rows = TokenRows.next_token([e.input_ids for e in examples], [e.response_mask for e in examples],
                                batching.pad_id)
    if batching.update_token_budget is None:
        groups = chunks(len(examples), batching.micro_batch_size)
    else:
        groups = budget_groups(rows.lengths.tolist(), batching.update_token_budget, packed=batching.packed,
                               min_count=min_count, dp_group=dp_group)
    return collate(kind, rows, groups, packed=batching.packed)
