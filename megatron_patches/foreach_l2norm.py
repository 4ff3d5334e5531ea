"""Patch: without Transformer Engine or apex, megatron's gradient norm no longer syncs once per tensor.

What: ``megatron.core.optimizer.clip_grads.l2_norm_impl``, when it is megatron's local fallback
  (``megatron.core.utils.local_multi_tensor_l2_norm``), becomes ``foreach_l2_norm``: the per-tensor norms
  from one ``torch._foreach_norm``, stacked and normed on the device. Where TE or apex is installed their
  fused kernel is in use and nothing is patched.
Why: the fallback builds ``torch.tensor([torch.norm(t) for t in tensors])`` and calls ``float()`` on the
  result: on CUDA every tensor's norm is copied to the host, one sync per gradient tensor every step
  (measured 2026-11-27 on one H200, ``bench/gpu_check.py``'s sync sites: 1,530 of the 1,922 syncs of a
  3-step Qwen2-0.5B-shaped run, about 510 a step). The CPU counter (``SyncOps``) cannot see those copies.
Numerics: the same norms in the same order; on CPU bit-identical to the fallback
  (``tests/patches/test_foreach_l2norm.py``); on CUDA the fused foreach kernel may round the last
  bit differently from the per-tensor one. The result is fp32 on the gradients' device, as before.
Upstream: megatron-core 0.16.x (``megatron/core/utils.py`` ``local_multi_tensor_l2_norm``).
Remove when: megatron's fallback stays on the device.
"""

from __future__ import annotations

from typing import List, Sequence

import torch


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]],
                    per_tensor: bool, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm`` (and megatron's local fallback): ``([1] fp32 norm, None)``
    over every tensor of ``tensor_lists`` (the clip path passes one list)."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)  # one norm per tensor, on the device
    total = torch.linalg.vector_norm(torch.stack(norms))
    return total.reshape(1).to(torch.float32), None


def apply() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
