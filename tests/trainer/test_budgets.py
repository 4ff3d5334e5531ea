"""Token budgets for every stream of the update: pairs and replayed SFT examples are grouped by tokens up to the
rank's budget (``trainer.ppo_max_token_len_per_rank``) as rollouts are, a pair's two rows together; packing them
changes neither the loss nor the gradients; ``trainer.micro_batch_size`` is refused where it would cut a step's
update into hundreds of micro-batches; and the CPU proxy of the update stays under its bound."""

import dataclasses
import importlib.util
import math
import os
import random
import types

import numpy as np
import pytest
import torch

from multirank import run_ranks

from hpa.config import load_config
from hpa.config.errors import ConfigError
from hpa.config.schema import MAX_UPDATE_MICRO_BATCHES, validate
from hpa.data.preferences import PreferenceExample, SFTExample
from hpa.engine.batching import Batching
from hpa.trainer import micro_batches, phases

ONE_PROCESS = types.SimpleNamespace(dp_group=None, dp_rank=0, data_parallel_size=1)
VOCAB = 48
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pairs(seed, m, prompt=20, response=60):
    rng = random.Random(seed)

    def ids(k):
        return [rng.randint(1, VOCAB - 1) for _ in range(k)]

    return [PreferenceExample(prompt_ids=ids(rng.randint(1, prompt)), chosen_ids=ids(rng.randint(1, response)),
                              rejected_ids=ids(rng.randint(1, response))) for _ in range(m)]


def _ctx(*overrides):
    cfg = load_config(None, ["trainer.micro_batch_size=1", "trainer.sequence_packing=true", *overrides])
    return phases.StepContext.from_config(cfg, ONE_PROCESS, vocab_size=VOCAB, pad_id=0)


@pytest.mark.parametrize("budget", [64, 300, 1000, 100000])
def test_pair_micro_batches_a_step_are_ceil_of_the_pair_tokens_over_the_budget(budget):
    """Red before the budgets: pairs were cut by micro_batch_size (1 here: 24 micro-batches whatever the budget)."""
    examples = _pairs(0, 24)
    tokens = [len(e.chosen_input_ids) + len(e.rejected_input_ids) for e in examples]
    mbs = phases.preference_micro_batches(examples, None, _ctx(f"trainer.ppo_max_token_len_per_rank={budget}"),
                                          torch.zeros(24, 2))
    total, longest = sum(tokens), max(tokens)
    fewest = min(24, math.ceil(total / budget))  # at most one pair a micro-batch
    assert sum(mb.num_rows for mb in mbs) == 48 and sum(mb.tokens for mb in mbs) == total
    if longest <= budget:
        assert all(mb.tokens <= budget for mb in mbs)
    if total / fewest + longest <= budget or fewest == 24:  # the guarantee of hpa.engine.collate.budget_groups
        assert len(mbs) == fewest
    else:
        assert fewest <= len(mbs) <= math.ceil(total / (budget - longest))
    if budget >= 1000:
        assert len(mbs) == fewest  # these lengths meet the condition: one micro-batch at 100k, a few at 1000


def test_pairs_take_at_least_one_micro_batch_per_mini_batch_and_keep_micro_batch_size_without_a_budget():
    examples = _pairs(1, 12)
    ctx = _ctx("trainer.ppo_max_token_len_per_rank=100000", "trainer.global_batch_size=8",
               "trainer.ppo_mini_batch_size=2")  # 4 optimizer updates a step: each takes a share of the pairs
    assert len(phases.preference_micro_batches(examples, None, ctx, torch.zeros(12, 2))) == 4
    ctx = _ctx("trainer.micro_batch_size=5")
    assert [mb.num_rows for mb in phases.preference_micro_batches(examples, None, ctx, torch.zeros(12, 2))] == [10, 10, 4]


def test_replayed_and_sft_examples_are_cut_by_the_token_budget():
    rng = random.Random(2)
    examples = [SFTExample(prompt_ids=[1] * rng.randint(1, 20), response_ids=[2] * rng.randint(1, 40))
                for _ in range(30)]
    total = sum(len(e.input_ids) for e in examples)
    mbs = phases.replay_micro_batches(examples, _ctx("trainer.ppo_max_token_len_per_rank=400"))
    assert [mb.kind for mb in mbs] == ["replay"] * len(mbs) and len(mbs) == math.ceil(total / 400)
    assert all(mb.tokens <= 400 for mb in mbs) and sum(mb.num_rows for mb in mbs) == 30
    assert len(micro_batches.sft_micro_batches(examples, Batching(micro_batch_size=4, pad_id=0))) == 8


def test_micro_batch_size_is_refused_where_it_cuts_the_update_into_hundreds_of_micro_batches():
    cfg = load_config(None, ["trainer.global_batch_size=64", "rollout.n=4", "trainer.micro_batch_size=1",
                             "trainer.preference_batch_size=64"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=1)
    message = str(err.value)
    # 64 x 4 rollout rows and 64 pairs, one a micro-batch
    assert "trainer.micro_batch_size" in message and "320 micro-batches" in message
    assert "256 rollout" in message and "64 pairs" in message and "ppo_max_token_len_per_rank" in message
    validate(cfg, world_size=4)  # 80 a rank over 4 DP ranks
    validate(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, ppo_max_token_len_per_rank=8192)),
             world_size=1)  # every stream cut by tokens
    validate(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_size=4)), world_size=1)
    assert MAX_UPDATE_MICRO_BATCHES < 320


def _packed_pairs_worker(groups):
    from hpa.config.algorithm import AlgorithmConfig, DPOConfig
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.engine.optimizer import wrap_ddp
    from hpa.engine.step import forward_backward
    from hpa.models import build_policy
    from hpa.trainer import objective

    torch.manual_seed(0)
    model_cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, vocab_size=VOCAB, max_sequence_length=128,
                            make_vocab_size_divisible_by=16)
    policy = wrap_ddp(build_policy(model_cfg, ParallelConfig(), groups), ParallelConfig(), groups)
    algo = dataclasses.replace(AlgorithmConfig(), dpo=DPOConfig(rpo_alpha=0.5))
    examples = _pairs(3, 10, prompt=12, response=30)
    ref = -30.0 + torch.randn(10, 2, generator=torch.Generator().manual_seed(4))
    weights = objective.StepWeights(w_ppo=0.0, w_dpo=1.0, w_kl=0.0, lambda_token=0.0, lambda_semantic=0.0,
                                    entropy_coef=0.0, reward_kl_coef=0.0)

    def step(mbs):
        counts = objective.global_counts([], mbs, groups)
        loss_fn = objective.make_policy_loss(algo, weights, counts, groups, vocab_size=VOCAB, temperature=1.0)
        policy.zero_grad_buffer()
        records = forward_backward(policy, mbs, loss_fn, groups, capture_hidden=True)
        grads = torch.cat([p.main_grad.flatten().clone() for p in policy.parameters()]).numpy()
        return grads, objective.step_metrics(records, groups), len(mbs)

    one_each = micro_batches.preference_micro_batches(examples, Batching(micro_batch_size=1, pad_id=0), ref)
    tokens = sum(len(e.chosen_input_ids) + len(e.rejected_input_ids) for e in examples)
    packed = micro_batches.preference_micro_batches(
        examples, Batching(micro_batch_size=1, pad_id=0, packed=True, update_token_budget=tokens // 2 + 40), ref)
    padded_whole = micro_batches.preference_micro_batches(examples, Batching(micro_batch_size=10, pad_id=0), ref)
    return {"one_each": step(one_each), "packed": step(packed), "padded_whole": step(padded_whole)}


@pytest.mark.multirank
def test_packed_pair_micro_batches_give_the_loss_and_gradients_of_one_pair_a_micro_batch():
    out = run_ranks(_packed_pairs_worker)[0]
    reference, metrics, count = out["one_each"]
    assert count == 10 and out["packed"][2] == 2 and out["padded_whole"][2] == 1
    for key in ("packed", "padded_whole"):
        grads, m, _ = out[key]
        np.testing.assert_allclose(grads, reference, atol=1e-6, rtol=1e-5)
        for name in ("dpo/loss", "dpo/anchor_nll"):
            assert m[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-7)
    assert np.abs(reference).max() > 1e-4


def _rollouts(b=6, p=7, r=6, hidden=32):
    from hpa.rollout.base import RolloutBatch

    g = torch.Generator().manual_seed(5)
    prompt_len = torch.randint(1, p + 1, (b,), generator=g)
    response_len = torch.randint(1, r + 1, (b,), generator=g)
    prompt_mask = (torch.arange(p)[None, :] >= (p - prompt_len)[:, None]).long()
    response_mask = (torch.arange(r)[None, :] < response_len[:, None]).float()
    batch = RolloutBatch(prompt_ids=torch.randint(1, VOCAB, (b, p), generator=g) * prompt_mask,
                         prompt_mask=prompt_mask,
                         response_ids=(torch.randint(1, VOCAB, (b, r), generator=g) * response_mask).long(),
                         response_mask=response_mask, log_probs=torch.zeros(b, r), finish_reasons=["stop"] * b,
                         group_ids=torch.arange(b) // 2)
    batch.set("mask", response_mask)
    batch.set("old_log_probs", -3.5 + 0.3 * torch.randn(b, r, generator=g))
    batch.set("ref_log_probs", -3.7 + 0.3 * torch.randn(b, r, generator=g))
    batch.set("ref_pooled", torch.randn(b, hidden, generator=g))
    batch.set("advantages", torch.randn(b, r, generator=g) * response_mask)
    batch.set("returns", torch.zeros(b, r))
    return batch


def _ride_along_worker(groups, hidden_head):
    from hpa.config.algorithm import AlgorithmConfig, DPOConfig
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.engine.micro_batch import MicroBatch
    from hpa.engine.optimizer import wrap_ddp
    from hpa.engine.step import forward_backward
    from hpa.models import build_policy
    from hpa.trainer import objective

    torch.manual_seed(0)
    model_cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, vocab_size=VOCAB, max_sequence_length=128,
                            make_vocab_size_divisible_by=16)
    policy = wrap_ddp(build_policy(model_cfg, ParallelConfig(), groups), ParallelConfig(), groups)
    algo = dataclasses.replace(AlgorithmConfig(), dpo=DPOConfig(rpo_alpha=0.5))
    batching = Batching(micro_batch_size=3, pad_id=0, packed=True)
    rollout = micro_batches.rollout_micro_batches(_rollouts(), list(range(6)), batching, None)  # 2 of 3 rows
    examples = _pairs(6, 4, prompt=8, response=10)
    pairs = micro_batches.preference_micro_batches(examples, batching, -20.0 + torch.zeros(4, 2), micro_batch_size=2)
    weights = objective.StepWeights(w_ppo=0.4, w_dpo=0.4, w_kl=0.2, lambda_token=0.7, lambda_semantic=0.5,
                                    entropy_coef=0.01, reward_kl_coef=0.0)
    counts = objective.global_counts(rollout, pairs, groups)

    def step(mbs):
        loss_fn = objective.make_policy_loss(algo, weights, counts, groups, vocab_size=VOCAB, temperature=1.0)
        policy.zero_grad_buffer()
        records = forward_backward(policy, mbs, loss_fn, groups, capture_hidden=True, hidden_head=hidden_head)
        grads = torch.cat([p.main_grad.flatten().clone() for p in policy.parameters()]).numpy()
        return grads, objective.step_metrics(records, groups), [mb.kind for mb in mbs]

    budget = max(mb.tokens for mb in rollout) + max(mb.tokens for mb in pairs)
    riding = micro_batches.ride_along(rollout, pairs, budget)
    mixed = MicroBatch.concat(rollout + pairs)  # every stream in one sequence
    return {"apart": step(rollout + pairs), "riding": step(riding), "one": step([mixed])}


@pytest.mark.multirank
@pytest.mark.parametrize("hidden_head", [False, True], ids=["logits", "hidden_head"])
def test_offline_rows_riding_in_a_rollout_micro_batch_give_the_same_loss_and_gradients(hidden_head):
    # hidden_head: the loss gets the LM head's input (the trainer's update), which a mixed micro-batch splits
    out = run_ranks(_ride_along_worker, args=(hidden_head,))[0]
    reference, metrics, kinds = out["apart"]
    assert kinds == ["rollout", "rollout", "pairs", "pairs"]
    assert out["riding"][2] == ["mixed", "mixed"] and out["one"][2] == ["mixed"]
    for key in ("riding", "one"):
        grads, m, _ = out[key]
        np.testing.assert_allclose(grads, reference, atol=1e-6, rtol=1e-5)
        for name in ("dpo/loss", "dpo/anchor_nll", "actor/pg_loss", "kl/token", "kl/semantic", "actor/entropy"):
            assert m[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-7)
    assert np.abs(reference).max() > 1e-4


def _packed(tokens, kind):
    from hpa.engine.micro_batch import MicroBatch

    lengths = torch.tensor(tokens)
    ids = torch.arange(int(lengths.sum()))[None, :]
    return MicroBatch(kind=kind, input_ids=ids, labels=ids, lengths=lengths, packed=True, row_width=max(tokens))


def test_ride_along_puts_offline_micro_batches_where_they_fit_and_keeps_the_rest():
    rollout = [_packed([50, 40], "rollout"), _packed([30], "rollout")]
    offline = [_packed([20, 20], "pairs"), _packed([25, 5], "pairs"), _packed([60], "replay")]
    out = micro_batches.ride_along(rollout, offline, 100)
    # the first pairs (40 tokens) join the lighter rollout (30 -> 70), the next (30) the lighter again (70 -> 100);
    # the replay (60) fits neither (90 + 60, 100 + 60)
    assert [mb.kind for mb in out] == ["rollout", "mixed", "replay"]
    assert [p.kind for p in out[1].parts] == ["rollout", "pairs", "pairs"] and out[1].tokens == 100
    assert torch.equal(out[1].input_ids, torch.cat([rollout[1].input_ids, offline[0].input_ids,
                                                    offline[1].input_ids], dim=1))
    parts = out[1].split(torch.arange(100)[None, :, None], None)
    assert [(p.kind, v[0].shape[1], v[1]) for p, v in parts] == [("rollout", 30, None), ("pairs", 40, None),
                                                                ("pairs", 30, None)]
    assert micro_batches.ride_along(rollout, offline, None) == rollout + offline  # no budget: apart
    assert micro_batches.ride_along(rollout, offline, 55) == rollout + offline  # nothing fits


def _load_proxy():
    spec = importlib.util.spec_from_file_location("update_proxy", os.path.join(ROOT, "bench", "proxies", "update.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_update_proxy_at_the_checks_shape_stays_under_its_bound():
    """One policy update at configs/qwen2_0.5b_gpu_check.yaml's shape: 19,982 aten ops before the budgets (a
    rollout micro-batch and two of 8 pairs), 9,065 with them (bench/proxies/update.py); the bound is 14,000."""
    out = _load_proxy().measure(("rows64",))
    # the pairs (~250 tokens) ride in the rollout micro-batch (~4.9k of a budget of 8,192): one pass
    assert out["update.rows64.micro_batches.rollout"] == 1 and out["update.rows64.micro_batches.pairs"] == 1
    assert out["update.rows64.micro_batches.total"] == 1
    assert out["update.rows64.aten_ops"] <= 14000


@pytest.mark.slow
def test_the_update_proxy_at_the_perf_configs_shape_stays_under_its_bound():
    out = _load_proxy().measure(("rows256",))
    assert out["update.rows256.micro_batches.pairs"] == 1
    assert out["update.rows256.aten_ops"] <= 0.7 * out["update.rows256.trained_tokens"]
