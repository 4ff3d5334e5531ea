"""Micro-batches of every stream: the one place that builds ``MicroBatch``es.

Every stream (rollouts, preference pairs, SFT rows, held-out rows, reward-model scoring and training) hands
its rows here as tensors, ``TokenRows``: right-padded token ids ``[n, s]``, each row's length, labels, and the
per-row tensors its loss reads. ``row_groups`` / ``pair_groups`` say which rows share a micro-batch (by
micro-batch size or by token budget; ``budget_groups`` is the token-budget grouping of the pair, replay and SFT
streams), ``collate`` cuts them out, padded or packed. A stream's own module
only turns its records into ``TokenRows`` (``trainer.micro_batches`` for a ``RolloutBatch``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from hpa.data.collate import balanced_micro_batches, pad_right, token_budget_micro_batches
from hpa.distributed import comm
from hpa.engine.micro_batch import MicroBatch


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenRows:
    """``n`` right-padded training rows of one stream.

    Attributes:
        input_ids: ``[n, s]`` token ids, row ``i`` real on its first ``lengths[i]`` positions.
        lengths: ``[n]`` int64.
        labels: ``[n, s]`` the next token of each position; None: zeros (models whose loss reads no label).
        response_index: ``[n, r]`` the positions whose outputs predict the response tokens (clamped to each
            micro-batch's width), or None.
        positional: per-position tensors ``[n, s, ...]`` (masks), cut to each micro-batch's width.
        per_row: per-row tensors ``[n, ...]`` (advantages, cached log-probs, weights).
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    labels: Optional[torch.Tensor] = None
    response_index: Optional[torch.Tensor] = None
    positional: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    per_row: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def next_token(cls, seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[float]], pad_id: int,
                   **per_row: torch.Tensor) -> "TokenRows":
        """Token lists -> next-token rows: ``label_mask`` (positional) is 1 where the label is a masked-in
        token of ``masks`` (the response), the last token's label is a pad."""
        s = max(len(x) for x in seqs) + 1  # one more column: the last token's label is a pad
        ids, _ = pad_right(seqs, pad_id, length=s)  # [n, s + 1]
        label_mask = pad_right(masks, 0, length=s)[0].float()[:, 1:]  # [n, s]
        return cls(input_ids=ids[:, :-1], labels=ids[:, 1:], lengths=torch.tensor([len(x) for x in seqs]),
                   positional={"label_mask": label_mask}, per_row=per_row)


def chunks(n: int, size: int) -> List[List[int]]:
    """``0..n-1`` in consecutive runs of ``size``."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def pair_groups(num_pairs: int, micro_batch_size: int) -> List[List[int]]:
    """The rows of each pair micro-batch over rows laid out as every pair's chosen row, then every pair's
    rejected row (``[2m]``): ``micro_batch_size`` pairs, their chosen rows first, then their rejected rows."""
    return [c + [num_pairs + i for i in c] for c in chunks(num_pairs, micro_batch_size)]


def budget_groups(tokens: Sequence[int], token_budget: int, *, widths: Optional[Sequence[int]] = None,
                  rows_per_unit: int = 1, packed: bool = False, min_count: int = 1,
                  dp_group=None) -> List[List[int]]:
    """Units (a pair: its chosen and rejected rows; an SFT example: its row) grouped into as few micro-batches as
    the token budget allows, balanced in tokens; a unit is never split.

    The count is the least ``k >= max(ceil(C / token_budget), min_count)`` (``C``: the units' tokens, ``tokens``
    summed, packed; their padded tokens ``rows_per_unit * widths`` summed, padded) at which the balanced split
    (``hpa.data.collate.balanced_micro_batches``: longest unit first, each into the group of fewest tokens) keeps
    every group within ``token_budget`` (packed: its tokens; padded: ``rows_per_unit * len(group) * its widest
    unit``), or one unit a group. Packed, that split puts at most ``C/k + u`` tokens in a group (``u``: the
    largest unit), so ``k = ceil(C / token_budget)`` whenever ``C / ceil(C / token_budget) + u <= token_budget``,
    and ``k <= ceil(C / (token_budget - u))`` whenever ``u < token_budget``. With ``dp_group`` (every DP rank of
    an update needs as many micro-batches) every rank takes the largest ``k`` over DP and splits its units into
    that many balanced groups (a rank whose own ``k`` is smaller stays within ``C/k + u`` tokens a group).

    Args:
        tokens: ``[n]`` real tokens of each unit.
        token_budget: tokens allowed per micro-batch (``trainer.ppo_max_token_len_per_rank``).
        widths: ``[n]`` the longest row of each unit (padded only; default ``tokens``).
        rows_per_unit: rows each unit adds to a micro-batch (2 for a pair).
        packed: count real tokens (else padded ones).
        min_count: at least this many groups (the update's mini-batches, each of which takes its share), at
            most ``n``.

    Returns:
        index lists into ``tokens``, each ascending, in the order of their first index; every index appears once.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    n = len(tokens)
    if n == 0:
        return []
    widths = list(tokens if widths is None else widths)
    size = list(tokens) if packed else [rows_per_unit * w for w in widths]

    def cost(group: List[int]) -> int:
        return sum(size[i] for i in group) if packed else rows_per_unit * len(group) * max(widths[i] for i in group)

    count = min(n, max(min_count, -(-sum(size) // token_budget)))
    groups = balanced_micro_batches(size, count)
    while count < n and max(cost(g) for g in groups) > token_budget:
        count += 1
        groups = balanced_micro_batches(size, count)
    if dp_group is not None:
        most = int(comm.all_reduce_max(torch.tensor([count]), dp_group).item())
        if most != count:
            groups = balanced_micro_batches(size, most)
    return sorted(groups)


def row_groups(num_rows: int, *, micro_batch_size: int, lengths: Optional[Sequence[int]] = None,
               token_budget: Optional[int] = None, packed: bool = False, dp_group=None) -> List[List[int]]:
    """The rows of each micro-batch: ``micro_batch_size`` consecutive rows; or, with a ``token_budget`` and
    ``lengths``, rows of similar lengths grouped up to that many tokens (real tokens ``packed``, padded ones
    otherwise; ``hpa.data.collate.token_budget_micro_batches``). With ``dp_group`` (a training update: every
    DP rank needs as many micro-batches) the largest count over DP, each of balanced tokens (a group can
    pass the budget by one row)."""
    if token_budget is None or lengths is None:
        return chunks(num_rows, micro_batch_size)
    lengths = list(lengths)
    groups = token_budget_micro_batches(lengths, token_budget, packed=packed)
    if dp_group is None:
        return groups
    count = int(comm.all_reduce_max(torch.tensor([len(groups)]), dp_group).item())
    return balanced_micro_batches(lengths, count)


def collate(kind: str, rows: TokenRows, groups: Sequence[Sequence[int]], *, packed: bool = False,
            cut: bool = True) -> List[MicroBatch]:
    """One ``MicroBatch`` of kind ``kind`` per group of row indices (in the group's order), padded or
    ``packed``; ``cut``: each cut to its longest row, else every one keeps the rows' whole width ``s``."""
    s = rows.input_ids.shape[1]
    labels = torch.zeros_like(rows.input_ids) if rows.labels is None else rows.labels
    out = []
    for group in groups:
        idx = torch.as_tensor(list(group), dtype=torch.long)
        width = int(rows.lengths[idx].max()) if cut else s
        extra: Dict[str, torch.Tensor] = {k: v[idx][:, :width] for k, v in rows.positional.items()}
        extra.update({k: v[idx] for k, v in rows.per_row.items()})
        if rows.response_index is not None:
            extra["response_index"] = rows.response_index[idx].clamp(max=width - 1)
        out.append(MicroBatch.from_padded(kind, rows.input_ids[idx, :width], labels[idx, :width], rows.lengths[idx],
                                          packed=packed, **extra))
    return out


def pair_rows(examples, pad_id: int, **per_row: torch.Tensor) -> TokenRows:
    """Preference examples (``chosen_input_ids``, ``rejected_input_ids`` and their response masks) -> next-token
    rows, every chosen row, then every rejected row (``[2m]``; ``per_row`` tensors in that order)."""
    seqs = [e.chosen_input_ids for e in examples] + [e.rejected_input_ids for e in examples]
    masks = [e.chosen_response_mask for e in examples] + [e.rejected_response_mask for e in examples]
    return TokenRows.next_token(seqs, masks, pad_id, **per_row)


def pair_budget_groups(examples, token_budget: int, *, packed: bool = False, min_count: int = 1,
                       dp_group=None) -> List[List[int]]:
    """``budget_groups`` of preference examples (a pair's chosen and rejected rows are one unit), as the rows of
    each micro-batch in ``pair_rows``'s layout: the group's chosen rows, then its rejected rows."""
    m = len(examples)
    chosen = [len(e.chosen_input_ids) for e in examples]
    rejected = [len(e.rejected_input_ids) for e in examples]
    groups = budget_groups([c + r for c, r in zip(chosen, rejected)], token_budget,
                           widths=[max(c, r) for c, r in zip(chosen, rejected)], rows_per_unit=2, packed=packed,
                           min_count=min_count, dp_group=dp_group)
    return [g + [m + i for i in g] for g in groups]


def pair_micro_batches(examples, *, micro_batch_size: int, pad_id: int, packed: bool = False,
                       token_budget: Optional[int] = None, min_count: int = 1, dp_group=None,
                       **per_row: torch.Tensor) -> List[MicroBatch]:
    """Preference examples -> micro-batches of ``micro_batch_size`` pairs, or with a ``token_budget`` of pairs
    grouped up to it (``pair_budget_groups``), chosen rows then rejected rows, each cut to its longest row, of
    kind ``"pairs"``; ``per_row`` ``[2m, ...]`` in ``pair_rows``'s order, and ``source_row``: each row's index in
    that order (a forward over the micro-batches puts its rows back in it)."""
    rows = pair_rows(examples, pad_id, source_row=torch.arange(2 * len(examples)), **per_row)
    groups = pair_groups(len(examples), micro_batch_size) if token_budget is None else pair_budget_groups(
        examples, token_budget, packed=packed, min_count=min_count, dp_group=dp_group)
    return collate("pairs", rows, groups, packed=packed)
