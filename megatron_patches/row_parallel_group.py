"""Patch: megatron's RowParallelLinear hands its own TP group to its matmul.

What: ``megatron.core.tensor_parallel.layers.RowParallelLinear._forward_impl`` passes the layer's
  ``tp_group`` where megatron passes ``tp_group=None``.
Why: with ``None`` megatron's ``get_tensor_model_parallel_group_if_none`` issues a ``DeprecationWarning``
  on rank 0 at every call and reads the TP group from ``parallel_state`` (a global lookup that can name
  another model's layout). ``torch.compile`` cannot trace ``warnings.warn``: every compiled layer broke
  its graph twice (attention's and the MLP's output projections).
Numerics: unchanged. The row-parallel matmul is called with ``sequence_parallel=False`` and
  ``allreduce_dgrad=False``, so the group is never used for a collective there; the layer's own
  reduction after the matmul already takes ``self.tp_group``.
Upstream: megatron-core 0.16.x (``megatron/core/tensor_parallel/layers.py``, ``RowParallelLinear.forward``).
Remove when: megatron's RowParallelLinear passes ``tp_group=self.tp_group`` to its matmul.
"""

from __future__ import annotations

import functools

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    original = RowParallelLinear._forward_impl

    @functools.wraps(original)
    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        return original(self, input, weight, *args, **kwargs)

    RowParallelLinear._forward_impl = _forward_impl
    _APPLIED = True
