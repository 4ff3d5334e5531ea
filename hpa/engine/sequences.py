"""The training sequences of a rollout and the one gather from positions to response tokens.

They belong to the engine (what a model's forward reads and how its per-position outputs map to response
tokens); the rollout layer above builds them (``RolloutBatch.sequences``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch


def gather_positions(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[i, index[i, j], ...]``: per-position values ``[b, s, ...]`` at the positions ``index`` ``[b, r]``
    (the response tokens' positions) -> ``[b, r, ...]``."""
    index = index.to(values.device)
    if values.dim() > 2:
        index = index.view(*index.shape, *([1] * (values.dim() - 2))).expand(*index.shape, *values.shape[2:])
    return values.gather(1, index)


@dataclass
class TrainingSequences:
    """Right-padded ``prompt + response`` rows for the training forward (``forward_backward``).

    Row i holds its prompt without left padding at ``[0, p_i)`` and its response at
    ``[p_i, p_i + r_i)``. The logits at position t predict ``labels[t] = input_ids[t + 1]``, so the
    log-prob of response token j sits at position ``p_i - 1 + j`` (``response_index``).

    Attributes:
        input_ids: ``[b, s]`` with ``s = p + r``; pad id after the response.
        position_ids: ``[b, s]``, ``0..s-1``.
        labels: ``[b, s]``, next token (pad at the end).
        response_mask: ``[b, s]`` float, 1 where ``labels`` is a (masked-in) response token.
        response_index: ``[b, r]`` int64, the position whose logits predict response token j
            (clamped into range on padding; mask those out with the rollout's response mask).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor
    response_index: torch.Tensor

    def to_response(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values ``[b, s, ...]`` (log-probs, values, KL...) -> ``[b, r, ...]``."""
        return gather_positions(values, self.response_index)

    def micro_batch(self, rows=None) -> Dict[str, torch.Tensor]:
        """The dict ``forward_backward`` takes (optionally only ``rows``)."""
        out = {"input_ids": self.input_ids, "position_ids": self.position_ids, "labels": self.labels,
               "response_mask": self.response_mask, "response_index": self.response_index}
        if rows is not None:
            out = {k: v[rows] for k, v in out.items()}
        return out
