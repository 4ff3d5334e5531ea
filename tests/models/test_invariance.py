"""Layout invariance: one checkpoint under TP1, TP2, PP2 and TP2xPP2 gives the same token
log-probs, entropy and hidden states, and the same parameters after one optimizer step."""

import numpy as np
import pytest
import torch

from multirank import layout_id, run_ranks

pytestmark = pytest.mark.multirank

ATOL = 1e-5
VOCAB = 64


def tiny_model_config():
    from hpa.config.schema import ModelConfig

    return ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=VOCAB, max_sequence_length=32,
                       make_vocab_size_divisible_by=16)


def micro_batches(num=2, b=2, s=10):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(num):
        ids = torch.randint(0, VOCAB, (b, s + 1), generator=g)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:],
                    "position_ids": torch.arange(s).expand(b, s)})
    return out


def _setup(groups, ckpt_in):
    from hpa.config.schema import OptimConfig, ParallelConfig
    from hpa.models import build_policy
    from hpa.models.weights import load_model_weights
    from hpa.engine.optimizer import build_optimizer, wrap_ddp

    parallel = ParallelConfig(tensor_model_parallel_size=groups.tensor_model_parallel_size,
                              pipeline_model_parallel_size=groups.pipeline_model_parallel_size)
    model = build_policy(tiny_model_config(), parallel, groups)
    load_model_weights(model, ckpt_in, groups)
    ddp = wrap_ddp(model, parallel, groups)
    opt = build_optimizer(ddp, OptimConfig(lr=1e-3, clip_grad=0.0), parallel, groups)
    return ddp, opt


def save_initial_worker(groups, ckpt_dir):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.models.weights import save_model_weights

    torch.manual_seed(0)
    save_model_weights(build_policy(tiny_model_config(), ParallelConfig(), groups), ckpt_dir, groups)


def layout_worker(groups, ckpt_in, ckpt_out):
    """Forward (log-probs, entropy, hidden) then one NLL step; saves the updated weights."""
    from hpa.ops.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs
    from hpa.models.weights import save_model_weights
    from hpa.engine.step import forward_backward, optimizer_step, zero_grad

    ddp, opt = _setup(groups, ckpt_in)
    mbs = micro_batches()
    num_tokens = sum(mb["labels"].numel() for mb in mbs)

    def inspect(batch, logits, hidden):
        logp = vocab_parallel_log_probs(logits, batch["labels"], groups.tp_group)
        ent = vocab_parallel_entropy(logits, groups.tp_group)
        return logits.sum() * 0, {"logp": logp.detach(), "ent": ent.detach(), "hidden": hidden.detach()}

    with torch.no_grad():
        fwd = forward_backward(ddp, mbs, inspect, groups, forward_only=True, capture_hidden=True)

    def nll(batch, logits, hidden):
        logp = vocab_parallel_log_probs(logits, batch["labels"], groups.tp_group)
        return -logp.sum() / num_tokens, {}

    zero_grad(ddp, opt)
    forward_backward(ddp, mbs, nll, groups)
    updated, grad_norm = optimizer_step(opt)
    save_model_weights(ddp, ckpt_out, groups)
    if not groups.is_last_stage:
        return None
    return {k: torch.cat([m[k] for m in fwd]).numpy() for k in ("logp", "ent", "hidden")} | {
        "grad_norm": grad_norm, "updated": updated}


def read_weights_worker(groups, ckpt_dirs):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.models.weights import load_model_weights

    out = []
    for d in ckpt_dirs:
        model = build_policy(tiny_model_config(), ParallelConfig(), groups)
        load_model_weights(model, d, groups)
        out.append({k: v.detach().numpy().copy() for k, v in model.state_dict().items()
                    if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")})
    return out


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    init = root / "init"
    run_ranks(save_initial_worker, args=(str(init),))
    per_layout, ckpts = {}, []
    for tp, pp in LAYOUTS:
        out = root / layout_id(tp, pp)
        ranks = run_ranks(layout_worker, tp=tp, pp=pp, args=(str(init), str(out)))
        per_layout[(tp, pp)] = ranks[-1]  # the last global rank is on the last stage
        ckpts.append(str(out))
    weights = run_ranks(read_weights_worker, args=(ckpts,))[0]
    return per_layout, dict(zip(LAYOUTS, weights))


@pytest.mark.parametrize("tp,pp", LAYOUTS[1:], ids=[layout_id(tp, pp) for tp, pp in LAYOUTS[1:]])
def test_forward_matches_tp1(results, tp, pp):
    per_layout, _ = results
    ref, got = per_layout[(1, 1)], per_layout[(tp, pp)]
    for key in ("logp", "ent", "hidden"):
        np.testing.assert_allclose(got[key], ref[key], atol=ATOL, rtol=0, err_msg=key)
    assert got["updated"] and ref["updated"]
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("tp,pp", LAYOUTS[1:], ids=[layout_id(tp, pp) for tp, pp in LAYOUTS[1:]])
def test_parameters_after_one_step_match_tp1(results, tp, pp):
    _, weights = results
    ref, got = weights[(1, 1)], weights[(tp, pp)]
    assert ref.keys() == got.keys()
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], atol=ATOL, rtol=0, err_msg=name)


def test_step_changed_the_parameters(results, tmp_path):
    """Guards the test above: the compared weights did move in the step."""
    per_layout, weights = results
    assert per_layout[(1, 1)]["grad_norm"] > 0
    assert per_layout[(1, 1)]["logp"].shape == (4, 10)
    assert per_layout[(1, 1)]["hidden"].shape == (4, 10, 32)
