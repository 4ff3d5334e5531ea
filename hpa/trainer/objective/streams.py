"""The data streams of the objective: what a micro-batch of each ``kind`` carries, the per-token
quantities every term on it reads (``prepare``: computed once per micro-batch, only at the positions the terms
read, by the fused head ``hpa.engine.head``, and returned in the row layout, so packing changes no term), and the global counts that normalise its terms.

Each loss term is normalised by a *global* count of the current mini-batch, taken over all DP ranks and
all micro-batches (``GlobalCounts``), so a term's weight is its share of the step's gradient whatever the
number of micro-batches of each kind or the DP size.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Mapping, Sequence

import torch

from hpa.algorithms.masked import mean_pool
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.engine.micro_batch import MicroBatch
from hpa.engine.head import label_log_probs, response_log_probs


@dataclasses.dataclass(frozen=True)
class GlobalCounts:
    """Counts over all DP ranks of one mini-batch (what makes every loss term's weight exact)."""

    tokens: float
    sequences: float
    pairs: float
    chosen_tokens: float = 1.0  # response tokens of the pairs' chosen rows (the anchor's normaliser)
    replay_tokens: float = 1.0  # response tokens of the replayed SFT examples (the replay term's normaliser)


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """What a term's loss function reads besides its micro-batch and the stream's outputs."""

    algo: object  # AlgorithmConfig
    weights: object  # StepWeights
    counts: GlobalCounts
    aggregation: object  # hpa.algorithms.losses.Aggregation over the rollout counts


@dataclasses.dataclass(frozen=True)
class Stream:
    """One kind of micro-batch.

    Args:
        name: the micro-batch ``kind``.
        prepare: ``prepare(batch, logits, hidden, groups, vocab_size, temperature) -> dict`` of the per-token
            quantities its terms read.
        counts: ``GlobalCounts`` field -> the count of one micro-batch (summed over micro-batches and DP).
    """

    name: str
    prepare: Callable[..., Dict[str, torch.Tensor]]
    counts: Mapping[str, Callable[[MicroBatch], float]]


def prepare_rollout(batch: MicroBatch, logits, hidden, groups: ParallelGroups, vocab_size: int,
                    temperature: float) -> Dict[str, torch.Tensor]:
    """Log-probs and entropy at the rollout temperature ``[b, r]``, response-pooled hidden states ``[b, h]``."""
    logp, ent = response_log_probs(batch, logits, groups.tp_group, vocab_size=vocab_size, temperature=temperature,
                                   entropy=True)  # [b, r] each
    return {"log_probs": logp, "entropy": ent,
            "pooled": mean_pool(batch.unpack(hidden).float(), batch["pool_mask"])}


def prepare_labels(batch: MicroBatch, logits, hidden, groups: ParallelGroups, vocab_size: int,
                   temperature: float) -> Dict[str, torch.Tensor]:
    """Per-token log-probs of the labels ``[rows, s]`` at temperature 1: a pair micro-batch's chosen rows, then
    its rejected ones; a replay micro-batch's SFT examples."""
    return {"token_log_probs": label_log_probs(batch, logits, groups.tp_group, vocab_size=vocab_size)}  # [2m, s]


def _chosen_tokens(mb: MicroBatch) -> float:
    return float(mb["label_mask"][:mb.num_rows // 2].sum())


def _label_tokens(mb: MicroBatch) -> float:
    return float(mb["label_mask"].sum())


STREAMS: Dict[str, Stream] = {s.name: s for s in (
    Stream("rollout", prepare_rollout, {"tokens": lambda mb: float(mb["mask"].sum()),
                                        "sequences": lambda mb: float((mb["mask"].sum(dim=1) > 0).sum())}),
    Stream("pairs", prepare_labels, {"pairs": lambda mb: mb.num_rows / 2, "chosen_tokens": _chosen_tokens}),
    Stream("replay", prepare_labels, {"replay_tokens": _label_tokens}),
)}


def stream_of(batch: MicroBatch) -> Stream:
    try:
        return STREAMS[batch.kind]
    except KeyError:
        raise ValueError(f"a micro-batch of kind {batch.kind!r} reaches the objective; its streams are "
                         f"{sorted(STREAMS)}") from None


def global_counts(rollout_mbs: Sequence[MicroBatch], offline_mbs: Sequence[MicroBatch],
                  groups: ParallelGroups) -> GlobalCounts:
    """The ``GlobalCounts`` of one mini-batch: each stream's counts of its micro-batches, summed over DP
    (at least 1, so an absent stream divides nothing by 0). ``offline_mbs``: the micro-batches of every
    stream but the rollouts (the pairs, the replayed SFT examples), each counted by its own stream (its ``kind``)."""
    by_stream = {name: [] for name in STREAMS}
    by_stream["rollout"] = [MicroBatch.of(mb) for mb in rollout_mbs]
    for mb in offline_mbs:
        mb = MicroBatch.of(mb)
        by_stream[stream_of(mb).name].append(mb)
    fields = [(name, count, by_stream[s.name]) for s in STREAMS.values() for name, count in s.counts.items()]
    local = torch.tensor([sum(count(mb) for mb in mbs) for _, count, mbs in fields], dtype=torch.float64)
    comm.all_reduce_sum(local, groups.dp_group)
    return GlobalCounts(**{name: max(value, 1.0) for (name, _, _), value in zip(fields, local.tolist())})
