"""The log-prob + entropy head on CPU: today's separate vocab-parallel ops against the fused, chunked head, and
the head from hidden states (``hpa.ops.linear_head``, eager and with its per-chunk regions compiled).

Usage::

    python bench/fused_head.py [--tokens 2048 --vocab 32768 --chunk-tokens 1024 --select 1.0 --repeats 3 --threads 1]

What runs: the forward and backward of ``Σ log p(label) − 0.01·Σ H`` over ``[tokens, vocab]`` logits at
TP1, in fp32 (the CPU dtype) and bf16 (the GPU dtype): "separate" is ``vocab_parallel_log_probs`` +
``vocab_parallel_entropy`` on every position; "fused" is ``fused_log_probs_entropy`` on the
``--select`` share of the positions (every ``1/select``-th: the response positions a loss reads; 1.0:
all of them), read out of the full logits through ``positions`` as the callers do. Per side it reports the aten ops dispatched, the largest fp32
tensor any op creates, the peak of the fp32 bytes live at once that the ops allocated (the logits and
their gradient buffer excluded when fp32: both sides hold those), and the median wall time of
``--repeats`` runs (outside the dispatch mode). "from_hidden" puts the output layer in the timed step: hidden
states ``[tokens, --hidden]`` and a weight ``[vocab, --hidden]``, "logits" (``F.linear`` then the fused head),
"linear" (``linear_log_probs_entropy``) and "linear_compiled" (its ``chunk_stats`` / ``chunk_grad`` through
``torch.compile(fullgraph=True)``; the first call, which compiles, is not timed: ``compile_s``), at the
``--select`` positions. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hpa.ops import linear_head
from hpa.ops.fused_head import fused_log_probs_entropy
from hpa.ops.linear_head import linear_log_probs_entropy
from hpa.ops.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs


class Fp32Tracker(TorchDispatchMode):
    """Counts aten ops, the largest fp32 output and the peak of live fp32 storage the ops allocated."""

    def __init__(self, ignore=()):
        super().__init__()
        self.ops = self.largest = self.live = self.peak = 0
        self.refs = {}  # storage pointer -> [bytes, live tensors on it]
        self.ignore = {t.untyped_storage().data_ptr() for t in ignore}

    def _release(self, ptr):
        entry = self.refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in tree_leaves(out):
            if not (torch.is_tensor(t) and t.dtype == torch.float32):
                continue
            self.largest = max(self.largest, t.numel())
            ptr = t.untyped_storage().data_ptr()
            if ptr in self.ignore or ptr == 0:
                continue
            if ptr not in self.refs:
                self.refs[ptr] = [t.untyped_storage().nbytes(), 0]
                self.live += self.refs[ptr][0]
                self.peak = max(self.peak, self.live)
            self.refs[ptr][1] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def separate(logits, labels):
    return (vocab_parallel_log_probs(logits, labels, None, temperature=0.9),
            vocab_parallel_entropy(logits, None, temperature=0.9))


def fused(chunk_tokens, select):
    def head(logits, labels):
        if select >= 1:
            return fused_log_probs_entropy(logits, labels, None, temperature=0.9, entropy=True,
                                           chunk_tokens=chunk_tokens)
        positions = torch.arange(0, logits.shape[0], round(1 / select))  # the positions a loss reads
        return fused_log_probs_entropy(logits, labels[positions], None, temperature=0.9, positions=positions,
                                       entropy=True, chunk_tokens=chunk_tokens)
    return head


def step(head, logits, labels):
    logp, ent = head(logits, labels)
    (logp.sum() - 0.01 * ent.sum()).backward()


def measure(head, base, labels, repeats):
    logits = base.clone().requires_grad_()
    logits.grad = torch.zeros_like(logits)  # allocated up front: the same buffer on both sides
    with Fp32Tracker(ignore=(logits, logits.grad)) as mode:
        step(head, logits, labels)
    times = []
    for _ in range(repeats):
        logits.grad = None
        start = time.perf_counter()
        step(head, logits, labels)
        times.append(time.perf_counter() - start)
    return {"aten_ops": mode.ops, "largest_fp32_elements": mode.largest, "peak_fp32_mb": round(mode.peak / 2**20, 1),
            "wall_s": round(statistics.median(times), 3)}


def from_hidden(args, dtype):
    """Wall time of forward + backward from hidden states, output layer included (see the module docstring)."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden ** 0.5).to(dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    positions = torch.arange(0, args.tokens, max(1, round(1 / args.select)))

    def logits_head(x, w):
        return fused_log_probs_entropy(torch.nn.functional.linear(x, w), labels[positions], None, temperature=0.9,
                                       positions=positions, entropy=True, chunk_tokens=args.chunk_tokens)

    def linear(x, w):
        return linear_log_probs_entropy(x, w, labels[positions], None, temperature=0.9, positions=positions,
                                        entropy=True, chunk_tokens=args.chunk_tokens)

    def timed(head):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        start = time.perf_counter()
        step(head, x, w)
        first = time.perf_counter() - start
        times = []
        for _ in range(args.repeats):
            x.grad = w.grad = None
            start = time.perf_counter()
            step(head, x, w)
            times.append(time.perf_counter() - start)
        return {"wall_s": round(statistics.median(times), 3), "first_s": round(first, 1)}

    out = {"logits": timed(logits_head), "linear": timed(linear)}
    eager = linear_head.chunk_stats, linear_head.chunk_grad
    linear_head.chunk_stats = torch.compile(eager[0], fullgraph=True, dynamic=True)
    linear_head.chunk_grad = torch.compile(eager[1], fullgraph=True, dynamic=True)
    try:
        out["linear_compiled"] = timed(linear)
    finally:
        linear_head.chunk_stats, linear_head.chunk_grad = eager
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--select", type=float, default=1.0, help="share of the positions the fused head computes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the from_hidden sides")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    base = 3 * torch.randn(args.tokens, args.vocab, generator=gen)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    out = {"config": vars(args), "torch": torch.__version__}
    for dtype in ("float32", "bfloat16"):
        logits = base.to(getattr(torch, dtype))
        out[dtype] = {"separate": measure(separate, logits, labels, args.repeats),
                      "fused": measure(fused(args.chunk_tokens, args.select), logits, labels, args.repeats),
                      "from_hidden": from_hidden(args, logits.dtype)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
