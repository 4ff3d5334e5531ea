"""The coverage trust (``hpa.algorithms.coverage``) on hand-made embeddings."""

import math

import pytest
import torch

from hpa.algorithms.coverage import (KL_BOOST_FLOOR, KL_BOOST_RATE, EmbeddingCache, abstention_kl_weights,
                                     adapt_kl_boost, bank_center, calibrate, coverage_trust, far_kl_sums, far_rows,
                                     knn_distance, trust_stats, unique_rows)


def _unit(*rows):
    return torch.nn.functional.normalize(torch.tensor(rows, dtype=torch.float32), dim=1)


def test_knn_distance_is_the_mean_cosine_distance_to_the_k_nearest():
    bank = torch.tensor([[1.0, 0.0, 0.0], [2.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    # a bank row's own direction is at distance 0 whatever its length; k=2 averages the two nearest
    d = knn_distance(torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, -5.0]]), bank, k=2)
    torch.testing.assert_close(d, torch.tensor([0.0, 1.0]), atol=1e-6, rtol=0)
    d3 = knn_distance(torch.tensor([[1.0, 0.0, 0.0]]), bank, k=3)
    torch.testing.assert_close(d3, torch.tensor([(1 - 1 / math.sqrt(2)) / 3]), atol=1e-6, rtol=0)
    # k beyond the bank averages the whole bank
    torch.testing.assert_close(knn_distance(torch.tensor([[0.0, 0.0, 1.0]]), bank[:1], k=5), torch.tensor([1.0]))


def test_knn_distance_chunking_equals_one_pass_and_a_brute_force_reference():
    g = torch.Generator().manual_seed(0)
    q, bank = torch.randn(9, 16, generator=g), torch.randn(101, 16, generator=g)
    ref = 1 - (_unit(*q.tolist()) @ _unit(*bank.tolist()).T).topk(5, dim=1).values.mean(dim=1)
    for chunk in (1, 7, 50, 101, 4096):
        torch.testing.assert_close(knn_distance(q, bank, 5, chunk_size=chunk), ref, atol=1e-6, rtol=0)


def test_knn_distance_errors():
    with pytest.raises(ValueError, match="share h"):
        knn_distance(torch.zeros(2, 3), torch.zeros(4, 2), 1)
    with pytest.raises(ValueError, match="bank is empty"):
        knn_distance(torch.zeros(2, 3), torch.zeros(0, 3), 1)
    with pytest.raises(ValueError, match="k and chunk_size"):
        knn_distance(torch.zeros(2, 3), torch.ones(4, 3), 0)


def test_calibrated_trust_is_full_near_the_data_and_none_far_from_it():
    """Bank around the x axis, held-out pairs from the same cone; a query along the bank keeps trust 1, one
    orthogonal to it gets 0, one in between a value on the ramp."""
    g = torch.Generator().manual_seed(1)
    direction = torch.tensor([1.0, 0.0, 0.0, 0.0])
    bank = direction + 0.1 * torch.randn(200, 4, generator=g)
    heldout = direction + 0.1 * torch.randn(50, 4, generator=g)
    held = knn_distance(heldout, bank, 5)
    low, high = calibrate(held, low_quantile=0.5, high_quantile=0.95, margin=1.5)
    ordered = held.double().sort().values
    assert low == pytest.approx(float(ordered[24] + ordered[25]) / 2, rel=1e-9)  # 50 pairs: the middle two
    assert high == pytest.approx(1.5 * float(torch.quantile(held.double(), 0.95)), rel=1e-9)
    near, far = direction[None], torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    trust = coverage_trust(knn_distance(torch.cat([near, far]), bank, 5), low, high)
    assert trust.tolist() == [1.0, 0.0]
    # the held-out pairs themselves: at least half fully trusted, at most the 5 % beyond the p95 at 0
    held_trust = coverage_trust(held, low, high)
    assert (held_trust == 1).float().mean() >= 0.5 and (held_trust == 0).float().mean() <= 0.05
    # the ramp is linear between low and high
    mid = coverage_trust(torch.tensor([low + 0.25 * (high - low)]), low, high)
    torch.testing.assert_close(mid, torch.tensor([0.75]), atol=1e-5, rtol=0)


def test_calibrate_errors_and_degenerate_distances():
    with pytest.raises(ValueError, match="held-out pairs"):
        calibrate(torch.zeros(0))
    with pytest.raises(ValueError, match="low_quantile < high_quantile"):
        calibrate(torch.ones(3), low_quantile=0.9, high_quantile=0.5)
    with pytest.raises(ValueError, match="margin >= 1"):
        calibrate(torch.ones(3), margin=0.5)
    low, high = calibrate(torch.zeros(4))  # every held-out pair in the bank
    assert low == 0.0 and high > low
    with pytest.raises(ValueError, match="high > low"):
        coverage_trust(torch.zeros(2), 1.0, 1.0)


def test_trust_stats_over_the_valid_rows():
    """Mean, p10, p90 (torch.quantile's linear interpolation) and far share of the valid rows only; an
    invalid row's trust, far or not, changes nothing; no valid row: NaN."""
    trust = torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.7])
    valid = torch.tensor([True] * 5 + [False, False])
    mean, p10, p90, far = trust_stats(trust, valid, trust <= 0).tolist()
    kept = trust[:5].double()
    assert mean == pytest.approx(0.5) and far == pytest.approx(0.4)
    assert p10 == float(torch.quantile(kept, 0.1)) == 0.0 and p90 == float(torch.quantile(kept, 0.9)) == 1.0
    t = torch.tensor([0.2, 0.4, 0.9, 0.0])
    _, p10, p90, _ = trust_stats(t, torch.tensor([True, True, True, False]), t <= 0).tolist()
    assert p10 == pytest.approx(0.24) and p90 == pytest.approx(0.8)
    assert all(math.isnan(v) for v in trust_stats(trust, torch.zeros(7, dtype=torch.bool), trust <= 0).tolist())


def test_centering_on_the_bank_spreads_distances_a_common_direction_hides():
    """Pooled states share one large common direction: raw, a query off the bank's two clusters is only
    ~1e-3 away in cosine; centred on the bank's mean it is ~1 away, while a query in a cluster stays near.
    Centering equals subtracting the mean by hand."""
    g = torch.Generator().manual_seed(2)
    e = torch.eye(8)
    common = 50.0 * e[0]
    bank = common + torch.cat([e[1].expand(150, 8), e[2].expand(150, 8)]) + 0.05 * torch.randn(300, 8, generator=g)
    queries = torch.stack([common + e[1], common + e[3]])  # in the first cluster; off both
    raw = knn_distance(queries, bank, 5)
    assert raw[1] < 2e-3  # hidden by the common direction
    c = bank_center(bank)
    torch.testing.assert_close(c, bank.mean(dim=0))
    centred = knn_distance(queries, bank, 5, center=c)
    torch.testing.assert_close(centred, knn_distance(queries - c, bank - c, 5), atol=1e-6, rtol=0)
    assert centred[0] < 0.05 and centred[1] > 0.7


def test_unique_rows_keeps_first_seen_order_and_maps_every_row_back():
    rows = [[3, 4], [1], [3, 4], [], [1], [3, 5]]
    distinct, where = unique_rows(rows)
    assert distinct == [[3, 4], [1], [], [3, 5]]
    assert where.tolist() == [0, 1, 0, 2, 1, 3]
    assert [distinct[i] for i in where.tolist()] == rows


def test_abstention_kl_weights_grow_where_trust_falls():
    trust = torch.tensor([1.0, 0.5, 0.0, 1.5, -0.5])
    assert abstention_kl_weights(trust, 4.0, shape="linear").tolist() == [1.0, 3.0, 5.0, 1.0, 5.0]  # clamped to [0, 1] first
    assert abstention_kl_weights(trust, 0.0, shape="linear").tolist() == [1.0] * 5
    with pytest.raises(ValueError, match="boost"):
        abstention_kl_weights(trust, -1.0, shape="linear")


def test_far_shape_holds_only_rows_without_support():
    trust = torch.tensor([1.0, 0.9, 0.5, 0.0, -0.2])
    assert abstention_kl_weights(trust, 100.0, shape="far").tolist() == [1.0, 1.0, 1.0, 101.0, 101.0]
    judged = torch.tensor([False, False, False, True, False])
    assert abstention_kl_weights(trust, 100.0, judged=judged, shape="far").tolist() == [1.0, 1.0, 1.0, 1.0, 101.0]
    with pytest.raises(ValueError, match="shape"):
        abstention_kl_weights(trust, 100.0, shape="square")


def test_abstention_kl_weights_leave_rows_a_rule_judges_alone():
    """A far row whose prompt a rule reward judges (it has a ground truth) has a reward that says what to do
    there: its KL keeps weight 1, as a covered row's; the far rows no reward judges get 1 + boost."""
    trust = torch.tensor([0.0, 0.0, 0.5, 1.0])
    judged = torch.tensor([True, False, True, False])
    assert abstention_kl_weights(trust, 4.0, judged=judged, shape="linear").tolist() == [1.0, 5.0, 1.0, 1.0]
    assert abstention_kl_weights(trust, 4.0, judged=None, shape="linear").tolist() == [5.0, 5.0, 3.0, 1.0]


def test_far_kl_sums_are_the_k3_estimate_over_the_far_rows_sampled_tokens():
    """k3 per token is exp(d) - d - 1 with d = ref - old: by hand for d = ln 2 (2 - ln 2 - 1) and d = 0 (0);
    a covered row, a rule-judged far row and masked tokens count nothing."""
    ln2 = math.log(2.0)
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = old + torch.tensor([[ln2, 0.0, 5.0], [ln2, ln2, ln2], [ln2, ln2, ln2], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    trust, judged = torch.tensor([0.0, 0.5, 0.0, 0.0]), torch.tensor([False, False, True, False])
    far = far_rows(trust, judged)
    assert far.tolist() == [True, False, False, True]
    sums = far_kl_sums(old, ref, mask, far)
    assert sums.dtype == torch.float64
    # row 0: tokens 0 (ln 2) and 1 (0), token 2 masked; row 3: three tokens at d = 0
    torch.testing.assert_close(sums, torch.tensor([1.0 - ln2, 5.0], dtype=torch.float64))


def test_adapt_kl_boost_grows_past_the_target_shrinks_below_it_and_stays_in_its_bounds():
    up, down = math.exp(KL_BOOST_RATE), math.exp(-KL_BOOST_RATE)
    assert adapt_kl_boost(100.0, 0.02, 0.02, ceiling=1000.0) == 100.0  # at the target: unchanged
    assert adapt_kl_boost(100.0, 0.06, 0.02, ceiling=1000.0) == pytest.approx(100.0 * up)  # error clipped at +1
    assert adapt_kl_boost(100.0, 0.03, 0.02, ceiling=1000.0) == pytest.approx(100.0 * math.exp(0.5 * KL_BOOST_RATE))
    assert adapt_kl_boost(100.0, 0.0, 0.02, ceiling=1000.0) == pytest.approx(100.0 * down)
    assert adapt_kl_boost(100.0, float("nan"), 0.02, ceiling=1000.0) == 100.0  # no far row this step
    assert adapt_kl_boost(999.0, 1.0, 0.02, ceiling=1000.0) == 1000.0
    assert adapt_kl_boost(KL_BOOST_FLOOR, 0.0, 0.02, ceiling=1000.0) == KL_BOOST_FLOOR
    assert adapt_kl_boost(0.0, 1.0, 0.02, ceiling=1000.0) == pytest.approx(KL_BOOST_FLOOR * up)  # can grow again
    # released from 100 to the floor in ln(1e4) / 0.2 = 47 steps of no drift, and back in as many of drift
    b = 100.0
    for step in range(1, 48):
        b = adapt_kl_boost(b, 0.0, 0.02, ceiling=1000.0)
        assert (b == KL_BOOST_FLOOR) == (step == 47)
    for _ in range(47):
        b = adapt_kl_boost(b, 0.1, 0.02, ceiling=1000.0)
    assert b > 100.0
    with pytest.raises(ValueError, match="target"):
        adapt_kl_boost(100.0, 0.01, 0.0, ceiling=1000.0)


def test_embedding_cache_computes_each_sequence_once_and_keeps_at_most_its_limit():
    calls = []

    def embed(rows):  # [n, 2]: (length, first token)
        calls.append(rows)
        return torch.tensor([[float(len(r)), float(r[0])] for r in rows])

    cache = EmbeddingCache(limit=2)
    out = cache.embed([[1], [2, 2], [1]], embed)
    assert out.tolist() == [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]] and calls == [[[1], [2, 2]]]
    out = cache.embed([[2, 2], [3, 3, 3], [1]], embed)  # only [3, 3, 3] is new; the cache is full
    assert out.tolist() == [[2.0, 2.0], [3.0, 3.0], [1.0, 1.0]] and calls[1:] == [[[3, 3, 3]]]
    assert len(cache) == 2
    cache.embed([[3, 3, 3]], embed)  # not kept: computed again
    assert calls[2:] == [[[3, 3, 3]]]
