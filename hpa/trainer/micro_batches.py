"""Micro-batches of one HPA step: the one place that cuts a step's rows for the pipeline schedule.

Each is a ``MicroBatch`` (``hpa.engine.micro_batch``), padded or packed (``trainer.sequence_packing``).
A rollout micro-batch carries the training sequences of its rows plus every per-row tensor the policy
and critic losses read (``ROLLOUT_ROW_KEYS``, taken from the ``RolloutBatch``); a pair micro-batch
carries ``m`` preference pairs as ``2m`` rows (chosen rows, then rejected rows). Every DP rank gets the
same number of micro-batches, as megatron's pipeline schedule and DDP require.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from hpa.data.collate import balanced_micro_batches, pad_right, token_budget_micro_batches
from hpa.distributed import comm
from hpa.engine.forward import chunks, response_token_mask
from hpa.engine.micro_batch import MicroBatch
from hpa.rollout.base import RolloutBatch

# per-row tensors of a RolloutBatch that the losses read; "values" (GAE critic) and "is_weights"
# (truncated importance sampling) and "kl_weights" (the coverage trust's abstention) are present only when
# configured
ROLLOUT_ROW_KEYS = ("mask", "old_log_probs", "ref_log_probs", "ref_pooled", "advantages", "returns", "values",
                    "is_weights", "kl_weights")
OPTIONAL_ROW_KEYS = frozenset({"values", "is_weights", "kl_weights"})


def mini_batches(num_rows: int, num_mini_batches: int) -> List[List[int]]:
    """``num_rows`` split into ``num_mini_batches`` equal, contiguous row lists (one optimizer update each)."""
    size = num_rows // num_mini_batches
    return [list(range(i * size, (i + 1) * size)) for i in range(num_mini_batches)]


def rollout_micro_batches(batch: RolloutBatch, rows: Sequence[int], *, micro_batch_size: int,
                          token_budget: Optional[int], dp_group, packed: bool = False) -> List[MicroBatch]:
    """Micro-batches of ``rows`` of ``batch``: ``micro_batch_size`` rows each, or, with a token budget,
    groups of balanced token counts near that budget (the count every DP rank needs; a group can pass the
    budget by one row). Padded, each is cut to its own longest sequence and the budget counts padded
    tokens; ``packed``, its rows are packed and the budget counts real tokens."""
    ts = batch.sequences
    pool_mask = response_token_mask(ts, batch.response_mask)
    lengths = batch.sequence_lengths.tolist()
    if token_budget is None:
        groups = [[rows[i] for i in chunk] for chunk in chunks(len(rows), micro_batch_size)]
    else:
        own = len(token_budget_micro_batches([lengths[r] for r in rows], token_budget, packed=packed))
        count = int(comm.all_reduce_max(torch.tensor([own]), dp_group).item())
        groups = [[rows[i] for i in g] for g in balanced_micro_batches([lengths[r] for r in rows], count)]
    keys = [k for k in ROLLOUT_ROW_KEYS if k in batch.extras or k not in OPTIONAL_ROW_KEYS]
    out = []
    for group in groups:
        idx = torch.tensor(group)
        width = max(lengths[r] for r in group)
        out.append(MicroBatch.from_padded(
            "rollout", ts.input_ids[idx, :width], ts.labels[idx, :width], torch.tensor([lengths[r] for r in group]),
            packed=packed, response_index=ts.response_index[idx].clamp(max=width - 1),
            pool_mask=pool_mask[idx][:, :width], **{k: batch.get(k)[idx] for k in keys}))
    return out


def _right_padded(kind: str, seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[float]], pad_id: int, *,
                  packed: bool, **rows) -> MicroBatch:
    """Next-token rows (``label_mask`` is 1 where the label is a masked-in token), right-padded or packed."""
    s = max(len(x) for x in seqs) + 1  # one more column: the last token's label is a pad
    ids, _ = pad_right(seqs, pad_id, length=s)
    resp = pad_right(masks, 0, length=s)[0].float()
    return MicroBatch.from_padded(kind, ids[:, :-1], ids[:, 1:], torch.tensor([len(x) for x in seqs]),
                                  packed=packed, label_mask=resp[:, 1:], **rows)


def pair_micro_batches(examples, *, micro_batch_size: int, pad_id: int, packed: bool = False) -> List[MicroBatch]:
    """Preference examples -> micro-batches of ``micro_batch_size`` pairs, chosen rows then rejected rows,
    right-padded or packed, of kind ``"pairs"``."""
    out = []
    for rows in chunks(len(examples), micro_batch_size):
        seqs = [examples[i].chosen_input_ids for i in rows] + [examples[i].rejected_input_ids for i in rows]
        masks = [examples[i].chosen_response_mask for i in rows] + \
                [examples[i].rejected_response_mask for i in rows]
        out.append(_right_padded("pairs", seqs, masks, pad_id, packed=packed))
    return out


def chosen_micro_batches(examples, *, micro_batch_size: int, pad_id: int, packed: bool = False) -> List[MicroBatch]:
    """The chosen rows of preference examples alone (the trust gate's held-out NLL)."""
    return [_right_padded("rows", [examples[i].chosen_input_ids for i in rows],
                          [examples[i].chosen_response_mask for i in rows], pad_id, packed=packed)
            for rows in chunks(len(examples), micro_batch_size)]


def attach_ref_pair_logps(micro_batches: List[MicroBatch], ref_seq_logps: torch.Tensor) -> None:
    """Hand each pair micro-batch its rows of the reference's summed response log-probs."""
    start = 0
    for mb in micro_batches:
        n = mb.num_rows
        mb.rows["ref_seq_logp"] = ref_seq_logps[start:start + n]
        start += n


def pair_rows(per_pair: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """Per-pair values ``[m, 2]`` (chosen, rejected) in the row order of ``pair_micro_batches``: each
    micro-batch's chosen rows, then its rejected rows. ``[2m]``"""
    return torch.cat([per_pair[rows].T.reshape(-1) for rows in chunks(per_pair.shape[0], micro_batch_size)])


def sft_micro_batches(examples, *, micro_batch_size: int, pad_id: int, packed: bool = False) -> List[MicroBatch]:
    """SFT examples -> micro-batches with ``input_ids``/``labels`` and ``label_mask`` rows."""
    return [_right_padded("sft", [examples[i].input_ids for i in rows], [examples[i].response_mask for i in rows],
                          pad_id, packed=packed)
            for rows in chunks(len(examples), micro_batch_size)]
