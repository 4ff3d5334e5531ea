"""Heads that replace the LM output layer on the last pipeline stage, and hidden-state capture."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional

import torch
from torch import nn


class ScalarHead(nn.Module):
    """``K`` scalar outputs per position (K = 1 for a value model, K heads for a reward ensemble).

    It takes the place of GPTModel's ``output_layer`` and keeps its call signature, so megatron's
    post-processing (final norm, transpose to ``[b, s, K]``) is reused unchanged. The weight is
    replicated across TP ranks; its input (after the final norm) is identical on every TP rank, so
    the gradients are too. Under sequence parallelism the final norm's output is split over the
    sequence; the head gathers it first, so every TP rank again sees every position.

    Args:
        hidden_size: h.
        num_heads: K.
        init_std: standard deviation of the weight init (the bias starts at 0).
        seed: seed of the weight init, independent of the layout.
        sequence_parallel: the backbone runs sequence parallel (``parallel.sequence_parallel``).
        tp_group: the TP group the sequence is split over (needed with ``sequence_parallel``).
    """

    def __init__(self, hidden_size: int, num_heads: int = 1, init_std: float = 0.02, seed: int = 0, *,
                 sequence_parallel: bool = False, tp_group=None):
        super().__init__()
        self.num_heads = num_heads
        # its own generator: the same head under every TP/PP layout (the global RNG stream differs per stage)
        generator = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(num_heads, hidden_size, generator=generator) * init_std)
        self.bias = nn.Parameter(torch.zeros(num_heads))
        # megatron reads this attribute of an output layer; the weights themselves are not split
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        # [s, b, h] ([s/tp, b, h] under sequence parallelism) -> [s, b, K]; megatron's output layers
        # return (output, bias)
        if self.sequence_parallel:
            hidden_states = gather_sequence(hidden_states, self.tp_group)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def gather_sequence(hidden_states: torch.Tensor, tp_group) -> torch.Tensor:
    """``[s/tp, b, h]`` -> ``[s, b, h]``: the sequence-parallel slices of every TP rank, in order.

    What follows is computed identically on every TP rank, so the backward keeps each rank's own
    slice of the gradient (a split, not megatron's default reduce-scatter, which would sum tp
    identical copies).
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False, group=tp_group)


def unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel under DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


@contextlib.contextmanager
def capture_final_hidden(model: nn.Module) -> Iterator[List[Optional[torch.Tensor]]]:
    """Capture the decoder output (after the final norm on the last stage), ``[s, b, h]``.

    Usage: ``with capture_final_hidden(model) as box: out = model(...)``; then ``box[0]``. On stages
    that are not last the captured tensor is the stage output (no final norm). Under sequence
    parallelism the decoder's ``[s/tp, b, h]`` slices are gathered into the whole sequence.
    """
    box: List[Optional[torch.Tensor]] = [None]
    gpt = unwrap(model)
    sequence_parallel = gpt.config.sequence_parallel and gpt.config.tensor_model_parallel_size > 1

    def hook(_module, _inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        box[0] = gather_sequence(hidden, gpt.pg_collection.tp) if sequence_parallel else hidden

    handle = gpt.decoder.register_forward_hook(hook)
    try:
        yield box
    finally:
        handle.remove()
