"""Megatron layer specs: Transformer Engine on GPUs when importable, megatron's local spec otherwise."""

from __future__ import annotations

from typing import Optional

import torch


def transformer_engine_import_error() -> Optional[str]:
    """None when Transformer Engine's PyTorch layers import on a CUDA machine, else why not.

    The package being present is not enough: a TE built against another torch, or without its
    CUDA libraries, fails only when ``transformer_engine.pytorch`` is imported.
    """
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or OSError/RuntimeError from its compiled extension
        return f"import transformer_engine.pytorch failed: {type(exc).__name__}: {exc}"
    return None


def transformer_engine_available() -> bool:
    return transformer_engine_import_error() is None


def use_transformer_engine(transformer_impl: str) -> bool:
    """Resolve ``model.transformer_impl`` (auto | local | transformer_engine) to a yes/no."""
    if transformer_impl == "local":
        return False
    error = transformer_engine_import_error()
    if transformer_impl == "transformer_engine" and error is not None:
        raise RuntimeError(f"model.transformer_impl=transformer_engine but Transformer Engine is not usable "
                           f"({error}); run `hpa doctor` for the install command, or use 'auto'/'local'")
    return error is None


def gpt_layer_spec(*, use_te: bool, normalization: str):
    """The ModuleSpec of one decoder layer."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization)
