"""Log-probs (and entropy) at the positions a loss reads, from a micro-batch's model output in the model layout.

The output is either the LM head's input (``HeadInput``: the final hidden states and the output weight, what
``forward_backward(..., hidden_head=True)`` hands a loss, the default of the trainer's log-prob passes) or the
logits. Only the positions a loss reads (response tokens, or a row's label positions) go through the head:
``hpa.ops.linear_head`` computes their logits chunk by chunk from the hidden states, ``hpa.ops.fused_head``
reads them chunk by chunk out of given logits; both in the model's layout, padded ``[n, s, ·]`` or packed
``[1, T, ·]``, with the results in the row layout the losses read. Positions beyond a packed row's length
read 0, as ``MicroBatch.unpack`` gives them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, List, Optional, Tuple, Union

import torch

from hpa.engine.micro_batch import MicroBatch
from hpa.models.heads import unwrap
from hpa.ops.fused_head import fused_log_probs_entropy
from hpa.ops.linear_head import linear_log_probs_entropy


@dataclasses.dataclass(frozen=True)
class HeadInput:
    """The LM head's input in place of its logits.

    Args:
        hidden: ``[b, s, h]`` padded or ``[1, T, h]`` packed, replicated over TP (the output layer's input after
            megatron's region function, which reduces its gradient over TP).
        weight: the output layer's local vocab shard ``[v/tp, h]`` (the embedding's when tied).
        kernel: the head's kernels (``hpa.ops.linear_head.linear_log_probs_entropy``): ``auto`` (on CUDA the
            matmul-fused Triton forward and the region backward, each falling back to the region kernels, then
            torch), ``fused_forward``, ``fused`` (the backward fused too), ``regions``, ``torch``.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    kernel: str = "auto"

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def __getitem__(self, index) -> "HeadInput":
        """The head's input at some positions (``index`` applies to ``hidden``'s leading dimensions), as
        slicing the logits would give: a mixed micro-batch splits its output by stream
        (``MicroBatch.split``)."""
        return HeadInput(self.hidden[index], self.weight, self.kernel)


Output = Union[torch.Tensor, HeadInput]  # logits [n, s, v/tp] | [1, T, v/tp], or the head's input


def deferrable(module) -> bool:
    """Whether ``module``'s GPTModel ends in megatron's LM output layer (not a value head) without a bias."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    gpt = unwrap(module)
    layer = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) else None
    return isinstance(layer, ColumnParallelLinear) and (layer.bias is None or layer.skip_bias_add)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: megatron's copy-to-TP-region all-reduces
    ``grad.contiguous()`` and returns ``grad``, so the reduction of a transposed gradient (the model's
    ``[s, b, h] -> [b, s, h]`` output) would be lost."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@contextlib.contextmanager
def defer_output_layer(module) -> Iterator[List[torch.Tensor]]:
    """Inside the block the output layer of ``module`` (``deferrable``) returns its input, made ready as its
    matmul would take it (gathered under sequence parallelism, else copied into the TP region), in place of the
    logits: the model returns the hidden states ``[b, s, h]``; the box gets the weight the layer was called
    with. Usage: ``with defer_output_layer(m) as box: out = m(...)``; then ``HeadInput(out, box[0])``."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, \
        gather_from_sequence_parallel_region

    layer = unwrap(module).output_layer
    box: List[torch.Tensor] = []

    def forward(input_, weight=None, runtime_gather_output=None):
        box.append(layer.weight if weight is None else weight)
        if layer.sequence_parallel:  # all-gather, reduce-scatter of the gradient: as the linear's own
            hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                          group=layer.tp_group)
        else:  # identity, all-reduce of the gradient: as the linear's own
            hidden = _ContiguousGrad.apply(copy_to_tensor_model_parallel_region(input_, group=layer.tp_group))
        return hidden, None  # [s, b, h]

    layer.forward = forward  # the instance's, so the module's hooks still run
    try:
        yield box
    finally:
        del layer.forward


def _model_positions(batch: MicroBatch, rows: torch.Tensor,
                     cols: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Row-layout positions ``(rows, cols)`` -> ``(flat index into the model layout's tokens, valid or None)``.

    Packed, a position at or beyond its row's length is not in the model's input: it gets a valid index
    (the row's last token) and ``valid`` False.
    """
    if not batch.packed:
        return rows * batch.input_ids.shape[1] + cols, None
    offsets, lengths = batch.row_offsets(cols.device)  # [n], built on the host, copied once without blocking
    row_length = lengths[rows]
    return offsets[rows] + torch.minimum(cols, row_length - 1), cols < row_length


def _head(batch: MicroBatch, logits: Output, flat: torch.Tensor, tp_group, vocab_size: int,
          temperature: float, entropy: bool, chunk_tokens: Optional[int]):
    """The head at the model-layout tokens ``flat`` (any shape): results of ``flat``'s shape."""
    index = flat.reshape(-1)
    labels = batch.labels.reshape(-1).index_select(0, index)
    if isinstance(logits, HeadInput):
        logp, ent = linear_log_probs_entropy(logits.hidden, logits.weight, labels, tp_group, vocab_size,
                                             temperature, positions=index, entropy=entropy,
                                             chunk_tokens=chunk_tokens, kernel=logits.kernel)
    else:
        logp, ent = fused_log_probs_entropy(logits, labels, tp_group, vocab_size, temperature, positions=index,
                                            entropy=entropy, chunk_tokens=chunk_tokens)  # no copy of a slice
    return logp.view(flat.shape), None if ent is None else ent.view(flat.shape)


def response_log_probs(batch: MicroBatch, logits: Output, tp_group, *, vocab_size: int,
                       temperature: float = 1.0, entropy: bool = False,
                       chunk_tokens: Optional[int] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) of the response tokens, ``[n, r]``: ``batch.response(batch.unpack(per-position))``
    computed at the ``response_index`` positions only.

    Args:
        logits: ``[n, s, v/tp]`` padded or ``[1, T, v/tp]`` packed, or the head's input (``HeadInput``).
    """
    index = batch["response_index"].to(logits.device)  # [n, r]
    rows = torch.arange(index.shape[0], device=logits.device)[:, None].expand_as(index)
    flat, valid = _model_positions(batch, rows, index)
    logp, ent = _head(batch, logits, flat, tp_group, vocab_size, temperature, entropy, chunk_tokens)
    if valid is not None:
        logp = torch.where(valid, logp, 0.0)
        ent = None if ent is None else torch.where(valid, ent, 0.0)
    return logp, ent


def label_log_probs(batch: MicroBatch, logits: Output, tp_group, *, vocab_size: int,
                    temperature: float = 1.0, chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """Log-probs ``[n, s]`` in the row layout where ``batch["label_mask"]`` is nonzero, 0 elsewhere (the losses
    multiply by the mask, so they read today's values).

    Args:
        logits: ``[n, s, v/tp]`` padded or ``[1, T, v/tp]`` packed, or the head's input (``HeadInput``).
    """
    label_mask = batch["label_mask"]  # [n, s]
    positions = batch.label_positions(logits.device)  # from the host's mask: no count read on the device
    if positions is None:  # a mask made on the device: every model-layout token, the mask applied after
        logp = _dense_log_probs(batch, logits, tp_group, vocab_size, temperature, chunk_tokens)
        return torch.where(label_mask != 0, logp, 0.0)
    rows, cols, flat = positions
    logp, _ = _head(batch, logits, flat, tp_group, vocab_size, temperature, False, chunk_tokens)
    out = logp.new_zeros(label_mask.shape)
    return out.index_put((rows, cols), logp)


def _dense_log_probs(batch: MicroBatch, logits: Output, tp_group, vocab_size: int, temperature: float,
                     chunk_tokens: Optional[int]) -> torch.Tensor:
    """Log-probs of every token of the model layout, in the row layout ``[n, s]`` (0 past a packed row)."""
    flat = torch.arange(batch.input_ids.numel(), device=logits.device).view(batch.input_ids.shape)
    logp, _ = _head(batch, logits, flat, tp_group, vocab_size, temperature, False, chunk_tokens)
    return batch.unpack(logp)
