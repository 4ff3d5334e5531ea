"""The head on hidden states and the output weight (``hpa.ops.linear_head``) beyond the shared cases of
``test_fused_head.py``: fp64 gradcheck to both inputs, positions (repeated, into a ``[b, s, h]`` batch), a
frozen weight, no ``[·, V]`` tensor beyond one chunk, the per-chunk regions traced without a graph break, the
matmul-fused kernels' torch references, and the Triton kernels (region and matmul-fused) against the torch path
under Triton's CPU interpreter where Triton is installed and on a GPU (marked ``gpu``)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpa.ops import linear_head
from hpa.ops.linear_head import linear_log_probs_entropy
from hpa.ops.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs


def _problem(rows=7, hidden=5, vocab=12, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen, dtype=dtype)
    w = 1.5 * torch.randn(vocab, hidden, generator=gen, dtype=dtype)
    return x, w, gen


@pytest.mark.parametrize("vocab_size,temperature", [(None, 1.0), (9, 0.6)], ids=["full", "padded9_temp0.6"])
@pytest.mark.parametrize("outputs", ["both", "log_probs", "entropy"])
def test_gradcheck_float64(outputs, vocab_size, temperature):
    x, w, gen = _problem()
    labels = torch.randint(0, vocab_size or 12, (7,), generator=gen)

    def fn(x, w):
        logp, ent = linear_log_probs_entropy(x, w, labels, None, vocab_size, temperature,
                                             entropy=outputs != "log_probs", chunk_tokens=3)
        return {"both": (logp, ent), "log_probs": logp, "entropy": ent}[outputs]

    assert torch.autograd.gradcheck(fn, (x.requires_grad_(), w.requires_grad_()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_positions_into_a_batch_equal_the_separate_ops_on_the_logits(dtype):
    """``[b, s, h]`` hidden states at positions (one repeated): values and gradients of the separate ops on
    ``hidden·Wᵀ`` at the gathered rows; rows not selected get no gradient, padded weight rows none."""
    x, w, gen = _problem(rows=12, hidden=6, vocab=16, seed=1, dtype=torch.float32)
    x, w = x.view(3, 4, 6).to(dtype), w.to(dtype)
    positions = torch.tensor([7, 0, 3, 3, 11, 5, 1])
    labels = torch.randint(0, 13, (7,), generator=gen)
    g = torch.randn(2, 7, generator=gen)
    got_x, got_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = linear_log_probs_entropy(got_x, got_w, labels, None, 13, 0.8, positions=positions, entropy=True,
                                         chunk_tokens=2)
    (g[0] * logp + g[1] * ent).sum().backward()
    want_x, want_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = want_x.reshape(-1, 6)[positions] @ want_w.t()  # [7, 16]
    ref_logp = vocab_parallel_log_probs(logits, labels, None, 13, 0.8)
    ref_ent = vocab_parallel_entropy(logits, None, 13, 0.8)
    (g[0] * ref_logp + g[1] * ref_ent).sum().backward()
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    atol = 5e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got_x.grad.float(), want_x.grad.float(), rtol=0, atol=atol)
    torch.testing.assert_close(got_w.grad.float(), want_w.grad.float(), rtol=0, atol=atol)
    assert got_x.grad.dtype == dtype and got_w.grad.dtype == dtype
    flat = got_x.grad.reshape(-1, 6)
    assert not flat[[2, 4, 6, 8, 9, 10]].any() and flat[3].abs().sum() > 0
    assert not got_w.grad[13:].any()


def test_frozen_weight_and_inputs_unchanged():
    x, w, gen = _problem(dtype=torch.float32)
    labels = torch.randint(0, 12, (7,), generator=gen)
    before = x.clone(), w.clone()
    xg = x.clone().requires_grad_()
    logp, ent = linear_log_probs_entropy(xg, w, labels, None, entropy=True, chunk_tokens=2)
    (logp + ent).sum().backward()
    assert w.grad is None and xg.grad.abs().sum() > 0
    assert torch.equal(x, before[0]) and torch.equal(w, before[1])
    empty = torch.zeros(0, 5, requires_grad=True)
    logp, _ = linear_log_probs_entropy(empty, w, torch.zeros(0, dtype=torch.long), None)
    logp.sum().backward()
    assert logp.shape == (0,) and empty.grad.shape == (0, 5)


def test_errors_say_what_to_do():
    w = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"hidden must be \[M, h\]"):
        linear_log_probs_entropy(torch.randn(2, 3, 4), w, torch.zeros(2, 3, dtype=torch.long), None)
    with pytest.raises(ValueError, match=r"weight \[v/tp, h\]"):
        linear_log_probs_entropy(torch.randn(2, 5), w, torch.zeros(2, dtype=torch.long), None)
    with pytest.raises(ValueError, match="positions"):
        linear_log_probs_entropy(torch.randn(4, 4), w, torch.zeros(4, dtype=torch.long), None,
                                 positions=torch.arange(3))
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_log_probs_entropy(torch.randn(2, 4), w, torch.zeros(2, dtype=torch.long), None, chunk_tokens=0)
    with pytest.raises(ValueError, match="vocab_size=9 must be in"):
        linear_log_probs_entropy(torch.randn(2, 4), w, torch.zeros(2, dtype=torch.long), None, vocab_size=9)
    with pytest.raises(ValueError, match="kernel must be one of"):
        linear_log_probs_entropy(torch.randn(2, 4), w, torch.zeros(2, dtype=torch.long), None, kernel="triton")


def test_cpu_default_is_the_torch_path():
    """``auto`` off CUDA: the chunked torch path, Triton never imported."""
    assert linear_head._kernels(torch.device("cpu")) == (False, linear_head.chunk_stats, False,
                                                         linear_head.chunk_grad)
    assert linear_head._kernels(torch.device("cpu"), "torch")[0] is False


@pytest.mark.parametrize("fused_ok,regions_ok,dtype,want", [
    (True, True, torch.bfloat16, "fused_forward"), (True, False, torch.bfloat16, "fused_forward_torch"),
    (False, True, torch.bfloat16, "regions"), (False, False, torch.bfloat16, "torch"),
    (True, True, torch.float64, "regions")])
def test_cuda_default_prefers_the_fused_forward_that_passes_its_check(monkeypatch, fused_ok, regions_ok, dtype,
                                                                       want):
    """``auto`` on CUDA (a stand-in Triton module; no GPU needed): the forward by the matmul-fused kernel if its
    check passes (bf16/fp16/fp32 weights), else the region kernel if theirs does, else torch; the backward by the
    region kernel if its check passes, else torch, never the fused backward. By name: unchecked."""
    import sys
    import types

    import hpa.ops

    stub = types.SimpleNamespace(fused_usable=lambda device, head: fused_ok, usable=lambda device, *fns: regions_ok,
                                 fused_stats="fs", fused_grads="fg", chunk_stats="cs", chunk_grad="cg")
    monkeypatch.setitem(sys.modules, "hpa.ops.linear_head_triton", stub)
    monkeypatch.setattr(hpa.ops, "linear_head_triton", stub, raising=False)
    got = linear_head._kernels(torch.device("cuda"), "auto", dtype)
    assert got == {"fused_forward": (True, "fs", False, "cg"),
                   "fused_forward_torch": (True, "fs", False, linear_head.chunk_grad),
                   "regions": (False, "cs", False, "cg"),
                   "torch": (False, linear_head.chunk_stats, False, linear_head.chunk_grad)}[want]
    for kernel, named in (("fused", (True, "fs", True, "fg")), ("fused_forward", (True, "fs", False, "cg")),
                          ("regions", (False, "cs", False, "cg"))):
        assert linear_head._kernels(torch.device("cuda"), kernel, dtype) == named


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "log_probs"])
def test_fused_references_equal_the_chunked_path(monkeypatch, entropy):
    """``fused_stats`` / ``fused_grads`` in torch (what the byte-count proxy counts as the fused kernels) run the
    head over every row at once: values and both gradients equal the chunked path, vocab padding included."""
    x, w, gen = _problem(rows=9, hidden=5, vocab=14, seed=3, dtype=torch.float64)
    positions = torch.tensor([0, 2, 2, 8, 5, 1])
    labels = torch.tensor([3, 12, 0, 7, 11, 5])  # 12: a padded row (vocab 11)
    g = torch.randn(2, 6, generator=gen, dtype=torch.float64)

    def run():
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = linear_log_probs_entropy(a, b, labels, None, 11, 0.7, positions=positions, entropy=entropy,
                                             chunk_tokens=2)
        ((g[0] * logp).sum() + ((g[1] * ent).sum() if entropy else 0)).backward()
        return logp, ent, a.grad, b.grad

    want = run()
    monkeypatch.setattr(linear_head, "_kernels", lambda *args: (True, linear_head.fused_stats, True,
                                                                linear_head.fused_grads))
    got = run()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert got[3][11:].abs().sum() == 0 and got[2][[3, 4, 6, 7]].abs().sum() == 0  # padding, unselected rows


class LargestVocabTensor(TorchDispatchMode):
    """The most elements of any op output whose last dim is the vocabulary, padded or not (forward and
    backward)."""

    def __init__(self, *vocab):
        super().__init__()
        self.vocab, self.largest = set(vocab), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if torch.is_tensor(t) and t.dim() >= 1 and t.shape[-1] in self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_vocab_tensor_beyond_one_chunk():
    """Run red by setting ``chunk_tokens`` to the 64 tokens: the bound holds only because of the chunks."""
    x, w, gen = _problem(rows=64, hidden=8, vocab=512, dtype=torch.float32)
    labels = torch.randint(0, 500, (64,), generator=gen)
    x, w = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    with LargestVocabTensor(500, 512) as mode:
        logp, ent = linear_log_probs_entropy(x, w, labels, None, 500, 0.8, entropy=True, chunk_tokens=16)
        (logp - 0.01 * ent).sum().backward()
    assert 16 * 500 <= mode.largest <= 16 * 512
    with LargestVocabTensor(500, 512) as mode:
        linear_log_probs_entropy(x, w, labels, None, 500, 0.8, entropy=True, chunk_tokens=64)
    assert mode.largest >= 64 * 500  # the check can fail


@pytest.mark.parametrize("with_entropy", [True, False])
def test_the_regions_trace_without_a_graph_break(with_entropy):
    """``torch.compile(fullgraph=True)`` of each per-chunk region (traced only: the eager backend) equals eager."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    z = 3 * torch.randn(5, 40, generator=gen)
    index = torch.randint(0, 40, (5, 1), generator=gen)
    on = torch.tensor([True, False, True, True, True])
    stats = torch.compile(linear_head.chunk_stats, fullgraph=True, backend="eager")
    grad = torch.compile(linear_head.chunk_grad, fullgraph=True, backend="eager")
    want = linear_head.chunk_stats(z.clone(), index, on, 0.7, with_entropy)
    torch.testing.assert_close(stats(z.clone(), index, on, 0.7, with_entropy), want)
    m, log_s = want[0], want[1].log()
    ent = log_s - want[3] / want[1] if with_entropy else None
    g = torch.randn(2, 5, generator=gen)
    args = (m, log_s, ent, g[0], g[1] if with_entropy else None, index, on, 0.7)
    torch.testing.assert_close(grad(z.clone(), *args), linear_head.chunk_grad(z.clone(), *args))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_kernels_equal_the_torch_functions(dtype):
    from hpa.ops import linear_head_triton

    device = torch.device("cuda")
    assert linear_head_triton.usable(device, linear_head.chunk_stats, linear_head.chunk_grad)
    gen = torch.Generator(device=device).manual_seed(0)
    z = (4 * torch.randn(37, 151_936 // 4, device=device, generator=gen)).to(dtype)
    index = torch.randint(0, z.shape[1], (37, 1), device=device, generator=gen)
    on = torch.rand(37, device=device, generator=gen) < 0.8
    want = linear_head.chunk_stats(z.clone(), index, on, 0.9, True)
    torch.testing.assert_close(linear_head_triton.chunk_stats(z.clone(), index, on, 0.9, True), want,
                               rtol=1e-4, atol=1e-3)
    m, log_s = want[0], want[1].log()
    ent = log_s - want[3] / want[1]
    g = torch.randn(2, 37, device=device, generator=gen)
    for g_lp, g_ent in ((g[0], g[1]), (g[0], None), (None, g[1])):
        want_grad = linear_head.chunk_grad(z.clone(), m, log_s, ent, g_lp, g_ent, index, on, 0.9)
        got = linear_head_triton.chunk_grad(z.clone(), m, log_s, ent, g_lp, g_ent, index, on, 0.9)
        torch.testing.assert_close(got.float(), want_grad.float(), rtol=2e-2, atol=1e-5)


def _proxy():
    from proxy_loader import load_proxy

    return load_proxy("head")


def test_proxy_head_bytes_per_token():
    """``bench/proxies/head.py``: the CUDA default (the matmul-fused forward, the region backward) moves at most
    2 MB a response token forward + backward with entropy at V = 151,936: 5 to 5.5 bf16 passes over a token's
    logits (the backward's matmul writes them, its kernel reads them and writes their gradient, two matmuls read
    that) plus the weight's share, 2 passes fewer than the head with cuBLAS matmuls and region kernels both ways
    (7 to 7.5 passes: its forward's matmul writes and its kernel reads the logits), at h = 896 too, where the
    weight's share grows by at least its three reads and one gradient write (4·2·V·Δh over the 1,536 tokens); the
    fully matmul-fused head (no logits in memory) under half a pass and at least the weight read and its gradient
    written; the head on the model's logits ten times more."""
    proxy = _proxy()
    got = proxy.measure()
    logit_pass = 2 * proxy.VOCAB
    tokens = proxy.ROWS * proxy.RESPONSE
    assert 5 * logit_pass <= got["head.bytes_per_token"] <= min(5.5 * logit_pass, 2_000_000)
    assert 4 * proxy.VOCAB * proxy.HIDDEN / tokens <= got["head.bytes_per_token_fused_backward"] <= logit_pass / 2
    assert 7 * logit_pass <= got["head.bytes_per_token_unfused_matmul"] <= 7.5 * logit_pass
    for suffix in ("", "_h896"):
        assert got[f"head.bytes_per_token_unfused_matmul{suffix}"] - got[f"head.bytes_per_token{suffix}"] \
            >= 2 * logit_pass
    assert got["head.bytes_per_token_h896"] - got["head.bytes_per_token"] >= \
        4 * 2 * proxy.VOCAB * (896 - proxy.HIDDEN) / tokens
    assert got["head.bytes_per_token_logits"] >= 10 * got["head.bytes_per_token_unfused_matmul"]
    assert got["head.bytes_per_token_eager"] > got["head.bytes_per_token_unfused_matmul"]  # regions op by op


def test_proxy_counter_models_the_traffic():
    """The counter: a matmul reads both inputs and writes its output, a view moves nothing, a gather reads what it
    outputs, a filled allocation writes its output only."""
    proxy = _proxy()
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with proxy.HbmBytes() as counter:
        torch.mm(a, b)
    assert counter.total == 4 * (12 + 20 + 15)
    with proxy.HbmBytes() as counter:
        a.t()
        a[:, :2]
    assert counter.total == 0
    index = torch.tensor([2])
    with proxy.HbmBytes() as counter:
        a.index_select(0, index)  # the index, the row read and written
    assert counter.total == 8 + 2 * 16
    with proxy.HbmBytes() as counter:
        a.new_zeros(10)
    assert counter.total == 40


_INTERPRETED = """
import torch
from hpa.ops import linear_head, linear_head_triton
from hpa.ops.linear_head import linear_log_probs_entropy

gen = torch.Generator().manual_seed(1)
x, w = torch.randn(2, 9, 8, generator=gen), torch.randn(1100, 8, generator=gen)
positions, labels = torch.tensor([0, 3, 3, 17, 5, 9, 12]), torch.randint(0, 1050, (7,), generator=gen)
g = torch.randn(2, 7, generator=gen)

def run():
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = linear_log_probs_entropy(a, b, labels, None, 1050, 0.8, positions=positions, entropy=True,
                                         chunk_tokens=3)
    (g[0] * logp + g[1] * ent).sum().backward()
    return logp, ent, a.grad, b.grad

want = run()
linear_head.chunk_stats, linear_head.chunk_grad = linear_head_triton.chunk_stats, linear_head_triton.chunk_grad
for got, ref in zip(run(), want):
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
print("ok")
"""


_INTERPRETED_FUSED = """
import warnings

import torch
from hpa.ops import linear_head_triton
from hpa.ops.linear_head import linear_log_probs_entropy

linear_head_triton.FUSED_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "BLOCK_H": 16}  # h = 24: 2 each
gen = torch.Generator().manual_seed(2)
x, w = torch.randn(2, 13, 24, generator=gen), 0.5 * torch.randn(100, 24, generator=gen)
positions = torch.tensor([0, 3, 3, 17, 5, 9, 12, 1, 2, 4, 6, 7, 8, 10, 11, 13, 14, 15, 16, 25])  # 19-24 unselected
labels = torch.randint(0, 90, (20,), generator=gen)
labels[4] = 97  # a padded vocab row (vocab 90): -logsumexp, no gradient to the padding
g = torch.randn(2, 20, generator=gen)

def run(kernel, dtype, outputs, temperature, rows=positions):
    a, b = x.clone().to(dtype).requires_grad_(), w.clone().to(dtype).requires_grad_()
    hidden = a if rows is not None else a.reshape(-1, 24)[:20]
    logp, ent = linear_log_probs_entropy(hidden, b, labels, None, 90, temperature, positions=rows,
                                         entropy=outputs != "log_probs", kernel=kernel)
    loss = (g[1] * ent).sum() if outputs == "entropy" else (g[0] * logp).sum() + (
        (g[1] * ent).sum() if outputs == "both" else 0)
    loss.backward()
    return [None if t is None else t.float() for t in (logp, ent, a.grad, b.grad)]

cases = [("both", 0.8, positions), ("log_probs", 1.0, positions), ("entropy", 1.3, positions), ("both", 1.0, None)]
for kernel, (outputs, temperature, rows) in [(k, c) for k in ("fused", "fused_forward") for c in cases]:
    exact = run("torch", torch.float32, outputs, temperature, rows)
    for got, want in zip(run(kernel, torch.float32, outputs, temperature, rows), exact):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bf16: the kernels round the logits to bf16 as the torch path does (the fused forward's statistics then fit
    # the region backward's recomputed logits): values as far from fp32 as the torch path's, gradients
    # within 2 % of the largest
    torch_bf16 = run("torch", torch.bfloat16, outputs, temperature, rows)
    for i, (got, ref, want) in enumerate(zip(run(kernel, torch.bfloat16, outputs, temperature, rows), torch_bf16,
                                             exact)):
        if want is not None:
            torch.testing.assert_close(got, ref, rtol=5e-2, atol=1e-1)
            error = (got - want).abs().max()
            bound = (ref - want).abs().max() + 1e-3 if i < 2 else 2e-2 * want.abs().max()  # 1e-3: fp32 sum order
            assert error <= bound, (kernel, i, error)
    fused = run(kernel, torch.float32, outputs, temperature, rows)
    assert fused[3][90:].abs().sum() == 0
    if rows is not None:
        assert fused[2].reshape(-1, 24)[[18, 19, 20, 21, 22, 23]].abs().sum() == 0
with warnings.catch_warnings():  # the first-use check itself passes (it warns where it fails)
    warnings.simplefilter("error")
    assert linear_head_triton.fused_usable.__wrapped__(torch.device("cpu"), linear_log_probs_entropy)
print("ok")
"""


def test_fused_triton_kernels_in_triton_s_interpreter():
    """Where Triton is installed, its interpreter runs the matmul-fused kernels inside the whole head (small tiles,
    every tile partial), both halves fused (``fused``) and the fused forward with the region backward
    (``fused_forward``, the CUDA default): fp32 values and both gradients equal the torch path, with and without
    entropy, an entropy-only loss, temperatures, a label in the vocab padding, repeated and unselected positions;
    in bf16 within bf16 rounding of the torch path and no farther from fp32 than it; the first-use check passes."""
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), *sys.path]))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED_FUSED], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_triton_kernels_on_a_gpu(dtype):
    """On CUDA the matmul-fused forward passes its first-use check and is the default's forward (``auto``, with
    the region backward), and at a real vocabulary shard the default and the fully fused head (values and
    gradients) match the torch path on fp32 inputs."""
    from hpa.ops import linear_head_triton

    device = torch.device("cuda")
    assert linear_head_triton.fused_usable(device, linear_head.linear_log_probs_entropy)
    assert linear_head._kernels(device, "auto", dtype) == (True, linear_head_triton.fused_stats, False,
                                                            linear_head_triton.chunk_grad)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(300, 256, device=device, generator=gen)
    w = 0.1 * torch.randn(151_936 // 4, 256, device=device, generator=gen)
    labels = torch.randint(0, w.shape[0], (300,), device=device, generator=gen)
    g = torch.randn(2, 300, device=device, generator=gen)

    def run(kernel, dtype):
        a, b = x.clone().to(dtype).requires_grad_(), w.clone().to(dtype).requires_grad_()
        logp, ent = linear_log_probs_entropy(a, b, labels, None, None, 0.9, entropy=True, kernel=kernel)
        (g[0] * logp + g[1] * ent).sum().backward()
        return logp, ent, a.grad.float(), b.grad.float()

    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    want = run("torch", torch.float32)
    for kernel in ("fused_forward", "fused"):
        for got, ref in zip(run(kernel, dtype), want):
            torch.testing.assert_close(got, ref, **tol)


def test_triton_kernels_in_triton_s_interpreter():
    """Where Triton is installed (not in the project's CPU environment), its interpreter (``TRITON_INTERPRET=1``,
    on the CPU) runs the kernels inside the whole head: values and both gradients equal the torch path."""
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), *sys.path]))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
