"""Triton kernels of ``hpa.ops.linear_head``: the matmul-fused head (``fused_stats``, ``fused_grads``: the
logits only in registers) and, its fallback, the per-chunk elementwise work between cuBLAS matmuls
(``chunk_stats``, ``chunk_grad``: each one pass over the chunk's logits); the contracts of the torch functions
of the same names there.

Imported only on CUDA (``hpa.ops.linear_head._kernels``) or when a path is asked for by name. ``fused_usable``
(the fused forward, the CUDA default's forward) and ``usable`` (the region kernels, its backward) check once per
device against the torch path; a failing one falls back, with a warning. None of these kernels has run on a GPU
yet; they ran under Triton's CPU interpreter.
``tests/ops/test_linear_head.py`` runs them under Triton's interpreter on a CPU where Triton is installed, and
compares them on a GPU (marked ``gpu``).

``chunk_stats`` is an online softmax: each lane keeps a running max ``m``, ``Σ e^(t−m)`` and
``Σ e^(t−m)·(t−m)``, rescaled by ``e^δ`` (and the second by ``+ δ·Σ e^(t−m)``) when the max moves by ``δ``;
the lanes merge the same way at the end. ``chunk_grad`` writes ``d logits`` over the logits it read.
"""

from __future__ import annotations

import functools
import os
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


# --- the matmul-fused head: the logits live in registers only -------------------------------------------------
#
# Written after verl's ``efficient_entropy`` kernels (verl/utils/kernel/kernels.py at volcengine/verl b178a3c):
# the forward loops over vocab tiles per token tile with an online softmax; the backward recomputes each logits
# tile and forms ``d logits`` in registers, once per token tile for ``d hidden`` (looping over the vocab) and once
# per vocab tile for ``d W`` (looping over the tokens), each program writing one column block of its output.

# CUDA tiles (untuned, never run on a GPU); the tests set small ones for the interpreter. BLOCK_K: the reduction
# over h of a logits tile; BLOCK_H: the columns of d hidden / d W one backward program writes (each program
# recomputes its logits tiles, so the backward forms the logits 2·ceil(h / BLOCK_H) times)
FUSED_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "BLOCK_H": 128}
# Triton's CPU interpreter multiplies bf16 tiles wrongly (3.9.0): there the products go through fp32 (exact for
# bf16 inputs, the same fp32 sums a tensor core forms)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a·b``: fp32 inputs exactly (``ieee``, not tf32); ``IEEE`` also upcasts low-precision inputs."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _logits_tile(x_ptr, w_ptr, rows, cols, n_rows, n_cols, h, temperature, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``x[rows]·w[cols]ᵀ / T`` ``[BLOCK_M, BLOCK_N]`` in fp32 (0 outside the matrices), the product rounded to
    the weight's dtype first, as the cuBLAS matmul of the region path and the torch path write it: the fused
    forward's statistics then match the region backward's recomputed logits."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for k in range(0, h, BLOCK_K):
        kk = k + ks
        x = tl.load(x_ptr + rows[:, None] * h + kk[None, :], mask=(rows[:, None] < n_rows) & (kk[None, :] < h),
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * h + kk[None, :], mask=(cols[:, None] < n_cols) & (kk[None, :] < h),
                    other=0.0)
        acc = _dot(x, tl.trans(w), acc, IEEE)
    if w_ptr.dtype.element_ty == tl.bfloat16:  # round to nearest even by bits (the interpreter's cast truncates)
        bits = acc.to(tl.uint32, bitcast=True)
        acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif w_ptr.dtype.element_ty == tl.float16:
        acc = acc.to(tl.float16).to(tl.float32)
    return acc / temperature


@triton.jit
def _fused_stats_kernel(x_ptr, w_ptr, index_ptr, on_ptr, out_ptr, n_rows, n_cols, h, temperature,
                        IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    index = tl.load(index_ptr + rows, mask=rows < n_rows, other=-1)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s1 = tl.zeros([BLOCK_M], tl.float32)  # Σ e^(t−m)
    s2 = tl.zeros([BLOCK_M], tl.float32)  # Σ e^(t−m)·(t−m)
    label = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        t = _logits_tile(x_ptr, w_ptr, rows, cols, n_rows, n_cols, h, temperature, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        real = (cols < n_cols)[None, :]
        t = tl.where(real, t, float("-inf"))
        label += tl.sum(tl.where(cols[None, :] == index[:, None], t, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(t, axis=1))  # finite: every tile holds a real column
        seen = m > float("-inf")
        delta = tl.where(seen, m - m_new, 0.0)
        alpha = tl.where(seen, tl.exp(delta), 0.0)
        shifted = tl.where(real, t - m_new[:, None], 0.0)
        e = tl.where(real, tl.exp(shifted), 0.0)
        s2 = alpha * (s2 + delta * s1) + tl.sum(e * shifted, axis=1)
        s1 = alpha * s1 + tl.sum(e, axis=1)
        m = m_new
    on = tl.load(on_ptr + rows, mask=rows < n_rows, other=0) != 0
    keep = rows < n_rows
    tl.store(out_ptr + rows, m, mask=keep)
    tl.store(out_ptr + n_rows + rows, s1, mask=keep)
    tl.store(out_ptr + 2 * n_rows + rows, tl.where(on, label, 0.0), mask=keep)
    tl.store(out_ptr + 3 * n_rows + rows, s2, mask=keep)


@triton.jit
def _dz_tile(t, cols, n_cols, m, log_s, ent, g_lp, g_ent, index, on, temperature, HAS_LP: tl.constexpr,
             HAS_ENT: tl.constexpr):
    """``d loss / d z`` of a logits tile ``t`` (already divided by T), as ``chunk_grad``; 0 outside the vocab."""
    real = (cols < n_cols)[None, :]
    log_p = tl.where(real, t - m[:, None] - log_s[:, None], 0.0)
    p = tl.where(real, tl.exp(log_p), 0.0)
    coef = tl.zeros_like(log_p)
    if HAS_ENT:
        coef += g_ent[:, None] * (log_p + ent[:, None])
    if HAS_LP:
        coef += g_lp[:, None]
    grad = -p * coef
    if HAS_LP:
        hit = (cols[None, :] == index[:, None]) & on[:, None]
        grad += tl.where(hit, g_lp[:, None], 0.0)
    return grad / temperature


@triton.jit
def _row_stats(rows, n_rows, m_ptr, log_s_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, index_ptr, on_ptr,
               HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr):
    keep = rows < n_rows
    m = tl.load(m_ptr + rows, mask=keep, other=0.0)
    log_s = tl.load(log_s_ptr + rows, mask=keep, other=0.0)
    zero = tl.zeros_like(m)
    ent, g_ent, g_lp = zero, zero, zero  # a padded row: both upstream gradients 0, so d z is 0
    if HAS_ENT:
        ent = tl.load(ent_ptr + rows, mask=keep, other=0.0)
        g_ent = tl.load(g_ent_ptr + rows, mask=keep, other=0.0)
    if HAS_LP:
        g_lp = tl.load(g_lp_ptr + rows, mask=keep, other=0.0)
    index = tl.load(index_ptr + rows, mask=keep, other=-1)
    on = tl.load(on_ptr + rows, mask=keep, other=0) != 0
    return m, log_s, ent, g_lp, g_ent, index, on


@triton.jit
def _fused_grad_hidden_kernel(x_ptr, w_ptr, m_ptr, log_s_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, index_ptr, on_ptr,
                              out_ptr, n_rows, n_cols, h, temperature, IEEE: tl.constexpr, HAS_LP: tl.constexpr,
                              HAS_ENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """``d x`` ``[N, h]``: a program owns a tile of token rows and sums ``dz · w`` over the vocab tiles.
    ``_fused_grad_weight_kernel`` is its transpose (a tile of vocab rows, summed over the token tiles); the two
    stay two kernels, so that each program holds its output tile in one fp32 accumulator, with no atomics."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # this program's columns of d hidden
    m, log_s, ent, g_lp, g_ent, index, on = _row_stats(rows, n_rows, m_ptr, log_s_ptr, ent_ptr, g_lp_ptr,
                                                       g_ent_ptr, index_ptr, on_ptr, HAS_LP, HAS_ENT)
    acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        t = _logits_tile(x_ptr, w_ptr, rows, cols, n_rows, n_cols, h, temperature, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        dz = _dz_tile(t, cols, n_cols, m, log_s, ent, g_lp, g_ent, index, on, temperature, HAS_LP, HAS_ENT)
        w = tl.load(w_ptr + cols[:, None] * h + ks[None, :], mask=(cols[:, None] < n_cols) & (ks[None, :] < h),
                    other=0.0)
        acc = _dot(dz.to(w.dtype), w, acc, IEEE)
    tl.store(out_ptr + rows[:, None] * h + ks[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < n_rows) & (ks[None, :] < h))


@triton.jit
def _fused_grad_weight_kernel(x_ptr, w_ptr, m_ptr, log_s_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, index_ptr, on_ptr,
                              out_ptr, n_rows, n_cols, h, temperature, IEEE: tl.constexpr, HAS_LP: tl.constexpr,
                              HAS_ENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """``d w`` ``[n, h]``: the transpose of ``_fused_grad_hidden_kernel`` (see there)."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # this program's columns of d W
    acc = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)  # fp32 over every token tile: one rounding, as one matmul
    for start in range(0, n_rows, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        m, log_s, ent, g_lp, g_ent, index, on = _row_stats(rows, n_rows, m_ptr, log_s_ptr, ent_ptr, g_lp_ptr,
                                                           g_ent_ptr, index_ptr, on_ptr, HAS_LP, HAS_ENT)
        t = _logits_tile(x_ptr, w_ptr, rows, cols, n_rows, n_cols, h, temperature, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        dz = _dz_tile(t, cols, n_cols, m, log_s, ent, g_lp, g_ent, index, on, temperature, HAS_LP, HAS_ENT)
        x = tl.load(x_ptr + rows[:, None] * h + ks[None, :], mask=(rows[:, None] < n_rows) & (ks[None, :] < h),
                    other=0.0)
        acc = _dot(tl.trans(dz.to(x.dtype)), x, acc, IEEE)
    tl.store(out_ptr + cols[:, None] * h + ks[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(cols[:, None] < n_cols) & (ks[None, :] < h))


def fused_stats(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor, on_shard: torch.Tensor, temperature: float,
                with_entropy: bool, blocks: Optional[dict] = None) -> torch.Tensor:
    """As ``hpa.ops.linear_head.fused_stats``: ``[4, N]`` fp32 statistics of ``x·wᵀ``, no logits in memory."""
    blocks = blocks or FUSED_BLOCKS
    x, w = x.contiguous(), w.contiguous()
    n, h = x.shape
    out = torch.empty((4, n), dtype=torch.float32, device=x.device)
    if n:
        _fused_stats_kernel[(triton.cdiv(n, blocks["BLOCK_M"]),)](
            x, w, index.reshape(-1).contiguous(), on_shard.contiguous(), out, n, w.shape[0], h, float(temperature),
            IEEE=w.dtype == torch.float32 or _INTERPRETED, BLOCK_M=blocks["BLOCK_M"], BLOCK_N=blocks["BLOCK_N"],
            BLOCK_K=blocks["BLOCK_K"])
    return out


def fused_grads(x: torch.Tensor, w: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor,
                entropy: Optional[torch.Tensor], grad_log_probs: Optional[torch.Tensor],
                grad_entropy: Optional[torch.Tensor], index: torch.Tensor, on_shard: torch.Tensor,
                temperature: float, need_hidden: bool, need_weight: bool, blocks: Optional[dict] = None):
    """As ``hpa.ops.linear_head.fused_grads``: ``(d x [N, h] or None, d w [n, h] or None)`` in ``w``'s dtype."""
    blocks = blocks or FUSED_BLOCKS
    x, w = x.contiguous(), w.contiguous()
    n, h = x.shape
    has_lp, has_ent = grad_log_probs is not None, grad_entropy is not None
    m = m.float().contiguous()
    args = (x, w, m, log_s.float().contiguous(), entropy.float().contiguous() if has_ent else m,
            grad_log_probs.float().contiguous() if has_lp else m, grad_entropy.float().contiguous() if has_ent else m,
            index.reshape(-1).contiguous(), on_shard.contiguous())
    meta = dict(IEEE=w.dtype == torch.float32 or _INTERPRETED, HAS_LP=has_lp, HAS_ENT=has_ent, num_warps=8,
                **blocks)  # 8 warps: a [128, 128] fp32 accumulator beside the logits tile
    grad_x = grad_w = None
    if need_hidden:
        grad_x = torch.empty_like(x, dtype=w.dtype)
        if n:
            grid = (triton.cdiv(n, blocks["BLOCK_M"]), triton.cdiv(h, blocks["BLOCK_H"]))
            _fused_grad_hidden_kernel[grid](*args, grad_x, n, w.shape[0], h, float(temperature), **meta)
    if need_weight:
        grad_w = torch.empty_like(w)
        if n:
            grid = (triton.cdiv(w.shape[0], blocks["BLOCK_N"]), triton.cdiv(h, blocks["BLOCK_H"]))
            _fused_grad_weight_kernel[grid](*args, grad_w, n, w.shape[0], h, float(temperature), **meta)
        else:
            grad_w.zero_()
    return grad_x, grad_w


@functools.lru_cache(maxsize=None)
def fused_usable(device: torch.device, head) -> bool:
    """Whether the matmul-fused forward (``fused_stats``, the CUDA default's forward) runs on ``device`` and matches
    the head's torch path in fp32 (log-probs and entropy within 2 % of each one's largest) on a small bf16 problem
    with a temperature, repeated positions and a label in the vocab padding. The fused backward (``fused_grads``)
    runs only when asked for by name and is not checked. ``head``: ``hpa.ops.linear_head.linear_log_probs_entropy``
    (an argument: this module does not import the head, which imports it)."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(2, 40, 64, device=device, generator=gen).to(torch.bfloat16)
        w = (0.3 * torch.randn(1000, 64, device=device, generator=gen)).to(torch.bfloat16)
        positions = torch.randint(0, 80, (70,), device=device, generator=gen)
        labels = torch.randint(0, 990, (70,), device=device, generator=gen)
        labels[3] = 995  # a padded vocab row: −logsumexp

        def run(kernel, dtype):
            with torch.no_grad():
                return head(x.to(dtype), w.to(dtype), labels, None, 990, 0.7, positions=positions,
                            entropy=True, kernel=kernel)

        # against the torch path in fp32 on the same bf16-valued inputs (the kernel rounds the logits to bf16)
        for got, want in zip(run("fused_forward", torch.bfloat16), run("torch", torch.float32)):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item() + 1e-4)
        return True
    except Exception as error:  # noqa: BLE001 -- any failure means: use the region kernels or torch
        warnings.warn(f"hpa.ops.linear_head: the matmul-fused Triton forward fails its check on {device} ({error}); "
                      f"the head runs its region kernels or its torch path")
        return False
