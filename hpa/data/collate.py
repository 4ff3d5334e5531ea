"""Padding and micro-batch planning (``hpa.engine.collate`` builds the micro-batches from them).

Prompts are padded on the left (generation appends on the right, so every row's last prompt token
sits in the same column); training sequences are padded on the right. Masks are 1 on real tokens.

Micro-batch planners work on sequence lengths and return lists of indices into the batch.
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Sequence, Tuple

import torch


def _target_length(seqs: Sequence[Sequence[int]], length: Optional[int], pad_to_multiple_of: int) -> int:
    longest = max((len(s) for s in seqs), default=0)
    target = longest if length is None else length
    if target < longest:
        raise ValueError(f"pad length {length} is shorter than the longest sequence ({longest} tokens)")
    return -(-target // pad_to_multiple_of) * pad_to_multiple_of


def _pad(seqs: Sequence[Sequence[int]], value: int, *, left: bool, length: Optional[int],
         pad_to_multiple_of: int) -> Tuple[torch.Tensor, torch.Tensor]:
    s = _target_length(seqs, length, pad_to_multiple_of)
    values = torch.full((len(seqs), s), value, dtype=torch.long)  # [b, s]
    mask = torch.zeros((len(seqs), s), dtype=torch.long)  # [b, s]
    for row, seq in enumerate(seqs):
        if len(seq):
            cols = slice(s - len(seq), s) if left else slice(0, len(seq))
            values[row, cols] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, cols] = 1
    return values, mask


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int, *, length: Optional[int] = None,
             pad_to_multiple_of: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Left-pad ``seqs``; returns ``ids [b, s]`` (int64) and ``attention_mask [b, s]`` (int64, 1 = token)."""
    return _pad(seqs, pad_id, left=True, length=length, pad_to_multiple_of=pad_to_multiple_of)


def pad_right(seqs: Sequence[Sequence[int]], pad_value: int, *, length: Optional[int] = None,
              pad_to_multiple_of: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``seqs``; returns ``values [b, s]`` (int64) and ``attention_mask [b, s]`` (int64, 1 = token)."""
    return _pad(seqs, pad_value, left=False, length=length, pad_to_multiple_of=pad_to_multiple_of)


def token_budget_micro_batches(lengths: Sequence[int], max_token_len: int, *, packed: bool = False) -> List[List[int]]:
    """Split a batch into micro-batches whose padded size ``max_len * count`` (``packed``: whose token
    count ``sum(lengths)``) is <= ``max_token_len``.

    Sequences are taken longest first (stable for ties) and packed greedily, so similar lengths share
    a micro-batch and little is padded. A sequence longer than ``max_token_len`` gets a micro-batch
    of its own (it cannot be split here; the budget is then exceeded by that one sequence).

    Args:
        lengths: token count of each sequence of the batch.
        max_token_len: padded tokens allowed per micro-batch (e.g. ``ppo_max_token_len_per_rank``).

    Returns:
        index lists into ``lengths``; each index appears in exactly one list, indices ascending
        within a list.
    """
    if max_token_len < 1:
        raise ValueError(f"max_token_len must be positive, got {max_token_len}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: List[List[int]] = []
    current: List[int] = []
    current_max = current_sum = 0
    for i in order:
        new_max = max(current_max, lengths[i])
        cost = current_sum + lengths[i] if packed else new_max * (len(current) + 1)
        if current and cost > max_token_len:
            groups.append(sorted(current))
            current, new_max, current_sum = [], lengths[i], 0
        current.append(i)
        current_max = new_max
        current_sum += lengths[i]
    if current:
        groups.append(sorted(current))
    return groups


def balanced_micro_batches(lengths: Sequence[int], num_micro_batches: int) -> List[List[int]]:
    """Split a batch into exactly ``num_micro_batches`` non-empty groups of balanced token counts.

    Megatron's pipeline schedule needs the same number of micro-batches on every DP rank: each rank
    computes ``len(token_budget_micro_batches(...))``, the caller takes the max across DP ranks and
    passes it here. Longest sequences are placed first, each into the group with the fewest tokens
    (then fewest sequences), so group sums differ by at most one sequence's length.

    Returns:
        ``num_micro_batches`` index lists, each ascending; every index appears exactly once.
    """
    if not 1 <= num_micro_batches <= len(lengths):
        raise ValueError(f"num_micro_batches={num_micro_batches} must be in [1, batch size {len(lengths)}]; "
                         f"an empty micro-batch cannot go through the pipeline schedule")
    heap = [(0, 0, g) for g in range(num_micro_batches)]  # (tokens, count, group)
    groups: List[List[int]] = [[] for _ in range(num_micro_batches)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        tokens, count, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, g))
    return [sorted(g) for g in groups]
