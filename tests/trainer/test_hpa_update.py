"""The mixed update: each weight means what it says, whatever the micro-batching.

With w_dpo = 0 the step's gradient is plain PPO (+ entropy, + hierarchical KL); with
w_ppo = w_kl = 0 it is plain DPO; the mixed gradient is the weighted sum of the three; and
splitting the same data into more micro-batches changes nothing.
"""

import numpy as np
import pytest
import torch

from multirank import run_ranks

pytestmark = pytest.mark.multirank

VOCAB = 48


def _setup(groups):
    from hpa.config.algorithm import AlgorithmConfig
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout.base import RolloutBatch
    from hpa.engine import collate, forward
    from hpa.engine.optimizer import wrap_ddp

    torch.manual_seed(0)
    model_cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            vocab_size=VOCAB, max_sequence_length=32, make_vocab_size_divisible_by=16)
    parallel = ParallelConfig()
    policy = wrap_ddp(build_policy(model_cfg, parallel, groups), parallel, groups)
    g = torch.Generator().manual_seed(3)
    b, p, r = 4, 5, 6
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    response_mask = torch.ones(b, r)
    response_mask[1, 4:] = 0  # a response that stopped early
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

    def rollout_mbs(size):
        out = []
        for rows in collate.chunks(b, size):
            idx = torch.tensor(rows)
            mb = ts.micro_batch(idx)
            mb.update(kind="rollout", mask=response_mask[idx], pool_mask=pool_mask[idx],
                      **{k: v[idx] for k, v in extras.items()})
            out.append(mb)
        return out

    class Pair:
        def __init__(self, prompt, chosen, rejected):
            self.chosen_input_ids = prompt + chosen
            self.rejected_input_ids = prompt + rejected
            self.chosen_response_mask = [0] * len(prompt) + [1] * len(chosen)
            self.rejected_response_mask = [0] * len(prompt) + [1] * len(rejected)

    pairs = [Pair([5, 6, 7], [8, 9], [10, 11, 12]), Pair([13, 14], [15], [16, 17]), Pair([18], [19, 20, 21], [22])]

    def pair_mbs(size):
        mbs = collate.pair_micro_batches(pairs, micro_batch_size=size, pad_id=0)
        ref = torch.tensor([-6.0, -5.0, -7.0, -8.0, -4.5, -6.5])  # chosen rows then rejected rows
        chosen, rejected = ref[:3], ref[3:]
        start = 0
        for mb in mbs:
            m = mb["input_ids"].shape[0] // 2
            mb["ref_seq_logp"] = torch.cat([chosen[start:start + m], rejected[start:start + m]])
            mb["kind"] = "pairs"
            start += m
        return mbs

    from hpa.data.preferences import SFTExample
    from hpa.engine.batching import Batching
    from hpa.trainer.micro_batches import sft_micro_batches

    examples = [SFTExample(prompt_ids=[3, 4], response_ids=[23, 24, 25]), SFTExample(prompt_ids=[26], response_ids=[27]),
                SFTExample(prompt_ids=[28, 29, 30], response_ids=[31, 32])]

    def replay_mbs(size, kind="replay"):
        return sft_micro_batches(examples, Batching(micro_batch_size=size, pad_id=0), kind=kind)

    return AlgorithmConfig(), policy, rollout_mbs, pair_mbs, replay_mbs


def gradients_worker(groups):
    import dataclasses

    from hpa.config.algorithm import ReplayConfig
    from hpa.trainer import objective
    from hpa.engine.step import forward_backward

    algo, policy, rollout_mbs, pair_mbs, replay_mbs = _setup(groups)

    def grad(w_ppo, w_dpo, w_kl, rollout_size=4, pair_size=3, with_rollouts=True, with_pairs=True, entropy=0.01,
             is_weight=None, replay_size=0, coef=0.0, pairs_factor=1.0):
        weights = objective.StepWeights(w_ppo=w_ppo, w_dpo=w_dpo, w_kl=w_kl, lambda_token=0.7, lambda_semantic=0.5,
                                        entropy_coef=entropy, reward_kl_coef=0.0,
                                        factors=objective.StepFactors(pairs=pairs_factor))
        r = rollout_mbs(rollout_size) if with_rollouts else []
        for mb in r if is_weight is not None else []:
            mb["is_weights"] = torch.full_like(mb["mask"], is_weight) * mb["mask"]
        p = (pair_mbs(pair_size) if with_pairs else []) + (replay_mbs(replay_size) if replay_size else [])
        counts = objective.global_counts(r, p, groups)
        loss_fn = objective.make_policy_loss(dataclasses.replace(algo, replay=ReplayConfig(coef=coef)), weights,
                                             counts, groups, vocab_size=VOCAB, temperature=1.0)
        policy.zero_grad_buffer()
        records = forward_backward(policy, r + p, loss_fn, groups, capture_hidden=True)
        flat = torch.cat([prm.main_grad.flatten().clone() for prm in policy.parameters()])
        return flat.numpy(), objective.step_metrics(records, groups)

    out = {}
    out["mixed"], out["mixed_metrics"] = grad(0.4, 0.4, 0.2)
    out["mixed_split"], out["split_metrics"] = grad(0.4, 0.4, 0.2, rollout_size=1, pair_size=1)
    out["no_dpo"], _ = grad(0.4, 0.0, 0.2)
    out["ppo_only_data"], _ = grad(0.4, 0.0, 0.2, with_pairs=False)
    out["dpo_only"], _ = grad(0.0, 0.4, 0.0)
    out["dpo_only_data"], _ = grad(0.0, 0.4, 0.0, with_rollouts=False)
    out["ppo_part"], _ = grad(0.4, 0.0, 0.0)
    out["kl_part"], _ = grad(0.0, 0.0, 0.2)
    out["dpo_unit"], out["dpo_metrics"] = grad(0.0, 1.0, 0.0, with_rollouts=False)
    out["pg_plain"], _ = grad(0.4, 0.0, 0.0, with_pairs=False, entropy=0.0)
    out["pg_is_2"], _ = grad(0.4, 0.0, 0.0, with_pairs=False, entropy=0.0, is_weight=2.0)
    out["kl_plain"], out["kl_plain_metrics"] = grad(0.0, 0.0, 0.2, with_pairs=False)
    out["kl_is_2"], out["kl_is_2_metrics"] = grad(0.0, 0.0, 0.2, with_pairs=False, is_weight=2.0)
    # the SFT replay: its own part, split over micro-batches, in the mixed step, under the balance's factor
    out["replay_unit"], out["replay_metrics"] = grad(0.0, 1.0, 0.0, with_rollouts=False, with_pairs=False,
                                                     replay_size=3, coef=1.0)
    out["replay_split"], out["replay_split_metrics"] = grad(0.0, 0.5, 0.0, with_rollouts=False, with_pairs=False,
                                                             replay_size=1, coef=0.5, pairs_factor=2.0)
    out["mixed_replay"], _ = grad(0.4, 0.4, 0.2, replay_size=2, coef=0.5)
    out["mixed_replay_off"], _ = grad(0.4, 0.4, 0.2, replay_size=2, coef=0.0)
    # hpa sft's loss on the same examples: the NLL per response token, summed over micro-batches
    from hpa.engine.head import label_log_probs

    mbs = replay_mbs(2, kind="sft")
    tokens = sum(float(mb["label_mask"].sum()) for mb in mbs)

    def sft_nll(batch, logits, hidden):
        logp = label_log_probs(batch, logits, groups.tp_group, vocab_size=VOCAB)
        share = -(logp * batch["label_mask"]).sum() / tokens
        return share, {"sft/nll": share.detach()}

    policy.zero_grad_buffer()
    records = forward_backward(policy, mbs, sft_nll, groups)
    out["sft_grad"] = torch.cat([prm.main_grad.flatten().clone() for prm in policy.parameters()]).numpy()
    out["sft_nll"] = objective.step_metrics(records, groups, share_keys=frozenset({"sft/nll"}))["sft/nll"]
    return out


@pytest.fixture(scope="module")
def grads():
    return run_ranks(gradients_worker)[0]


def test_w_dpo_zero_is_plain_ppo(grads):
    np.testing.assert_allclose(grads["no_dpo"], grads["ppo_only_data"], atol=1e-7)


def test_w_ppo_and_w_kl_zero_is_plain_dpo(grads):
    np.testing.assert_allclose(grads["dpo_only"], grads["dpo_only_data"], atol=1e-7)
    np.testing.assert_allclose(grads["dpo_only"], 0.4 * grads["dpo_unit"], atol=1e-7)


def test_mixed_gradient_is_the_weighted_sum(grads):
    np.testing.assert_allclose(grads["mixed"], grads["ppo_part"] + grads["dpo_only"] + grads["kl_part"],
                               atol=1e-6)
    assert np.abs(grads["kl_part"]).max() > 0 and np.abs(grads["ppo_part"]).max() > 0


def test_micro_batching_does_not_change_the_step(grads):
    np.testing.assert_allclose(grads["mixed_split"], grads["mixed"], atol=1e-6)
    for key in ("dpo/loss", "actor/pg_loss", "kl/token", "kl/semantic"):
        assert grads["split_metrics"][key] == pytest.approx(grads["mixed_metrics"][key], rel=1e-5, abs=1e-7)


def test_importance_weights_reach_the_policy_loss(grads):
    """The rollout correction's IS weights (``algorithm.rollout_correction.rollout_is``) multiply each token's PPO loss:
    a constant weight of 2 doubles the policy-gradient step."""
    assert np.abs(grads["pg_plain"]).max() > 0
    np.testing.assert_allclose(grads["pg_is_2"], 2.0 * grads["pg_plain"], atol=1e-7)


def test_importance_weights_reach_both_kl_terms(grads):
    """The same weights multiply the token KL and the semantic distance (by the row's mean weight): a constant
    weight of 2 doubles the hierarchical-KL step; the logged KL stays the policy's, unweighted."""
    assert np.abs(grads["kl_plain"]).max() > 0
    np.testing.assert_allclose(grads["kl_is_2"], 2.0 * grads["kl_plain"], atol=1e-7)
    for key in ("kl/token", "kl/semantic"):
        assert grads["kl_is_2_metrics"][key] == pytest.approx(grads["kl_plain_metrics"][key], rel=1e-6)


def test_the_sft_replay_is_hpa_sfts_loss_weighted_and_split_freely(grads):
    """The replay term (``algorithm.replay``) on the SFT examples is ``hpa sft``'s NLL per token (value and
    gradient) times ``w_dpo · b · coef``; over three micro-batches as over one; in a mixed step it adds its own
    part and nothing else, and with coef 0 it is absent."""
    assert grads["replay_metrics"]["replay/nll"] == pytest.approx(grads["sft_nll"], rel=1e-6)
    np.testing.assert_allclose(grads["replay_unit"], grads["sft_grad"], atol=1e-7)
    assert np.abs(grads["replay_unit"]).max() > 0
    assert grads["replay_split_metrics"]["replay/nll"] == pytest.approx(grads["sft_nll"], rel=1e-6)
    np.testing.assert_allclose(grads["replay_split"], 0.5 * 2.0 * 0.5 * grads["replay_unit"], atol=1e-7)
    np.testing.assert_allclose(grads["mixed_replay"], grads["mixed"] + 0.4 * 0.5 * grads["replay_unit"], atol=1e-6)
    np.testing.assert_allclose(grads["mixed_replay_off"], grads["mixed"], atol=1e-7)


def test_dpo_loss_metric_is_the_pair_mean(grads):
    # at the reference-free start the logits are small: the sigmoid DPO loss is near log 2
    assert grads["dpo_metrics"]["dpo/loss"] == pytest.approx(np.log(2), abs=0.2)
