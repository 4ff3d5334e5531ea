"""Megatron layer specs: Transformer Engine on GPUs when importable, megatron's local spec otherwise."""

from __future__ import annotations

import importlib.util

import torch


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def use_transformer_engine(transformer_impl: str) -> bool:
    """Resolve ``model.transformer_impl`` (auto | local | transformer_engine) to a yes/no."""
    if transformer_impl == "local":
        return False
    available = transformer_engine_available()
    if transformer_impl == "transformer_engine" and not available:
        raise RuntimeError("model.transformer_impl=transformer_engine but Transformer Engine is not "
                           "importable on a CUDA machine; install hpa[gpu] or use 'auto'/'local'")
    return available


def gpt_layer_spec(*, use_te: bool, normalization: str):
    """The ModuleSpec of one decoder layer."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization)
