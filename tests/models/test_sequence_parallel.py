"""Sequence parallelism on CPU (gloo): TP2 with sequence parallelism equals TP2 without it.

Compared on odd micro-batch widths (7 and 9, padded to a multiple of TP inside ``forward_backward``):
the policy's token log-probs, the critic's values, the pooled final hidden states and the semantic
KL they give against a reference, and the parameters after one optimizer step of a loss that uses
both the log-probs and the semantic term (so the norms' gradients, summed over TP under sequence
parallelism, are checked too).
"""

import numpy as np
import pytest
import torch

from multirank import run_ranks

ATOL = 1e-5
VOCAB = 64
WIDTHS = (7, 9)


def _model_config():
    from hpa.config.schema import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=VOCAB, max_sequence_length=32,
                       make_vocab_size_divisible_by=16, untie_embeddings_and_output_weights=True)


def _micro_batches():
    g = torch.Generator().manual_seed(3)
    out = []
    for s in WIDTHS:
        ids = torch.randint(0, VOCAB, (2, s + 1), generator=g)
        pool = (torch.arange(s) >= s // 2).float().expand(2, s).clone()
        pool[1, -1] = 0  # rows end at different positions
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(s).expand(2, s),
                    "pool_mask": pool})
    return out


def sp_worker(groups):
    from hpa.algorithms.kl import semantic_mse
    from hpa.config.schema import OptimConfig, ParallelConfig
    from hpa.models import build_policy, build_reference, build_value
    from hpa.algorithms.masked import mean_pool
    from hpa.ops.vocab_parallel import vocab_parallel_log_probs
    from hpa.engine.optimizer import build_optimizer, wrap_ddp
    from hpa.engine.step import forward_backward, optimizer_step, zero_grad

    cfg = _model_config()
    mbs = _micro_batches()
    num_tokens = sum(mb["labels"].numel() for mb in mbs)
    results, weights = {}, {}
    for sp in (False, True):
        parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp)
        models = {}
        for seed, (name, build) in enumerate([("policy", build_policy), ("reference", build_reference),
                                              ("value", build_value)]):
            torch.manual_seed(seed)
            models[name] = build(cfg, parallel, groups)
            params = dict(models[name].named_parameters())
            if sp:  # the very same weights as the run without sequence parallelism
                assert params.keys() == weights[name].keys()
                with torch.no_grad():
                    for k, v in params.items():
                        v.copy_(weights[name][k])
            else:
                weights[name] = {k: v.detach().clone() for k, v in params.items()}
        assert models["policy"].config.sequence_parallel is sp

        def read(batch, logits, hidden):
            return logits.sum() * 0, {"logp": vocab_parallel_log_probs(logits, batch["labels"], groups.tp_group),
                                      "pooled": mean_pool(hidden, batch["pool_mask"])}

        with torch.no_grad():
            pol = forward_backward(models["policy"], mbs, read, groups, forward_only=True, capture_hidden=True)
            ref = forward_backward(models["reference"], mbs, read, groups, forward_only=True, capture_hidden=True)
            val = forward_backward(models["value"], mbs, lambda b, v, h: (v.sum() * 0, {"values": v[..., 0]}),
                                   groups, forward_only=True)
        for mb, r in zip(mbs, ref):
            mb["ref_pooled"] = r["pooled"]

        ddp = wrap_ddp(models["policy"], parallel, groups)
        opt = build_optimizer(ddp, OptimConfig(lr=1e-2, clip_grad=0.0), parallel, groups)

        def loss_fn(batch, logits, hidden):
            logp = vocab_parallel_log_probs(logits, batch["labels"], groups.tp_group)
            semantic = semantic_mse(mean_pool(hidden, batch["pool_mask"]), batch["ref_pooled"])  # [b]
            return -logp.sum() / num_tokens + 10.0 * semantic.sum() / 4, {}

        zero_grad(ddp, opt)
        forward_backward(ddp, mbs, loss_fn, groups, capture_hidden=True)
        updated, grad_norm = optimizer_step(opt)
        results[sp] = {
            "logp": [p["logp"].numpy() for p in pol],
            "values": [v["values"].numpy() for v in val],
            "pooled": [p["pooled"].numpy() for p in pol],
            "semantic": [semantic_mse(p["pooled"], r["pooled"]).numpy() for p, r in zip(pol, ref)],
            "grad_norm": grad_norm, "updated": updated,
            "params": {k: v.detach().clone().numpy() for k, v in models["policy"].named_parameters()},
        }
    return results


def test_pad_sequence_to_a_multiple_of_tp():
    from hpa.engine.step import pad_sequence

    ids, pos = torch.tensor([[5, 6, 7], [8, 9, 4]]), torch.arange(3).expand(2, 3)
    padded_ids, padded_pos = pad_sequence(ids, pos, 4)
    assert padded_ids.tolist() == [[5, 6, 7, 0], [8, 9, 4, 0]] and padded_pos.tolist() == [[0, 1, 2, 3]] * 2
    assert pad_sequence(ids, pos, 3)[0] is ids and pad_sequence(ids, pos, 1)[1] is pos
    assert pad_sequence(ids[:, :1], pos[:, :1], 2)[1].tolist() == [[0, 1]] * 2


@pytest.fixture(scope="module")
def results():
    return run_ranks(sp_worker, tp=2)


@pytest.mark.multirank
def test_tp2_sequence_parallel_forward_equals_tp2(results):
    for rank in results:
        ref, got = rank[False], rank[True]
        for key in ("logp", "values", "pooled", "semantic"):
            for i, width in enumerate(WIDTHS):
                assert got[key][i].shape == ref[key][i].shape, key
                np.testing.assert_allclose(got[key][i], ref[key][i], atol=ATOL, rtol=0, err_msg=f"{key} width {width}")
        assert ref["logp"][0].shape == (2, 7) and ref["values"][1].shape == (2, 9)
        assert float(np.abs(ref["semantic"][0]).max()) > 1e-3  # policy and reference differ: the term is live


@pytest.mark.multirank
def test_tp2_sequence_parallel_step_equals_tp2(results):
    for rank in results:
        ref, got = rank[False], rank[True]
        assert ref["updated"] and got["updated"] and ref["grad_norm"] > 0
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert ref["params"].keys() == got["params"].keys()
        norms = [k for k in ref["params"] if "layernorm" in k or "final_layernorm" in k]
        assert norms  # the sequence-parallel parameters are among those compared
        for name in ref["params"]:
            np.testing.assert_allclose(got["params"][name], ref["params"][name], atol=ATOL, rtol=0, err_msg=name)
