"""Patch: without Transformer Engine or apex, megatron's gradient clipping and main -> model parameter copy
run as one multi-tensor operation each instead of one (or three) per tensor.

What: where megatron uses its local fallback ``megatron.core.utils.local_multi_tensor_scale``:
  ``clip_grads.multi_tensor_scale_impl`` and ``optimizer.multi_tensor_scale_impl`` become ``foreach_scale``
  (``torch._foreach_mul_`` in place, ``torch._foreach_copy_`` otherwise), and ``clip_grad_by_total_norm_fp32``
  (in ``clip_grads`` and where ``optimizer.py`` imported it) scales the gradients with one
  ``torch._foreach_mul_`` without a ``detach`` per gradient. On every device, the fp16/bf16 optimizer's
  main <-> model parameter copies (``Float16OptimizerWithFloat16Params._copy_main_params_to_model_params``
  and ``_copy_model_params_to_main_params``) become one ``torch._foreach_copy_`` over the parameters where
  megatron would loop (bf16, or no fused kernel); a fused kernel (fp16 with TE or apex) is left alone.
Why: the fallback copies tensor by tensor (``dst.copy_(src * scale)``), and the bf16 copy loops over
  ``param.data`` whatever is installed: at Qwen2-0.5B's structure (170 tensors) the clip and the copy were
  ~1,000 host operations a step (``bench/proxies/optimizer.py``), each a kernel launch on a GPU.
Numerics: the same products and casts, element by element: bit-identical to megatron's path on CPU
  (``tests/patches/test_foreach_scale.py``); on CUDA the foreach kernels compute in the same opmath (fp32).
  The clip still asserts fp32 gradients (by dtype, so CPU gradients pass too).
Upstream: megatron-core 0.16.x (``megatron/core/utils.py`` ``local_multi_tensor_scale``,
  ``optimizer/clip_grads.py``, ``optimizer/optimizer.py``).
Remove when: megatron's fallbacks use torch's foreach operations.
"""

from __future__ import annotations

from typing import List, Sequence, Union

import torch


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]],
                  scale: float) -> None:
    """Drop-in for ``amp_C.multi_tensor_scale`` (and megatron's local fallback): ``dst = src * scale`` for each
    pair of ``tensor_lists = [src, dst]``."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    with torch.no_grad():
        if src is dst or all(s is d for s, d in zip(src, dst)):
            torch._foreach_mul_(dst, scale)
        elif scale == 1.0:  # x * 1.0 == x: only the cast to dst's dtype is left
            torch._foreach_copy_(dst, src)
        else:
            torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def clip_grad_by_total_norm_fp32(parameters: Union[List[torch.Tensor], torch.Tensor], max_norm: Union[int, float],
                                 total_norm: float, use_decoupled_grad: bool = False) -> None:
    """megatron's ``clip_grad_by_total_norm_fp32`` (0.16.x) with one ``torch._foreach_mul_`` for the scaling."""
    from megatron.core.utils import to_local_if_dtensor

    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad" if use_decoupled_grad else "grad", None)
        if grad is None:
            continue
        if use_decoupled_grad:
            assert grad.dtype in (torch.float32, torch.bfloat16)
        else:
            assert grad.dtype == torch.float32, f"clipping expects fp32 gradients, got {grad.dtype}"
        grads.append(to_local_if_dtensor(grad))
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        with torch.no_grad():
            torch._foreach_mul_(grads, clip_coeff)


clip_grad_by_total_norm_fp32.__hpa_foreach__ = True


def _params_float16_and_main(optimizer):
    model_params, main_params = [], []
    for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
        model_params.extend(model_group)
        main_params.extend(main_group)
    return model_params, main_params


def _loops(optimizer) -> bool:
    """Whether megatron's copy would go tensor by tensor: bf16 (no overflow buffer) or the local fallback."""
    from megatron.core import utils
    from megatron.core.optimizer import optimizer as megatron_optimizer

    return (optimizer._dummy_overflow_buf is None
            or megatron_optimizer.multi_tensor_scale_impl in (utils.local_multi_tensor_scale, foreach_scale))


def _copy_main_params_to_model_params(self) -> None:
    if not _loops(self):
        return _ORIGINAL["main_to_model"](self)
    model_params, main_params = _params_float16_and_main(self)
    if model_params:
        with torch.no_grad():
            torch._foreach_copy_(model_params, main_params)


def _copy_model_params_to_main_params(self, state_dict=None) -> None:
    if not _loops(self):
        return _ORIGINAL["model_to_main"](self, state_dict=state_dict)
    assert state_dict is None, "Initialize main params from state dict is not supported"
    model_params, main_params = _params_float16_and_main(self)
    if model_params:
        with torch.no_grad():
            torch._foreach_copy_(main_params, model_params)


_copy_main_params_to_model_params.__hpa_foreach__ = True
_ORIGINAL = {}


def apply() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    if clip_grads.multi_tensor_scale_impl in (utils.local_multi_tensor_scale, foreach_scale):
        clip_grads.multi_tensor_scale_impl = foreach_scale
        if not getattr(clip_grads.clip_grad_by_total_norm_fp32, "__hpa_foreach__", False):
            clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
            megatron_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    if megatron_optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        megatron_optimizer.multi_tensor_scale_impl = foreach_scale
    cls = megatron_optimizer.Float16OptimizerWithFloat16Params
    if not getattr(cls._copy_main_params_to_model_params, "__hpa_foreach__", False):
        _ORIGINAL["main_to_model"] = cls._copy_main_params_to_model_params
        _ORIGINAL["model_to_main"] = cls._copy_model_params_to_main_params
        cls._copy_main_params_to_model_params = _copy_main_params_to_model_params
        cls._copy_model_params_to_main_params = _copy_model_params_to_main_params
