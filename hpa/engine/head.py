"""Log-probs (and entropy) at the positions a loss reads, from a micro-batch's logits in the model layout.

Only the rows of the logits at those positions (response tokens, or a row's label positions) go through
``hpa.ops.fused_head``, read chunk by chunk out of the model's layout, padded ``[n, s, v/tp]`` or packed
``[1, T, v/tp]``; the results come back in the row layout the losses read. Positions beyond a
packed row's length read 0, as ``MicroBatch.unpack`` gives them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from hpa.engine.micro_batch import MicroBatch
from hpa.ops.fused_head import fused_log_probs_entropy


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


def _head(batch: MicroBatch, logits: torch.Tensor, flat: torch.Tensor, tp_group, vocab_size: int,
          temperature: float, entropy: bool, chunk_tokens: Optional[int]):
    """The fused head at the model-layout tokens ``flat`` (any shape): results of ``flat``'s shape."""
    index = flat.reshape(-1)
    labels = batch.labels.reshape(-1).index_select(0, index)
    logp, ent = fused_log_probs_entropy(logits, labels, tp_group, vocab_size, temperature, positions=index,
                                        entropy=entropy, chunk_tokens=chunk_tokens)  # no copy of a sliced output
    return logp.view(flat.shape), None if ent is None else ent.view(flat.shape)


def response_log_probs(batch: MicroBatch, logits: torch.Tensor, tp_group, *, vocab_size: int,
                       temperature: float = 1.0, entropy: bool = False,
                       chunk_tokens: Optional[int] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) of the response tokens, ``[n, r]``: ``batch.response(batch.unpack(per-position))``
    computed at the ``response_index`` positions only.

    Args:
        logits: ``[n, s, v/tp]`` padded or ``[1, T, v/tp]`` packed.
    """
    index = batch["response_index"].to(logits.device)  # [n, r]
    rows = torch.arange(index.shape[0], device=logits.device)[:, None].expand_as(index)
    flat, valid = _model_positions(batch, rows, index)
    logp, ent = _head(batch, logits, flat, tp_group, vocab_size, temperature, entropy, chunk_tokens)
    if valid is not None:
        logp = torch.where(valid, logp, 0.0)
        ent = None if ent is None else torch.where(valid, ent, 0.0)
    return logp, ent


def label_log_probs(batch: MicroBatch, logits: torch.Tensor, tp_group, *, vocab_size: int,
                    temperature: float = 1.0, chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """Log-probs ``[n, s]`` in the row layout where ``batch["label_mask"]`` is nonzero, 0 elsewhere (the losses
    multiply by the mask, so they read today's values).

    Args:
        logits: ``[n, s, v/tp]`` padded or ``[1, T, v/tp]`` packed.
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


def _dense_log_probs(batch: MicroBatch, logits: torch.Tensor, tp_group, vocab_size: int, temperature: float,
                     chunk_tokens: Optional[int]) -> torch.Tensor:
    """Log-probs of every token of the model layout, in the row layout ``[n, s]`` (0 past a packed row)."""
    flat = torch.arange(batch.input_ids.numel(), device=logits.device).view(batch.input_ids.shape)
    logp, _ = _head(batch, logits, flat, tp_group, vocab_size, temperature, False, chunk_tokens)
    return batch.unpack(logp)
