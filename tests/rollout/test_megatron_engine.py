"""Native Megatron engine under TP1, TP2 and PP2, all from ONE checkpoint (saved at TP1).

One spawn per layout runs every check; the tests below compare what the spawns returned:
- greedy tokens are identical across layouts; seeded samples too;
- the KV-cache decode (hpa's own cache, and megatron's static inference context) equals a no-cache
  full recompute of the same tokens;
- EOS and stop ids end rows on their own (the stopped run is the unstopped run truncated), with the
  right finish reason and length; prompts of different lengths exercise left padding;
- the rollout log-probs equal the training forward's (``forward_backward`` + ``vocab_parallel_log_probs``
  on ``RolloutBatch.training_sequences()``) within 1e-4, at temperature 1 and 0.7.
"""

import numpy as np
import pytest
import torch

import training_forward
from multirank import layout_id, run_ranks

pytestmark = pytest.mark.multirank

VOCAB = 64
PAD = 0
ATOL = 1e-4
MAX_NEW = 8
PROMPT_LENGTHS = (3, 7, 5)
LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def tiny_model_config():
    from hpa.config.schema import ModelConfig

    # A larger init std than the default makes the next-token distribution peaked, so greedy picks
    # are far from ties and EOS/stop tokens actually occur.
    return ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=VOCAB, max_sequence_length=32,
                       make_vocab_size_divisible_by=16, init_method_std=0.3)


def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def choose_stops(response_ids):
    """Two tokens of the unstopped sample (an EOS and a stop id) that end some rows early but not
    all; deterministic in the tokens, so every layout picks the same ones."""
    rows = response_ids.tolist()
    candidates = [t for t in rows[0][1:] + rows[1][2:] if t != PAD]
    for eos in candidates:
        for stop in candidates:
            hit = [eos in r[:-1] or stop in r[:-1] for r in rows]
            if eos != stop and 0 < sum(hit) < len(rows) - 1:
                return eos, stop
    raise AssertionError(f"no EOS/stop pair ends some but not all rows early in {rows}")


def training_log_probs(model, groups, batch, temperature):
    """``[b, r]`` log-probs of the batch's tokens from the training forward (last stage; None elsewhere)."""
    return training_forward.training_log_probs(model, groups, batch, temperature, VOCAB)


def engine_worker(groups, ckpt_dir, save):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import SamplingParams, TokenizerInfo, logprob_consistency
    from hpa.rollout.kv_cache import CachedDecoder
    from hpa.rollout.megatron_engine import MegatronRolloutEngine
    from hpa.models.weights import load_model_weights, save_model_weights

    parallel = ParallelConfig(tensor_model_parallel_size=groups.tensor_model_parallel_size,
                              pipeline_model_parallel_size=groups.pipeline_model_parallel_size)
    if save:
        torch.manual_seed(0)
        save_model_weights(build_policy(tiny_model_config(), parallel, groups), ckpt_dir, groups)
    model = build_policy(tiny_model_config(), parallel, groups)
    load_model_weights(model, ckpt_dir, groups)

    def engine(eos=1, kv="hpa"):
        return MegatronRolloutEngine(model, groups, TokenizerInfo(vocab_size=VOCAB, eos_token_id=eos,
                                                                  pad_token_id=PAD), kv_cache=kv)

    def pack(batch):
        return {"response_ids": batch.response_ids.numpy(), "response_mask": batch.response_mask.numpy(),
                "log_probs": batch.log_probs.numpy(), "finish_reasons": list(batch.finish_reasons),
                "group_ids": batch.group_ids.numpy(), "prompt_ids": batch.prompt_ids.numpy(),
                "prompt_mask": batch.prompt_mask.numpy()}

    ps = prompts()
    out = {}
    greedy = engine().generate(ps, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True))
    sampled = engine().generate(ps, SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                                                   seed=11))
    eos, stop = choose_stops(sampled.response_ids)
    stop_params = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, stop_token_ids=(stop,), seed=11)
    stopped = engine(eos).generate(ps, stop_params)
    stopped_nocache = engine(eos, kv="none").generate(ps, stop_params)
    stopped_megatron = engine(eos, kv="megatron").generate(ps, stop_params)
    greedy_params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    greedy_nocache = engine(kv="none").generate(ps, greedy_params)
    greedy_megatron = engine(kv="megatron").generate(ps, greedy_params)
    # prompts of one length: no padding, so hpa's cache runs SDPA without a mask (causal prefill)
    same_length = [p[:3] for p in ps]
    equal = engine().generate(same_length, greedy_params)
    equal_nocache = engine(kv="none").generate(same_length, greedy_params)
    t07_params = SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=MAX_NEW,
                                stop_token_ids=(stop,), seed=5)
    t07 = engine(eos).generate(ps, t07_params)
    out["eos_stop"] = (eos, stop)
    out["default_kv_cache"] = engine().kv_cache
    out["plain_layers"] = CachedDecoder(model, 1, 8).plain  # the local spec: linears without megatron's wrapper
    try:  # a prompt that leaves no room for max_new_tokens within the model's context
        engine().generate([[3] * 30], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    except ValueError as e:
        out["too_long_error"] = str(e)
    for name, batch in [("greedy", greedy), ("sampled", sampled), ("stopped", stopped),
                        ("stopped_nocache", stopped_nocache), ("greedy_nocache", greedy_nocache), ("t07", t07),
                        ("stopped_megatron", stopped_megatron), ("greedy_megatron", greedy_megatron),
                        ("equal", equal), ("equal_nocache", equal_nocache)]:
        out[name] = pack(batch)
    for name, batch, temperature in [("greedy", greedy, 1.0), ("stopped", stopped, 1.0), ("t07", t07, 0.7),
                                     ("equal", equal, 1.0)]:
        train = training_log_probs(model, groups, batch, temperature)
        if train is not None:
            out[f"train_{name}"] = train.numpy()
            out[f"metrics_{name}"] = logprob_consistency(batch.log_probs, train, batch.response_mask)
    return out


_CACHE = {}


def run_layout(tp, pp, root):
    if (tp, pp) not in _CACHE:
        ckpt = str(root / "ckpt")
        if (tp, pp) != (1, 1):
            run_layout(1, 1, root)
        _CACHE[(tp, pp)] = run_ranks(engine_worker, tp=tp, pp=pp, args=(ckpt, (tp, pp) == (1, 1)))
    return _CACHE[(tp, pp)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    _CACHE.clear()
    return tmp_path_factory.mktemp("rollout")


IDS = [layout_id(tp, pp) for tp, pp in LAYOUTS]


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=IDS)
def test_every_rank_gets_the_same_rollout(root, tp, pp):
    ranks = run_layout(tp, pp, root)
    for other in ranks[1:]:
        for name in ("greedy", "stopped", "t07"):
            for key in ("response_ids", "response_mask", "log_probs", "finish_reasons"):
                np.testing.assert_array_equal(other[name][key], ranks[0][name][key], err_msg=f"{name}.{key}")


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=IDS)
def test_kv_cache_equals_full_recompute(root, tp, pp):
    res = run_layout(tp, pp, root)[-1]
    assert res["default_kv_cache"] == "hpa"  # hpa's own cache, not the fallback to megatron's context
    assert res["plain_layers"] and all(res["plain_layers"])
    for cached, full in [("stopped", "stopped_nocache"), ("greedy", "greedy_nocache"),
                         ("stopped_megatron", "stopped_nocache"), ("greedy_megatron", "greedy_nocache"),
                         ("equal", "equal_nocache")]:
        np.testing.assert_array_equal(res[cached]["response_ids"], res[full]["response_ids"])
        np.testing.assert_array_equal(res[cached]["response_mask"], res[full]["response_mask"])
        np.testing.assert_allclose(res[cached]["log_probs"], res[full]["log_probs"], atol=1e-5, rtol=0)


def test_prompt_longer_than_the_context_is_refused_with_a_clear_message(root):
    res = run_layout(1, 1, root)[-1]
    assert res["too_long_error"] == ("longest prompt (30) + max_new_tokens (8) = 38 exceeds the model's "
                                     "max_sequence_length 32; lower rollout.max_new_tokens or data.max_prompt_length")


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=IDS)
def test_rows_stop_on_their_own(root, tp, pp):
    res = run_layout(tp, pp, root)[-1]
    eos, stop = res["eos_stop"]
    full, got = res["sampled"], res["stopped"]
    assert got["prompt_mask"].sum(1).tolist() == [n for n in PROMPT_LENGTHS for _ in range(2)]
    assert got["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    assert set(got["finish_reasons"]) == {"stop", "length"}
    assert all(r == "length" for r in full["finish_reasons"]) and full["response_mask"].all()
    for i, row in enumerate(full["response_ids"].tolist()):
        hits = [j for j, t in enumerate(row) if t in (eos, stop)]
        length = hits[0] + 1 if hits else MAX_NEW
        assert got["finish_reasons"][i] == ("stop" if hits else "length"), i
        assert got["response_mask"][i].sum() == length, i
        assert got["response_ids"][i, :length].tolist() == row[:length], i  # same draws until it stops
        assert (got["response_ids"][i, length:] == PAD).all() and (got["log_probs"][i, length:] == 0).all()
        np.testing.assert_allclose(got["log_probs"][i, :length], full["log_probs"][i, :length], atol=1e-5)


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=IDS)
def test_rollout_log_probs_match_training_forward(root, tp, pp):
    res = run_layout(tp, pp, root)[-1]
    for name in ("greedy", "stopped", "t07", "equal"):
        mask = res[name]["response_mask"] > 0
        diff = np.abs(res[name]["log_probs"] - res[f"train_{name}"])[mask]
        assert diff.max() < ATOL, (name, diff.max())
        assert res[f"metrics_{name}"]["rollout/logprob_diff_max"] < ATOL
    # Guard: the tokens are not all equally likely, so matching log-probs means something.
    assert np.ptp(res["greedy"]["log_probs"]) > 0.5


@pytest.mark.parametrize("tp,pp", LAYOUTS[1:], ids=IDS[1:])
def test_same_tokens_as_tp1(root, tp, pp):
    ref, got = run_layout(1, 1, root)[-1], run_layout(tp, pp, root)[-1]
    assert got["eos_stop"] == ref["eos_stop"]
    for name in ("greedy", "sampled", "stopped", "t07"):
        np.testing.assert_array_equal(got[name]["response_ids"], ref[name]["response_ids"], err_msg=name)
        assert got[name]["finish_reasons"] == ref[name]["finish_reasons"]
        np.testing.assert_allclose(got[name]["log_probs"], ref[name]["log_probs"], atol=1e-5, rtol=0, err_msg=name)


def test_sampled_rows_differ_within_a_group(root):
    """Guard: the n samples of one prompt are not copies of each other."""
    res = run_layout(1, 1, root)[-1]
    ids = res["sampled"]["response_ids"]
    assert any(not np.array_equal(ids[2 * g], ids[2 * g + 1]) for g in range(len(PROMPT_LENGTHS)))
