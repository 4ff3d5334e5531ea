"""Patch: megatron's torch norms accept sequence parallelism.

What: ``WrappedTorchNorm`` (the norm of the local layer spec when apex is absent) builds its
  ``torch.nn.LayerNorm`` / ``RMSNorm`` under ``config.sequence_parallel`` instead of asserting, and
  marks the norm's parameters ``sequence_parallel = True`` as megatron's fused and Transformer Engine
  norms do.
Why: under sequence parallelism each TP rank normalises its own slice of the sequence; a norm is
  per position, so only its weight gradients differ by rank, and megatron's
  ``finalize_model_grads`` all-reduces the gradients of parameters marked ``sequence_parallel``
  over the TP group. The assertion is the only thing that keeps the local spec (the CPU path) from
  running sequence parallel; megatron's sequence-parallel collectives (all-gather and
  reduce-scatter into a tensor) run on gloo as they are in torch 2.13.
Numerics: unchanged: the same norm, on a slice of the positions; the marked gradients are summed
  over TP exactly as for the fused norms.
Upstream: megatron-core 0.16.x (``megatron/core/transformer/torch_norm.py``).
Remove when: megatron-core's ``WrappedTorchNorm`` supports ``sequence_parallel``.
"""

from __future__ import annotations

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        config.sequence_parallel = False  # only for megatron's assertion; restored at once
        try:
            norm = original(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)
    _APPLIED = True
