"""The rollout correction in the step (``algorithm.rollout_correction``, ``phases.rollout_correction``): the
behaviour log-probs the engine recorded and the trainer's π_old give the IS weights, the rejection and the veto
(hand-derived, verl v0.7.0's definitions), the rejected tokens leave the loss mask after the advantages, the
rejected rows move no gradient, the weights reach the PPO and KL terms, and the ``rollout_corr/`` metrics of
DP2 are those of the whole batch on one rank."""

import dataclasses
import math
import types

import pytest
import torch

from hpa.config import load_config
from hpa.rollout.base import RolloutBatch
from hpa.trainer import phases

from multirank import run_ranks

VOCAB = 48
CORRECTION = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
              "algorithm.rollout_correction.rollout_rs=token", "algorithm.rollout_correction.rollout_rs_threshold=2.0",
              "algorithm.rollout_correction.rollout_token_veto_threshold=1e-3"]
GRPO = ["algorithm.advantage.estimator=grpo", "algorithm.advantage.norm_by_std=false",
        "algorithm.kl.use_kl_in_reward=false"]

# the hand case: log π_old − log π_behaviour per token, 4 rows of 3 (row 1 stopped after 2 tokens)
#   row 0: on-policy                              -> weights 1, kept
#   row 1: one token 3x likelier under π_old      -> weight truncated to 2, that token rejected (3 > 2)
#   row 2: one token 1e4x less likely             -> rejected (1e-4 < 1/2) and the row vetoed (1e-4 < 1e-3)
#   row 3: ratios 0.8 and 1.25, inside [1/2, 2]   -> kept, weighted
LOG_RATIO = torch.tensor([[0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0], [0.0, math.log(1e-4), 0.0],
                          [math.log(0.8), math.log(1.25), 0.0]])
RESPONSE_MASK = torch.tensor([[1., 1., 1.], [1., 1., 0.], [1., 1., 1.], [1., 1., 1.]])
WEIGHTS = torch.tensor([[1.0, 1.0, 1.0], [2.0, 1.0, 0.0], [1.0, 1e-4, 1.0], [0.8, 1.25, 1.0]])
KEPT = torch.tensor([[1., 1., 1.], [0., 1., 0.], [0., 0., 0.], [1., 1., 1.]])


def hand_metrics():
    """verl's metrics of the hand case, from their definitions (``compute_is_metrics``, ``compute_rs_metrics``,
    the rejection and the veto of ``compute_rollout_correction_and_rejection_mask``, v0.7.0): 11 valid tokens."""
    ratios = [1, 1, 1, 3, 1, 1, 1e-4, 1, 0.8, 1.25, 1]
    bounded = [min(max(w, 0.5), 2.0) for w in ratios]  # the ESS and std read the weights clamped to [1/2, 2]
    mean_b = sum(bounded) / 11
    mean_b2 = sum(b * b for b in bounded) / 11
    return {"rollout_corr/rollout_is_mean": sum(ratios) / 11, "rollout_corr/rollout_is_max": 3.0,
            "rollout_corr/rollout_is_min": 1e-4, "rollout_corr/rollout_is_ratio_fraction_high": 1 / 11,
            "rollout_corr/rollout_is_ratio_fraction_low": 1 / 11,
            "rollout_corr/rollout_is_eff_sample_size": 1.0 / (mean_b2 / mean_b ** 2),
            "rollout_corr/rollout_is_std": math.sqrt(mean_b2 - mean_b ** 2),
            "rollout_corr/rollout_is_seq_mean": (1 + 2 + (2 + 1e-4) / 3 + 3.05 / 3) / 4,
            "rollout_corr/rollout_rs_mean": sum(ratios) / 11,
            "rollout_corr/rollout_rs_masked_fraction": 2 / 11, "rollout_corr/rollout_rs_seq_masked_fraction": 0.5,
            "rollout_corr/rollout_is_veto_fraction": 0.25,
            "rollout_corr/rollout_is_catastrophic_token_fraction": 1 / 11}


def _batch(old, log_ratio, response_mask, group_ids, seed=0):
    """A rollout whose engine recorded ``old − log_ratio`` (the behaviour log-probs)."""
    b, r = response_mask.shape
    g = torch.Generator().manual_seed(seed)
    return RolloutBatch(prompt_ids=torch.randint(1, VOCAB, (b, 3), generator=g),
                        prompt_mask=torch.ones(b, 3, dtype=torch.long),
                        response_ids=(torch.randint(1, VOCAB, (b, r), generator=g) * response_mask).long(),
                        response_mask=response_mask, log_probs=(old - log_ratio) * response_mask,
                        finish_reasons=["stop"] * b, group_ids=torch.tensor(group_ids))


def _ctx(groups, *overrides):
    cfg = load_config(None, ["trainer.micro_batch_size=2", "rollout.temperature=1.0", *GRPO, *overrides])
    return phases.StepContext.from_config(cfg, groups, vocab_size=VOCAB, pad_id=0)


ONE_RANK = types.SimpleNamespace(dp_group=None, data_parallel_size=1)


def test_weights_rejection_veto_and_metrics_by_hand():
    ctx = _ctx(ONE_RANK, *CORRECTION)
    old = torch.full((4, 3), -2.0) * RESPONSE_MASK
    batch = _batch(old, LOG_RATIO, RESPONSE_MASK, [0, 0, 0, 1])
    metrics = phases.rollout_correction(batch, old, ctx)
    torch.testing.assert_close(batch.get("is_weights"), WEIGHTS)
    torch.testing.assert_close(batch.get("rollout_kept"), KEPT)
    for key, value in hand_metrics().items():
        assert metrics[key] == pytest.approx(value, rel=1e-5), key
    assert all(isinstance(v, float) for v in metrics.values())


def test_rejection_leaves_the_loss_mask_after_the_advantages():
    """GRPO without std: the vetoed row 2 still scores in its group's baseline (the advantages see every scored
    token, as verl's grpo sums its rewards unmasked); then it and row 1's rejected token leave the loss mask."""
    ctx = _ctx(ONE_RANK, *CORRECTION)
    old = torch.full((4, 3), -2.0) * RESPONSE_MASK
    batch = _batch(old, LOG_RATIO, RESPONSE_MASK, [0, 0, 0, 1])
    phases.rollout_correction(batch, old, ctx)
    scores = torch.tensor([1.0, 0.0, 2.0, 5.0])
    token_scores = torch.zeros(4, 3)
    token_scores[torch.arange(4), RESPONSE_MASK.sum(dim=1).long() - 1] = scores
    batch.set("mask", RESPONSE_MASK.clone()).set("token_scores", token_scores)
    phases.compute_advantages(batch, ctx, reward_kl_coef=0.0)
    expected = torch.tensor([0.0, -1.0, 1.0, 5.0])  # group 0's mean is 1 (row 2 in it); group 1 has one row
    torch.testing.assert_close(batch.get("advantages"), expected[:, None] * RESPONSE_MASK)
    torch.testing.assert_close(batch.get("mask"), RESPONSE_MASK * KEPT)


def test_off_by_default_sets_nothing():
    ctx = _ctx(ONE_RANK)
    assert not ctx.algorithm.rollout_correction.enabled
    old = torch.full((4, 3), -2.0) * RESPONSE_MASK
    batch = _batch(old, LOG_RATIO, RESPONSE_MASK, [0, 0, 0, 1])
    batch.set("mask", RESPONSE_MASK.clone()).set("token_scores", torch.zeros(4, 3))
    phases.compute_advantages(batch, ctx, reward_kl_coef=0.0)
    assert "is_weights" not in batch.extras and "rollout_kept" not in batch.extras
    torch.testing.assert_close(batch.get("mask"), RESPONSE_MASK)


def test_weights_alone_reject_nothing():
    ctx = _ctx(ONE_RANK, "algorithm.rollout_correction.rollout_is=sequence")
    old = torch.full((4, 3), -2.0) * RESPONSE_MASK
    batch = _batch(old, LOG_RATIO, RESPONSE_MASK, [0, 0, 0, 1])
    metrics = phases.rollout_correction(batch, old, ctx)
    assert "rollout_kept" not in batch.extras
    row = torch.tensor([1.0, 2.0, 1e-4, 1.0])  # min(Π ratios, 2): 1, 3 -> 2, 1e-4, 0.8 x 1.25
    torch.testing.assert_close(batch.get("is_weights"), row[:, None] * RESPONSE_MASK)
    assert metrics["rollout_corr/rollout_is_veto_fraction"] == 0.0
    assert "rollout_corr/rollout_rs_masked_fraction" not in metrics


# -- the step's gradient: one gloo rank in this process ---------------------------------------------------

def _gradient_case(groups):
    """(ctx, policy, batch after the correction and the advantages, grad(rows, batch) -> flat gradient)."""
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.engine import forward
    from hpa.engine.optimizer import wrap_ddp
    from hpa.engine.step import forward_backward
    from hpa.models import build_policy
    from hpa.trainer import micro_batches, objective

    torch.manual_seed(0)
    model_cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            vocab_size=VOCAB, max_sequence_length=32, make_vocab_size_divisible_by=16)
    policy = wrap_ddp(build_policy(model_cfg, ParallelConfig(), groups), ParallelConfig(), groups)
    ctx = dataclasses.replace(_ctx(groups, *CORRECTION), hidden_size=32)
    probe = _batch(torch.zeros(4, 3), torch.zeros(4, 3), RESPONSE_MASK, [0, 0, 0, 1], seed=1)
    out = forward.sequence_log_probs(policy, probe.sequences, RESPONSE_MASK, groups, batching=ctx.batching,
                                     vocab_size=VOCAB, temperature=1.0, hidden_size=32)
    batch = _batch(out["log_probs"], LOG_RATIO, RESPONSE_MASK, [0, 0, 0, 1], seed=1)
    metrics = phases.reference_and_old_policy(batch, policy, policy, ctx)  # the policy as its own reference
    g = torch.Generator().manual_seed(2)
    batch.set("ref_log_probs", batch.get("ref_log_probs") - 0.3 * torch.rand(4, 3, generator=g))
    batch.set("ref_pooled", batch.get("ref_pooled") + 0.1 * torch.randn(4, 32, generator=g))
    token_scores = torch.zeros(4, 3)
    token_scores[torch.arange(4), RESPONSE_MASK.sum(dim=1).long() - 1] = torch.tensor([1.0, 0.0, 2.0, 5.0])
    batch.set("mask", RESPONSE_MASK.clone()).set("token_scores", token_scores)
    phases.compute_advantages(batch, ctx, reward_kl_coef=0.0)
    weights = objective.StepWeights(w_ppo=0.5, w_dpo=0.0, w_kl=0.5, lambda_token=0.7, lambda_semantic=0.5,
                                    entropy_coef=0.01, reward_kl_coef=0.0)

    def grad(rows, b=batch):
        mbs = micro_batches.rollout_micro_batches(b, rows, ctx.batching, groups.dp_group)
        counts = objective.global_counts(mbs, [], groups)
        loss_fn = objective.make_policy_loss(ctx.algorithm, weights, counts, groups, vocab_size=VOCAB, temperature=1.0)
        policy.zero_grad_buffer()
        forward_backward(policy, mbs, loss_fn, groups, capture_hidden=True)
        return torch.cat([p.main_grad.flatten().clone() for p in policy.parameters()])

    return batch, metrics, grad


def test_rejected_rows_and_tokens_move_no_gradient(groups):
    batch, metrics, grad = _gradient_case(groups)
    # π_old is the trainer's forward and π_behaviour what the "engine" recorded: their log-ratio is the hand case's
    assert metrics["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(0.25)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 11)
    torch.testing.assert_close(batch.get("is_weights"), WEIGHTS, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(batch.get("mask"), RESPONSE_MASK * KEPT)
    full = grad([0, 1, 2, 3])
    assert full.abs().max() > 0
    # the vetoed row 2 contributes nothing: the step without it has the same gradient
    torch.testing.assert_close(grad([0, 1, 3]), full, rtol=1e-5, atol=1e-7)
    # what a rejected token carries (its advantage, its reference log-prob) reaches no gradient
    changed = batch.select(torch.arange(4))
    changed.set("advantages", batch.get("advantages") + 100.0 * (1 - KEPT) * RESPONSE_MASK)
    changed.set("ref_log_probs", batch.get("ref_log_probs") - 5.0 * (1 - KEPT) * RESPONSE_MASK)
    torch.testing.assert_close(grad([0, 1, 2, 3], changed), full, rtol=1e-5, atol=1e-7)
    # and the rejection is what did it: with every token back in the mask the gradient moves
    unrejected = batch.select(torch.arange(4))
    unrejected.set("mask", RESPONSE_MASK.clone())
    assert (grad([0, 1, 2, 3], unrejected) - full).abs().max() > 1e-4


# -- DP2: every rank's metrics are the whole batch's ------------------------------------------------------

def _dp2_worker(groups):
    ctx = _ctx(groups, *CORRECTION)
    rows = [0, 1, 2] if groups.dp_rank == 0 else [3]
    log_ratio, mask = LOG_RATIO[rows], RESPONSE_MASK[rows]
    if groups.dp_rank == 1:  # a longer padded response on this rank: the gather pads the other one
        log_ratio, mask = torch.nn.functional.pad(log_ratio, (0, 2)), torch.nn.functional.pad(mask, (0, 2))
    old = torch.full(mask.shape, -2.0) * mask
    batch = _batch(old, log_ratio, mask, [0] * len(rows))
    metrics = phases.rollout_correction(batch, old, ctx)
    return metrics, batch.get("is_weights"), batch.get("rollout_kept")


@pytest.mark.multirank
def test_dp2_metrics_are_the_whole_batchs():
    one = phases.rollout_correction(_batch(torch.full((4, 3), -2.0) * RESPONSE_MASK, LOG_RATIO, RESPONSE_MASK,
                                           [0, 0, 0, 1]), torch.full((4, 3), -2.0) * RESPONSE_MASK,
                                    _ctx(ONE_RANK, *CORRECTION))
    ranks = run_ranks(_dp2_worker, tp=1, dp=2)
    for metrics, _, _ in ranks:
        assert metrics.keys() == one.keys()
        for key, value in one.items():
            assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    torch.testing.assert_close(ranks[0][1], WEIGHTS[:3])
    torch.testing.assert_close(ranks[1][2][:, :3], KEPT[3:])


def test_the_ppo_term_is_decoupled_ppo():
    """The ``ppo`` term on the phase's ``is_weights`` and rejected ``mask`` is ``decoupled_policy_loss`` of the same
    π_old, π_behaviour and policy log-probs: value, gradient and metrics."""
    from hpa.algorithms.losses import Aggregation
    from hpa.algorithms.rollout_correction import RolloutCorrection, decoupled_policy_loss
    from hpa.trainer.objective.streams import LossInputs
    from hpa.trainer.objective.terms import ppo_term

    ctx = _ctx(ONE_RANK, *CORRECTION)
    g = torch.Generator().manual_seed(4)
    old = (-2.0 + 0.3 * torch.randn(4, 3, generator=g)) * RESPONSE_MASK
    batch = _batch(old, LOG_RATIO, RESPONSE_MASK, [0, 0, 0, 1])
    phases.rollout_correction(batch, old, ctx)
    advantages = torch.randn(4, 3, generator=g) * RESPONSE_MASK
    new = (old + 0.2 * torch.randn(4, 3, generator=g)).requires_grad_()
    aggregation = Aggregation(mode="token-mean", num_global_tokens=float((RESPONSE_MASK * KEPT).sum()))
    inputs = LossInputs(algo=ctx.algorithm, weights=None, counts=None, aggregation=aggregation)
    mb = {"old_log_probs": old, "advantages": advantages, "mask": RESPONSE_MASK * batch.get("rollout_kept"),
          "is_weights": batch.get("is_weights")}
    loss, metrics = ppo_term(mb, {"log_probs": new}, inputs)
    (grad,) = torch.autograd.grad(loss, new)
    ppo = ctx.algorithm.ppo
    options = RolloutCorrection(**dataclasses.asdict(ctx.algorithm.rollout_correction))
    new2 = new.detach().clone().requires_grad_()
    expected, expected_metrics = decoupled_policy_loss(
        old, batch.log_probs, new2, advantages, RESPONSE_MASK, correction=options, name=ppo.policy_loss,
        clip_ratio=ppo.clip_ratio, clip_ratio_low=ppo.clip_ratio_low, clip_ratio_high=ppo.clip_ratio_high,
        clip_ratio_c=ppo.clip_ratio_c, aggregation=aggregation)
    (expected_grad,) = torch.autograd.grad(expected, new2)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(grad, expected_grad)
    assert grad[2].abs().max() == 0 and grad[1, 0] == 0  # the vetoed row, the rejected token
    for key in ("pg_loss", "pg_clipfrac", "ppo_kl"):
        assert metrics[f"actor/{key}"].item() == pytest.approx(expected_metrics[key].item(), rel=1e-6, abs=1e-9)
