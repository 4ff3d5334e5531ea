"""Static-shape decode: the step that the native engine captures in a CUDA graph on a GPU,
run eagerly on CPU, against today's eager decode.

One TP1/PP1 spawn runs every generate call; the tests compare what it returned:
- greedy tokens equal and log-probs within 1e-6 for prompts of mixed lengths, batch sizes that cross the
  row buckets (1, 3, 5, 9 rows: buckets 1, 4, 8, 16), and EOS / stop ids that end rows at different steps;
- seeded sampling draws the same tokens (padding rows of a bucket are not sampled);
- the decode loop reads the device (``.item``, ``.tolist``, tensor ``bool``, device-to-host copies,
  data-dependent shapes) about once per ``FINISHED_CHECK_EVERY`` steps, where eager decode reads it every step
  (counted in the test device mode, ``hpa/distributed/device_mode.py``);
- a bucket's step is built once for the run: reused across calls, kept by ``sync_weights`` and ``sleep``;
  with a stand-in of the CUDA-graph capture, one capture per bucket across rollouts and weight updates, and
  one more only when a parameter gets new storage; a shorter request runs in the longer bucket of its rows
  (one cache held per row count).

The CUDA graph capture itself runs only on a GPU: ``tests/gpu/test_graph_decode.py``.
"""

import numpy as np
import pytest
import torch

from multirank import run_ranks

pytestmark = pytest.mark.multirank

VOCAB = 64
PAD = 0
MAX_NEW = 12
BATCH_SIZES = (1, 3, 5, 9)


def tiny_model_config():
    from hpa.config.schema import ModelConfig

    # init std 0.1: greedy picks far from ties, logits small enough that fp32 rounding stays below 1e-6
    # (at 0.3 the eager cache and a full recompute differ by 1e-5 already)
    return ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=VOCAB, max_sequence_length=48,
                       make_vocab_size_divisible_by=16, init_method_std=0.1)


def prompt_lists(n):
    g = torch.Generator().manual_seed(n)
    return [torch.randint(2, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy", "nonzero",
                "masked_select", "unique")


class SyncCounter(torch.overrides.TorchFunctionMode):
    """Counts reads of tensor values by the host: what is a host-device sync on a GPU. The engine computes
    on the CPU in the test device mode, so every tensor counts (a boolean-mask index too)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS or (name == "__getitem__" and isinstance(args[1], torch.Tensor)
                                    and args[1].dtype == torch.bool):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def worker(groups):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import SamplingParams, TokenizerInfo
    from hpa.rollout import megatron_engine as me

    torch.manual_seed(0)
    model = build_policy(tiny_model_config(), ParallelConfig(), groups)

    def engine(decode, eos=1):
        return me.MegatronRolloutEngine(model, groups, TokenizerInfo(vocab_size=VOCAB, eos_token_id=eos,
                                                                     pad_token_id=PAD), decode=decode)

    def pack(batch):
        return {k: getattr(batch, k).numpy() for k in ("response_ids", "response_mask", "log_probs", "prompt_ids",
                                                       "prompt_mask")} | {"finish_reasons": list(batch.finish_reasons)}

    out = {"auto_on_cpu": engine("auto").decode}
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    for n in BATCH_SIZES:
        ps = prompt_lists(n)
        full = engine("eager").generate(ps, greedy)
        # an EOS and a stop id taken from the responses, so rows end at different steps
        seen = [t for row in full.response_ids.tolist() for t in row[2:]]
        eos, stop = seen[0], seen[len(seen) // 2]
        stopping = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop_token_ids=(stop,))
        sampled = SamplingParams(n=2, temperature=1.0, top_k=20, max_new_tokens=MAX_NEW, seed=3)
        for name, params, e in [("greedy", greedy, 1), ("stopped", stopping, eos), ("sampled", sampled, eos)]:
            out[(n, name)] = {mode: pack(engine(mode, e).generate(ps, params)) for mode in ("eager", "static")}

    e = engine("static")
    ps, params = prompt_lists(3), greedy
    e.generate(ps, params)
    first = e._steps[(4, 48)]
    e.generate(prompt_lists(4), params)
    out["reused"] = e._steps[(4, 48)] is first
    e.sync_weights()
    e.sleep()
    e.generate(ps, params)
    out["kept_after_sync_and_sleep"] = e._steps[(4, 48)] is first
    try:
        me.MegatronRolloutEngine(model, groups, TokenizerInfo(vocab_size=VOCAB, eos_token_id=1, pad_token_id=PAD),
                                 decode="graph")
    except ValueError as err:
        out["graph_on_cpu_error"] = str(err)
    return out


def sync_worker(groups):
    """Host reads of whole generate calls (prompts built outside), in the test device mode."""
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import SamplingParams, TokenizerInfo
    from hpa.rollout import megatron_engine as me

    torch.manual_seed(0)
    model = build_policy(tiny_model_config(), ParallelConfig(), groups)
    info = TokenizerInfo(vocab_size=VOCAB, eos_token_id=1, pad_token_id=PAD)

    def syncs(decode, max_new):
        e = me.MegatronRolloutEngine(model, groups, info, decode=decode)
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
        ps = prompt_lists(3)
        e.generate(ps, params)  # build the bucket's step first
        with SyncCounter() as counter:
            e.generate(ps, params)
        return len(counter.calls)

    return {"device": groups.device.type, "check_every": me.FINISHED_CHECK_EVERY,
            "syncs": {(d, m): syncs(d, m) for d in ("eager", "static") for m in (8, 16, 32)}}


def captures_worker(groups):
    """Graph decode with a stand-in of the capture (``tests/rollout/test_cuda_graph.py``'s ``FakeGraphs``) over
    several rollouts of two buckets, each followed by an in-place weight update, ``sync_weights`` and ``sleep``
    as the trainer does; then a parameter given new storage."""
    from test_cuda_graph import FakeGraphs

    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import SamplingParams, TokenizerInfo, cuda_graph
    from hpa.rollout import megatron_engine as me

    fake = cuda_graph.GRAPHS = FakeGraphs()
    torch.manual_seed(0)
    model = build_policy(tiny_model_config(), ParallelConfig(), groups)
    info = TokenizerInfo(vocab_size=VOCAB, eos_token_id=1, pad_token_id=PAD)
    graph, eager = (me.MegatronRolloutEngine(model, groups, info, decode=d) for d in ("graph", "eager"))
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    out = {"same": [], "decoded": set()}
    for rollout in range(3):
        for n in (3, 6):  # buckets of 4 and 8 rows
            got, want = graph.generate(prompt_lists(n), params), eager.generate(prompt_lists(n), params)
            out["same"].append(torch.equal(got.response_ids, want.response_ids))
            out["decoded"].add(graph.decoded)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))  # the optimizer's step: in place
        graph.sync_weights()
        graph.sleep()
    out["captures"], out["engine_captures"] = fake.captures, graph.captures
    out["metrics"], out["eager_metrics"] = graph.decode_metrics(), eager.decode_metrics()
    with torch.no_grad():
        p = next(model.parameters())
        p.data = p.data.clone()  # same values, new storage: a captured graph would read the old one
    graph.generate(prompt_lists(3), params)
    out["after_storage"] = fake.captures
    return out


def slots_worker(groups):
    """Graph decode (the capture's stand-in) of three rows with prompts of 2, 8, 3 and 2 tokens, cache slots in
    blocks of 8: 14 positions need 16 slots, 20 need 24."""
    from test_cuda_graph import FakeGraphs

    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import SamplingParams, TokenizerInfo, cuda_graph
    from hpa.rollout import megatron_engine as me

    fake = cuda_graph.GRAPHS = FakeGraphs()
    me.SLOT_BLOCK = 8
    torch.manual_seed(0)
    model = build_policy(tiny_model_config(), ParallelConfig(), groups)
    info = TokenizerInfo(vocab_size=VOCAB, eos_token_id=1, pad_token_id=PAD)
    graph, eager = (me.MegatronRolloutEngine(model, groups, info, decode=d) for d in ("graph", "eager"))
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    out = {"same": [], "buckets": [], "captures": []}
    for length in (2, 8, 3, 2):
        prompts = [[5 + i] * length for i in range(3)]
        got, want = graph.generate(prompts, params), eager.generate(prompts, params)
        out["same"].append(torch.equal(got.response_ids, want.response_ids)
                           and torch.allclose(got.log_probs, want.log_probs, atol=1e-6, rtol=0))
        out["buckets"].append(sorted(graph._steps))
        out["captures"].append(fake.captures)
    return out


def test_a_shorter_request_reuses_the_longer_bucket_and_one_cache_is_held_per_row_count():
    """Prompts of varying length hold one cache per row count (the longest request's) and capture again only
    when a request is longer than any before, not once per length (``megatron_engine.bucket_for``)."""
    out = run_ranks(slots_worker)[0]
    assert all(out["same"]), out["same"]  # the extra slots stay masked: the tokens and log-probs of eager decode
    assert out["buckets"] == [[(4, 16)], [(4, 24)], [(4, 24)], [(4, 24)]]
    assert out["captures"] == [1, 2, 2, 2]


def test_bucket_for_picks_the_smallest_held_bucket_that_fits():
    from hpa.rollout.megatron_engine import bucket_for

    held = {(4, 128): 0, (4, 256): 0, (8, 128): 0}
    assert bucket_for(held, 4, 100) == (4, 128)
    assert bucket_for(held, 4, 200) == (4, 256)
    assert bucket_for(held, 4, 300) == (4, 300)  # longer than any held: a new bucket
    assert bucket_for(held, 16, 100) == (16, 100)  # another row count
    assert bucket_for({}, 4, 100) == (4, 100)


def test_graph_decode_captures_once_per_bucket_for_the_run():
    out = run_ranks(captures_worker)[0]
    assert all(out["same"]) and len(out["same"]) == 6 and out["decoded"] == {"graph"}
    assert out["captures"] == 2 == out["engine_captures"]  # two buckets, three rollouts, three weight updates
    assert out["after_storage"] == 3  # the bucket used again captures again
    assert out["metrics"] == {"rollout/decode_graph": 1.0, "rollout/graph_captures": 2.0,
                              "rollout/decode_buckets": 2.0}
    assert out["eager_metrics"] == {}  # an engine that decodes eagerly from the start adds no keys


@pytest.fixture(scope="module")
def res():
    return run_ranks(worker)[0]


@pytest.mark.parametrize("n", BATCH_SIZES)
@pytest.mark.parametrize("name", ["greedy", "stopped", "sampled"])
def test_static_decode_equals_eager(res, n, name):
    eager, static = res[(n, name)]["eager"], res[(n, name)]["static"]
    for key in ("response_ids", "response_mask", "prompt_ids", "prompt_mask"):
        np.testing.assert_array_equal(static[key], eager[key], err_msg=key)
    assert static["finish_reasons"] == eager["finish_reasons"]
    # fp32 rounding: attention sums over every static slot (masked) where eager sums over the prefix
    np.testing.assert_allclose(static["log_probs"], eager["log_probs"], atol=1e-6, rtol=0)


def test_stops_end_rows_at_different_steps(res):
    """The stopping cases are not vacuous: some rows stop, at more than one step, and before MAX_NEW."""
    lengths = set()
    for n in BATCH_SIZES[1:]:
        got = res[(n, "stopped")]["static"]
        assert "stop" in got["finish_reasons"]
        lengths |= set(got["response_mask"].sum(1).astype(int).tolist())
    assert len(lengths) >= 3 and min(lengths) < MAX_NEW


def test_decode_loop_reads_the_device_once_per_check_interval(monkeypatch):
    monkeypatch.setenv("HPA_TEST_MODEL_DEVICE", "lazy")
    res = run_ranks(sync_worker)[0]
    assert res["device"] == "lazy"
    syncs, k = res["syncs"], res["check_every"]
    # eager: at least one read per step (the finished check, and the attention mask's all-valid check)
    assert syncs[("eager", 16)] - syncs[("eager", 8)] >= 8
    # static: one read per k >= 8 steps, plus a constant (prefill mask, results to the host)
    assert k >= 8
    for short, long in [(8, 16), (16, 32)]:
        assert syncs[("static", long)] - syncs[("static", short)] == (long - short) // k
    assert syncs[("static", 32)] <= 32 // k + 9, syncs


def test_a_bucket_step_is_built_once_for_the_run(res):
    assert res["reused"] and res["kept_after_sync_and_sleep"]


def test_graph_decode_is_off_on_cpu(res):
    assert res["auto_on_cpu"] == "eager"
    assert "needs the parameters on CUDA" in res["graph_on_cpu_error"]
    assert "rollout.cuda_graphs=false" in res["graph_on_cpu_error"]
