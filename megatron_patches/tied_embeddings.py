"""Patch: tied embeddings under pipeline parallelism stay on the CPU.

What: while ``LanguageModule.setup_embeddings_and_output_layer`` runs, ``Tensor.cuda()`` returns the
  tensor unchanged, so the last stage's copy of a tied word embedding stays where it was built.
Why: with ``share_embeddings_and_output_weights`` and PP > 1 megatron moves that copy with
  ``weight.data = weight.data.cuda()`` before all-reducing it over the embedding group; without CUDA
  this raises, so no tied model (Qwen2 0.5B-style) can be built under PP on CPU.
Numerics: unchanged; only the device of one tensor differs.
Upstream: megatron-core 0.16.x (``megatron/core/models/common/language_module/language_module.py``).
Remove when: megatron-core allocates that copy on the parameter's device instead of calling ``.cuda()``.
"""

from __future__ import annotations

import functools

import torch

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer
    _APPLIED = True
