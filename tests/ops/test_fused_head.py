"""The fused, chunked log-prob + entropy heads against the separate vocab-parallel ops (values and
gradients, TP1 and TP2, vocab padding, temperature, bf16), and the memory bound of the head on logits: no fp32
tensor larger than one chunk during its forward and backward (a dispatch-mode check that today's ops fail).

"fused" is the head on given logits (``hpa.ops.fused_head``); "linear" the head on hidden states and the output
weight (``hpa.ops.linear_head``), fed the case's full logits as hidden states and the rows of the identity its
shard owns as the weight, so its logits are the case's exactly and ``d hidden`` on the shard's columns is the
logits' gradient; its ``d weight`` is checked against ``d logitsᵀ·hidden`` of today's ops. "linear_fused" is the
same head on its matmul-fused path (every position at once, the shard statistics merged as the chunked path's),
with the torch references of the fused Triton kernels."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpa.ops.fused_head import fused_log_probs_entropy
from hpa.ops import linear_head
from hpa.ops.linear_head import linear_log_probs_entropy
from hpa.ops.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs
from tests.multirank import run_ranks

PADDING_LOGIT = 1e6  # written into padded columns: any leak into the softmax is obvious
ROWS = 11
CHUNK = 3  # four chunks, the last one short

# name -> full vocab width, true vocab size, temperature, dtype, logit scale
CASES = {
    "fp32": dict(width=16, vocab_size=None, temperature=1.0, dtype="float32", scale=3.0),
    "fp32_padded13_temp0.7": dict(width=16, vocab_size=13, temperature=0.7, dtype="float32", scale=3.0),
    # tp2: rank 1 is all padding
    "fp32_padded7_temp1.3": dict(width=16, vocab_size=7, temperature=1.3, dtype="float32", scale=3.0),
    "bf16_padded13_temp0.7": dict(width=16, vocab_size=13, temperature=0.7, dtype="bfloat16", scale=3.0),
    "fp32_large_1e4": dict(width=16, vocab_size=None, temperature=1.0, dtype="float32", scale=1e4),
}


def make_case(name):
    """Full (unsharded) fp32 logits, labels and loss weights of one case, identical in every process."""
    case = CASES[name]
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))
    vocab_size = case["vocab_size"] or case["width"]
    logits = case["scale"] * torch.randn(ROWS, case["width"], generator=gen)
    if case["scale"] >= 1e4:
        logits[0, :2] = torch.tensor([1e4, -1e4])
    logits[:, vocab_size:] = PADDING_LOGIT
    labels = torch.randint(0, vocab_size, (ROWS,), generator=gen)
    weights = torch.randn(2, ROWS, generator=gen)  # loss = Σ w0·log-prob + w1·entropy
    return dict(case, logits=logits, labels=labels, weights=weights)


def _run(op, logits, inputs, tp_group, full=None, columns=None):
    """``op``'s log-probs, entropy and the gradient of ``Σ w0·logp + w1·H`` to ``logits`` (the linear head: to
    the hidden states ``full`` on the shard's ``columns``, and its weight gradient)."""
    kw = dict(vocab_size=inputs["vocab_size"], temperature=inputs["temperature"])
    if op in ("linear", "linear_fused"):
        x = full.clone().requires_grad_()
        weight = torch.eye(full.shape[-1], dtype=full.dtype)[columns].requires_grad_()  # [v/tp, width]
        kernels = linear_head._kernels
        if op == "linear_fused":  # the matmul-fused path, its torch references in place of the Triton kernels
            linear_head._kernels = lambda *args: (True, linear_head.fused_stats, True, linear_head.fused_grads)
        try:  # forward and backward
            logp, ent = linear_log_probs_entropy(x, weight, inputs["labels"], tp_group, entropy=True,
                                                 chunk_tokens=CHUNK, **kw)
            (inputs["weights"][0] * logp + inputs["weights"][1] * ent).sum().backward()
        finally:
            linear_head._kernels = kernels
        return dict(logp=logp.detach().double().numpy(), ent=ent.detach().double().numpy(), dtype=str(logp.dtype),
                    grad=x.grad[:, columns].double().numpy(), grad_dtype=str(x.grad.dtype),
                    weight_grad=weight.grad.double().numpy(), weight_grad_dtype=str(weight.grad.dtype))
    x = logits.clone().requires_grad_()
    if op == "fused":
        logp, ent = fused_log_probs_entropy(x, inputs["labels"], tp_group, entropy=True, chunk_tokens=CHUNK, **kw)
    else:
        logp = vocab_parallel_log_probs(x, inputs["labels"], tp_group, **kw)
        ent = vocab_parallel_entropy(x, tp_group, **kw)
    (inputs["weights"][0] * logp + inputs["weights"][1] * ent).sum().backward()
    return dict(logp=logp.detach().double().numpy(), ent=ent.detach().double().numpy(), dtype=str(logp.dtype),
                grad=x.grad.double().numpy(), grad_dtype=str(x.grad.dtype))


def worker(groups, names):
    tp = groups.tensor_model_parallel_size
    out = {}
    for name in names:
        inputs = make_case(name)
        width = inputs["width"] // tp
        shard = inputs["logits"][:, groups.tp_rank * width:(groups.tp_rank + 1) * width]
        dtype = getattr(torch, inputs["dtype"])
        columns = slice(groups.tp_rank * width, (groups.tp_rank + 1) * width)
        out[name] = {"fused": _run("fused", shard.to(dtype), inputs, groups.tp_group),
                     "linear": _run("linear", None, inputs, groups.tp_group, inputs["logits"].to(dtype), columns),
                     "linear_fused": _run("linear_fused", None, inputs, groups.tp_group, inputs["logits"].to(dtype),
                                          columns),
                     "today": _run("today", shard.to(dtype), inputs, groups.tp_group),
                     "today_fp32": _run("today", shard, inputs, groups.tp_group)}  # bf16's unrounded logits
    return dict(tp_rank=groups.tp_rank, cases=out)


_RESULTS = {}
OPS = ("fused", "linear", "linear_fused")


def results_for(tp):
    """Per case and op: values (every rank the same) and the shard gradients concatenated to the full vocab."""
    if tp not in _RESULTS:
        ranks = sorted(run_ranks(worker, tp=tp, args=(sorted(CASES),)), key=lambda r: r["tp_rank"])
        merged = {}
        for name in CASES:
            merged[name] = {}
            for op in ("today", "today_fp32") + OPS:
                per_rank = [r["cases"][name][op] for r in ranks]
                for r in per_rank[1:]:
                    np.testing.assert_array_equal(r["logp"], per_rank[0]["logp"])
                    np.testing.assert_array_equal(r["ent"], per_rank[0]["ent"])
                merged[name][op] = dict(per_rank[0], grad=np.concatenate([r["grad"] for r in per_rank], axis=-1))
                if op in ("linear", "linear_fused"):  # d weight = d logitsᵀ · hidden, with today's d logits
                    grad = merged[name]["today"]["grad"]
                    hidden = make_case(name)["logits"].to(getattr(torch, CASES[name]["dtype"])).double().numpy()
                    merged[name][op]["weight_grad"] = np.concatenate([r["weight_grad"] for r in per_rank])
                    merged[name][op]["want_weight_grad"] = grad.T @ hidden
        _RESULTS[tp] = merged
    return _RESULTS[tp]


@pytest.mark.multirank
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_equals_the_separate_ops(tp, name, op):
    got, want = results_for(tp)[name][op], results_for(tp)[name]["today"]
    large = CASES[name]["scale"] >= 1e4
    value_atol = 1e-2 if large else 1e-5  # fp32 holds 1e4 to ~1e-3
    grad_atol = 1e-2 if CASES[name]["dtype"] == "bfloat16" else 1e-5  # one bf16 rounding of the gradient
    assert got["dtype"] == "torch.float32" and got["grad_dtype"] == "torch." + CASES[name]["dtype"]
    assert np.isfinite(got["logp"]).all() and np.isfinite(got["ent"]).all() and np.isfinite(got["grad"]).all()
    np.testing.assert_allclose(got["logp"], want["logp"], rtol=0, atol=value_atol)
    np.testing.assert_allclose(got["ent"], want["ent"], rtol=0, atol=value_atol)
    np.testing.assert_allclose(got["grad"], want["grad"], rtol=0, atol=grad_atol)
    vocab_size = CASES[name]["vocab_size"]
    if vocab_size is not None:  # padded columns get no gradient
        assert not got["grad"][:, vocab_size:].any()
    if op in ("linear", "linear_fused"):
        assert got["weight_grad_dtype"] == "torch." + CASES[name]["dtype"]
        scale = 1.0 if not large else CASES[name]["scale"]  # d weight = d logitsᵀ · hidden: hidden's scale
        bf16 = CASES[name]["dtype"] == "bfloat16"  # d logits and d weight each rounded to bf16
        np.testing.assert_allclose(got["weight_grad"], got["want_weight_grad"],
                                   rtol=3e-2 if bf16 else 1e-3 if large else 1e-5, atol=grad_atol * scale * 4)
        if vocab_size is not None:  # padded rows of the weight get no gradient
            assert not got["weight_grad"][vocab_size:].any()


@pytest.mark.multirank
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_bf16_close_to_fp32_logits(tp, op):
    """bf16 input against the separate ops on the fp32 logits it was rounded from: bf16 tolerance."""
    case = results_for(tp)["bf16_padded13_temp0.7"]
    got, want = case[op], case["today_fp32"]
    for key in ("logp", "ent", "grad"):
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=5e-2, err_msg=key)


@pytest.mark.multirank
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_equals_tp1(name, op):
    tp1, tp2 = results_for(1)[name][op], results_for(2)[name][op]
    atol = 1e-2 if CASES[name]["scale"] >= 1e4 else 1e-5
    for key in ("logp", "ent"):
        np.testing.assert_allclose(tp2[key], tp1[key], rtol=0, atol=atol, err_msg=key)
    np.testing.assert_allclose(tp2["grad"], tp1["grad"], rtol=0,
                               atol=1e-2 if CASES[name]["dtype"] == "bfloat16" else 1e-5)


@pytest.mark.parametrize("vocab_size,temperature", [(None, 1.0), (9, 0.6)], ids=["full", "padded9_temp0.6"])
@pytest.mark.parametrize("outputs", ["both", "log_probs", "entropy"])
def test_gradcheck_float64(outputs, vocab_size, temperature):
    gen = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(7, 12, generator=gen, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, vocab_size or 12, (7,), generator=gen)

    def fn(x):
        logp, ent = fused_log_probs_entropy(x, labels, None, vocab_size, temperature, entropy=outputs != "log_probs",
                                            chunk_tokens=3)
        return {"both": (logp, ent), "log_probs": logp, "entropy": ent}[outputs]

    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_positions_equal_the_gathered_rows(dtype):
    """Computing at ``positions`` (one repeated) equals the separate ops on the gathered rows, gradients
    accumulated back into the full logits; rows not selected get none."""
    gen = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(9, 16, generator=gen)).to(dtype)
    positions = torch.tensor([7, 0, 3, 3, 8, 5, 1])
    labels = torch.randint(0, 13, (7,), generator=gen)
    w = torch.randn(2, 7, generator=gen)
    got, want = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    logp, ent = fused_log_probs_entropy(got, labels, None, 13, 0.8, positions=positions, entropy=True, chunk_tokens=2)
    (w[0] * logp + w[1] * ent).sum().backward()
    rows = want[positions]
    ref_logp = vocab_parallel_log_probs(rows, labels, None, 13, 0.8)
    ref_ent = vocab_parallel_entropy(rows, None, 13, 0.8)
    (w[0] * ref_logp + w[1] * ref_ent).sum().backward()
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    atol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.grad.float(), want.grad.float(), rtol=0, atol=atol)
    assert not got.grad[[2, 4, 6]].any() and got.grad[3].abs().sum() > 0


def test_positions_into_a_sliced_batch_equal_the_gathered_rows():
    """``[b, s, v/tp]`` logits cut from a wider output (not viewable as rows): the same as on its rows."""
    gen = torch.Generator().manual_seed(5)
    full = 3 * torch.randn(3, 6, 16, generator=gen)
    positions = torch.tensor([0, 4, 4, 7, 11, 14])
    labels = torch.randint(0, 16, (6,), generator=gen)
    sliced = full.clone().requires_grad_()
    logp, ent = fused_log_probs_entropy(sliced[:, :5], labels, None, positions=positions, entropy=True,
                                        chunk_tokens=4)
    (logp + 0.5 * ent).sum().backward()
    rows = full.clone().requires_grad_()
    flat = rows[:, :5].reshape(-1, 16)[positions]
    ((vocab_parallel_log_probs(flat, labels, None) + 0.5 * vocab_parallel_entropy(flat, None)).sum()).backward()
    torch.testing.assert_close(logp, vocab_parallel_log_probs(flat, labels, None).detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(sliced.grad, rows.grad, rtol=0, atol=1e-5)
    assert not sliced.grad[:, 5:].any()


def test_inputs_unchanged_and_empty_selection():
    logits = torch.randn(5, 8).requires_grad_()
    before = logits.detach().clone()
    logp, ent = fused_log_probs_entropy(logits, torch.arange(5), None, entropy=True, chunk_tokens=2)
    (logp + ent).sum().backward()
    assert torch.equal(logits.detach(), before)
    empty = torch.zeros(0, 8, requires_grad=True)
    logp, _ = fused_log_probs_entropy(empty, torch.zeros(0, dtype=torch.long), None)
    logp.sum().backward()
    assert logp.shape == (0,) and empty.grad.shape == (0, 8)


def test_default_chunk_bounds_fp32_elements(monkeypatch):
    from hpa.ops import fused_head

    monkeypatch.setattr(fused_head, "CHUNK_ELEMENTS", 8 * VOCAB)
    assert 0 < _largest_fp32(lambda x, y: fused_log_probs_entropy(x, y, None, entropy=True), vocab=VOCAB) <= 8 * VOCAB


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match=r"logits must be \[M, v/tp\]"):
        fused_log_probs_entropy(torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="positions"):
        fused_log_probs_entropy(torch.randn(4, 8), torch.zeros(4, dtype=torch.long), None, positions=torch.arange(3))
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_log_probs_entropy(torch.randn(2, 8), torch.zeros(2, dtype=torch.long), None, chunk_tokens=0)
    with pytest.raises(ValueError, match="vocab_size=9 must be in"):
        fused_log_probs_entropy(torch.randn(2, 8), torch.zeros(2, dtype=torch.long), None, vocab_size=9)


# ---------------------------------------------------------------- memory: the dispatch-mode check

class LargestFp32(TorchDispatchMode):
    """Records the largest fp32 tensor any op outputs (forward and backward run under it)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if torch.is_tensor(t) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def _largest_fp32(head, tokens=64, vocab=512):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=gen).bfloat16().requires_grad_()  # as on GPUs
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    with LargestFp32() as mode:
        logp, ent = head(logits, labels)
        (logp - 0.01 * ent).sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    return mode.largest


CHUNK_TOKENS = 16
VOCAB = 512


def _fused(logits, labels):
    return fused_log_probs_entropy(logits, labels, None, vocab_size=500, temperature=0.8, entropy=True,
                                   chunk_tokens=CHUNK_TOKENS)


def _separate(logits, labels):
    return (vocab_parallel_log_probs(logits, labels, None, vocab_size=500, temperature=0.8),
            vocab_parallel_entropy(logits, None, vocab_size=500, temperature=0.8))


def test_no_fp32_tensor_beyond_one_chunk():
    assert 0 < _largest_fp32(_fused, vocab=VOCAB) <= CHUNK_TOKENS * VOCAB


@pytest.mark.parametrize("layout", ["rows", "sliced_batch"])
def test_no_fp32_tensor_beyond_one_chunk_at_positions(layout):
    def head(logits, labels):
        positions = torch.arange(logits.shape[0]).flip(0)[::2]  # the positions a loss reads
        if layout == "sliced_batch":  # a [b, s, v/tp] model output cut from a padded width, as step.py does
            logits = logits.view(4, -1, logits.shape[-1])[:, :-2]
            positions = torch.arange(logits.shape[0] * logits.shape[1])[::2]
        return fused_log_probs_entropy(logits, labels[positions], None, vocab_size=500, positions=positions,
                                       entropy=True, chunk_tokens=CHUNK_TOKENS // 2)

    assert 0 < _largest_fp32(head, vocab=VOCAB) <= CHUNK_TOKENS // 2 * VOCAB


def test_the_check_catches_the_separate_ops():
    """Run red: the separate ops upcast all 64 tokens at once (the check can fail)."""
    assert _largest_fp32(_separate, vocab=VOCAB) > CHUNK_TOKENS * VOCAB
