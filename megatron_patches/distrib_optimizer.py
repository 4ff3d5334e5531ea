"""Patch: megatron's distributed optimizer and fp16/bf16 optimizer accept CPU parameters.

What: ``DistributedOptimizer.__init__`` and ``Float16OptimizerWithFloat16Params.__init__`` run with
  CPU fp32/fp16/bf16 tensors reporting their CUDA type names, so the dtype dispatch
  (``param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']`` /
  ``== 'torch.cuda.FloatTensor'``) classifies CPU parameters as it classifies GPU ones.
Why: without it every CPU parameter falls through to "Wrapped parameters must be one of
  torch.cuda.FloatTensor, ..." and the distributed optimizer cannot be built on CPU.
Numerics: unchanged; the same shards and main-parameter copies are built.
Upstream: megatron-core 0.16.x (``optimizer/distrib_optimizer.py``, ``optimizer/optimizer.py``).
Remove when: the checks compare ``param.dtype`` rather than CUDA type strings.
"""

from __future__ import annotations

from ._tensor_type import with_cuda_type_names


def apply() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for cls in (DistributedOptimizer, Float16OptimizerWithFloat16Params):
        if not getattr(cls.__init__, "__hpa_patched__", False):
            cls.__init__ = with_cuda_type_names(cls.__init__)
