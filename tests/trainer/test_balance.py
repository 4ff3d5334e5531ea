"""The automatic balance (``algorithm.hpa.balance``): the per-group gradient norms are exact, and the
measured step's gradient is the balanced sum.

At TP1 the rollout group's and the pair group's norms are computed by hand from separate backward
passes (the vector norm of every parameter's gradient); under TP2, PP2 and DP2 the measured norms
(megatron's reductions, as gradient clipping uses them) must equal them, and the gradient the measured
step leaves in the buffers must equal one backward pass with the pair term scaled by the factor.
"""

import math

import numpy as np
import pytest
import torch

from multirank import layout_id, run_ranks

pytestmark = pytest.mark.multirank

VOCAB = 48
ATOL = 1e-5


def _model_config():
    from hpa.config.schema import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                       vocab_size=VOCAB, max_sequence_length=32, make_vocab_size_divisible_by=16)


def save_initial_worker(groups, ckpt_dir):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.models.weights import save_model_weights

    torch.manual_seed(0)
    save_model_weights(build_policy(_model_config(), ParallelConfig(), groups), ckpt_dir, groups)


def _data(groups):
    """This DP rank's rollout and pair micro-batches (all of them at DP1, half at DP2)."""
    from hpa.engine import collate, forward
    from hpa.rollout.base import RolloutBatch

    g = torch.Generator().manual_seed(3)
    b, p, r = 4, 5, 6
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :2] = 0
    response_mask = torch.ones(b, r)
    response_mask[1, 4:] = 0
    batch = RolloutBatch(prompt_ids=torch.randint(1, VOCAB, (b, p), generator=g) * prompt_mask,
                         prompt_mask=prompt_mask,
                         response_ids=(torch.randint(1, VOCAB, (b, r), generator=g) * response_mask).long(),
                         response_mask=response_mask, log_probs=torch.zeros(b, r), finish_reasons=["length"] * b,
                         group_ids=torch.tensor([0, 0, 1, 1]))
    ts = batch.training_sequences()
    extras = {"old_log_probs": -3.5 + 0.3 * torch.randn(b, r, generator=g),
              "ref_log_probs": -3.7 + 0.3 * torch.randn(b, r, generator=g),
              "advantages": torch.randn(b, r, generator=g) * response_mask,
              "ref_pooled": torch.randn(b, 32, generator=g)}
    pool_mask = forward.response_token_mask(ts, response_mask)
    dp, rank = groups.data_parallel_size, groups.dp_rank
    rollout = []
    for rows in collate.chunks(b, 2):
        idx = torch.tensor(rows)
        mb = ts.micro_batch(idx)
        mb.update(kind="rollout", mask=response_mask[idx], pool_mask=pool_mask[idx],
                  **{k: v[idx] for k, v in extras.items()})
        rollout.append(mb)

    class Pair:
        def __init__(self, prompt, chosen, rejected):
            self.chosen_input_ids = prompt + chosen
            self.rejected_input_ids = prompt + rejected
            self.chosen_response_mask = [0] * len(prompt) + [1] * len(chosen)
            self.rejected_response_mask = [0] * len(prompt) + [1] * len(rejected)

    pairs = [Pair([5, 6, 7], [8, 9], [10, 11, 12]), Pair([13, 14], [15], [16, 17])]
    ref = [(-6.0, -8.0), (-5.0, -4.5)]
    pair_mbs = []
    for i in range(len(pairs)):
        mb = collate.pair_micro_batches([pairs[i]], micro_batch_size=1, pad_id=0)[0]
        mb["ref_seq_logp"] = torch.tensor(ref[i])
        pair_mbs.append(mb)
    # DP2: each rank takes every other micro-batch (one rollout and one pair micro-batch each)
    return rollout[rank::dp], pair_mbs[rank::dp]


def balance_worker(groups, ckpt_in):
    from hpa.config.algorithm import AlgorithmConfig, DPOConfig
    from hpa.config.schema import OptimConfig, ParallelConfig
    from hpa.engine.optimizer import build_optimizer, wrap_ddp
    from hpa.engine.step import add_grads, forward_backward, zero_grad
    from hpa.models import build_policy
    from hpa.models.weights import load_model_weights
    from hpa.trainer import objective, phases
    from hpa.trainer.objective import GradientBalance

    parallel = ParallelConfig(tensor_model_parallel_size=groups.tensor_model_parallel_size,
                              pipeline_model_parallel_size=groups.pipeline_model_parallel_size)
    model = build_policy(_model_config(), parallel, groups)
    load_model_weights(model, ckpt_in, groups)
    ddp = wrap_ddp(model, parallel, groups)
    opt = build_optimizer(ddp, OptimConfig(lr=1e-3, clip_grad=1.0), parallel, groups)

    class Policy:
        pass

    policy = Policy()
    policy.model, policy.optimizer = ddp, opt
    algo = AlgorithmConfig(dpo=DPOConfig(rpo_alpha=1.0))
    rollout, pairs = _data(groups)
    weights = objective.StepWeights(w_ppo=0.4, w_dpo=0.4, w_kl=0.2, lambda_token=0.7, lambda_semantic=0.5,
                                    entropy_coef=0.01, reward_kl_coef=0.0)
    counts = objective.global_counts(rollout, pairs, groups)
    from hpa.engine.batching import Batching

    ctx = phases.StepContext(groups=groups, algorithm=algo, trainer=None, batching=Batching(micro_batch_size=2, pad_id=0),
                             vocab_size=VOCAB, temperature=1.0, hidden_size=_model_config().hidden_size)

    def loss_fn(scale):
        return objective.make_policy_loss(algo, weights.with_factors(objective.StepFactors(pairs=scale)), counts,
                                          groups, vocab_size=VOCAB, temperature=1.0)

    def flat_grads():
        return torch.cat([p.main_grad.flatten().clone() for p in ddp.parameters()]).numpy()

    def hand_norm(mbs):
        zero_grad(ddp, opt)
        forward_backward(ddp, mbs, loss_fn(1.0), groups, capture_hidden=True)
        return math.sqrt(sum(float((p.main_grad.double() ** 2).sum()) for p in ddp.parameters()))

    out = {}
    if groups.world_size == 1:
        out["hand_rollout"], out["hand_pairs"] = hand_norm(rollout), hand_norm(pairs)
    zero_grad(ddp, opt)
    balance = GradientBalance(measure_steps=1)
    _, norms = phases._measured_backward(policy, rollout, pairs, loss_fn(1.0), ctx)
    factor = balance.record(norms["grad_norm/rollout"], norms["grad_norm/pairs"], weights.w_ppo, weights.w_dpo)
    add_grads(ddp, norms.pop("_rollout_grads"), scale=factor)
    out.update(norms, factor=factor, measured=flat_grads())
    zero_grad(ddp, opt)
    forward_backward(ddp, rollout + pairs, loss_fn(factor), groups, capture_hidden=True)
    out["one_pass"] = flat_grads()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("balance") / "init")
    run_ranks(save_initial_worker, args=(ckpt,))
    return ckpt, run_ranks(balance_worker, args=(ckpt,))[0]


def test_measured_norms_are_the_hand_computed_norms_at_tp1(reference):
    _, ref = reference
    assert ref["grad_norm/rollout"] == pytest.approx(ref["hand_rollout"], rel=1e-6)
    assert ref["grad_norm/pairs"] == pytest.approx(ref["hand_pairs"], rel=1e-6)
    # the factor makes w_dpo : w_ppo the ratio of the two groups' norms
    assert ref["factor"] == pytest.approx(ref["hand_rollout"] / ref["hand_pairs"], rel=1e-6)


def test_measured_step_is_one_pass_with_the_pair_term_scaled(reference):
    _, ref = reference
    assert ref["factor"] != pytest.approx(1.0, abs=1e-3)  # the scaling is visible
    np.testing.assert_allclose(ref["measured"], ref["one_pass"], atol=1e-6)


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
                         ids=[layout_id(2, 1, 1), layout_id(1, 2, 1), layout_id(1, 1, 2)])
def test_per_group_norms_do_not_depend_on_the_layout(reference, tp, pp, dp):
    ckpt, ref = reference
    results = run_ranks(balance_worker, tp=tp, pp=pp, dp=dp, args=(ckpt,))
    for rank, out in enumerate(results):
        assert out["grad_norm/rollout"] == pytest.approx(ref["hand_rollout"], rel=ATOL), rank
        assert out["grad_norm/pairs"] == pytest.approx(ref["hand_pairs"], rel=ATOL), rank
        np.testing.assert_allclose(out["measured"], out["one_pass"], atol=1e-6)
