"""Patch: inside a compiled region, ColumnParallelLinear's collectives are synchronous.

What: ``megatron.core.tensor_parallel.layers.ColumnParallelLinear._forward_impl``, while ``torch.compile``
  traces it under tensor parallelism, moves the matmul's own collectives into megatron's mapping functions
  and calls the matmul without them: with ``allreduce_dgrad`` (no sequence parallelism) the input goes
  through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of the gradient backward);
  with sequence parallelism through ``gather_from_sequence_parallel_region`` (all-gather forward,
  reduce-scatter of the gradient backward). Eager calls are unchanged.
Why: megatron's matmul runs these collectives with ``async_op=True`` in its backward (to overlap them with the
  weight gradient, and to gather the input again instead of keeping it); dynamo cannot trace an asynchronous
  collective, so every compiled layer under TP > 1 failed to compile (``hpa.models.compiled_layers``).
Numerics: unchanged (the same gathers and the same sums over the TP group). Memory: under sequence
  parallelism the compiled layer keeps the gathered input of each column-parallel linear for its backward,
  where megatron gathers it again.
Upstream: megatron-core 0.16.x (``megatron/core/tensor_parallel/layers.py``,
  ``LinearWithGradAccumulationAndAsyncCommunication``).
Remove when: dynamo traces ``torch.distributed`` collectives with ``async_op=True``.
"""

from __future__ import annotations

import functools

import torch

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    original = ColumnParallelLinear._forward_impl

    @functools.wraps(original)
    def _forward_impl(self, input, weight, *args, **kwargs):
        if torch.compiler.is_compiling():
            group = kwargs.get("tp_group") or self.tp_group
            if kwargs.get("sequence_parallel"):
                input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
                kwargs["sequence_parallel"] = False
            elif kwargs.get("allreduce_dgrad"):
                input = copy_to_tensor_model_parallel_region(input, group=group)
                kwargs["allreduce_dgrad"] = False
        return original(self, input, weight, *args, **kwargs)

    ColumnParallelLinear._forward_impl = _forward_impl
    _APPLIED = True
