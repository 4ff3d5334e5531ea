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
    the gradients are too.

    Args:
        hidden_size: h.
        num_heads: K.
        init_std: standard deviation of the weight init (the bias starts at 0).
        seed: seed of the weight init, independent of the layout.
    """

    def __init__(self, hidden_size: int, num_heads: int = 1, init_std: float = 0.02, seed: int = 0):
        super().__init__()
        self.num_heads = num_heads
        # its own generator: the same head under every TP/PP layout (the global RNG stream differs per stage)
        generator = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(num_heads, hidden_size, generator=generator) * init_std)
        self.bias = nn.Parameter(torch.zeros(num_heads))
        self.sequence_parallel = False

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        # [s, b, h] -> [s, b, K]; megatron's output layers return (output, bias)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel under DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


@contextlib.contextmanager
def capture_final_hidden(model: nn.Module) -> Iterator[List[Optional[torch.Tensor]]]:
    """Capture the decoder output (after the final norm on the last stage), ``[s, b, h]``.

    Usage: ``with capture_final_hidden(model) as box: out = model(...)``; then ``box[0]``. On stages
    that are not last the captured tensor is the stage output (no final norm).
    """
    box: List[Optional[torch.Tensor]] = [None]

    def hook(_module, _inputs, output):
        box[0] = output[0] if isinstance(output, tuple) else output

    handle = unwrap(model).decoder.register_forward_hook(hook)
    try:
        yield box
    finally:
        handle.remove()
