"""Micro-batches of one HPA step: the one place that cuts a step's rows for the pipeline schedule.

A rollout micro-batch carries the training sequences of its rows plus every per-row tensor the policy
and critic losses read (``ROLLOUT_ROW_KEYS``, taken from the ``RolloutBatch``); a pair micro-batch
carries ``m`` preference pairs as ``2m`` rows (chosen rows, then rejected rows). Every DP rank gets the
same number of micro-batches, as megatron's pipeline schedule and DDP require.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from hpa.data.collate import balanced_micro_batches, token_budget_micro_batches
from hpa.distributed import comm
from hpa.engine.forward import chunks, response_token_mask
from hpa.rollout.base import RolloutBatch

# per-row tensors of a RolloutBatch that the losses read; "values" (GAE critic) and "is_weights"
# (truncated importance sampling) are present only when configured
ROLLOUT_ROW_KEYS = ("mask", "old_log_probs", "ref_log_probs", "ref_pooled", "advantages", "returns", "values",
                    "is_weights")
OPTIONAL_ROW_KEYS = frozenset({"values", "is_weights"})


def mini_batches(num_rows: int, num_mini_batches: int) -> List[List[int]]:
    """``num_rows`` split into ``num_mini_batches`` equal, contiguous row lists (one optimizer update each)."""
    size = num_rows // num_mini_batches
    return [list(range(i * size, (i + 1) * size)) for i in range(num_mini_batches)]


def rollout_micro_batches(batch: RolloutBatch, rows: Sequence[int], *, micro_batch_size: int,
                          token_budget: Optional[int], dp_group) -> List[dict]:
    """Micro-batches of ``rows`` of ``batch``: ``micro_batch_size`` rows each, or, with a token budget,
    groups under that many tokens, each cut to its own longest sequence (so short responses do not pay
    for long ones)."""
    ts = batch.sequences
    pool_mask = response_token_mask(ts, batch.response_mask)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    if token_budget is None:
        groups = [[rows[i] for i in chunk] for chunk in chunks(len(rows), micro_batch_size)]
    else:
        own = len(token_budget_micro_batches([lengths[r] for r in rows], token_budget))
        count = int(comm.all_reduce_max(torch.tensor([own]), dp_group).item())
        groups = [[rows[i] for i in g] for g in balanced_micro_batches([lengths[r] for r in rows], count)]
    keys = [k for k in ROLLOUT_ROW_KEYS if k in batch.extras or k not in OPTIONAL_ROW_KEYS]
    out = []
    for group in groups:
        idx = torch.tensor(group)
        width = max(lengths[r] for r in group)
        mb = {k: v[:, :width] for k, v in ts.micro_batch(idx).items() if k != "response_index"}
        mb["response_index"] = ts.response_index[idx].clamp(max=width - 1)
        mb.update(kind="rollout", pool_mask=pool_mask[idx][:, :width], **{k: batch.get(k)[idx] for k in keys})
        out.append(mb)
    return out


def _right_padded(seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[float]], pad_id: int) -> dict:
    """Next-token rows: ``input_ids``/``labels``/``label_mask``/``position_ids`` ``[n, s]`` (label_mask
    is 1 where the label is a masked-in token)."""
    s = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), s + 1), pad_id, dtype=torch.long)
    resp = torch.zeros((len(seqs), s + 1), dtype=torch.float32)
    for i, (seq, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(seq)] = torch.tensor(seq)
        resp[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "label_mask": resp[:, 1:],
            "position_ids": torch.arange(s).expand(len(seqs), s)}


def pair_micro_batches(examples, *, micro_batch_size: int, pad_id: int) -> List[dict]:
    """Preference examples -> micro-batches of ``micro_batch_size`` pairs, chosen rows then rejected rows,
    right-padded, marked ``kind="pairs"``."""
    out = []
    for rows in chunks(len(examples), micro_batch_size):
        seqs = [examples[i].chosen_input_ids for i in rows] + [examples[i].rejected_input_ids for i in rows]
        masks = [examples[i].chosen_response_mask for i in rows] + \
                [examples[i].rejected_response_mask for i in rows]
        out.append(dict(_right_padded(seqs, masks, pad_id), kind="pairs"))
    return out


def chosen_micro_batches(examples, *, micro_batch_size: int, pad_id: int) -> List[dict]:
    """The chosen rows of preference examples alone (the trust gate's held-out NLL), right-padded."""
    return [_right_padded([examples[i].chosen_input_ids for i in rows], [examples[i].chosen_response_mask for i in rows],
                          pad_id) for rows in chunks(len(examples), micro_batch_size)]


def attach_ref_pair_logps(micro_batches: List[dict], ref_seq_logps: torch.Tensor) -> None:
    """Hand each pair micro-batch its rows of the reference's summed response log-probs."""
    start = 0
    for mb in micro_batches:
        n = mb["input_ids"].shape[0]
        mb["ref_seq_logp"] = ref_seq_logps[start:start + n]
        start += n


def pair_rows(per_pair: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """Per-pair values ``[m, 2]`` (chosen, rejected) in the row order of ``pair_micro_batches``: each
    micro-batch's chosen rows, then its rejected rows. ``[2m]``"""
    return torch.cat([per_pair[rows].T.reshape(-1) for rows in chunks(per_pair.shape[0], micro_batch_size)])


def sft_micro_batches(examples, *, micro_batch_size: int, pad_id: int) -> List[dict]:
    """SFT examples -> right-padded ``input_ids``/``labels``/``label_mask`` ``[m, s]`` micro-batches."""
    return [_right_padded([examples[i].input_ids for i in rows], [examples[i].response_mask for i in rows], pad_id)
            for rows in chunks(len(examples), micro_batch_size)]
