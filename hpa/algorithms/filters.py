"""Rollout filters: which of a step's responses train, chosen by ``algorithm.rollout_filter.name``.

Every entry has one signature, over the rows of the *whole* step (every DP rank's rows, gathered by the
caller: the cross-rank fact is the argument)::

    fn(metric, valid, group_ids, *, k, scope) -> (keep, threshold)

    metric     # [B] the reward filtered on
    valid      # [B] bool, rows that may train at all (a non-finite reward is not valid)
    group_ids  # [B] int64, the prompt each row answers (unique over the whole step)
    keep       # [B] bool, never True where not valid
    threshold  # [B] the threshold each row was held to (NaN where the filter has none)

- ``none``: every valid row.
- ``reward_above_mean_std``: the HPA recipe's ``responses[rewards > rewards.mean() + k * rewards.std()]``:
  rows whose metric is strictly above ``mean + k·std`` of the valid rows of the batch (``scope="batch"``)
  or of their prompt's group (``scope="group"``). The std is torch's default, unbiased (Bessel), as the
  recipe's ``rewards.std()``; over fewer than two rows it is taken as 0, so nothing strictly above the
  mean is kept from a single row. All-equal rewards keep nothing.
- ``dapo_groups``: DAPO's dynamic-sampling filter (Yu et al. 2025, https://arxiv.org/abs/2503.14476;
  verl's ``filter_groups``): the valid rows of the groups whose valid metrics are not all equal (verl keeps
  ``np.std(metric) > 0``, the same up to rounding; a group with one valid row has no spread and is
  dropped, where verl keeps a group of one response, which only ``rollout.n = 1`` makes, refused here).
  ``k`` and ``scope`` are unused. The refill of the dropped groups is the trainer's (it generates).
"""

from __future__ import annotations

from typing import Tuple

import torch

from hpa.registry import Registry

ROLLOUT_FILTERS = Registry("rollout filter")


def _group_rows(group_ids: torch.Tensor):
    """Row indices of each group, groups in order of first appearance."""
    order: dict = {}
    for row, gid in enumerate(group_ids.tolist()):
        order.setdefault(gid, []).append(row)
    return [torch.tensor(rows) for rows in order.values()]


def _mean_std(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    mean = values.mean()
    std = values.std() if values.numel() > 1 else torch.zeros((), dtype=values.dtype)
    return mean, std


@ROLLOUT_FILTERS.register("none")
def _none(metric, valid, group_ids, *, k, scope):
    return valid.bool().clone(), torch.full(metric.shape, float("nan"), dtype=torch.float64)


@ROLLOUT_FILTERS.register("reward_above_mean_std")
def _reward_above_mean_std(metric, valid, group_ids, *, k, scope):
    valid = valid.bool()
    values = metric.double()
    threshold = torch.full(values.shape, float("nan"), dtype=torch.float64)
    if scope == "batch":
        parts = [torch.arange(values.numel())]
    elif scope == "group":
        parts = _group_rows(group_ids)
    else:
        raise ValueError(f"unknown scope {scope!r}; valid: 'batch', 'group'")
    for rows in parts:
        rows = rows[valid[rows]]
        if rows.numel():
            mean, std = _mean_std(values[rows])
            threshold[rows] = mean + k * std
    keep = valid & (values > threshold)  # NaN (no valid row) compares False
    return keep, threshold


@ROLLOUT_FILTERS.register("dapo_groups")
def _dapo_groups(metric, valid, group_ids, *, k, scope):
    valid = valid.bool()
    keep = torch.zeros_like(valid)
    for rows in _group_rows(group_ids):
        rows = rows[valid[rows]]
        if rows.numel() > 1 and metric[rows].max() > metric[rows].min():
            keep[rows] = True
    return keep, torch.full(metric.shape, float("nan"), dtype=torch.float64)


def rollout_filter(metric: torch.Tensor, valid: torch.Tensor, group_ids: torch.Tensor, *, name: str,
                   k: float = 1.0, scope: str = "batch") -> Tuple[torch.Tensor, torch.Tensor]:
    """The rows of the whole step that ``name`` keeps; see the module docstring.

    Args:
        metric: the reward filtered on. # [B]
        valid: rows that may train. # [B]
        group_ids: the prompt of each row, unique over the step. # [B]
        name: a name in ``ROLLOUT_FILTERS``.
        k: ``reward_above_mean_std``'s k.
        scope: ``reward_above_mean_std``'s ``batch`` or ``group``.

    Returns:
        ``(keep, threshold)``: bool ``[B]`` and float64 ``[B]`` (NaN where no threshold applies).
    """
    if not metric.shape == valid.shape == group_ids.shape or metric.dim() != 1:
        raise ValueError(f"metric, valid and group_ids must be [B] alike, got {tuple(metric.shape)}, "
                         f"{tuple(valid.shape)}, {tuple(group_ids.shape)}")
    return ROLLOUT_FILTERS.get(name)(metric, valid, group_ids, k=k, scope=scope)
