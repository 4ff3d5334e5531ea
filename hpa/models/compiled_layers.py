"""Regional ``torch.compile`` of a GPTModel's transformer layers (``model.compile``).

Each decoder layer's forward is compiled, forward and backward (dynamo, AOTAutograd, inductor); everything
around the layers stays eager: the embedding, the output layer, megatron's pipeline schedule, DDP's hooks, and
hpa's KV-cache decode (``hpa/rollout/kv_cache.py``), which runs its own layer code. A call with an
``inference_context`` (megatron's own inference path) runs the layer eagerly.

One compiled graph serves every layer of every model: dynamo treats a module's parameters as inputs, so a
layer's guards are on its type and attributes, not on which layer it is. A new graph is compiled per regime
(padded or packed rows, gradients on or off, training or eval mode), not per layer and not per length.

Lengths are dynamic from the first call: the token dimension of the hidden states (``[s, b, h]``: the
sequence and the rows of a padded micro-batch; ``[t, 1, h]``: the tokens of a packed one), of the RoPE table
and of the packed layout's tensors is marked dynamic (``torch._dynamo.maybe_mark_dynamic``) before the layer
is called. Without it dynamo compiles a static graph for the first length and recompiles at the second;
``dynamic=True`` would make every dimension symbolic, the widths included, where inductor's kernels do better
with the widths fixed. Bucketing the lengths was the alternative; packing already makes every micro-batch's
token count different, so one graph for all lengths is what fits.

What the layer reads from Python state is made ready before the compiled call, so it never becomes a guard:
the packed attention's chunk layout (``hpa.models.specs.ChunkLayout``) is laid out and copied eagerly, and
packed RoPE does not use its cross-layer cache inside a compiled region (``megatron_patches/packed_rope.py``).
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from hpa.models.specs import uses_varlen_attention

_COMPILED = {}  # fullgraph -> the compiled layer call
# graphs of the one compiled layer function: a run's regimes multiply (padded or packed, gradients on or off,
# training or eval mode, frozen or trainable parameters, LoRA adapters on or off, packed chunks in one piece or
# several): a 2-step CPU run already compiles 4; past dynamo's default of 8 the layers would run eagerly
RECOMPILE_LIMIT = 64


def compile_wanted(setting: Optional[bool], device: torch.device, *, use_te: bool,
                   recompute_granularity: Optional[str]) -> bool:
    """Resolve ``model.compile`` (null: on where the layers run on CUDA, off elsewhere) to a yes/no.

    Args:
        setting: ``model.compile``.
        device: where the model computes.
        use_te: whether the layers are Transformer Engine's (those are left alone).
        recompute_granularity: ``model.recompute_granularity``; ``selective`` checkpoints the core attention
            inside the layer with megatron's checkpoint, which saves the RNG states: dynamo cannot trace that.
    """
    why_not = None
    if use_te:
        why_not = ("compiles megatron's local layers, and this model uses Transformer Engine's; set "
                   "model.transformer_impl=local to compile them")
    elif recompute_granularity == "selective":
        why_not = ("cannot trace model.recompute_granularity=selective (megatron's checkpoint inside the layer "
                   "saves the RNG states); use full or null")
    if setting is None:
        return device.type == "cuda" and why_not is None
    if setting and why_not is not None:
        raise ValueError(f"model.compile=true {why_not}, or set model.compile=false")
    return setting


def compile_layers(gpt, *, fullgraph: bool = False) -> int:
    """Make each decoder layer of ``gpt`` (a GPTModel of one pipeline stage) run its forward compiled.

    Args:
        gpt: the unwrapped GPTModel.
        fullgraph: fail on a graph break instead of running the rest of the layer eagerly (the tests' setting;
            the trainer's is off, so an untested path is slower, not broken).

    Returns:
        The number of layers compiled.
    """
    # dynamo's limit counts graphs per function (code object) and is one setting for all: other compiled functions
    # may recompile this often too before they fall back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in gpt.decoder.layers:
        layer.__dict__["_hpa_compile_fullgraph"] = fullgraph
        # a bound method, not a closure: a deep copy of the model calls its own layers
        layer.forward = types.MethodType(_forward, layer)
    return len(gpt.decoder.layers)


def is_compiled(layer) -> bool:
    return "_hpa_compile_fullgraph" in layer.__dict__


def _layer_forward(layer, *args, **kwargs):
    return type(layer).forward(layer, *args, **kwargs)


def _compiled(fullgraph: bool):
    if fullgraph not in _COMPILED:
        _COMPILED[fullgraph] = torch.compile(_layer_forward, fullgraph=fullgraph)
    return _COMPILED[fullgraph]


def _forward(layer, *args, **kwargs):
    if kwargs.get("inference_context") is not None or torch.compiler.is_compiling():
        return _layer_forward(layer, *args, **kwargs)  # eager, or traced by an enclosing compile
    if "hidden_states" in kwargs:
        hidden = kwargs["hidden_states"] = _canonical_strides(kwargs["hidden_states"])
    else:
        hidden = _canonical_strides(args[0])
        args = (hidden, *args[1:])
    _prepare(hidden, kwargs.get("rotary_pos_emb"), kwargs.get("packed_seq_params"),
             layer.config.attention_dropout if layer.training else 0.0)
    return _compiled(layer.__dict__["_hpa_compile_fullgraph"])(layer, *args, **kwargs)


def _canonical_strides(hidden: torch.Tensor) -> torch.Tensor:
    """The same memory with the contiguous strides when it is contiguous: a packed micro-batch's ``[t, 1, h]``
    from the embedding (a transposed ``[1, t, h]``) has another stride on its size-1 dimension than the layers'
    outputs, and dynamo guards on it (a second graph for the first layer alone)."""
    if hidden.is_contiguous() and hidden.dim() > 1:
        return hidden.view(-1).view(hidden.shape)
    return hidden


def _prepare(hidden: torch.Tensor, rotary: Optional[torch.Tensor], packed, dropout: float) -> None:
    """Mark the token dimensions dynamic and lay out the packed attention's chunks, eagerly."""
    _dynamic(hidden, 0, 1)  # [s, b, h] or [t, 1, h]
    if torch.is_tensor(rotary):
        _dynamic(rotary, 0)  # [s, 1, 1, d]
    if packed is None:
        return
    _dynamic(packed.cu_seqlens_q, 0)
    _dynamic(packed.cu_seqlens_kv, 0)
    layout = getattr(packed, "hpa_chunks", None)
    if layout is not None and not uses_varlen_attention(hidden, dropout):
        _dynamic(layout.index, 0, 1)  # [n, c]
        _dynamic(layout.rows, 0, 1)  # [n, c]
        _dynamic(layout.inverse, 0)  # [t]
        _dynamic(layout.mask(), 0, 2, 3)  # [n, 1, c, c]


def _dynamic(tensor: Optional[torch.Tensor], *dims: int) -> None:
    if tensor is not None:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
