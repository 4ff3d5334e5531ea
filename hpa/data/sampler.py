"""Deterministic, data-parallel-sharded, resumable batch sampler.

The order is defined globally and then split across data-parallel ranks, so every rank computes it
without communication (rank and DP size are plain ints; no torch.distributed here):

* epoch ``e`` uses ``permutation(num_samples)`` seeded with ``(seed, e)`` (identity when not shuffling);
* drop-last: the epoch is cut to ``steps_per_epoch = num_samples // global_batch_size`` full global
  batches; the remaining ``num_samples % global_batch_size`` indices are not used *that epoch*
  (with shuffling, a different remainder is left out each epoch);
* step ``k`` of an epoch is the global batch ``order[k*G : (k+1)*G]``; DP rank ``r`` takes the
  contiguous slice ``[r*G/dp, (r+1)*G/dp)``, so every rank gets ``G/dp`` indices every step and the
  ranks' slices are disjoint.

The position is ``(epoch, step_in_epoch)`` of the global order: a sampler restored with
``load_state_dict`` yields exactly what the uninterrupted one would have, even under a different
DP size (the global batches are the same, only their split changes).

Two helpers for work measured once over a fixed list (the controllers' start-up measurements):
``evenly_spaced`` takes a subset in the file's order, ``dp_share`` a DP rank's part of it.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Sequence, Tuple

import numpy as np


def evenly_spaced(items: Sequence, limit: int) -> list:
    """``items`` when there are at most ``limit``, else ``limit`` of them at even spacing, in order."""
    n = len(items)
    return list(items) if n <= limit else [items[i * n // limit] for i in range(limit)]


def dp_share(items: Sequence, dp_rank: int, dp_size: int) -> Tuple[list, int]:
    """DP rank ``dp_rank``'s share of ``items`` (every ``dp_size``-th from ``dp_rank``), padded with repeats
    of the first item to ``ceil(len(items) / dp_size)`` so every rank does the same work, and how many of
    its entries are real (the first ``counted``; the repeats are not to be counted)."""
    per_rank = -(-len(items) // dp_size)
    mine = list(items[dp_rank::dp_size])
    counted = len(mine)
    return (mine + list(items[:1]) * per_rank)[:per_rank], counted


class DistributedBatchSampler:
    """Yields, forever (epoch after epoch), this rank's list of dataset indices for each step.

    Args:
        num_samples: dataset size.
        global_batch_size: indices per step summed over all DP ranks; divisible by ``dp_size``.
        dp_rank: this rank's data-parallel rank.
        dp_size: data-parallel size.
        seed: shuffling seed.
        shuffle: reshuffle every epoch; False keeps file order.
    """

    def __init__(self, num_samples: int, *, global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                             f"dp_size={dp_size} so every rank gets the same number of samples")
        if num_samples < global_batch_size:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global batch of "
                             f"{global_batch_size}; add data or lower the batch size")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.step_in_epoch = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global order of indices of ``epoch``, before drop-last. ``[num_samples]``"""
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_batch(self, epoch: int, step_in_epoch: int) -> List[int]:
        """All ranks' indices of one step, rank 0's slice first. ``[global_batch_size]``"""
        if self._order_epoch != epoch:
            self._order, self._order_epoch = self.epoch_order(epoch), epoch
        start = step_in_epoch * self.global_batch_size
        return self._order[start:start + self.global_batch_size].tolist()

    def next_batch(self) -> List[int]:
        """This rank's indices for the next step, advancing the position. ``[global_batch_size / dp]``"""
        batch = self.global_batch(self.epoch, self.step_in_epoch)
        start = self.dp_rank * self.local_batch_size
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return batch[start:start + self.local_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed,
                "shuffle": self.shuffle, "num_samples": self.num_samples,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the position; the order-defining settings must match the saved ones."""
        for key in ("seed", "shuffle", "num_samples", "global_batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has "
                                 f"{getattr(self, key)!r}; resuming would change the data order. Use the "
                                 f"same dataset and settings as the checkpointed run, or start a new run")
        if not 0 <= state["step_in_epoch"] < self.steps_per_epoch or state["epoch"] < 0:
            raise ValueError(f"sampler state position (epoch={state['epoch']}, step_in_epoch="
                             f"{state['step_in_epoch']}) is invalid for {self.steps_per_epoch} steps per epoch")
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
