"""``hpa.engine.collate``, the one place micro-batches are built, checked against hand-padded rows (the file is
named apart from tests/data/test_collate.py: the test directories share one module namespace)."""

import types

import pytest
import torch

import math
import random

from hpa.engine.collate import (TokenRows, budget_groups, chunks, collate, pair_budget_groups, pair_groups,
                                pair_micro_batches, pair_rows, row_groups)
from hpa.engine.micro_batch import MicroBatch


def _pair(prompt, chosen, rejected):
    return types.SimpleNamespace(chosen_input_ids=prompt + chosen, rejected_input_ids=prompt + rejected,
                                 chosen_response_mask=[0] * len(prompt) + [1] * len(chosen),
                                 rejected_response_mask=[0] * len(prompt) + [1] * len(rejected))


PAIRS = [_pair([5, 6], [7, 2], [8, 9, 9, 2]), _pair([5], [4], [4, 4]), _pair([3, 3, 3], [1], [2])]


def test_pair_rows_share_one_width_chosen_then_rejected_and_mask_the_response_labels():
    rows = pair_rows(PAIRS[:2], pad_id=0)
    assert rows.input_ids.tolist() == [[5, 6, 7, 2, 0, 0], [5, 4, 0, 0, 0, 0],  # chosen rows
                                       [5, 6, 8, 9, 9, 2], [5, 4, 4, 0, 0, 0]]  # rejected rows
    assert rows.labels.tolist() == [[6, 7, 2, 0, 0, 0], [4, 0, 0, 0, 0, 0], [6, 8, 9, 9, 2, 0], [4, 4, 0, 0, 0, 0]]
    assert rows.lengths.tolist() == [4, 2, 6, 3]
    # label t is token t + 1: masked in where that token is a response token
    assert rows.positional["label_mask"].tolist() == [[0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0],
                                                      [0, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]


def test_pair_groups_put_each_micro_batch_chosen_rows_before_its_rejected_rows():
    assert pair_groups(3, 2) == [[0, 1, 3, 4], [2, 5]]
    assert pair_groups(3, 1) == [[0, 3], [1, 4], [2, 5]]
    assert chunks(5, 2) == [[0, 1], [2, 3], [4]]


def _hand_padded(seqs, masks, pad_id):
    """One micro-batch padded on its own (the construction every stream had before it moved here)."""
    s = max(len(x) for x in seqs) + 1
    ids = torch.full((len(seqs), s), pad_id, dtype=torch.long)
    resp = torch.zeros(len(seqs), s)
    for i, (x, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(x)] = torch.tensor(x)
        resp[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids[:, :-1], ids[:, 1:], resp[:, 1:]


@pytest.mark.parametrize("packed", [False, True])
def test_pair_micro_batches_equal_each_micro_batch_padded_on_its_own(packed):
    ref = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])  # [2m]: chosen rows, then rejected rows
    mbs = pair_micro_batches(PAIRS, micro_batch_size=2, pad_id=0, packed=packed, ref_seq_logp=ref)
    assert [mb.kind for mb in mbs] == ["pairs", "pairs"] and all(mb.packed == packed for mb in mbs)
    for mb, pairs, values in ((mbs[0], PAIRS[:2], [-1.0, -2.0, -4.0, -5.0]), (mbs[1], PAIRS[2:], [-3.0, -6.0])):
        seqs = [p.chosen_input_ids for p in pairs] + [p.rejected_input_ids for p in pairs]
        masks = [p.chosen_response_mask for p in pairs] + [p.rejected_response_mask for p in pairs]
        ids, labels, label_mask = _hand_padded(seqs, masks, 0)
        lengths = torch.tensor([len(x) for x in seqs])
        # packed: the rows' real tokens one after the other, 0 (the pad id) beyond each row once unpacked
        assert torch.equal(mb.unpack(mb.input_ids[..., None])[..., 0], ids)
        assert torch.equal(mb.unpack(mb.labels[..., None])[..., 0], labels)
        assert mb.input_ids.shape == ((1, int(lengths.sum())) if packed else tuple(ids.shape))
        assert mb.width == ids.shape[1]  # cut to its own longest row
        assert torch.equal(mb["label_mask"], label_mask)
        assert torch.equal(mb.lengths, lengths)
        assert mb["ref_seq_logp"].tolist() == values


def test_collate_cuts_positional_rows_and_clamps_the_response_index_but_keeps_per_row_tensors():
    ids = torch.arange(1, 13).reshape(3, 4)  # [3, 4]
    rows = TokenRows(input_ids=ids, lengths=torch.tensor([2, 4, 1]), response_index=torch.tensor([[1, 3]] * 3),
                     positional={"pool_mask": torch.ones(3, 4)}, per_row={"ref_pooled": torch.eye(3, 4)})
    first, second = collate("rollout", rows, [[2, 0], [1]])
    assert first.input_ids.tolist() == [[9, 10], [1, 2]]  # the group's order, cut to its longest row (2)
    assert torch.equal(first.labels, torch.zeros(2, 2, dtype=torch.long))  # no labels: zeros
    assert first["response_index"].tolist() == [[1, 1], [1, 1]]
    assert first["pool_mask"].shape == (2, 2)
    assert first["ref_pooled"].tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]  # [n, h]: never cut, even where h == s
    assert second.input_ids.tolist() == [[5, 6, 7, 8]] and second["response_index"].tolist() == [[1, 3]]
    whole, = collate("rows", rows, [[2, 0]], cut=False)
    assert whole.input_ids.shape == (2, 4) and whole["pool_mask"].shape == (2, 4)


def test_collate_packed_is_from_padded_packed():
    ids = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]])
    rows = TokenRows(input_ids=ids, labels=ids.roll(-1, 1), lengths=torch.tensor([3, 2]))
    mb, = collate("rows", rows, [[0, 1]], packed=True)
    ref = MicroBatch.from_padded("rows", ids[:, :3], ids.roll(-1, 1)[:, :3], torch.tensor([3, 2]), packed=True)
    assert torch.equal(mb.input_ids, ref.input_ids) and torch.equal(mb.labels, ref.labels)
    assert mb.input_ids.tolist() == [[3, 4, 5, 6, 7]] and mb.row_width == 3


def test_row_groups_by_size_or_token_budget():
    assert row_groups(5, micro_batch_size=2) == [[0, 1], [2, 3], [4]]
    assert row_groups(5, micro_batch_size=2, lengths=[10, 3, 9, 2, 3], token_budget=None) == [[0, 1], [2, 3], [4]]
    # the budget counts padded tokens: longest first, [10, 9] pads to 20; packed it counts real ones
    assert row_groups(5, micro_batch_size=2, lengths=[10, 3, 9, 2, 3], token_budget=20) == [[0, 2], [1, 3, 4]]
    assert row_groups(4, micro_batch_size=1, lengths=[5, 5, 5, 5], token_budget=10, packed=True) == [[0, 1], [2, 3]]
    assert row_groups(4, micro_batch_size=1, lengths=[5, 5, 5, 5], token_budget=10) == [[0, 1], [2, 3]]
    assert row_groups(3, micro_batch_size=1, lengths=[5, 4, 4], token_budget=9, packed=True) == [[0, 1], [2]]
    assert row_groups(3, micro_batch_size=1, lengths=[5, 4, 4], token_budget=9) == [[0], [1, 2]]


def _random_pairs(rng, m, low, high):
    return [_pair([1] * rng.randint(1, low), [2] * rng.randint(1, high), [3] * rng.randint(1, high)) for _ in range(m)]


@pytest.mark.parametrize("seed", range(40))
def test_pair_budget_groups_are_ceil_of_the_pair_tokens_over_the_budget(seed):
    """Packed: every micro-batch within the budget, a pair's two rows in one micro-batch, and as many
    micro-batches as ceil(pair tokens / budget) wherever C / ceil(C / B) + u <= B (u: the longest pair); never
    more than ceil(C / (B - u)) (the bound of the balanced split, budget_groups's docstring)."""
    rng = random.Random(seed)
    m = rng.randint(1, 80)
    pairs = _random_pairs(rng, m, 30, 120)
    tokens = [len(p.chosen_input_ids) + len(p.rejected_input_ids) for p in pairs]
    total, longest = sum(tokens), max(tokens)
    budget = rng.randint(longest + 1, max(longest + 2, total + 50))
    groups = pair_budget_groups(pairs, budget, packed=True)
    # each group is the chosen rows of its pairs, then their rejected rows; every row exactly once
    assert sorted(r for g in groups for r in g) == list(range(2 * m))
    for g in groups:
        half = len(g) // 2
        assert [r - m for r in g[half:]] == g[:half] and all(r < m for r in g[:half])
        assert sum(tokens[i] for i in g[:half]) <= budget
    fewest = math.ceil(total / budget)
    assert fewest <= len(groups) <= math.ceil(total / (budget - longest))
    if total / fewest + longest <= budget:
        assert len(groups) == fewest


def test_budget_groups_by_hand():
    # packed: 30 tokens over a budget of 10 -> 3 groups of 10
    assert budget_groups([6, 4, 5, 5, 3, 7], 10, packed=True) == [[0, 1], [2, 3], [4, 5]]
    # at least min_count groups (the update's mini-batches), at most one unit a group
    assert len(budget_groups([1, 1, 1], 100, packed=True, min_count=2)) == 2
    assert budget_groups([1, 1], 100, packed=True, min_count=5) == [[0], [1]]
    # a unit over the budget gets a group of its own
    assert budget_groups([30, 2, 2], 10, packed=True) == [[0], [1], [2]]
    # padded: a group costs rows x its widest unit: pairs of widths 4, 4, 1 (2 rows each) within 16
    assert budget_groups([8, 8, 2], 16, widths=[4, 4, 1], rows_per_unit=2) == [[0, 2], [1]]
    assert budget_groups([], 10) == []
    with pytest.raises(ValueError, match="token_budget"):
        budget_groups([1], 0)


@pytest.mark.parametrize("packed", [False, True])
def test_pair_micro_batches_by_token_budget_keep_pairs_whole_and_their_reference_log_probs(packed):
    ref = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])  # [2m]: chosen rows, then rejected rows
    # pair tokens 6 + 2 + 4 | 2 + 3 | 4 + 4: 25 real tokens; a budget of 13 takes two micro-batches packed
    mbs = pair_micro_batches(PAIRS, micro_batch_size=1, pad_id=0, packed=packed, token_budget=13, ref_seq_logp=ref)
    by_pair = {}
    for mb in mbs:
        half = mb.num_rows // 2
        assert mb.kind == "pairs" and mb.num_rows % 2 == 0
        assert (mb.tokens if packed else mb.computed_tokens) <= 13
        for c, r in zip(mb["ref_seq_logp"][:half].tolist(), mb["ref_seq_logp"][half:].tolist()):
            by_pair[c] = r
    assert by_pair == {-1.0: -4.0, -2.0: -5.0, -3.0: -6.0}  # every pair once, its chosen and rejected together
    assert len(mbs) == (2 if packed else 3)
