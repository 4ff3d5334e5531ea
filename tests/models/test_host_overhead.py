"""The host's cost of a micro-batch (issue: the GPU waits for the host): one attention call per layer for
packed rows, RoPE from per-token positions without host reads, cu_seqlens and positions built once on the
host and copied without blocking. Checked on CPU: against megatron's own unfused kernels, and through
``bench/host_overhead.py``'s counts (aten operations and host-device syncs in the test device mode)."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from multirank import run_ranks

from hpa.distributed.device_mode import StrictDeviceMode, SyncCounter, on_device
from hpa.engine.micro_batch import MicroBatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE = torch.device("lazy", 0)


def _reference_attention(q, k, v, lengths, scale):
    """Causal attention row by row, K/V heads repeated: ``[t, heads, d]``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))  # [h, n, d]
        scores = qs @ ks.transpose(1, 2) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


def _packed(lengths):
    ids = torch.ones(len(lengths), max(lengths), dtype=torch.long)
    return MicroBatch.from_padded("rows", ids, ids, torch.tensor(lengths), packed=True)


def test_chunks_keep_attention_inside_each_row():
    from hpa.models import specs

    params = _packed([2, 1, 3]).packed_seq_params()
    layout = params.hpa_chunks  # one chunk of 6 tokens: the block-diagonal causal mask of the three rows
    assert layout.index.tolist() == [[0, 1, 2, 3, 4, 5]] and layout.inverse.tolist() == list(range(6))
    assert layout.mask()[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
                                                  [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert layout.mask() is layout.mask()  # once per micro-batch, for every layer
    # chunks of at most `budget` tokens of consecutive rows, padded to the longest chunk; a pad sees itself only
    small = specs.ChunkLayout([2, 1, 3], budget=3)
    assert small.index.tolist() == [[0, 1, 2], [3, 4, 5]]
    small = specs.ChunkLayout([3, 1, 1, 2], budget=3)
    assert small.index.tolist() == [[0, 1, 2], [3, 4, 0], [5, 6, 0]] and small.inverse.tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert small.mask()[1, 0].int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]


def test_packed_attention_without_varlen_costs_tokens_times_chunk_not_tokens_squared():
    """Many rows packed on the CPU: the scores of one chunk at a time (``t·c``), not a ``[t, t]`` mask over the
    whole pack (that made the packed DPO step 2.3x slower on long rows), and equal to attention row by row."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpa.models import specs

    lengths = [300, 200, 250, 100, 400, 150, 350, 250] * 3
    mb = _packed(lengths)
    params = mb.packed_seq_params()
    t, heads, d = sum(lengths), 4, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, heads, d, generator=g) for _ in range(3))

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in (out if isinstance(out, (tuple, list)) else (out,)):
                if torch.is_tensor(x):
                    Largest.numel = max(Largest.numel, x.numel() // heads if x.dim() == 4 else x.numel())
            return out

    with Largest():
        out = specs.chunked_causal_attention(q, k, v, params, dropout=0.0, scale=d ** -0.5, gqa=False)
    # chunks padded to the widest: at most twice t·c; a [t, t] mask would be t^2 = 36M
    assert Largest.numel <= 2 * t * max(specs.ATTENTION_CHUNK_TOKENS, max(lengths)) < t * t // 4, Largest.numel
    start = 0
    for n in lengths:  # each row alone, causal
        qr, kr, vr = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=d ** -0.5)
        torch.testing.assert_close(out[start:start + n], ref.transpose(0, 1), rtol=0, atol=1e-5)
        start += n


@pytest.mark.parametrize("flavour", ["window_size", "is_causal"])
def test_varlen_call_on_cuda(monkeypatch, flavour):
    """The CUDA kernel's call (``torch.nn.attention.varlen.varlen_attn``, which needs a GPU), checked with a
    stand-in of either signature: causal through ``window_size=(-1, 0)`` with ``enable_gqa`` (torch 2.13) or
    ``is_causal=True`` with K/V heads repeated by the caller; int32 cu_seqlens, the longest row, the scale."""
    import torch.nn.attention.varlen as varlen

    from hpa.models import specs

    lengths = [3, 1, 4]
    seen = {}

    if flavour == "window_size":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
            assert window_size == (-1, 0) and enable_gqa
            seen.update(cu=cu_seq_q, max=(max_q, max_k), kv_heads=key.shape[1])
            return _reference_attention(query, key, value, lengths, scale)
    else:
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, *, scale=None):
            assert is_causal
            seen.update(cu=cu_seq_q, max=(max_q, max_k), kv_heads=key.shape[1])
            return _reference_attention(query, key, value, lengths, scale)

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(8, 6, 4, generator=g), torch.randn(8, 2, 4, generator=g), torch.randn(8, 2, 4, generator=g)
    params = _packed(lengths).packed_seq_params()
    out = specs.varlen_causal_attention(q, k, v, params, scale=0.5)
    assert seen["cu"].dtype == torch.int32 and seen["cu"].tolist() == [0, 3, 4, 8] and seen["max"] == (4, 4)
    assert seen["kv_heads"] == (2 if flavour == "window_size" else 6)
    torch.testing.assert_close(out, _reference_attention(q, k, v, lengths, 0.5), rtol=0, atol=1e-6)


def test_packed_rope_reads_nothing_on_the_host_and_matches_megatron():
    """RoPE of packed rows from per-token positions equals megatron's THD loop, with no host read of a
    device value (megatron's own path reads cu_seqlens on the host)."""
    import megatron_patches
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    megatron_patches.apply_model_patches()
    lengths = [3, 1, 4]
    g = torch.Generator().manual_seed(1)
    t = torch.randn(8, 3, 8, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    freqs = torch.outer(torch.arange(5).float(), inv)
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d], as megatron's table
    cu = _packed(lengths).packed_seq_params().cu_seqlens_q
    config = types.SimpleNamespace(apply_rope_fusion=False, multi_latent_attention=False, context_parallel_size=1,
                                   rotary_interleaved=False)
    one_rank = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    expected = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=one_rank)
    with StrictDeviceMode(DEVICE), SyncCounter() as syncs:
        got = attention.apply_rotary_pos_emb(on_device(t), on_device(freqs), config, cu_seqlens=on_device(cu))
    assert syncs.count == 0, syncs.by_op
    torch.testing.assert_close(got.as_subclass(torch.Tensor), expected, rtol=0, atol=1e-6)


def test_sync_counter_counts_reads_of_device_values_only():
    with StrictDeviceMode(DEVICE), SyncCounter() as syncs:
        host = torch.tensor([1, 2])
        host.tolist(), int(host[0])  # host values: no sync
        device = host.to(DEVICE)
        device[0].item(), device.tolist(), bool(device[0] > 0), device.cpu()
    assert syncs.count == 4 and syncs.by_op == {"item": 1, "tolist": 1, "__bool__": 1, "cpu": 1}


class _Copies(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            self.calls.append(kwargs.get("non_blocking", False))
        return func(*args, **kwargs)


def test_a_micro_batch_enters_the_device_without_blocking_and_builds_its_inputs_once():
    mb = _packed([3, 1, 4])
    mb.rows["mask"] = torch.ones(3, 4)
    with StrictDeviceMode(DEVICE), _Copies() as copies:
        on = mb.to(DEVICE)
        assert copies.calls == [True, True, True]  # ids, labels, the mask
        positions = on.position_ids()
        params = on.packed_seq_params()
        assert copies.calls == [True] * 5  # one copy each, built on the host; no chunk layout yet (varlen: none)
        params.hpa_chunks.index, params.hpa_chunks.mask()
        assert copies.calls == [True] * 8  # the attention's chunk layout without the varlen kernel: 3, once
        params.hpa_chunks.moved(lambda x: x).inverse
        assert copies.calls == [True] * 8
        assert on.position_ids() is positions and on.packed_seq_params() is params
        assert positions.device == DEVICE and params.cu_seqlens_q.device == DEVICE
    assert positions.as_subclass(torch.Tensor).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert params.cu_seqlens_q.as_subclass(torch.Tensor).tolist() == [0, 3, 4, 8] and params.max_seqlen_q == 4


def _fused_vs_megatron_worker(groups):
    """Logits of one model with hpa's attention (padded and packed) and with megatron's unfused
    ``DotProductAttention`` (padded), same weights."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.engine.step import model_inputs
    from hpa.models import build_policy, specs

    cfg = ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=64,
                      vocab_size=64, max_sequence_length=32, make_vocab_size_divisible_by=16, add_qkv_bias=True)
    torch.manual_seed(0)
    ours = build_policy(cfg, ParallelConfig(), groups)
    original = specs.packed_local_attention
    specs.packed_local_attention = lambda: DotProductAttention
    try:
        torch.manual_seed(0)
        theirs = build_policy(cfg, ParallelConfig(), groups)
    finally:
        specs.packed_local_attention = original
    theirs.load_state_dict(ours.state_dict())
    lengths = torch.tensor([5, 2, 7])
    ids = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(2))
    out = {}
    for name, model, packed in (("theirs", theirs, False), ("ours", ours, False), ("ours_packed", ours, True)):
        mb = MicroBatch.from_padded("rows", ids, ids, lengths, packed=packed)
        i, p, params, _ = model_inputs(mb, 1)
        with torch.no_grad():
            logits = model(i, p, None, **({"packed_seq_params": params} if params is not None else {}))
        out[name] = mb.unpack(logits)
    keep = torch.arange(7)[None, :] < lengths[:, None]
    return {k: v[keep] for k, v in out.items()}


@pytest.mark.multirank
def test_fused_attention_equals_megatrons_unfused_kernel():
    out = run_ranks(_fused_vs_megatron_worker)[0]
    torch.testing.assert_close(out["ours"], out["theirs"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out["ours_packed"], out["theirs"], rtol=0, atol=1e-5)


def _bench(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HPA_TEST_MODEL_DEVICE="lazy", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "host_overhead.py"), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.e2e  # runs bench/host_overhead.py as a subprocess (about a minute)
def test_host_cost_of_a_micro_batch_does_not_grow_with_its_rows():
    """At Qwen2-0.5B's structure (24 layers), packed: the same operations for 8 rows as for 32 (within 10 %),
    at most 1.2x the padded layout's; host-device syncs a constant (none in the model's passes) that grows
    with neither the rows nor the layers, and a step's the same packed as padded."""
    full, two = _bench("--no-step"), _bench("--layers", "2")
    for phase in ("forward", "update"):
        packed, padded = full[phase]["packed"], full[phase]["padded"]
        for key in ("aten_ops", "kernel_ops"):
            assert packed["rows32"][key] <= 1.1 * packed["rows8"][key], (phase, key, packed)
            assert packed["rows32"][key] <= 1.2 * padded["rows32"][key], (phase, key, packed, padded)
        syncs = {r[phase][layout][rows]["syncs"] for r in (full, two) for layout in ("padded", "packed")
                 for rows in ("rows8", "rows32")}
        assert syncs == {0}, (phase, syncs)
        # nor any operation that waits for a CUDA device, forward or backward, the heads included (SyncOps)
        sync_ops = {r[phase][layout][rows]["sync_ops"] for r in (full, two) for layout in ("padded", "packed")
                    for rows in ("rows8", "rows32")}
        assert sync_ops == {0}, (phase, [r[phase] for r in (full, two)])
    assert two["syncs_per_step"]["packed"] == two["syncs_per_step"]["padded"], two["syncs_per_step"]


def test_gpu_check_phase_figures_and_sync_count_run_without_a_gpu():
    """``bench/gpu_check.py``'s CPU-runnable parts: per-phase seconds and update tokens/s from step records,
    and no sync count (None, not 0) where CUDA's sync debug mode does not exist."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    records = [{"timing_s/rollout": 2.0, "timing_s/old_logprob": 0.5, "timing_s/reference": 0.25,
                "timing_s/update_actor": 1.0, "perf/update_throughput": 1000.0, "perf/forward_tokens": 600.0,
                "perf/mfu": 0.1},
               {"timing_s/rollout": 4.0, "timing_s/old_logprob": 1.5, "timing_s/reference": 0.75,
                "timing_s/update_actor": 3.0, "perf/update_throughput": 3000.0, "perf/forward_tokens": 1400.0,
                "perf/mfu": 0.3}]
    # forward passes: 1000 tokens in 1.0 s and 0.5 s; MFU 2N/6N of the update's per token: 0.2 * rate / (3 * 2000)
    assert gpu_check.phase_figures(records) == pytest.approx(
        {"rollout_s": 3.0, "old_policy_s": 1.0, "reference_s": 0.5, "update_s": 2.0, "update_tokens_per_s": 2000.0,
         "old_policy_tokens_per_s": 1000.0, "reference_tokens_per_s": 2000.0,
         "old_policy_mfu": 0.2 / 6, "reference_mfu": 0.2 / 3})
    if not torch.cuda.is_available():
        assert gpu_check._counting_syncs(lambda: 7) == (7, None, {})
    assert gpu_check._per_step(None, [{}, {}]) is None
    # per step over steps 2..N: start-up with step 1 (clock 0) and after the last record (clock N) left out
    assert gpu_check._per_step({0: 500, 1: 12, 2: 8, 3: 40}, [{}, {}, {}]) == 10.0
    assert gpu_check._per_step({0: 500}, [{}]) is None


def test_gpu_check_counts_each_sync_under_the_steps_recorded_so_far(tmp_path):
    """``StepClock`` reads the run's metrics file: 0 before it exists and while only the start (step 0) is
    recorded, then the number of training steps; a line still being written does not count."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    path = tmp_path / "metrics.jsonl"
    clock = gpu_check.StepClock(path)
    assert clock() == 0
    path.write_text('{"step": 0, "eval/score": 0.4}\n')
    assert clock() == 0
    path.write_text('{"step": 0}\n{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert clock() == 1
    path.write_text('{"step": 0}\n{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    assert clock() == 2
    # a sync's site: the innermost frame of hpa, its patches or megatron, from that folder
    frame = lambda path, line: type("F", (), {"filename": path, "lineno": line})  # noqa: E731
    stack = [frame("/x/site-packages/megatron/core/utils.py", 7), frame("/repo/hpa/engine/step.py", 3),
             frame("/x/site-packages/torch/nn/module.py", 9)]
    assert gpu_check._site(stack) == "hpa/engine/step.py:3"
    assert gpu_check._site(stack[:1]) == "megatron/core/utils.py:7"


def test_varlen_signature_is_read_once(monkeypatch):
    """``inspect.signature`` of the kernel once per process, not on every attention call."""
    import inspect

    import torch.nn.attention.varlen as varlen

    from hpa.models import specs

    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn: calls.append(fn) or real(fn))

    def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
             enable_gqa=False):
        return query

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    params = _packed([3, 1, 4]).packed_seq_params()
    q = torch.randn(8, 2, 4)
    for _ in range(3):
        specs.varlen_causal_attention(q, q, q, params, scale=0.5)
    assert [fn for fn in calls if fn is fake] == [fake]


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _probe_worker(groups):
    """``bench/gpu_check.py``'s packing probe on CPU (fp32, the chunked attention): with hpa's attention, and with
    one that lets every packed token see the whole pack (what a broken varlen call would do)."""
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.models import build_policy, specs

    gpu_check = _gpu_check()
    cfg = ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=64,
                      vocab_size=64, max_sequence_length=32, make_vocab_size_divisible_by=16, add_qkv_bias=True)
    torch.manual_seed(0)
    model = build_policy(cfg, ParallelConfig(), groups)
    out = {"good": gpu_check.packing_probe(model, groups, 64, lengths=[9, 5, 12, 7])}

    def leaky(query, key, value, params, *, dropout, scale, gqa):  # [t, heads, d]: no mask at all
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)[0].transpose(0, 1)

    specs.chunked_causal_attention = leaky
    out["leaky"] = gpu_check.packing_probe(model, groups, 64, lengths=[9, 5, 12, 7])
    return out


@pytest.mark.multirank
def test_gpu_checks_packing_probe_sees_a_leak():
    out = run_ranks(_probe_worker)[0]
    good, leaky = out["good"], out["leaky"]
    assert good["causality_leak_max"] == 0.0 and good["changed_after_max"] > 0, good
    assert good["logprob_gap_mean"] < 1e-5 and good["varlen_calls"] == 0 and good["tokens"] == 33  # CPU: chunked
    assert leaky["causality_leak_max"] > 1e-3 and leaky["logprob_gap_mean"] > 1e-3, leaky


def test_gpu_check_fails_when_a_path_it_checks_did_not_run():
    """``failed_checks``: passes only with the config packing, the padded run done, graph decode at every step
    with one capture per bucket, and a probe that saw the varlen kernel, no leak and a small gap."""
    gpu_check = _gpu_check()
    probe = {"varlen_calls": 48, "causality_leak_max": 0.0, "changed_after_max": 0.3, "logprob_gap_mean": 0.01}
    steps = [{"rollout/decode_graph": 1.0, "rollout/graph_captures": 1.0, "rollout/decode_buckets": 1.0}] * 4
    good = {"device": "NVIDIA H100", "sequence_packing": True, "packing": {"padded_run_ok": True},
            "decode": gpu_check.decode_figures(steps), "packing_probe": probe}
    assert gpu_check.failed_checks(good) == []
    fallback = [dict(steps[0], **{"rollout/decode_graph": 0.0})] + steps[1:]
    recaptured = steps[:3] + [dict(steps[0], **{"rollout/graph_captures": 4.0})]
    cases = {"does not pack": dict(good, sequence_packing=False),
             "padded reference": dict(good, packing={"padded_run_ok": False}),
             "did not run at every step": dict(good, decode=gpu_check.decode_figures(fallback)),
             "captured again": dict(good, decode=gpu_check.decode_figures(recaptured)),
             "varlen kernel": dict(good, packing_probe=dict(probe, varlen_calls=0)),
             "causality probe": dict(good, packing_probe=dict(probe, causality_leak_max=0.2)),
             "differ by": dict(good, packing_probe=dict(probe, logprob_gap_mean=0.4)),
             "packing probe: initialise": dict(good, packing_probe={"error": "initialise: nccl"})}
    eager = dict(good, decode=gpu_check.decode_figures([{}] * 4))
    assert "did not run at every step" in gpu_check.failed_checks(eager)[0]
    for expected, figures in cases.items():
        failed = gpu_check.failed_checks(figures)
        assert len(failed) == 1 and expected in failed[0], (expected, failed)
