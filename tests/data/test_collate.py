import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpa.data.collate import balanced_micro_batches, pad_left, pad_right, token_budget_micro_batches

PAD = 0


def test_pad_left_and_right_values_and_masks():
    ids, mask = pad_left([[5, 6, 7], [8]], PAD)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = pad_right([[5, 6, 7], [8]], PAD, pad_to_multiple_of=4)
    assert ids.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]] and mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert ids.dtype == torch.long
    with pytest.raises(ValueError, match="shorter"):
        pad_right([[1, 2, 3]], PAD, length=2)


def assert_partition(groups, n):
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(n))
    assert all(g == sorted(g) and g for g in groups)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40), budget=st.integers(1, 200))
def test_token_budget_respects_budget_and_covers_once(lengths, budget):
    groups = token_budget_micro_batches(lengths, budget)
    assert_partition(groups, len(lengths))
    for g in groups:
        padded = max(lengths[i] for i in g) * len(g)
        assert padded <= budget or len(g) == 1  # an over-long sequence goes alone


def test_token_budget_packs_similar_lengths():
    assert token_budget_micro_batches([10, 3, 9, 2, 3], 20) == [[0, 2], [1, 3, 4]]
    assert token_budget_micro_batches([30, 1], 20) == [[0], [1]]


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40), data=st.data())
def test_balanced_gives_exact_count_and_balance(lengths, data):
    k = data.draw(st.integers(1, len(lengths)))
    groups = balanced_micro_batches(lengths, k)
    assert len(groups) == k
    assert_partition(groups, len(lengths))
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert max(sums) - min(sums) <= max(lengths)


def test_balanced_rejects_more_groups_than_sequences():
    with pytest.raises(ValueError, match="empty micro-batch"):
        balanced_micro_batches([3, 4], 3)
