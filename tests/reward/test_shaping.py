import io
import math
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hpa.reward.shaping import (BaseRewardOutput, CombinedReward, EmbeddingBank, RewardInputs,
                                RunningNormalizer, UncertaintyAwareReward, copy_penalty, diversity,
                                ensemble_mean_std, ngram_copy_rate, overlong_penalty,
                                place_at_last_token, target_length_penalty)

METRIC_KEYS = {"reward/raw_mean", "reward/sigma_mean", "reward/diversity_mean", "reward/length_penalty_mean",
               "reward/copy_rate", "reward/shaped_mean", "reward/shaped_std", "reward/nonfinite_count",
               "reward/learned_mean"}


class FakeBase:
    """A stand-in for the reward model: fixed [b, K] rewards and [b, h] embeddings."""

    def __init__(self, rewards, embeddings=None):
        self.rewards, self.embeddings = rewards, embeddings

    def __call__(self, inputs):
        return BaseRewardOutput(rewards=self.rewards, embeddings=self.embeddings)


def off(**kw):
    """A shaper with every term off, then the given ones on."""
    args = dict(alpha=0.0, beta=0.0, copy_coef=0.0)
    args.update(kw)
    return UncertaintyAwareReward(**args)


# -- single terms ------------------------------------------------------------------------------------

def test_place_at_last_token_right_left_and_empty_rows():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [0, 1, 1]])
    out = place_at_last_token(scores, mask)
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0], [0.0, 0.0, 4.0]]))


def test_sigma_k1_is_zero_and_k3_is_population_std():
    mean, std = ensemble_mean_std(torch.tensor([[2.0], [-3.0]]))
    assert torch.equal(mean, torch.tensor([2.0, -3.0])) and torch.equal(std, torch.zeros(2))
    mean, std = ensemble_mean_std(torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0]]))
    assert torch.allclose(mean, torch.tensor([2.0, 4.0]))
    assert torch.allclose(std, torch.tensor([math.sqrt(2.0 / 3.0), 0.0]))


def test_sigma_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"\[b, K\]"):
        ensemble_mean_std(torch.ones(3))


def test_overlong_penalty_matches_verl_dapo():
    lengths = torch.tensor([5, 6, 8, 10])
    pen = overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=1.0)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, 0.5, 1.0]))
    # verl: reward += min(-(len - (max_len - L)) / L * factor, 0)
    verl = [min(-(n - (10 - 4)) / 4 * 2.0, 0) for n in lengths.tolist()]
    assert torch.allclose(-overlong_penalty(lengths, 10, 4, 2.0), torch.tensor(verl))


def test_target_length_penalty_modes():
    lengths = torch.tensor([3, 5, 8])
    assert torch.allclose(target_length_penalty(lengths, 5, 0.1, "two_sided"), torch.tensor([0.2, 0.0, 0.3]))
    assert torch.allclose(target_length_penalty(lengths, 5, 0.1, "above"), torch.tensor([0.0, 0.0, 0.3]))


def test_copy_rate_hand_case_and_padding():
    # response bigrams (1,2) (2,3) (3,9): two of three occur in the left-padded prompt
    resp = torch.tensor([[1, 2, 3, 9, 0, 0], [1, 2, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0]])
    resp_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    prompt = torch.tensor([[0, 0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 2, 0], [0, 0, 0, 0, 0, 0, 7]])
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1]])
    rate = ngram_copy_rate(resp, resp_mask, prompt, prompt_mask, n=2)
    # row 1: (1,2) is not in the prompt; (2,0) would be, if padding were counted. row 2: shorter than n.
    assert torch.allclose(rate, torch.tensor([2 / 3, 0.0, 0.0]))


def test_copy_penalty_modes():
    rate = torch.tensor([2 / 3, 0.5, 0.1])
    assert torch.allclose(copy_penalty(rate, 0.5, 2.0, "linear"), torch.tensor([1 / 3, 0.0, 0.0]))
    assert torch.allclose(copy_penalty(rate, 0.5, 2.0, "step"), torch.tensor([2.0, 0.0, 0.0]))


def test_diversity_hand_values_and_empty_bank():
    bank = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    emb = torch.tensor([[1.0, 0.0], [1.0, 1.0], [-3.0, -3.0]])
    expected = torch.tensor([0.5, 1 - math.sqrt(0.5), 1 + math.sqrt(0.5)])
    assert torch.allclose(diversity(emb, bank), expected, atol=1e-6)
    assert torch.equal(diversity(emb, torch.zeros(0, 2)), torch.zeros(3))


# -- bank --------------------------------------------------------------------------------------------

def test_bank_is_fifo_ring_buffer():
    bank = EmbeddingBank(3)
    assert len(bank) == 0 and bank.entries().shape[0] == 0
    bank.update(torch.tensor([[1.0], [2.0]]))
    assert bank.entries().flatten().tolist() == [1.0, 2.0]
    bank.update(torch.tensor([[3.0], [4.0]]))
    assert bank.entries().flatten().tolist() == [2.0, 3.0, 4.0]
    bank.update(torch.tensor([[5.0], [6.0], [7.0], [8.0]]))
    assert bank.entries().flatten().tolist() == [6.0, 7.0, 8.0]
    bank.update(torch.tensor([[9.0], [float("nan")], [10.0]]), torch.tensor([True, True, False]))
    assert bank.entries().flatten().tolist() == [7.0, 8.0, 9.0]


def test_bank_state_round_trip_is_exact():
    bank = EmbeddingBank(5)
    bank.update(torch.randn(7, 4))
    buf = io.BytesIO()
    torch.save(bank.state_dict(), buf)
    buf.seek(0)
    restored = EmbeddingBank(5)
    restored.load_state_dict(torch.load(buf))
    assert torch.equal(restored.entries(), bank.entries())
    more = torch.randn(3, 4)
    bank.update(more)
    restored.update(more)
    assert torch.equal(restored.entries(), bank.entries())
    with pytest.raises(ValueError, match="diversity_bank_size"):
        EmbeddingBank(6).load_state_dict(bank.state_dict())


def test_two_ranks_fed_same_gathered_embeddings_hold_identical_banks():
    banks = [EmbeddingBank(4), EmbeddingBank(4)]
    torch.manual_seed(0)
    for _ in range(3):
        per_rank = [torch.randn(2, 3), torch.randn(2, 3)]
        gathered = torch.cat(per_rank)  # what all_gather over DP returns on every rank
        for bank in banks:
            bank.update(gathered)
    assert torch.equal(banks[0].entries(), banks[1].entries())


class ThreadGather:
    """all_gather over "ranks" that are threads: concatenate every rank's tensor in rank order."""

    def __init__(self, world):
        self.slots = [None] * world
        self.barrier = threading.Barrier(world)

    def for_rank(self, rank):
        def all_gather(x):
            self.slots[rank] = x
            self.barrier.wait()
            out = torch.cat(self.slots)
            self.barrier.wait()
            return out
        return all_gather


def test_two_dp_ranks_through_call_keep_identical_state():
    torch.manual_seed(0)
    world, b = 2, 3
    gather = ThreadGather(world)
    shapers = [UncertaintyAwareReward(FakeBase(torch.randn(b, 3), torch.randn(b, 8)), copy_coef=0.0,
                                      diversity_bank_size=4, normalize=True) for _ in range(world)]
    inputs = RewardInputs(response_ids=torch.ones(b, 5, dtype=torch.long), response_mask=torch.ones(b, 5))
    outs = [None] * world

    def run(rank):
        for _ in range(3):
            outs[rank] = shapers[rank](inputs, all_gather=gather.for_rank(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    s0, s1 = (s.state_dict() for s in shapers)
    assert torch.equal(s0["bank"]["buffer"], s1["bank"]["buffer"]) and s0["normalizer"] == s1["normalizer"]
    assert s0["normalizer"]["count"] == 3 * world * b
    # DP=2 equals DP=1 on the concatenated batch (same bank, same statistics, same rewards)
    one = UncertaintyAwareReward(FakeBase(torch.cat([s.base.rewards for s in shapers]),
                                          torch.cat([s.base.embeddings for s in shapers])),
                                 copy_coef=0.0, diversity_bank_size=4, normalize=True)
    both = RewardInputs(response_ids=torch.ones(world * b, 5, dtype=torch.long),
                        response_mask=torch.ones(world * b, 5))
    for _ in range(3):
        out = one(both)
    assert torch.allclose(out.rewards, torch.cat([o.rewards for o in outs]), atol=1e-6)
    assert torch.allclose(one.bank.entries(), shapers[0].bank.entries())


# -- normaliser --------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(-100, 100, allow_nan=False), min_size=0, max_size=6), min_size=1, max_size=6))
def test_welford_chunks_equal_one_pass(chunks):
    norm = RunningNormalizer()
    for chunk in chunks:
        norm.update(torch.tensor(chunk, dtype=torch.float64))
    values = torch.tensor([v for c in chunks for v in c], dtype=torch.float64)
    assert norm.count == values.numel()
    if values.numel():
        assert math.isclose(norm.mean, values.mean().item(), abs_tol=1e-9)
        assert math.isclose(norm.var, values.var(correction=0).item(), rel_tol=1e-7, abs_tol=1e-7)


def test_normalizer_ignores_invalid_and_round_trips():
    norm = RunningNormalizer()
    assert torch.equal(norm.normalize(torch.tensor([3.0])), torch.tensor([3.0]))  # identity before data
    norm.update(torch.tensor([1.0, 3.0, float("nan"), 100.0]), torch.tensor([True, True, True, False]))
    assert norm.count == 2 and norm.mean == 2.0 and norm.var == 1.0
    assert torch.allclose(norm.normalize(torch.tensor([4.0])), torch.tensor([2.0]))
    restored = RunningNormalizer()
    restored.load_state_dict(norm.state_dict())
    assert restored.state_dict() == norm.state_dict()


# -- the wrapper -------------------------------------------------------------------------------------

def test_formula_end_to_end_on_small_batch():
    shaper = UncertaintyAwareReward(alpha=0.5, beta=0.2, diversity_bank_size=8, overlong_buffer_len=2,
                                    max_response_length=4, overlong_penalty_factor=1.0, target_length=3,
                                    target_length_coef=0.1, copy_ngram=2, copy_threshold=0.5, copy_coef=1.0)
    shaper.bank.update(torch.tensor([[1.0, 0.0]]))
    raw = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    emb = torch.tensor([[2.0, 0.0], [0.0, 5.0]])  # diversity 0 and 1
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # lengths 4 and 2
    resp = torch.tensor([[5, 6, 7, 8], [1, 2, 0, 0]])
    prompt = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    out = shaper.finalize(shaper.shape(raw, mask, embeddings=emb, response_ids=resp, prompt_ids=prompt,
                                       prompt_mask=torch.ones_like(prompt)))
    sigma0 = math.sqrt(2 / 3)
    # r̂ − α·σ + β·div − (overlong + target) − copy
    r0 = 2.0 - 0.5 * sigma0 + 0.2 * 0.0 - (1.0 + 0.1) - 1.0 * (1.0 - 0.5)
    r1 = 0.0 - 0.0 + 0.2 * 1.0 - (0.0 + 0.1) - 0.0
    assert torch.allclose(out.rewards, torch.tensor([r0, r1]), atol=1e-6)
    assert torch.allclose(out.token_level_scores, torch.tensor([[0, 0, 0, r0], [0, r1, 0, 0]]), atol=1e-6)
    assert out.valid.tolist() == [True, True]
    m = out.metrics
    assert set(m) == METRIC_KEYS
    assert m["reward/raw_mean"] == pytest.approx(1.0)
    assert m["reward/learned_mean"] == pytest.approx(1.0)  # no rule part: all of r̂ is learned
    assert m["reward/sigma_mean"] == pytest.approx(sigma0 / 2)
    assert m["reward/diversity_mean"] == pytest.approx(0.5)
    assert m["reward/length_penalty_mean"] == pytest.approx((1.1 + 0.1) / 2)
    assert m["reward/copy_rate"] == pytest.approx(0.5)
    assert m["reward/shaped_mean"] == pytest.approx((r0 + r1) / 2, abs=1e-6)
    assert m["reward/shaped_std"] == pytest.approx(abs(r0 - r1) / 2, abs=1e-6)
    assert m["reward/nonfinite_count"] == 0.0
    assert len(shaper.bank) == 1  # shape() reads the bank only


def test_every_term_switches_off():
    raw = torch.tensor([[1.0, 3.0]])
    out = off().finalize(off().shape(raw, torch.ones(1, 3)))
    assert out.rewards.tolist() == [2.0]
    assert set(out.metrics) == METRIC_KEYS


def test_call_scores_against_bank_before_adding_batch():
    emb = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    shaper = UncertaintyAwareReward(FakeBase(torch.zeros(2, 1), emb), alpha=0.0, beta=1.0, copy_coef=0.0)
    inputs = RewardInputs(response_ids=torch.ones(2, 2, dtype=torch.long), response_mask=torch.ones(2, 2))
    first = shaper(inputs)
    assert first.rewards.tolist() == [0.0, 0.0]  # empty bank: diversity 0, not the batch against itself
    assert len(shaper.bank) == 2
    second = shaper(inputs)
    assert torch.allclose(second.diversity, torch.zeros(2))  # identical to what is in the bank


def test_policy_embeddings_source():
    shaper = UncertaintyAwareReward(FakeBase(torch.zeros(1, 1), torch.tensor([[1.0, 0.0]])),
                                    diversity_source="policy", copy_coef=0.0)
    shaper.bank.update(torch.tensor([[0.0, 1.0]]))
    inputs = RewardInputs(response_ids=torch.ones(1, 2, dtype=torch.long), response_mask=torch.ones(1, 2))
    out = shaper(inputs, policy_embeddings=torch.tensor([[0.0, 1.0]]))
    assert out.diversity.tolist() == [0.0]
    with pytest.raises(ValueError, match="diversity_source"):
        shaper(inputs)  # policy embeddings are required


def test_nonfinite_samples_are_invalid_zeroed_counted_and_kept_out_of_state():
    raw = torch.tensor([[float("nan"), 1.0], [1.0, 2.0], [float("inf"), float("inf")], [1.0, 1.0]])
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [float("nan"), 0.0]])
    shaper = UncertaintyAwareReward(FakeBase(raw, emb), copy_coef=0.0, normalize=True, diversity_bank_size=8)
    inputs = RewardInputs(response_ids=torch.ones(4, 2, dtype=torch.long), response_mask=torch.ones(4, 2))
    out = shaper(inputs)
    assert out.valid.tolist() == [False, True, False, False]
    assert out.rewards[~out.valid].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(out.rewards).all() and torch.isfinite(out.token_level_scores).all()
    assert out.metrics["reward/nonfinite_count"] == 3.0
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert len(shaper.bank) == 1 and shaper.normalizer.count == 1


def test_normalize_and_clip():
    raw = torch.tensor([[0.0], [10.0]])
    shaper = UncertaintyAwareReward(FakeBase(raw), alpha=0.0, beta=0.0, copy_coef=0.0, normalize=True, clip=0.5)
    inputs = RewardInputs(response_ids=torch.ones(2, 2, dtype=torch.long), response_mask=torch.ones(2, 2))
    out = shaper(inputs)  # mean 5, std 5 -> [-1, 1] -> clipped
    assert torch.allclose(out.rewards, torch.tensor([-0.5, 0.5]))
    assert torch.allclose(out.token_level_scores[:, -1], out.rewards)


def test_missing_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="beta: 0"):
        UncertaintyAwareReward(copy_coef=0.0).shape(torch.zeros(1, 1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="copy_coef: 0"):
        UncertaintyAwareReward(beta=0.0).shape(torch.zeros(1, 1), torch.ones(1, 2))


def test_shaper_state_round_trip():
    shaper = UncertaintyAwareReward(FakeBase(torch.randn(3, 2), torch.randn(3, 4)), copy_coef=0.0, normalize=True)
    inputs = RewardInputs(response_ids=torch.ones(3, 2, dtype=torch.long), response_mask=torch.ones(3, 2))
    shaper(inputs)
    restored = UncertaintyAwareReward(shaper.base, copy_coef=0.0, normalize=True)
    restored.load_state_dict(shaper.state_dict())
    assert torch.equal(restored(inputs).rewards, shaper(inputs).rewards)


def test_combined_reward_rule_shifts_mean_not_sigma():
    model = FakeBase(torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 2))
    rule = FakeBase(torch.tensor([[10.0]]))
    out = CombinedReward([model, rule])(None)
    mean, std = ensemble_mean_std(out.rewards)
    assert mean.tolist() == [12.0] and std.item() == pytest.approx(math.sqrt(2 / 3))
    assert out.embeddings is model.embeddings
    with pytest.raises(ValueError, match="heads"):
        CombinedReward([model, FakeBase(torch.zeros(1, 2))])(None)
