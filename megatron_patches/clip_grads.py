"""Patch: megatron's fp32 gradient clipping accepts CPU gradients.

What: ``clip_grad_by_total_norm_fp32`` (in ``megatron.core.optimizer.clip_grads`` and where
  ``optimizer.py`` imported it) runs with CPU fp32 tensors reporting the CUDA type name, so its
  ``assert param.grad.type() == 'torch.cuda.FloatTensor'`` holds for CPU fp32 gradients.
Why: the assert is the only CUDA-specific part left once ``cpu_device`` is applied; without TE or
  apex megatron already uses its local (pure torch) multi-tensor scale and l2-norm, which work on CPU.
Numerics: unchanged; the same clip coefficient max_norm / (total_norm + 1e-6) scales the grads.
Upstream: megatron-core 0.16.x (``megatron/core/optimizer/clip_grads.py``).
Remove when: the assert checks ``dtype == torch.float32`` instead of the CUDA type string.
"""

from __future__ import annotations

from ._tensor_type import with_cuda_type_names


def apply() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    if getattr(clip_grads.clip_grad_by_total_norm_fp32, "__hpa_patched__", False):
        return
    patched = with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = patched
    optimizer.clip_grad_by_total_norm_fp32 = patched
