"""A versioned rollout queue with bounded staleness: the hand-over between sampling and training.

Every entry records, per token, the policy version that sampled it (a partial rollout that continued
across a weight push spans versions) and its sampling (behaviour) log-probs, which the off-policy
correction (``hpa.algorithms.rollout_correction``) reads. The trainer's policy version counts weight
updates. ``max_staleness`` (``rollout.max_staleness``) bounds the lag ``version − sampled version`` of
every token handed to training; an entry whose oldest valid token lags more is dropped and counted, never
returned. ``max_staleness: 0`` only ever returns entries sampled by the current policy: today's
synchronous loop.

An entry is a group of rows put together (typically one prompt's ``n`` responses, or one step's batch)
and is kept or dropped whole, so group-normalised advantages never see half a group.

The module sits in ``hpa/rollout`` (not ``hpa/trainer``) because both sides use it: rollout workers put
into it and the trainer takes from it, and the rollout layer may not import the trainer.

Resume: ``state_dict`` holds the queued entries and the counters (``torch.save``-able, plain tensors,
numbers and lists); ``load_state_dict`` restores them. A run that does not save its queue calls
``discard`` at each checkpoint instead, in the uninterrupted run as in the resumed one, so both train on
the same rows.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Deque, Dict, List, Optional

import torch

from hpa.config.errors import ConfigError
from hpa.rollout.base import FINISH_REASONS, RolloutBatch

STALENESS_KEY = "rollout.max_staleness"


def check_max_staleness(max_staleness: int, key: str = STALENESS_KEY) -> int:
    """``max_staleness`` as an int >= 0, else a ConfigError naming ``key`` (the schema passes its own)."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ConfigError(key, f"must be an integer >= 0 (0: synchronous, k: train on rows at most k "
                               f"policy versions old), got {max_staleness!r}")
    return max_staleness


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionedRollout:
    """One queue entry: rows sampled together, with who sampled each token.

    Attributes:
        rows: per-row tensors the trainer needs (ids, masks, ...), each ``[b, ...]``.
        log_probs: behaviour (sampling) log-probs of the response tokens. # [b, r]
        versions: int64 policy version that sampled each response token. # [b, r]
        mask: valid response tokens; only these count for the lag. # [b, r]
    """

    rows: Dict[str, torch.Tensor]
    log_probs: torch.Tensor
    versions: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self):
        shape = tuple(self.log_probs.shape)
        if len(shape) != 2:
            raise ValueError(f"VersionedRollout.log_probs must be [b, r], got shape {shape}")
        for name in ("versions", "mask"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"VersionedRollout.{name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"log_probs {shape}")
        if self.versions.dtype != torch.int64:
            raise ValueError(f"VersionedRollout.versions must be int64, got {self.versions.dtype}")
        for name, value in self.rows.items():
            if value.shape[:1] != (shape[0],):
                raise ValueError(f"VersionedRollout.rows[{name!r}] has {value.shape[:1]} rows, log_probs {shape[0]}")

    @property
    def num_rows(self) -> int:
        return self.log_probs.shape[0]

    def oldest_version(self) -> int:
        """The smallest version of a valid token (of any token when no token is valid)."""
        valid = self.mask.bool()
        if not valid.any():
            return int(self.versions.min()) if self.versions.numel() else 0
        return int(self.versions[valid].min())

    def newest_version(self) -> int:
        return int(self.versions.max()) if self.versions.numel() else 0

    def to_state(self) -> Dict[str, object]:
        return {"rows": dict(self.rows), "log_probs": self.log_probs, "versions": self.versions, "mask": self.mask}


# a ``RolloutBatch`` extra ``[b, r]`` int64: the version that sampled each response token (a partial rollout,
# ``hpa/rollout/worker.py``); ``rollout_entry`` makes it the entry's ``versions``
TOKEN_VERSIONS = "token_versions"
_BATCH_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids")
_EXTRA = "extras."


def rollout_entry(batch: RolloutBatch, version: int) -> VersionedRollout:
    """A whole ``RolloutBatch`` sampled by policy ``version`` as one entry (its rows stay together). A batch
    whose tokens were sampled by several versions (a partial rollout) carries them in ``extras["token_versions"]``
    ``[b, r]``: they are the entry's ``versions`` (``version`` is then unused) and leave the extras."""
    extras = dict(batch.extras)
    per_token = extras.pop(TOKEN_VERSIONS, None)
    rows = {name: getattr(batch, name) for name in _BATCH_FIELDS}
    rows["finish_reasons"] = torch.tensor([FINISH_REASONS.index(r) for r in batch.finish_reasons], dtype=torch.int64)
    rows["pad_token_id"] = torch.full((batch.batch_size,), batch.pad_token_id, dtype=torch.int64)
    rows.update({_EXTRA + name: value for name, value in extras.items()})
    if per_token is not None:
        versions = per_token.to(torch.int64)
    else:
        versions = torch.full(batch.log_probs.shape, int(version), dtype=torch.int64)
    return VersionedRollout(rows=rows, log_probs=batch.log_probs, versions=versions, mask=batch.response_mask)


def rollout_batch(entry: VersionedRollout) -> RolloutBatch:
    """The ``RolloutBatch`` of an entry made by ``rollout_entry`` (the same tensors, not copies)."""
    rows = entry.rows
    pad = rows["pad_token_id"]
    return RolloutBatch(**{name: rows[name] for name in _BATCH_FIELDS}, log_probs=entry.log_probs,
                        finish_reasons=[FINISH_REASONS[int(i)] for i in rows["finish_reasons"]],
                        pad_token_id=int(pad[0]) if pad.numel() else 0,
                        extras={name[len(_EXTRA):]: value for name, value in rows.items() if name.startswith(_EXTRA)})


class RolloutQueue:
    """FIFO of ``VersionedRollout`` entries that never returns one older than ``version − max_staleness``.

    Args:
        max_staleness: the bound k (``rollout.max_staleness``), >= 0.
        version: the trainer's current policy version.
    """

    def __init__(self, max_staleness: int, *, version: int = 0):
        self.max_staleness = check_max_staleness(max_staleness)
        self._version = int(version)
        self._entries: Deque[VersionedRollout] = collections.deque()
        self.num_put_rows = 0
        self.num_returned_rows = 0
        self.num_dropped_rows = 0
        self.num_dropped_entries = 0
        self.num_discarded_rows = 0
        self._last_lags = torch.zeros(0, dtype=torch.int64)  # per valid token returned since the last metrics()

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_queued_rows(self) -> int:
        return sum(entry.num_rows for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def _is_stale(self, entry: VersionedRollout) -> bool:
        return self._version - entry.oldest_version() > self.max_staleness

    def _drop(self, entry: VersionedRollout) -> None:
        self.num_dropped_rows += entry.num_rows
        self.num_dropped_entries += 1

    def _evict(self) -> None:
        kept = collections.deque()
        for entry in self._entries:
            if self._is_stale(entry):
                self._drop(entry)
            else:
                kept.append(entry)
        self._entries = kept

    def put(self, entry: VersionedRollout) -> bool:
        """Queue ``entry``; an entry already too old is dropped and counted. Returns whether it was queued.

        Raises:
            ValueError: a token claims a version newer than the trainer's (a push that never happened).
        """
        if entry.newest_version() > self._version:
            raise ValueError(f"a rollout sampled by policy version {entry.newest_version()} was put while the "
                             f"trainer is at version {self._version}; versions come from the trainer's weight pushes")
        self.num_put_rows += entry.num_rows
        if self._is_stale(entry):
            self._drop(entry)
            return False
        self._entries.append(entry)
        return True

    def advance(self, version: Optional[int] = None) -> int:
        """Move to ``version`` (default: the next one) after a weight update; drops what became too old."""
        new_version = self._version + 1 if version is None else int(version)
        if new_version < self._version:
            raise ValueError(f"the policy version cannot go back from {self._version} to {new_version}")
        self._version = new_version
        self._evict()
        return self._version

    def get(self, max_rows: Optional[int] = None) -> List[VersionedRollout]:
        """Take the oldest entries, at most ``max_rows`` rows in all (whole entries; at least one if any),
        none of them stale. Their per-token lags feed ``metrics``."""
        self._evict()
        taken: List[VersionedRollout] = []
        num_rows = 0
        while self._entries:
            entry = self._entries[0]
            if taken and max_rows is not None and num_rows + entry.num_rows > max_rows:
                break
            taken.append(self._entries.popleft())
            num_rows += entry.num_rows
        self._last_lags = torch.cat([self._last_lags, *(self._version - entry.versions[entry.mask.bool()]
                                                        for entry in taken)])
        self.num_returned_rows += num_rows
        return taken

    def rewind(self, version: int) -> int:
        """Go back to ``version`` (a rollback to an earlier checkpoint): what is queued was sampled by policies
        that no longer exist, so it is discarded (counted). Returns the rows discarded."""
        num_rows = self.discard()
        self._version = int(version)
        return num_rows

    def discard(self) -> int:
        """Drop every queued entry (counted as discarded, not as stale); returns the rows dropped."""
        num_rows = self.num_queued_rows
        self.num_discarded_rows += num_rows
        self._entries.clear()
        return num_rows

    def metrics(self) -> Dict[str, float]:
        """``async/lag_max`` and ``async/lag_mean`` over the valid tokens returned by ``get`` since the previous
        ``metrics`` call (0 when none; the call starts a new window, e.g. one per step), ``async/lag_frac_{i}``
        for every lag i in 0..k (the staleness histogram), the cumulative ``async/dropped_rows`` and
        ``async/discarded_rows``, ``async/queued_rows`` and ``async/policy_version``."""
        lags = self._last_lags
        self._last_lags = torch.zeros(0, dtype=torch.int64)
        metrics = {"async/lag_max": float(lags.max()) if lags.numel() else 0.0,
                   "async/lag_mean": float(lags.double().mean()) if lags.numel() else 0.0}
        for lag in range(self.max_staleness + 1):
            metrics[f"async/lag_frac_{lag}"] = float((lags == lag).double().mean()) if lags.numel() else 0.0
        metrics.update({"async/dropped_rows": float(self.num_dropped_rows),
                        "async/discarded_rows": float(self.num_discarded_rows),
                        "async/queued_rows": float(self.num_queued_rows),
                        "async/policy_version": float(self._version)})
        return metrics

    def state_dict(self) -> Dict[str, object]:
        """The queue for a checkpoint: entries, version and counters (``torch.save``-able)."""
        return {"max_staleness": self.max_staleness, "version": self._version,
                "entries": [entry.to_state() for entry in self._entries],
                "counters": {"put_rows": self.num_put_rows, "returned_rows": self.num_returned_rows,
                             "dropped_rows": self.num_dropped_rows, "dropped_entries": self.num_dropped_entries,
                             "discarded_rows": self.num_discarded_rows},
                "last_lags": self._last_lags.clone()}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore ``state_dict``'s queue. This queue's ``max_staleness`` (the run's config) applies: a resume
        with a smaller bound drops, and counts, what it no longer admits."""
        self._version = int(state["version"])
        self._entries = collections.deque(VersionedRollout(**entry) for entry in state["entries"])
        counters = state["counters"]
        self.num_put_rows = int(counters["put_rows"])
        self.num_returned_rows = int(counters["returned_rows"])
        self.num_dropped_rows = int(counters["dropped_rows"])
        self.num_dropped_entries = int(counters["dropped_entries"])
        self.num_discarded_rows = int(counters["discarded_rows"])
        self._last_lags = state["last_lags"].clone()
        self._evict()
