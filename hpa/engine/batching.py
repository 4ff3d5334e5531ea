"""How a step's rows are cut into micro-batches (``Batching``): one value built from the ``trainer`` section and
the tokenizer's pad id, handed to every phase that builds micro-batches."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batching:
    """Args:
        micro_batch_size: rows per micro-batch (pairs per pair micro-batch) without a token budget.
        pad_id: the tokenizer's pad id.
        packed: pack each micro-batch's rows into one sequence (``trainer.sequence_packing``).
        forward_token_budget: tokens per micro-batch of the forward-only passes over the rollouts
            (``trainer.log_prob_max_token_len_per_rank``); None: ``micro_batch_size`` rows.
        update_token_budget: tokens per rollout micro-batch of the update (``trainer.ppo_max_token_len_per_rank``).
    """

    micro_batch_size: int
    pad_id: int
    packed: bool = False
    forward_token_budget: Optional[int] = None
    update_token_budget: Optional[int] = None

    def __post_init__(self):
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")

    @classmethod
    def from_config(cls, trainer, pad_id: int) -> "Batching":
        """From the ``trainer`` section (``TrainerConfig``) and the tokenizer's pad id."""
        return cls(micro_batch_size=trainer.micro_batch_size, pad_id=pad_id, packed=trainer.sequence_packing,
                   forward_token_budget=trainer.log_prob_max_token_len_per_rank,
                   update_token_budget=trainer.ppo_max_token_len_per_rank)
