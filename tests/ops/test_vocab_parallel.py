"""Vocab-parallel log-probs, entropy and KL against a one-process float64 reference on full logits.

Multi-rank checks run once per layout (one spawn each, every case and op inside it) and are memoised
so the per-case tests, and the TP1 == TP2 invariance test, read the same results.
"""

import math

import numpy as np
import pytest
import torch

from hpa.ops.vocab_parallel import vocab_parallel_entropy, vocab_parallel_kl, vocab_parallel_log_probs
from tests.multirank import run_ranks

OPS = ("log_probs", "entropy", "kl")
PADDING_LOGIT = 1e6  # written into padded columns: any leak into the softmax is obvious

# name -> full vocab width (divisible by every tp tested), true vocab size, temperature, dtype, logit scale
CASES = {
    "fp32": dict(width=16, vocab_size=None, temperature=1.0, dtype="float32", scale=3.0),
    "fp32_padded13_temp0.7": dict(width=16, vocab_size=13, temperature=0.7, dtype="float32", scale=3.0),
    "fp32_padded7": dict(width=16, vocab_size=7, temperature=1.0, dtype="float32", scale=3.0),  # tp2: rank 1 all pad
    "bf16_padded13": dict(width=16, vocab_size=13, temperature=1.0, dtype="bfloat16", scale=3.0),
    "fp32_large_1e4": dict(width=16, vocab_size=None, temperature=1.0, dtype="float32", scale=1e4),
}
# (value atol, grad atol) against the float64 reference on the very input values
TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (1e-5, 1e-2)}
LARGE_TOLERANCES = (1e-2, 1e-3)  # fp32 holds 1e4 to ~1e-3 absolute


def make_case(name):
    """Deterministic full (unsharded) inputs of one case, identical in every process."""
    case = CASES[name]
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))
    shape = (2, 5)
    vocab_size = case["vocab_size"] or case["width"]
    logits_p = case["scale"] * torch.randn(*shape, case["width"], generator=gen)
    logits_q = case["scale"] * torch.randn(*shape, case["width"], generator=gen)
    if case["scale"] >= 1e4:  # the extremes exactly, both signs, on the same row
        logits_p[0, 0, :2] = torch.tensor([1e4, -1e4])
        logits_q[0, 0, :2] = torch.tensor([-1e4, 1e4])
    logits_p[..., vocab_size:] = PADDING_LOGIT
    logits_q[..., vocab_size:] = PADDING_LOGIT
    labels = torch.randint(0, vocab_size, shape, generator=gen)
    weights = {op: torch.randn(*shape, generator=gen) for op in OPS}  # loss = Σ weight · op output
    dtype = getattr(torch, case["dtype"])
    return dict(case, logits_p=logits_p.to(dtype), logits_q=logits_q.to(dtype), labels=labels, weights=weights)


def _ops_on_shards(inputs, tp_group, tp_rank, tp):
    """Every op's value and shard gradients for one case; what a worker returns per case."""
    width = inputs["width"] // tp
    shard = slice(tp_rank * width, (tp_rank + 1) * width)
    p_in = inputs["logits_p"][..., shard].clone()
    q_in = inputs["logits_q"][..., shard].clone()
    p_before, q_before = p_in.clone(), q_in.clone()
    kwargs = dict(vocab_size=inputs["vocab_size"])
    out = {}
    for op in OPS:
        p = p_in.clone().requires_grad_()
        q = q_in.clone().requires_grad_()
        if op == "log_probs":
            value = vocab_parallel_log_probs(p, inputs["labels"], tp_group, temperature=inputs["temperature"],
                                             **kwargs)
        elif op == "entropy":
            value = vocab_parallel_entropy(p, tp_group, temperature=inputs["temperature"], **kwargs)
        else:
            value = vocab_parallel_kl(p, q, tp_group, temperature=inputs["temperature"], **kwargs)
        (value * inputs["weights"][op]).sum().backward()
        out[op] = dict(value=value.detach().double().numpy(), dtype=str(value.dtype),
                       grad_p=p.grad.double().numpy(), grad_dtype=str(p.grad.dtype),
                       grad_q=None if q.grad is None else q.grad.double().numpy())
    # q as a detached reference: same KL and p-gradient, no q-gradient.
    p = p_in.clone().requires_grad_()
    q = q_in.clone()
    value = vocab_parallel_kl(p, q, tp_group, temperature=inputs["temperature"], **kwargs)
    (value * inputs["weights"]["kl"]).sum().backward()
    out["kl_detached_q"] = dict(value=value.detach().double().numpy(), grad_p=p.grad.double().numpy())
    # Same inputs through the ops on the original (non-cloned) tensors: they must come back unchanged.
    p = p_in.requires_grad_()
    q = q_in.requires_grad_()
    total = (vocab_parallel_log_probs(p, inputs["labels"], tp_group, temperature=inputs["temperature"], **kwargs)
             + vocab_parallel_entropy(p, tp_group, temperature=inputs["temperature"], **kwargs)
             + vocab_parallel_kl(p, q, tp_group, temperature=inputs["temperature"], **kwargs)).sum()
    total.backward()
    out["inputs_unchanged"] = bool(torch.equal(p.detach(), p_before) and torch.equal(q.detach(), q_before))
    return out


def vocab_parallel_worker(groups, case_names):
    """One spawn per layout: every case, every op, values and gradients."""
    tp = groups.tensor_model_parallel_size
    return dict(tp_rank=groups.tp_rank,
                cases={name: _ops_on_shards(make_case(name), groups.tp_group, groups.tp_rank, tp)
                       for name in case_names})


_RESULTS = {}


def results_for(tp):
    """Per-case results of a ``tp``-rank run, shard gradients concatenated back to the full vocab."""
    if tp not in _RESULTS:
        ranks = sorted(run_ranks(vocab_parallel_worker, tp=tp, args=(sorted(CASES),)), key=lambda r: r["tp_rank"])
        merged = {}
        for name in CASES:
            per_rank = [r["cases"][name] for r in ranks]
            first = per_rank[0]
            case = {"inputs_unchanged": all(r["inputs_unchanged"] for r in per_rank)}
            for op in (*OPS, "kl_detached_q"):
                for r in per_rank[1:]:  # every rank must hold the same replicated value
                    np.testing.assert_array_equal(r[op]["value"], first[op]["value"])
                case[op] = {key: (np.concatenate([r[op][key] for r in per_rank], axis=-1)
                                  if key.startswith("grad_") and first[op][key] is not None
                                  and not key.endswith("dtype") else first[op][key])
                            for key in first[op]}
            merged[name] = case
        _RESULTS[tp] = merged
    return _RESULTS[tp]


def reference(inputs, logits_p=None, logits_q=None):
    """float64 autograd on the full logits (padded columns cut off): values and full-width gradients."""
    logits_p = (inputs["logits_p"] if logits_p is None else logits_p).double()
    logits_q = (inputs["logits_q"] if logits_q is None else logits_q).double()
    vocab_size = inputs["vocab_size"] or inputs["width"]
    out = {}
    for op in OPS:
        p = logits_p.clone().requires_grad_()
        q = logits_q.clone().requires_grad_()
        log_p = torch.log_softmax(p[..., :vocab_size] / inputs["temperature"], dim=-1)
        if op == "log_probs":
            value = log_p.gather(-1, inputs["labels"].unsqueeze(-1)).squeeze(-1)
        elif op == "entropy":
            value = torch.distributions.Categorical(logits=p[..., :vocab_size] / inputs["temperature"]).entropy()
        else:
            log_q = torch.log_softmax(q[..., :vocab_size] / inputs["temperature"], dim=-1)
            value = (log_p.exp() * (log_p - log_q)).sum(-1)
        (value * inputs["weights"][op].double()).sum().backward()
        out[op] = dict(value=value.detach().numpy(), grad_p=p.grad.numpy(),
                       grad_q=None if op != "kl" else q.grad.numpy())
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_matches_one_process_reference(tp, name):
    inputs = make_case(name)
    got = results_for(tp)[name]
    ref = reference(inputs)
    value_atol, grad_atol = LARGE_TOLERANCES if inputs["scale"] >= 1e4 else TOLERANCES[inputs["dtype"]]
    for op in OPS:
        assert got[op]["dtype"] == "torch.float32", op
        assert got[op]["grad_dtype"] == str(inputs["logits_p"].dtype), op
        assert np.isfinite(got[op]["value"]).all() and np.isfinite(got[op]["grad_p"]).all(), op
        np.testing.assert_allclose(got[op]["value"], ref[op]["value"], rtol=0, atol=value_atol, err_msg=op)
        np.testing.assert_allclose(got[op]["grad_p"], ref[op]["grad_p"], rtol=0, atol=grad_atol, err_msg=op)
    np.testing.assert_allclose(got["kl"]["grad_q"], ref["kl"]["grad_q"], rtol=0, atol=grad_atol)
    if inputs["vocab_size"] is not None:  # padded columns get no gradient
        for grad in (got["log_probs"]["grad_p"], got["entropy"]["grad_p"], got["kl"]["grad_p"], got["kl"]["grad_q"]):
            assert not grad[..., inputs["vocab_size"]:].any()
    # q detached (a reference model): the same KL and p-gradient, and no gradient for q.
    np.testing.assert_array_equal(got["kl_detached_q"]["value"], got["kl"]["value"])
    np.testing.assert_allclose(got["kl_detached_q"]["grad_p"], got["kl"]["grad_p"], rtol=0, atol=1e-7)
    assert got["inputs_unchanged"]


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_bf16_close_to_fp32_logits(tp):
    """bf16 input against the reference on the fp32 logits it was rounded from: bf16 tolerance."""
    name = "bf16_padded13"
    inputs = make_case(name)
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))  # regenerate the unrounded logits
    logits_p = 3.0 * torch.randn(2, 5, 16, generator=gen)
    logits_q = 3.0 * torch.randn(2, 5, 16, generator=gen)
    assert torch.equal(logits_p.bfloat16()[..., :13], inputs["logits_p"][..., :13])
    ref = reference(inputs, logits_p=logits_p, logits_q=logits_q)
    got = results_for(tp)[name]
    for op in OPS:
        np.testing.assert_allclose(got[op]["value"], ref[op]["value"], rtol=0, atol=5e-2, err_msg=op)
        np.testing.assert_allclose(got[op]["grad_p"], ref[op]["grad_p"], rtol=0, atol=5e-2, err_msg=op)


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_equals_tp1(name):
    """Invariance: sharding the vocab over two ranks changes nothing beyond float rounding."""
    tp1, tp2 = results_for(1)[name], results_for(2)[name]
    atol = 1e-2 if CASES[name]["scale"] >= 1e4 else 1e-5
    for op in OPS:
        np.testing.assert_allclose(tp2[op]["value"], tp1[op]["value"], rtol=0, atol=atol, err_msg=op)
        np.testing.assert_allclose(tp2[op]["grad_p"], tp1[op]["grad_p"], rtol=0, atol=1e-2 if
                                   CASES[name]["dtype"] == "bfloat16" else 1e-5, err_msg=op)


# ---------------------------------------------------------------- single process (tp_group=None)

def _single(op, p, q, labels, vocab_size, temperature):
    if op == "log_probs":
        return vocab_parallel_log_probs(p, labels, None, vocab_size=vocab_size, temperature=temperature)
    if op == "entropy":
        return vocab_parallel_entropy(p, None, vocab_size=vocab_size, temperature=temperature)
    return vocab_parallel_kl(p, q, None, vocab_size=vocab_size, temperature=temperature)


@pytest.mark.parametrize("vocab_size,temperature", [(None, 1.0), (9, 0.6)], ids=["full", "padded9_temp0.6"])
@pytest.mark.parametrize("op", OPS)
def test_gradcheck_float64(op, vocab_size, temperature):
    gen = torch.Generator().manual_seed(0)
    p = (2 * torch.randn(3, 4, 12, generator=gen, dtype=torch.float64)).requires_grad_()
    q = (2 * torch.randn(3, 4, 12, generator=gen, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, vocab_size or 12, (3, 4), generator=gen)
    fn = lambda p, q: _single(op, p, q, labels, vocab_size, temperature)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (p, q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS)
def test_large_logits_stay_finite_and_correct(op, dtype):
    gen = torch.Generator().manual_seed(1)
    p = (1e4 * torch.randn(4, 32, generator=gen)).clamp(-1e4, 1e4)
    q = (1e4 * torch.randn(4, 32, generator=gen)).clamp(-1e4, 1e4)
    p[0, :3] = torch.tensor([1e4, 1e4, -1e4])  # a tie at the max, and the minimum
    q[0, :3] = torch.tensor([-1e4, 1e4, 1e4])
    p, q = p.to(dtype), q.to(dtype)
    labels = torch.randint(0, 32, (4,), generator=gen)
    labels[0] = 2  # a label with probability exp(-2e4): log-prob is -2e4 - log 2, not -inf
    p_ = p.clone().requires_grad_()
    q_ = q.clone().requires_grad_()
    value = _single(op, p_, q_, labels, None, 1.0)
    value.sum().backward()
    assert value.dtype == torch.float32
    assert torch.isfinite(value).all() and torch.isfinite(p_.grad).all()
    assert q_.grad is None if op != "kl" else torch.isfinite(q_.grad).all()
    ref = reference(dict(width=32, vocab_size=None, temperature=1.0, labels=labels,
                         weights={o: torch.ones(4) for o in OPS}), logits_p=p, logits_q=q)[op]
    np.testing.assert_allclose(value.detach().double().numpy(), ref["value"], rtol=1e-6, atol=1e-2)
    # KL's p-gradient is ~1e3 here (log p − log q ~ 2e4), so the tolerance is relative; bf16 grads round.
    rtol, atol = (1e-2, 1e-2) if dtype == torch.bfloat16 else (1e-5, 1e-4)
    np.testing.assert_allclose(p_.grad.double().numpy(), ref["grad_p"], rtol=rtol, atol=atol)
    if op == "log_probs":  # the clamp makes several logits tie at the max
        row = p[0].double()
        num_max = int((row == row.max()).sum())
        expected = (row[2] - row.max()).item() - math.log(num_max)  # about -2e4
        assert value[0].item() == pytest.approx(expected, abs=1e-2)


def test_hand_computed_values():
    uniform = torch.zeros(2, 8)
    uniform[:, 6:] = 123.0  # padding
    assert torch.allclose(vocab_parallel_entropy(uniform, None, vocab_size=6), torch.full((2,), math.log(6)))
    assert torch.allclose(vocab_parallel_log_probs(uniform, torch.tensor([0, 5]), None, vocab_size=6),
                          torch.full((2,), -math.log(6)))
    assert torch.equal(vocab_parallel_kl(uniform, uniform, None, vocab_size=6), torch.zeros(2))
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = ½ log 2 + ½ log(2/3)
    p = torch.tensor([[0.0, 0.0]])
    q = torch.tensor([[0.0, math.log(3)]])
    expected = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    assert vocab_parallel_kl(p, q, None).item() == pytest.approx(expected, abs=1e-6)


def test_bf16_input_fp32_output_and_input_dtype_grad():
    logits = torch.randn(3, 10).bfloat16().requires_grad_()
    before = logits.detach().clone()
    value = vocab_parallel_log_probs(logits, torch.tensor([1, 2, 3]), None, temperature=0.5)
    value.sum().backward()
    assert value.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    assert torch.equal(logits.detach(), before)


def test_no_grad_reference_path():
    with torch.no_grad():
        value = vocab_parallel_entropy(torch.randn(2, 3, 10), None)
    assert value.shape == (2, 3) and not value.requires_grad


def test_errors_say_what_to_do():
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="vocab_size=9 must be in"):
        vocab_parallel_entropy(logits, None, vocab_size=9)
    with pytest.raises(ValueError, match="labels"):
        vocab_parallel_log_probs(logits, torch.zeros(3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(logits, torch.zeros(2, dtype=torch.long), None, temperature=0.0)
    with pytest.raises(ValueError, match="same shape"):
        vocab_parallel_kl(logits, torch.randn(2, 7), None)
