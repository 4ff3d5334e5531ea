"""Typed collectives. Groups are always passed in (they come from ``ParallelGroups``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over ``group``; returns the tensor. A no-op for a group of one."""
    if _size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group) -> torch.Tensor:
    if _size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce_mean(tensor: torch.Tensor, group) -> torch.Tensor:
    all_reduce_sum(tensor, group)
    return tensor.div_(_size(group))


def all_gather_cat(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Gather equally shaped tensors from every rank of ``group`` and concatenate along ``dim``."""
    n = _size(group)
    if n == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(n)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_gather_objects(obj: Any, group) -> List[Any]:
    n = _size(group)
    if n == 1:
        return [obj]
    out: List[Any] = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int, group=None) -> Any:
    """Broadcast a picklable object from global rank ``src`` to every rank of ``group``."""
    if not dist.is_initialized() or _size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def reduce_metrics(metrics: Dict[str, float], group, op: str = "mean") -> Dict[str, float]:
    """Mean (or sum/max) of scalar metrics over ``group``; every rank must pass the same keys."""
    if not metrics or _size(group) == 1:
        return dict(metrics)
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    if op == "max":
        all_reduce_max(values, group)
    else:
        all_reduce_sum(values, group)
        if op == "mean":
            values /= _size(group)
    return dict(zip(keys, values.tolist()))


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def broadcast_tensor(tensor: torch.Tensor, src: int, group: Optional[Any] = None) -> torch.Tensor:
    """In-place broadcast from global rank ``src``."""
    if dist.is_initialized() and _size(group) > 1:
        dist.broadcast(tensor, src=src, group=group)
    return tensor
