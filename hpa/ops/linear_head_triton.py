"""Triton kernels for the per-chunk elementwise work of ``hpa.ops.linear_head``: the same contracts as its
``chunk_stats`` and ``chunk_grad``, each one pass over the chunk's logits.

Imported only on CUDA (``hpa.ops.linear_head._kernels``). ``usable`` checks both kernels once per device
against the torch functions and falls back to them, with a warning, if Triton fails or disagrees.
``tests/ops/test_linear_head.py`` runs them under Triton's interpreter on a CPU where Triton is installed, and
compares them on a GPU (marked ``gpu``).

``chunk_stats`` is an online softmax: each lane keeps a running max ``m``, ``Σ e^(t−m)`` and
``Σ e^(t−m)·(t−m)``, rescaled by ``e^δ`` (and the second by ``+ δ·Σ e^(t−m)``) when the max moves by ``δ``;
the lanes merge the same way at the end. ``chunk_grad`` writes ``d logits`` over the logits it read.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _stats_kernel(z_ptr, stride_z, index_ptr, on_ptr, out_ptr, c, n, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_z
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s1 = tl.zeros([BLOCK], tl.float32)
    s2 = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + lanes
        t = tl.load(base + cols, mask=cols < n, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, t)
        seen = m > float("-inf")
        delta = tl.where(seen, m - m_new, 0.0)
        alpha = tl.where(seen, tl.exp(delta), 0.0)
        real = t > float("-inf")
        e = tl.where(real, tl.exp(t - m_new), 0.0)
        s2 = alpha * (s2 + delta * s1) + tl.where(real, e * (t - m_new), 0.0)
        s1 = alpha * s1 + e
        m = m_new
    top = tl.max(m, axis=0)
    seen = m > float("-inf")
    delta = tl.where(seen, m - top, 0.0)
    alpha = tl.where(seen, tl.exp(delta), 0.0)
    total = tl.sum(alpha * s1, axis=0)
    cross = tl.sum(alpha * (s2 + delta * s1), axis=0)
    on = tl.load(on_ptr + row) != 0
    index = tl.load(index_ptr + row)
    label = tl.load(base + index).to(tl.float32) / temperature
    tl.store(out_ptr + row, top)
    tl.store(out_ptr + c + row, total)
    tl.store(out_ptr + 2 * c + row, tl.where(on, label, 0.0))
    tl.store(out_ptr + 3 * c + row, cross)


@triton.jit
def _grad_kernel(z_ptr, stride_z, m_ptr, log_s_ptr, entropy_ptr, g_lp_ptr, g_ent_ptr, index_ptr, on_ptr, n,
                 temperature, HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    ptr = z_ptr + row * stride_z + cols
    log_p = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) / temperature
    log_p = log_p - tl.load(m_ptr + row) - tl.load(log_s_ptr + row)
    p = tl.exp(log_p)
    coef = tl.zeros([BLOCK], tl.float32)
    if HAS_ENT:
        coef += tl.load(g_ent_ptr + row) * (log_p + tl.load(entropy_ptr + row))
    if HAS_LP:
        g_lp = tl.load(g_lp_ptr + row)
        coef += g_lp
    grad = -p * coef
    if HAS_LP:
        hit = (cols == tl.load(index_ptr + row)) & (tl.load(on_ptr + row) != 0)
        grad += tl.where(hit, g_lp, 0.0)
    grad = grad / temperature
    tl.store(ptr, grad.to(z_ptr.dtype.element_ty), mask=mask)


def chunk_stats(z: torch.Tensor, index: torch.Tensor, on_shard: torch.Tensor, temperature: float,
                with_entropy: bool) -> torch.Tensor:
    """As ``hpa.ops.linear_head.chunk_stats`` (fp32 out; the entropy sum is computed either way)."""
    z = z.contiguous()
    c, n = z.shape
    out = torch.empty((4, c), dtype=torch.float32, device=z.device)
    if c:
        _stats_kernel[(c,)](z, z.stride(0), index.reshape(-1).contiguous(), on_shard.contiguous(), out, c, n,
                            float(temperature), BLOCK=BLOCK)
    return out


def chunk_grad(z: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor, entropy: Optional[torch.Tensor],
               grad_log_probs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], index: torch.Tensor,
               on_shard: torch.Tensor, temperature: float) -> torch.Tensor:
    """As ``hpa.ops.linear_head.chunk_grad``; the gradient is written over ``z`` (which must be contiguous)."""
    c, n = z.shape
    if not z.is_contiguous():
        z = z.contiguous()
    dummy = m  # a pointer for the arguments a constexpr branch never reads
    has_lp, has_ent = grad_log_probs is not None, grad_entropy is not None
    if c:
        _grad_kernel[(c, triton.cdiv(n, BLOCK))](
            z, z.stride(0), m.float().contiguous(), log_s.float().contiguous(),
            entropy.float().contiguous() if has_ent else dummy,
            grad_log_probs.float().contiguous() if has_lp else dummy,
            grad_entropy.float().contiguous() if has_ent else dummy,
            index.reshape(-1).contiguous(), on_shard.contiguous(), n, float(temperature),
            HAS_LP=has_lp, HAS_ENT=has_ent, BLOCK=BLOCK)
    return z


@functools.lru_cache(maxsize=None)
def usable(device: torch.device, torch_stats, torch_grad) -> bool:
    """Whether both kernels run on ``device`` and equal the torch functions ``torch_stats`` and ``torch_grad``
    (``hpa.ops.linear_head``'s) on a small random chunk."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        z = 3 * torch.randn(6, 3000, device=device, generator=gen, dtype=torch.bfloat16)
        index = torch.randint(0, 3000, (6, 1), device=device, generator=gen)
        on = torch.tensor([True, True, False, True, True, True], device=device)
        want = torch_stats(z.clone(), index, on, 0.7, True)
        got = chunk_stats(z.clone(), index, on, 0.7, True)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        m, log_s = want[0], (want[1].log())
        ent = log_s - want[3] / want[1]
        g = torch.randn(2, 6, device=device, generator=gen)
        want = torch_grad(z.clone(), m, log_s, ent, g[0], g[1], index, on, 0.7)
        got = chunk_grad(z.clone(), m, log_s, ent, g[0], g[1], index, on, 0.7)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-4)
        return True
    except Exception as error:  # noqa: BLE001 -- any failure means: use the torch path
        warnings.warn(f"hpa.ops.linear_head: the Triton kernels fail their check on {device} ({error}); the "
                      f"head runs its torch path")
        return False
