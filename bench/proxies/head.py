"""CPU proxy of the LM head's HBM traffic: bytes read and written per response token, forward + backward with
entropy, at the real vocabulary (V = 151,936, TP1) in bf16, the GPU's dtype.

Usage::

    python bench/proxies/head.py   # one JSON line

The counter (``HbmBytes``, a ``TorchDispatchMode``) is a model of a GPU's memory traffic: every aten op reads
each tensor argument and writes each tensor output once, so it moves the bytes of its inputs and outputs
(``numel × itemsize`` of each, a view's elements only); views and allocations without a fill move nothing, a
filled allocation (``new_zeros``, ``zeros_like``, ...) writes its output only; a
gather (``index``, ``index_select``, ``gather``) reads only the elements it outputs, a scatter (``index_add_``,
``scatter_add_``, ``index_put_``) reads its source and reads and writes only the elements it updates. A fused
kernel (the linear head's matmul-fused ``fused_stats`` and ``fused_grads``, or its per-chunk regions
``chunk_stats`` and ``chunk_grad`` between cuBLAS matmuls) counts its inputs and outputs once, as a
matmul does: tiles a kernel reads again (the weight once per token tile, the hidden states once per vocab tile)
are taken to come from cache. ``head.bytes_per_token_eager`` counts the chunked head with its regions op by op,
what the CPU's eager torch path moves. Everything runs on fake
tensors (``FakeTensorMode``), so the real shapes cost no memory and no time.

What runs: one packed micro-batch of ``ROWS`` rows of ``PROMPT`` prompt and ``RESPONSE`` response tokens;
hidden states ``[1, T, h]`` (narrow ``HIDDEN``) and the output weight ``[V, h]``, bf16; the loss
``Σ log p − 0.01·Σ H`` over the response tokens; backward to the hidden states and the weight.

- ``head.bytes_per_token``: the head from hidden states (``hpa.ops.linear_head``) as CUDA runs it by default
  (``fused_forward``): the matmul-fused forward (the hidden states and the weight read, ``[N]`` statistics
  written, no logits in memory), then the region backward: a chunk's recomputed logits written by a cuBLAS
  matmul, read by ``chunk_grad`` which writes ``d logits``, read by the two gradient matmuls (5 logit passes).
- ``head.bytes_per_token_fused_backward``: both halves matmul-fused (``kernel="fused"``): no logits in memory
  either way (the hidden states, the weight, per-token statistics and the two gradients).
- ``head.bytes_per_token_unfused_matmul``: the same head with cuBLAS matmuls and the two per-chunk region
  kernels both ways (``regions``, the CUDA fallback): the logits of a chunk go through memory 7 times.
- ``head.bytes_per_token_logits``: the head before it, the same counter: megatron's output layer forms the
  logits of every position (``F.linear``), then the chunked head on logits (``hpa.ops.fused_head``) at the
  response positions, then the output layer's backward matmuls on the full ``[T, V]`` logits' gradient.
- ``head.bytes_per_token_h896`` and ``head.bytes_per_token_unfused_matmul_h896``: the default and ``regions`` at
  the real hidden size (Qwen2-0.5B), where the weight's share (read three or four times, its gradient written
  once) is ~(4 to 5)·2·V·h / (tokens a call or a chunk); here the 1,536 response tokens are one chunk (the default chunk is 1,766 tokens at TP1).
- ``head.logit_passes``: ``head.bytes_per_token`` in units of one bf16 pass over a token's logits (2·V bytes).
"""

from __future__ import annotations

import contextlib
import json
from typing import Dict

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

VOCAB = 151_936
HIDDEN = 64  # narrow: the weight's share per token is HIDDEN / chunk tokens of a logit pass
ROWS, PROMPT, RESPONSE = 8, 64, 192  # 2,048 tokens, 1,536 of them response tokens
ENTROPY_COEF = 0.01

_FREE = {"empty", "empty_like", "new_empty", "empty_strided", "detach", "lift_fresh", "_unsafe_view"}
_FACTORIES = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like", "zeros", "ones", "full",
              "scalar_tensor", "arange"}  # write their output, read no data of their arguments
_GATHERS = {"index", "index_select", "gather"}
_SCATTERS = {"index_add", "index_add_", "scatter_add", "scatter_add_", "index_put", "index_put_", "_index_put_impl_"}


def _bytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


class HbmBytes(TorchDispatchMode):
    """Sums the bytes each aten op reads and writes (the module docstring's model)."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.ops = 0
        self.inside = False  # in a fused region: its ops are not counted one by one

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self.inside or func.namespace != "aten" or func.is_view or name in _FREE:  # prim.device etc.: metadata
            return out
        self.ops += 1
        inputs, outputs = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)], \
            [t for t in tree_leaves(out) if torch.is_tensor(t)]
        if name in _FACTORIES:
            self.total += sum(_bytes(t) for t in outputs)
        elif name in _GATHERS:  # reads the indices and the elements it outputs
            self.total += sum(_bytes(t) for t in inputs[1:]) + 2 * sum(_bytes(t) for t in outputs)
        elif name in _SCATTERS:  # reads indices and source, reads and writes the updated elements
            source = inputs[-1] if name.startswith(("index_add", "scatter_add")) else inputs[2]
            self.total += sum(_bytes(t) for t in inputs[1:]) + 2 * _bytes(source)
        else:
            self.total += sum(_bytes(t) for t in inputs) + sum(_bytes(t) for t in outputs)
        return out

    def region(self, fn):
        """``fn`` as one fused kernel: its tensor inputs and outputs, nothing inside."""
        def run(*args, **kwargs):
            self.inside = True
            try:
                out = fn(*args, **kwargs)
            finally:
                self.inside = False
            self.total += sum(_bytes(t) for t in tree_leaves((args, kwargs, out)))
            self.ops += 1
            return out
        return run


def _inputs(hidden_size: int):
    gen = torch.Generator().manual_seed(0)
    t = ROWS * (PROMPT + RESPONSE)
    hidden = torch.randn(1, t, hidden_size, dtype=torch.bfloat16).requires_grad_()  # [1, T, h]
    weight = torch.randn(VOCAB, hidden_size, dtype=torch.bfloat16).requires_grad_()  # [V, h]
    starts = torch.arange(ROWS) * (PROMPT + RESPONSE) + PROMPT - 1  # the position before each response
    positions = (starts[:, None] + torch.arange(RESPONSE)).reshape(-1)  # [N]
    labels = torch.randint(0, VOCAB, (positions.numel(),), generator=gen)
    return hidden, weight, positions, labels


def _linear(hidden, weight, positions, labels):
    from hpa.ops.linear_head import linear_log_probs_entropy

    return linear_log_probs_entropy(hidden, weight, labels, None, VOCAB, positions=positions, entropy=True)


def _logits(hidden, weight, positions, labels):
    from hpa.ops.fused_head import fused_log_probs_entropy

    logits = F.linear(hidden, weight)  # [1, T, V]: megatron's ColumnParallelLinear
    return fused_log_probs_entropy(logits, labels, None, VOCAB, positions=positions, entropy=True)


def bytes_per_token(head, *, hidden_size: int = HIDDEN, fused_regions: bool = True, fused_forward: bool = False,
                    fused_backward: bool = False) -> float:
    """Bytes the forward and backward of ``head`` move per response token (fake tensors, the ``HbmBytes`` model).
    ``fused_forward``: the linear head's forward runs its matmul-fused kernel, its backward cuBLAS matmuls and the
    region kernel (the CUDA default); with ``fused_backward`` the backward runs matmul-fused too. Each fused
    kernel counts as one region (their torch references stand in for them on fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hpa.ops import linear_head

    counter = HbmBytes()
    with contextlib.ExitStack() as stack:
        stack.enter_context(FakeTensorMode())
        if fused_forward:
            original = linear_head._kernels
            stack.callback(setattr, linear_head, "_kernels", original)
            kernels = (True, counter.region(linear_head.fused_stats), fused_backward,
                       counter.region(linear_head.fused_grads if fused_backward else linear_head.chunk_grad))
            setattr(linear_head, "_kernels", lambda *args, **kwargs: kernels)
        elif fused_regions:
            for name in ("chunk_stats", "chunk_grad"):
                original = getattr(linear_head, name)
                stack.callback(setattr, linear_head, name, original)
                setattr(linear_head, name, counter.region(original))
        hidden, weight, positions, labels = _inputs(hidden_size)
        with counter:
            logp, ent = head(hidden, weight, positions, labels)
            (logp.sum() - ENTROPY_COEF * ent.sum()).backward()
    return counter.total / positions.numel()


def measure() -> Dict[str, float]:
    new = bytes_per_token(_linear, fused_forward=True)
    return {"head.bytes_per_token": round(new),
            "head.bytes_per_token_fused_backward": round(bytes_per_token(_linear, fused_forward=True,
                                                                         fused_backward=True)),
            "head.bytes_per_token_unfused_matmul": round(bytes_per_token(_linear)),
            "head.bytes_per_token_logits": round(bytes_per_token(_logits)),
            "head.bytes_per_token_eager": round(bytes_per_token(_linear, fused_regions=False)),
            "head.bytes_per_token_h896": round(bytes_per_token(_linear, hidden_size=896, fused_forward=True)),
            "head.bytes_per_token_unfused_matmul_h896": round(bytes_per_token(_linear, hidden_size=896)),
            "head.logit_passes": round(new / (2 * VOCAB), 2)}


if __name__ == "__main__":
    print(json.dumps(measure()))
