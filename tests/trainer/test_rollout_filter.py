"""The rollout filter of a step (``hpa.trainer.rollout_filter``): hand-made batches in one process (which
rows train, the counts, DAPO's refill), and under DP2 the step with a filter against the step on the
kept rows given directly (one rank keeping some rows, and one keeping none)."""

import dataclasses
import math
import types

import numpy as np
import pytest
import torch

from hpa.config.algorithm import RolloutFilterConfig
from hpa.rollout.base import RolloutBatch
from hpa.trainer import rollout_filter
from multirank import run_ranks

ONE_PROCESS = types.SimpleNamespace(dp_group=None, dp_rank=0, data_parallel_size=1)


def _batch(raw, shaped=None, valid=None, n=2, r=3):
    """Rows answering prompts 0, 0, 1, 1, ... (n each) with the given rewards; response lengths 1..r."""
    b = len(raw)
    lengths = torch.tensor([1 + i % r for i in range(b)])
    response_mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    valid = torch.ones(b, dtype=torch.bool) if valid is None else torch.tensor(valid)
    batch = RolloutBatch(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                         response_ids=torch.ones(b, r, dtype=torch.long), response_mask=response_mask,
                         log_probs=torch.zeros(b, r), finish_reasons=["stop"] * b,
                         group_ids=torch.arange(b) // n)
    batch.set("mask", response_mask * valid[:, None].float())
    batch.set("raw_rewards", torch.tensor(raw, dtype=torch.float32))
    batch.set("shaped_rewards", torch.tensor(raw if shaped is None else shaped, dtype=torch.float32))
    return batch


def _refill(*rounds):
    calls = []

    def generate_more(r):
        calls.append(r)
        return rounds[r - 1]

    return generate_more, calls


def test_reward_above_mean_std_masks_the_dropped_rows_and_reports():
    # shaped rewards 0, 1, 2, 3 and an invalid row: mean 1.5, unbiased std 1.291 -> threshold 2.791 (k = 1)
    batch = _batch([9.0] * 5, shaped=[0.0, 1.0, 2.0, 3.0, 0.0], valid=[True, True, True, True, False])
    out, m = rollout_filter.apply(batch, RolloutFilterConfig(name="reward_above_mean_std"), ONE_PROCESS, None)
    assert out is batch and (out.get("mask").sum(dim=1) > 0).tolist() == [False, False, False, True, False]
    torch.testing.assert_close(out.get("mask")[3], batch.response_mask[3])
    assert m["filter/kept_fraction"] == pytest.approx(1 / 5)
    assert m["filter/threshold"] == pytest.approx(1.5 + math.sqrt(5 / 3))
    assert m["filter/kept_reward"] == pytest.approx(3.0)
    assert m["filter/dropped_reward"] == pytest.approx(1.0)  # the valid rows 0, 1, 2
    assert "filter/refill_rounds" not in m


def test_none_keeps_the_valid_rows():
    batch = _batch([1.0, 0.0, 1.0, 1.0], valid=[True, False, True, True])
    out, m = rollout_filter.apply(batch, RolloutFilterConfig(), ONE_PROCESS, None)
    assert m["filter/kept_fraction"] == pytest.approx(3 / 4) and m["filter/kept_reward"] == pytest.approx(1.0)
    # nothing valid was dropped: no dropped_reward (a metric is logged only where it is defined)
    assert set(m) == {"filter/kept_fraction", "filter/kept_reward"}


def test_metrics_without_rows_to_average_are_left_out():
    """No valid row at all: nothing kept, nothing dropped, no threshold; only the kept fraction (0) is defined."""
    batch = _batch([1.0, 2.0, 3.0, 4.0], valid=[False] * 4)
    _, m = rollout_filter.apply(batch, RolloutFilterConfig(name="reward_above_mean_std"), ONE_PROCESS, None)
    assert m == {"filter/kept_fraction": 0.0}


def test_dapo_refill_that_needs_two_rounds():
    """Round 0 keeps prompt 0 (rewards 1, 0) and drops prompt 1 (1, 1); round 1 keeps nothing; round 2 keeps
    its prompt 1 (0, 1): the batch of 4 rows is full after 2 refill rounds."""
    first = _batch([1.0, 0.0, 1.0, 1.0])
    generate_more, calls = _refill(_batch([0.0, 0.0, 1.0, 1.0]), _batch([1.0, 1.0, 0.0, 1.0]))
    out, m = rollout_filter.apply(first, RolloutFilterConfig(name="dapo_groups"), ONE_PROCESS, generate_more)
    assert calls == [1, 2]
    assert out.batch_size == 4 and out.get("raw_rewards").tolist() == [1.0, 0.0, 0.0, 1.0]
    assert (out.get("mask").sum(dim=1) > 0).all()
    ids = out.group_ids.tolist()
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2]  # two groups, kept apart across rounds
    assert m["filter/refill_rounds"] == 2.0 and m["filter/kept_fraction"] == 1.0
    # 12 rows generated, reward sum 8; the 4 that train sum to 2
    assert m["filter/kept_reward"] == pytest.approx(0.5) and m["filter/dropped_reward"] == pytest.approx(6 / 8)


def test_dapo_refill_that_hits_the_round_limit():
    """One refill round allowed and it keeps nothing: prompt 0 of round 0 trains, the other two slots hold
    round 0's dropped rows, masked out."""
    first = _batch([1.0, 0.0, 1.0, 1.0])
    generate_more, calls = _refill(_batch([0.0, 0.0, 1.0, 1.0]), _batch([1.0, 0.0, 0.0, 1.0]))
    out, m = rollout_filter.apply(first, RolloutFilterConfig(name="dapo_groups", max_refill_rounds=1), ONE_PROCESS,
                                  generate_more)
    assert calls == [1]
    assert out.batch_size == 4 and (out.get("mask").sum(dim=1) > 0).tolist() == [True, True, False, False]
    assert m["filter/refill_rounds"] == 1.0 and m["filter/kept_fraction"] == 0.5


def test_dapo_takes_whole_groups_in_order_until_the_batch_is_full():
    first = _batch([1.0, 0.0, 1.0, 1.0])  # prompt 0 kept
    generate_more, calls = _refill(_batch([0.0, 1.0, 1.0, 0.0]))  # both kept: only the first fits
    out, m = rollout_filter.apply(first, RolloutFilterConfig(name="dapo_groups"), ONE_PROCESS, generate_more)
    assert calls == [1] and out.get("raw_rewards").tolist() == [1.0, 0.0, 0.0, 1.0]
    assert m["filter/kept_fraction"] == 1.0 and m["filter/kept_reward"] == pytest.approx(0.5)


def test_dapo_without_refill_rounds_only_drops():
    first = _batch([1.0, 0.0, 1.0, 1.0])
    out, m = rollout_filter.apply(first, RolloutFilterConfig(name="dapo_groups", max_refill_rounds=0), ONE_PROCESS,
                                  None)
    assert out is first and m["filter/refill_rounds"] == 0.0 and m["filter/kept_fraction"] == 0.5


# -- DP2: the step with a filter equals the step on the kept rows given directly -----------------------

VOCAB = 96
# shaped rewards of the 4 rows (prompts 0, 0, 1, 1) on each rank; k = 0.5 over all 8 rows:
# mean 0.45, unbiased std 0.3742 -> threshold 0.637
SOME = {0: [0.9, 0.1, 0.7, 0.3], 1: [0.2, 1.0, 0.4, 0.0]}  # keeps rows 0, 2 on rank 0, row 1 on rank 1
NONE_ON_RANK_1 = {0: [0.9, 0.1, 1.0, 0.3], 1: [0.2, 0.1, 0.4, 0.0]}  # threshold 0.564: rank 1 keeps none
K = 0.5


def _kept(rewards):
    values = np.array(rewards[0] + rewards[1])
    threshold = values.mean() + K * values.std(ddof=1)
    return {rank: [i for i, v in enumerate(rewards[rank]) if v > threshold] for rank in (0, 1)}


def _step_batch(rank, rewards):
    """A rank's rollouts with what scoring and the reference forwards write (seeded by rank)."""
    g = torch.Generator().manual_seed(10 + rank)
    b, p, r, h = 4, 3, 5, 64
    response_mask = torch.ones(b, r)
    response_mask[1, 3:] = 0
    response_mask[3, 2:] = 0
    batch = RolloutBatch(prompt_ids=torch.randint(1, VOCAB, (b, p), generator=g), prompt_mask=torch.ones(b, p).long(),
                         response_ids=(torch.randint(1, VOCAB, (b, r), generator=g) * response_mask).long(),
                         response_mask=response_mask, log_probs=torch.zeros(b, r), finish_reasons=["stop"] * b,
                         group_ids=torch.tensor([0, 0, 1, 1]))
    shaped = torch.tensor(rewards[rank])
    token_scores = torch.zeros(b, r)
    token_scores[torch.arange(b), response_mask.sum(dim=1).long() - 1] = shaped
    batch.set("mask", response_mask.clone()).set("token_scores", token_scores)
    batch.set("shaped_rewards", shaped).set("raw_rewards", shaped)
    batch.set("old_log_probs", -4.0 + 0.3 * torch.randn(b, r, generator=g))
    batch.set("ref_log_probs", -4.2 + 0.3 * torch.randn(b, r, generator=g))
    batch.set("ref_pooled", torch.randn(b, h, generator=g))
    return batch


def _one_step(groups, batch, filter_name, policy_loss):
    """Advantages and one policy update on ``batch``; returns the parameters after it and the metrics."""
    from hpa.config import load_config
    from hpa.engine.optimizer import make_trainable
    from hpa.models import build_policy
    from hpa.trainer import phases
    from hpa.trainer.guard import Guard
    from hpa.trainer.objective import StepWeights

    cfg = load_config(None, ["algorithm.advantage.estimator=grpo", "algorithm.kl.use_kl_in_reward=false",
                             f"algorithm.ppo.policy_loss={policy_loss}", "trainer.micro_batch_size=4",
                             f"algorithm.rollout_filter.name={filter_name}", f"algorithm.rollout_filter.k={K}"])
    ctx = phases.StepContext.from_config(cfg, groups, vocab_size=VOCAB, pad_id=0)
    ctx = dataclasses.replace(ctx, temperature=1.0)
    metrics = {}
    if filter_name != "none":
        batch, metrics = rollout_filter.apply(batch, cfg.algorithm.rollout_filter, groups, None)
    phases.compute_advantages(batch, ctx, reward_kl_coef=0.0)
    torch.manual_seed(0)
    policy = make_trainable(build_policy(cfg.model, cfg.parallel, groups), cfg.optim, cfg.parallel, groups, 10)
    weights = StepWeights(w_ppo=0.4, w_dpo=0.0, w_kl=0.2, lambda_token=0.7, lambda_semantic=0.5, entropy_coef=0.01,
                          reward_kl_coef=0.0)
    metrics.update(phases.update_policy(batch, [], weights, policy, Guard(cfg.guard), ctx))
    params = torch.cat([prm.detach().flatten() for prm in policy.model.parameters()]).numpy()
    return params, batch.get("advantages").numpy(), metrics


def filtered_worker(groups, rewards, policy_loss):
    batch = _step_batch(groups.dp_rank, rewards)
    return _one_step(groups, batch, "reward_above_mean_std", policy_loss)


def direct_worker(groups, rewards, kept, policy_loss):
    """The kept rows of every rank given directly (no filter); with one DP rank, all of them on it."""
    if groups.data_parallel_size == 1:
        batch = RolloutBatch.concat([_step_batch(rank, rewards).select(kept[rank]) for rank in (0, 1) if kept[rank]])
    else:
        batch = _step_batch(groups.dp_rank, rewards).select(kept[groups.dp_rank])
    return _one_step(groups, batch, "none", policy_loss)


def _assert_step_equal(filtered, direct, kept):
    f_params, f_adv, f_metrics = filtered[0]
    d_params, _, d_metrics = direct[0]
    np.testing.assert_allclose(f_params, d_params, atol=1e-6, rtol=0)
    assert np.abs(f_params - filtered[1][0]).max() == 0.0  # the DP ranks stay identical
    for key in ("actor/pg_loss", "kl/token", "kl/semantic", "actor/entropy"):
        assert f_metrics[key] == pytest.approx(d_metrics[key], rel=1e-5, abs=1e-7), key
    # the advantages of the kept rows are those computed on the kept rows alone; dropped rows have none
    direct_adv = {0: direct[0][1], 1: direct[1][1] if len(direct) > 1 else direct[0][1][len(kept[0]):]}
    for rank in (0, 1):
        adv = filtered[rank][1]
        np.testing.assert_allclose(adv[kept[rank]], direct_adv[rank], atol=1e-6)
        dropped = [i for i in range(4) if i not in kept[rank]]
        assert not adv[dropped].any()


@pytest.mark.multirank
@pytest.mark.parametrize("policy_loss", ["vanilla", "geo_mean"])
def test_step_with_a_filter_equals_the_step_on_the_kept_rows_tp1_pp1_dp2(policy_loss):
    kept = _kept(SOME)
    assert kept == {0: [0, 2], 1: [1]}
    filtered = run_ranks(filtered_worker, dp=2, args=(SOME, policy_loss))
    direct = run_ranks(direct_worker, dp=2, args=(SOME, kept, policy_loss))
    _assert_step_equal(filtered, direct, kept)
    assert filtered[0][2]["filter/kept_fraction"] == pytest.approx(3 / 8)


@pytest.mark.multirank
def test_a_rank_that_keeps_no_row_neither_hangs_nor_changes_the_step_tp1_pp1_dp2():
    """Rank 1 keeps nothing: the DP2 step equals one rank training on rank 0's kept rows."""
    kept = _kept(NONE_ON_RANK_1)
    assert kept == {0: [0, 2], 1: []}
    filtered = run_ranks(filtered_worker, dp=2, args=(NONE_ON_RANK_1, "vanilla"))
    direct = run_ranks(direct_worker, dp=1, args=(NONE_ON_RANK_1, kept, "vanilla"))
    _assert_step_equal(filtered, direct, kept)
    assert filtered[1][2]["filter/kept_fraction"] == pytest.approx(2 / 8)


def test_every_registered_filter_says_what_the_step_does_around_it():
    from hpa.algorithms.filters import ROLLOUT_FILTERS

    assert sorted(rollout_filter.FILTER_STEPS) == sorted(ROLLOUT_FILTERS.names())
