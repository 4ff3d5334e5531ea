
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpa.data.sampler import DistributedBatchSampler, dp_share, evenly_spaced


def make(n=23, g=6, rank=0, dp=3, seed=7, shuffle=True):
    return DistributedBatchSampler(n, global_batch_size=g, dp_rank=rank, dp_size=dp, seed=seed, shuffle=shuffle)


def take(sampler, steps):
    return [sampler.next_batch() for _ in range(steps)]


def test_ranks_are_disjoint_equal_sized_and_cover_each_epoch():
    n, g, dp = 23, 6, 3
    samplers = [make(n, g, r, dp) for r in range(dp)]
    steps = samplers[0].steps_per_epoch
    assert steps == 3  # drop-last: 23 // 6
    for epoch in range(3):
        seen = []
        for _ in range(steps):
            batches = [s.next_batch() for s in samplers]
            assert all(len(b) == g // dp for b in batches)
            flat = [i for b in batches for i in b]
            assert len(set(flat)) == len(flat)  # disjoint across ranks within a step
            seen += flat
        assert len(set(seen)) == steps * g  # no index twice within an epoch
        assert set(seen) <= set(range(n))


def test_shuffle_differs_by_epoch_and_seed_and_is_deterministic():
    a, b = make(seed=1), make(seed=1)
    assert take(a, 9) == take(b, 9)
    first_epoch = take(make(seed=1), 3)
    second_epoch = take(make(seed=1), 6)[3:]
    assert first_epoch != second_epoch
    assert take(make(seed=2), 3) != first_epoch


def test_no_shuffle_keeps_file_order():
    s = make(n=10, g=4, dp=2, rank=1, shuffle=False)
    assert take(s, 3) == [[2, 3], [6, 7], [2, 3]]  # epoch 2 starts after 2 steps; indices 8, 9 dropped


@settings(max_examples=40, deadline=None)
@given(n=st.integers(4, 40), dp=st.integers(1, 4), per_rank=st.integers(1, 3), split=st.integers(0, 30),
       after=st.integers(1, 15), seed=st.integers(0, 5))
def test_resume_equals_uninterrupted(n, dp, per_rank, split, after, seed):
    g = dp * per_rank
    if g > n:
        return
    for rank in range(dp):
        full = take(make(n, g, rank, dp, seed), split + after)
        first = make(n, g, rank, dp, seed)
        take(first, split)
        state = first.state_dict()
        resumed = make(n, g, rank, dp, seed)
        resumed.load_state_dict(dict(state))
        assert take(resumed, after) == full[split:]


def test_resume_under_a_different_dp_size_keeps_global_batches():
    old = [make(24, 6, r, 3) for r in range(3)]
    for s in old:
        take(s, 5)
    state = old[0].state_dict()
    new = [make(24, 6, r, 2) for r in range(2)]
    for s in new:
        s.load_state_dict(state)
    expected = [sum((s.next_batch() for s in old), []) for _ in range(4)]
    assert [sum((s.next_batch() for s in new), []) for _ in range(4)] == expected


def test_load_state_rejects_a_different_order():
    s = make(seed=1)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict(make(seed=2).state_dict())


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_samples=10, global_batch_size=5, dp_rank=0, dp_size=2, seed=0), "multiple of"),
    (dict(num_samples=3, global_batch_size=4, dp_rank=0, dp_size=2, seed=0), "fewer than one global batch"),
    (dict(num_samples=10, global_batch_size=4, dp_rank=2, dp_size=2, seed=0), "dp_rank"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedBatchSampler(**kwargs)


def test_evenly_spaced_keeps_a_short_list_and_spaces_a_long_one_in_order():
    assert evenly_spaced([3, 1, 2], 5) == [3, 1, 2]
    assert evenly_spaced(list(range(10)), 4) == [0, 2, 5, 7]
    assert evenly_spaced(list(range(10)), 0) == []


@pytest.mark.parametrize("n,dp", [(5, 2), (4, 2), (1, 3), (0, 2), (7, 3)])
def test_dp_share_covers_every_item_once_with_equal_work(n, dp):
    items = [f"x{i}" for i in range(n)]
    shares = [dp_share(items, r, dp) for r in range(dp)]
    assert len({len(mine) for mine, _ in shares}) == 1  # the same work on every rank
    real = sorted(x for mine, counted in shares for x in mine[:counted])
    assert real == sorted(items)  # every item counted once
    for mine, counted in shares:
        assert all(x == items[0] for x in mine[counted:])  # the pad: repeats of the first item
