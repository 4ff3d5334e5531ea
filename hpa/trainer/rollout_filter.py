"""The rollout filter of a step (``algorithm.rollout_filter``), between scoring and the advantages.

The filter decides over the whole step: every DP rank's per-row rewards are gathered, the filter of
``hpa.algorithms.filters`` runs on them identically on every rank, and each rank keeps its own rows. A
dropped row stays in the batch with an all-zero loss ``mask`` (as a row with a non-finite reward), so the
advantages (a dropped row is its own group), the KL controller, and the global token and sequence counts
that normalise every loss are those of the kept rows; a rank that keeps no row still takes part in every
collective, so nothing waits on it and nothing divides by zero.

``dapo_groups`` refills: while some rank has fewer kept rows than its batch holds and fewer than
``max_refill_rounds`` extra rounds were generated, every rank generates another round of prompts (a round
is collective: the scoring gathers across ranks, so a rank that is already full generates too and discards
it). Each rank then fills its batch with its kept groups, whole, in the order they were generated; the
slots left when the round limit is reached hold dropped rows, masked out. The batch keeps its size, so
every rank cuts the same number of micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch

from hpa.algorithms.filters import rollout_filter
from hpa.config.algorithm import RolloutFilterConfig
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.rollout.base import RolloutBatch

METRIC_EXTRAS = {"shaped": "shaped_rewards", "raw": "raw_rewards"}


@dataclasses.dataclass(frozen=True)
class FilterSteps:
    """What the step does around a filter of ``hpa.algorithms.filters.ROLLOUT_FILTERS``.

    Args:
        decides: the filter decides over the gathered rows of every DP rank (``none`` keeps the valid rows).
        refills: generate more rounds while a rank's batch is not full (``max_refill_rounds``).
        metrics: ``metrics(mean_threshold, refill_rounds)``: the filter's own ``filter/*`` metrics (a None
            value is left out: the mean threshold is None where no row had one).
    """

    decides: bool = True
    refills: bool = False
    metrics: Callable[[Optional[float], int], Dict[str, Optional[float]]] = lambda threshold, refills: {}


FILTER_STEPS: Dict[str, FilterSteps] = {
    "none": FilterSteps(decides=False),
    "reward_above_mean_std": FilterSteps(metrics=lambda threshold, refills: {"filter/threshold": threshold}),
    "dapo_groups": FilterSteps(refills=True, metrics=lambda threshold, refills: {
        "filter/refill_rounds": float(refills)}),
}


def keep_rows(batch: RolloutBatch, cfg: RolloutFilterConfig, groups: ParallelGroups) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows that ``cfg`` keeps, decided over the rows of every DP rank.

    Every rank must pass a batch of the same number of rows (one generation round). Returns
    ``(keep, threshold)``, ``[b]`` bool and float64 (NaN where the filter has no threshold).
    """
    b = batch.batch_size
    metric = batch.get(METRIC_EXTRAS[cfg.resolved_metric]).double()
    valid = batch.get("mask").sum(dim=1) > 0
    if not FILTER_STEPS[cfg.name].decides:  # nothing to decide across ranks
        return valid, torch.full((b,), float("nan"), dtype=torch.float64)
    # group ids unique over the step: each rank's prompts are its own
    gid = batch.group_ids.long() + groups.dp_rank * b
    gathered = comm.all_gather_cat(torch.stack([metric, valid.double(), gid.double()], dim=1), groups.dp_group)
    keep, threshold = rollout_filter(gathered[:, 0], gathered[:, 1] > 0, gathered[:, 2].long(), name=cfg.name,
                                     k=cfg.k, scope=cfg.scope)
    mine = slice(groups.dp_rank * b, (groups.dp_rank + 1) * b)
    return keep[mine], threshold[mine]


def _kept_groups(keep: torch.Tensor, group_ids: torch.Tensor) -> List[List[int]]:
    """Rows of each group with a kept row, groups in order of first appearance."""
    out: Dict[int, List[int]] = {}
    for row in keep.nonzero(as_tuple=True)[0].tolist():
        out.setdefault(int(group_ids[row]), []).append(row)
    return list(out.values())


def apply(batch: RolloutBatch, cfg: RolloutFilterConfig, groups: ParallelGroups,
          generate_more: Callable[[int], RolloutBatch]) -> Tuple[RolloutBatch, Dict[str, float]]:
    """Filter the step's scored ``batch`` (and, for ``dapo_groups``, refill it).

    Args:
        batch: the scored rollouts of the step's first round (``mask``, ``shaped_rewards``, ``raw_rewards``
            and the rest of what scoring and the reference forwards wrote).
        cfg: the ``algorithm.rollout_filter`` section.
        groups: the process groups (the DP group carries the decision).
        generate_more: ``generate_more(round)`` rolls out, runs the reference forwards and scores a new
            round of prompts (round 1, 2, ...), as the first round was.

    Returns:
        ``(batch, metrics)``: the batch to train on (as many rows as ``batch``; dropped rows masked out) and
        ``filter/*`` metrics over every DP rank: ``kept_fraction`` (rows that train / rows of the batch),
        ``threshold`` (mean over the valid rows; reward_above_mean_std), ``refill_rounds`` (dapo_groups),
        ``kept_reward`` and ``dropped_reward`` (mean metric of the valid rows generated this step that train
        and that do not). A mean over no rows is left out.
    """
    b = batch.batch_size
    rounds: List[Tuple[RolloutBatch, torch.Tensor, torch.Tensor]] = [(batch, *keep_rows(batch, cfg, groups))]
    if FILTER_STEPS[cfg.name].refills:
        while len(rounds) - 1 < cfg.max_refill_rounds:
            kept = sum(int(keep.sum()) for _, keep, _ in rounds)
            missing = comm.all_reduce_max(torch.tensor([float(max(b - kept, 0))]), groups.dp_group)
            if missing.item() == 0:
                break
            more = generate_more(len(rounds))
            rounds.append((more, *keep_rows(more, cfg, groups)))
    out, trains = _compose(rounds, b) if len(rounds) > 1 else (batch, rounds[0][1])
    metrics = _metrics(rounds, out, trains, cfg, groups)  # before the mask changes: it reads which rows were valid
    out.set("mask", out.get("mask") * trains[:, None].to(out.get("mask").dtype))
    return out, metrics


def _compose(rounds, b: int) -> Tuple[RolloutBatch, torch.Tensor]:
    """``b`` rows: the kept groups of every round, whole, in order, then dropped rows of the first round;
    and which of them train. Group ids are offset per round, so groups of different rounds stay apart."""
    picks: List[Tuple[int, List[int], bool]] = []  # (round, rows, trains)
    used = 0
    for r, (batch, keep, _) in enumerate(rounds):
        for rows in _kept_groups(keep, batch.group_ids):
            if used + len(rows) <= b:
                picks.append((r, rows, True))
                used += len(rows)
    taken = {row for r, rows, _ in picks if r == 0 for row in rows}
    picks.append((0, [row for row in range(b) if row not in taken][:b - used], False))
    offset, parts, flags = 0, [], []
    for r, (batch, _, _) in enumerate(rounds):
        mine = [(rows, trains) for pr, rows, trains in picks if pr == r and rows]
        if mine:
            part = batch.select([row for rows, _ in mine for row in rows])
            part.group_ids = part.group_ids + offset
            parts.append(part)
            flags += [trains for rows, trains in mine for _ in rows]
        offset += int(batch.group_ids.max()) + 1
    return RolloutBatch.concat(parts), torch.tensor(flags, dtype=torch.bool)


def _metrics(rounds, out: RolloutBatch, trains: torch.Tensor, cfg: RolloutFilterConfig,
             groups: ParallelGroups) -> Dict[str, float]:
    metric_key = METRIC_EXTRAS[cfg.resolved_metric]
    generated = RolloutBatch.concat([batch for batch, _, _ in rounds]) if len(rounds) > 1 else rounds[0][0]
    valid = generated.get("mask").sum(dim=1) > 0
    metric = generated.get(metric_key).double()
    kept_sum, kept_n = float(out.get(metric_key).double()[trains].sum()), float(trains.sum())
    all_sum, all_n = float(metric[valid].sum()), float(valid.sum())
    thresholds = torch.cat([t for _, _, t in rounds])
    has_t = valid & ~torch.isnan(thresholds)
    t_sum, t_n = float(thresholds[has_t].sum()), float(has_t.sum())
    totals = torch.tensor([kept_n, float(out.batch_size), kept_sum, all_sum - kept_sum, all_n - kept_n, t_sum, t_n],
                          dtype=torch.float64)
    comm.all_reduce_sum(totals, groups.dp_group)
    kept_n, rows, kept_sum, dropped_sum, dropped_n, t_sum, t_n = totals.tolist()

    # a mean over no rows is left out, not logged as NaN (the counts are global, so every rank agrees)
    metrics = {"filter/kept_fraction": kept_n / rows}
    for key, total, n in (("kept_reward", kept_sum, kept_n), ("dropped_reward", dropped_sum, dropped_n)):
        if n:
            metrics[f"filter/{key}"] = total / n
    step_metrics = FILTER_STEPS[cfg.name].metrics(t_sum / t_n if t_n else None, len(rounds) - 1)
    metrics.update({k: v for k, v in step_metrics.items() if v is not None})
    return metrics
