"""CUDA-graph decode of the native engine against eager decode, on one CUDA GPU.

NEVER RUN YET: written on a machine without a GPU. The static-shape step it captures runs on CPU in
``tests/rollout/test_static_decode.py`` (equal to eager decode there); this file checks what only a GPU
can: the capture, the replay, in-place weight updates seen by a captured graph (kept by ``sync_weights``
and ``sleep``: one capture per bucket for the run), the speed-up, and bf16 (the dtype of the GPU check).
Run with ``pytest -m gpu tests/gpu/test_graph_decode.py -s``.
"""

import time

import pytest
import torch

from multirank import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 1024
# launch-bound on purpose: 24 narrow layers, as the 0.5B decode is at any batch
MODEL = dict(num_layers=24, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
             vocab_size=VOCAB, max_sequence_length=256, transformer_impl="local", init_method_std=0.1)


def prompt_lists(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def worker(groups):
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import SamplingParams, TokenizerInfo
    from hpa.rollout.megatron_engine import MegatronRolloutEngine

    torch.manual_seed(0)
    model = build_policy(ModelConfig(**MODEL), ParallelConfig(), groups)
    info = TokenizerInfo(vocab_size=VOCAB, eos_token_id=2, pad_token_id=0)
    engines = {d: MegatronRolloutEngine(model, groups, info, decode=d) for d in ("eager", "static", "graph")}
    out = {"auto": MegatronRolloutEngine(model, groups, info).decode}

    def run(decode, ps, params):
        b = engines[decode].generate(ps, params)
        return {"ids": b.response_ids, "mask": b.response_mask, "logp": b.log_probs,
                "finish": list(b.finish_reasons)}

    greedy = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    for n in (1, 3, 17):
        ps = prompt_lists(n, n)
        eager = run("eager", ps, greedy)
        seen = [t for row in eager["ids"].tolist() for t in row[4:]]
        stopping = SamplingParams(temperature=0.0, max_new_tokens=32, stop_token_ids=(seen[len(seen) // 2],))
        sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=7, ignore_eos=True)
        for name, params in [("greedy", greedy), ("stopped", stopping), ("sampled", sampled)]:
            out[(n, name)] = {d: run(d, ps, params) for d in ("eager", "static", "graph")}

    # in-place weight change without a sync: the captured graph reads the new values
    graph_engine, ps = engines["graph"], prompt_lists(3, 3)
    run("graph", ps, greedy)
    captured = graph_engine._steps[(4, 128)]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    out["inplace"] = {d: run(d, ps, greedy) for d in ("eager", "graph")}
    out["inplace_reused"] = graph_engine._steps[(4, 128)] is captured
    captures = graph_engine.captures
    graph_engine.sync_weights()
    graph_engine.sleep()
    out["after_sync"] = {"graph": run("graph", ps, greedy)}
    out["kept_after_sync"] = graph_engine._steps[(4, 128)] is captured and graph_engine.captures == captures
    out["decoded"] = graph_engine.decoded

    # per-token time at batch 64, 128 new tokens (the prefill included), after one warm call
    timing = SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
    ps = prompt_lists(64, 64)
    for d in ("eager", "graph"):
        engines[d].generate(ps, timing)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engines[d].generate(ps, timing)
        torch.cuda.synchronize()
        out[f"ms_per_token_step_{d}"] = (time.perf_counter() - t0) / 128 * 1e3
    return out


@pytest.fixture(scope="module")
def res():
    r = run_ranks(worker, parallel_kwargs={"backend": "nccl"})[0]
    print({k: v for k, v in r.items() if isinstance(k, str) and k.startswith("ms_")})
    return r


def _same(a, b, atol):
    assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["mask"], b["mask"]) and a["finish"] == b["finish"]
    torch.testing.assert_close(a["logp"], b["logp"], atol=atol, rtol=0)


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("name", ["greedy", "stopped", "sampled"])
def test_graph_decode_equals_eager_decode(res, n, name):
    r = res[(n, name)]
    _same(r["graph"], r["static"], atol=1e-6)  # the replay runs the captured kernels of the same step
    _same(r["graph"], r["eager"], atol=1e-4)  # fp32, 24 layers: attention over the static slots rounds differently


def test_auto_decode_is_graph_on_cuda(res):
    assert res["auto"] == "graph"


def test_captured_graph_sees_in_place_weight_updates_and_sync_keeps_it(res):
    assert res["inplace_reused"] and res["kept_after_sync"] and res["decoded"] == "graph"
    _same(res["inplace"]["graph"], res["inplace"]["eager"], atol=1e-4)
    _same(res["after_sync"]["graph"], res["inplace"]["eager"], atol=1e-4)


def test_graph_decode_is_faster(res):
    """The issue's target is 5x on the 0.5B shape at batch 64 (bench/rollout_vs_hf.py); this narrow
    24-layer model is launch-bound, so the graph should at least halve the step."""
    assert res["ms_per_token_step_graph"] * 2 < res["ms_per_token_step_eager"], res


def bf16_worker(groups):
    """bf16 weights (the GPU check's dtype): graph against static decode (the same kernels: equal) and against
    eager decode (attention over the static slots rounds differently: log-probs close, in bf16's rounding)."""
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import SamplingParams, TokenizerInfo
    from hpa.rollout.megatron_engine import MegatronRolloutEngine

    torch.manual_seed(0)
    model = build_policy(ModelConfig(**MODEL, params_dtype="bfloat16"), ParallelConfig(), groups)
    info = TokenizerInfo(vocab_size=VOCAB, eos_token_id=2, pad_token_id=0)
    engines = {d: MegatronRolloutEngine(model, groups, info, decode=d) for d in ("eager", "static", "graph")}
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=7, ignore_eos=True)
    out = {}
    for d, engine in engines.items():
        b = engine.generate(prompt_lists(17, 17), sampled)
        out[d] = {"ids": b.response_ids, "mask": b.response_mask, "logp": b.log_probs, "finish": list(b.finish_reasons)}
    out["decoded"], out["captures"] = engines["graph"].decoded, engines["graph"].captures
    return out


def test_bf16_graph_decode_equals_static_and_is_close_to_eager():
    r = run_ranks(bf16_worker, parallel_kwargs={"backend": "nccl"})[0]
    assert r["decoded"] == "graph" and r["captures"] == 1
    _same(r["graph"], r["static"], atol=0.0)
    # teacher-forced on graph's tokens the eager log-probs would compare exactly; sampled separately, rows whose
    # tokens agree must have close log-probs
    agree = (r["graph"]["ids"] == r["eager"]["ids"]).all(dim=1)
    assert agree.float().mean() >= 0.5, agree
    gap = (r["graph"]["logp"][agree] - r["eager"]["logp"][agree]).abs()
    assert gap.mean() < 3e-2 and gap.max() < 0.3, gap
