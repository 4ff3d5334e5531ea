"""Sequence packing is invisible to the numbers: the same rows packed into one sequence (megatron's THD
packed-sequence parameters, attention kept inside each row) give, within 1e-5 in fp32, the padded layout's
log-probs, pooled hidden states, critic values, reward-model scores and embeddings, every loss term of the mixed HPA step and the critic, and
the parameters after one optimizer step -- at TP1, TP2 with sequence parallelism and PP2. Plus the layout
itself (``MicroBatch``) against hand-built values."""

import numpy as np
import pytest
import torch

from multirank import layout_id, run_ranks

from hpa.trainer.objective import SHARE_KEYS

ATOL = 1e-5
VOCAB = 48
HIDDEN = 32


def _model_cfg():
    from hpa.config.schema import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=VOCAB, max_sequence_length=32, make_vocab_size_divisible_by=16,
                       untie_embeddings_and_output_weights=True)


def _rollout_batch():
    """Six rows of 2..7 prompt and 1..6 response tokens (11 + 6 = 17 real positions in the first micro-batch
    of two rows: odd, so TP2 with sequence parallelism pads the pack)."""
    from hpa.rollout.base import RolloutBatch

    g = torch.Generator().manual_seed(3)
    b, p, r = 6, 7, 6
    prompt_len = torch.tensor([7, 2, 5, 3, 6, 4])
    response_len = torch.tensor([4, 1, 6, 2, 5, 3])
    prompt_mask = (torch.arange(p)[None, :] >= (p - prompt_len)[:, None]).long()  # left-padded
    response_mask = (torch.arange(r)[None, :] < response_len[:, None]).float()
    batch = RolloutBatch(prompt_ids=torch.randint(1, VOCAB, (b, p), generator=g) * prompt_mask,
                         prompt_mask=prompt_mask,
                         response_ids=(torch.randint(1, VOCAB, (b, r), generator=g) * response_mask).long(),
                         response_mask=response_mask, log_probs=torch.zeros(b, r), finish_reasons=["stop"] * b,
                         group_ids=torch.tensor([0, 0, 1, 1, 2, 2]))
    batch.set("mask", response_mask)
    batch.set("old_log_probs", -3.5 + 0.3 * torch.randn(b, r, generator=g))
    batch.set("ref_log_probs", -3.7 + 0.3 * torch.randn(b, r, generator=g))
    batch.set("ref_pooled", torch.randn(b, HIDDEN, generator=g))
    batch.set("advantages", torch.randn(b, r, generator=g) * response_mask)
    batch.set("returns", torch.randn(b, r, generator=g) * response_mask)
    batch.set("values", torch.randn(b, r, generator=g) * response_mask)
    return batch


class _Pair:
    def __init__(self, prompt, chosen, rejected):
        self.chosen_input_ids = prompt + chosen
        self.rejected_input_ids = prompt + rejected
        self.chosen_response_mask = [0] * len(prompt) + [1] * len(chosen)
        self.rejected_response_mask = [0] * len(prompt) + [1] * len(rejected)


PAIRS = [_Pair([5, 6, 7], [8, 9], [10, 11, 12, 3, 4]), _Pair([13, 14], [15], [16, 17]),
         _Pair([18], [19, 20, 21, 22, 23, 24, 25], [26]), _Pair([27, 28, 29, 30], [31, 32], [33])]


def save_initial_worker(groups, policy_dir, critic_dir, reward_dir):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy, build_reward, build_value
    from hpa.models.weights import save_model_weights

    torch.manual_seed(0)
    save_model_weights(build_policy(_model_cfg(), ParallelConfig(), groups), policy_dir, groups)
    save_model_weights(build_value(_model_cfg(), ParallelConfig(), groups), critic_dir, groups)
    save_model_weights(build_reward(_model_cfg(), ParallelConfig(), groups, num_heads=3), reward_dir, groups)


def packing_worker(groups, policy_dir, critic_dir, reward_dir, sequence_parallel):
    from hpa.config.algorithm import AlgorithmConfig
    from hpa.config.schema import OptimConfig, ParallelConfig
    from hpa.engine import forward
    from hpa.engine.batching import Batching
    from hpa.engine.optimizer import build_optimizer, wrap_ddp
    from hpa.engine.step import forward_backward, optimizer_step, zero_grad
    from hpa.models import build_policy, build_reward, build_value
    from hpa.models.weights import load_model_weights
    from hpa.reward.model import join_prompt_response, score_sequences
    from hpa.trainer import micro_batches, objective

    parallel = ParallelConfig(tensor_model_parallel_size=groups.tensor_model_parallel_size,
                              pipeline_model_parallel_size=groups.pipeline_model_parallel_size,
                              sequence_parallel=sequence_parallel)
    algo = AlgorithmConfig()
    weights = objective.StepWeights(w_ppo=0.4, w_dpo=0.4, w_kl=0.2, lambda_token=0.7, lambda_semantic=0.5,
                                    entropy_coef=0.01, reward_kl_coef=0.0)
    batch = _rollout_batch()
    ts, lengths = batch.sequences, batch.sequence_lengths
    out = {}
    for name, packed, budget in (("padded", False, None), ("packed", True, None), ("packed_budget", True, 20)):
        policy = build_policy(_model_cfg(), parallel, groups)
        load_model_weights(policy, policy_dir, groups)
        critic = build_value(_model_cfg(), parallel, groups)
        load_model_weights(critic, critic_dir, groups)
        # with a budget the forward-only passes regroup rows too (trainer.log_prob_max_token_len_per_rank)
        batching = Batching(micro_batch_size=2, pad_id=0, packed=packed, forward_token_budget=budget,
                            update_token_budget=budget)
        kw = dict(batching=batching, lengths=lengths)
        res = forward.sequence_log_probs(policy, ts, batch.response_mask, groups, vocab_size=VOCAB, temperature=1.0,
                                         hidden_size=HIDDEN, **kw)
        res["values"] = forward.sequence_values(critic, ts, groups, **kw)
        reward = build_reward(_model_cfg(), parallel, groups, num_heads=3)
        load_model_weights(reward, reward_dir, groups)
        ids, attention, response = join_prompt_response(batch.response_ids, batch.response_mask, 0, batch.prompt_ids,
                                                        batch.prompt_mask)
        res["rewards"], res["embeddings"] = score_sequences(reward, ids, attention, groups, num_heads=3,
                                                            batching=Batching(micro_batch_size=4, pad_id=0,
                                                                              packed=packed),
                                                            pool_mask=response, hidden_size=HIDDEN)
        ref = torch.tensor([[-6.0, -7.0], [-5.0, -8.0], [-4.5, -3.0], [-6.5, -2.0]])  # [m, 2] (chosen, rejected)
        pair_mbs = micro_batches.preference_micro_batches(PAIRS, batching, ref)
        res["pair_logp"] = forward.pair_sequence_log_probs(policy, pair_mbs, groups, vocab_size=VOCAB)
        rollout_mbs = micro_batches.rollout_micro_batches(batch, list(range(6)), batching, groups.dp_group)
        res["rollout_micro_batches"] = len(rollout_mbs)
        assert all(mb.packed == packed for mb in rollout_mbs + pair_mbs)

        ddp = wrap_ddp(policy, parallel, groups)
        opt = build_optimizer(ddp, OptimConfig(lr=1e-3, clip_grad=0.0), parallel, groups)
        counts = objective.global_counts(rollout_mbs, pair_mbs, groups)
        loss_fn = objective.make_policy_loss(algo, weights, counts, groups, vocab_size=VOCAB, temperature=1.0)
        zero_grad(ddp, opt)
        records = forward_backward(ddp, rollout_mbs + pair_mbs, loss_fn, groups, capture_hidden=True)
        res["metrics"] = objective.step_metrics(records, groups)
        optimizer_step(opt)
        res["params"] = torch.cat([p.detach().flatten() for p in ddp.parameters()]).numpy()
        critic_loss = objective.make_critic_loss(algo, objective.global_counts(rollout_mbs, [], groups))
        with torch.no_grad():
            critic_records = forward_backward(critic, rollout_mbs, critic_loss, groups, forward_only=True)
        res["critic_metrics"] = objective.step_metrics(critic_records, groups)
        out[name] = {k: (v.numpy() if torch.is_tensor(v) else v) for k, v in res.items()}
    return out


LAYOUTS = [dict(tp=1, pp=1, sp=False), dict(tp=2, pp=1, sp=True), dict(tp=1, pp=2, sp=False)]


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    dirs = tuple(str(root / name) for name in ("policy", "critic", "reward"))
    run_ranks(save_initial_worker, args=dirs)
    return dirs


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: layout_id(l["tp"], l["pp"]) + ("_sp" if l["sp"] else ""))
def test_packed_equals_padded(initial, layout):
    ranks = run_ranks(packing_worker, tp=layout["tp"], pp=layout["pp"], args=(*initial, layout["sp"]))
    mask = _rollout_batch().response_mask.numpy()  # response tokens (beyond them nothing is defined)
    for rank, out in enumerate(ranks):
        padded = out["padded"]
        for name in ("packed", "packed_budget"):
            got = out[name]
            for key in ("log_probs", "pooled", "values", "pair_logp", "rewards", "embeddings", "params"):
                scale = mask if key in ("log_probs", "values") else 1.0
                np.testing.assert_allclose(got[key] * scale, padded[key] * scale, atol=ATOL, rtol=0,
                                           err_msg=f"rank {rank}, {name}: {key}")
            for group in ("metrics", "critic_metrics"):
                assert set(got[group]) == set(padded[group])
                # regrouped rows (the token budget) keep every loss term; per-micro-batch means (ppo_kl,
                # clip fractions) are averaged over other groups
                keys = padded[group] if name == "packed" else set(padded[group]) & SHARE_KEYS
                for key in keys:
                    value = padded[group][key]
                    assert got[group][key] == pytest.approx(value, abs=ATOL), (rank, name, group, key)
        # the terms compared are real: every loss term present, the step moved the parameters
        assert {"actor/pg_loss", "dpo/loss", "kl/token", "kl/semantic", "actor/entropy"} <= set(padded["metrics"])
        assert abs(padded["metrics"]["kl/semantic"]) > 0 and abs(padded["metrics"]["dpo/loss"]) > 0
        assert out["packed_budget"]["rollout_micro_batches"] != out["packed"]["rollout_micro_batches"]


def test_micro_batch_layout_by_hand():
    """Rows of 3 and 1 tokens: packed ids, positions restarting per row, THD cumulative lengths (with the
    sequence-parallel pad as a sequence of its own), and unpack/pack as exact inverses on real positions."""
    from hpa.engine.micro_batch import MicroBatch

    ids = torch.tensor([[4, 5, 6], [7, 0, 0]])
    labels = torch.tensor([[5, 6, 0], [0, 0, 0]])
    mb = MicroBatch.from_padded("rows", ids, labels, torch.tensor([3, 1]), packed=True,
                                label_mask=torch.tensor([[1., 1., 0.], [0., 0., 0.]]))
    assert mb.input_ids.tolist() == [[4, 5, 6, 7]] and mb.labels.tolist() == [[5, 6, 0, 0]]
    assert mb.position_ids().tolist() == [[0, 1, 2, 0]]
    assert (mb.tokens, mb.computed_tokens, mb.width) == (4, 4, 3)
    params = mb.packed_seq_params(pad=2)
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert params.max_seqlen_q == 3 and params.cu_seqlens_q.dtype == torch.int32
    assert mb.packed_seq_params().cu_seqlens_q.tolist() == [0, 3, 4]
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert mb.unpack(per_token).tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]
    assert torch.equal(mb.pack(mb.unpack(per_token)), per_token)
    padded = MicroBatch.from_padded("rows", ids, labels, torch.tensor([3, 1]))
    assert padded.packed_seq_params() is None and torch.equal(padded.unpack(ids), ids)
    assert (padded.tokens, padded.computed_tokens) == (4, 6)
    with pytest.raises(ValueError, match="row_width"):
        MicroBatch(kind="rows", input_ids=ids[:1, :1], labels=ids[:1, :1], lengths=torch.tensor([1]), packed=True)
