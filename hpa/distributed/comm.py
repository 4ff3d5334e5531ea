"""Typed collectives. Groups are always passed in (they come from ``ParallelGroups``).

Every tensor sent goes out on its process group's device: NCCL groups take CUDA tensors only (torch
has no CPU backend on an NCCL group), so a tensor the caller built on the CPU (a stop flag, a metric
vector, a count) is copied to the group's device, reduced there and copied back into the caller's
tensor. With ``HPA_STRICT_COMM_DEVICE=1`` (the test suite sets it) every tensor is also checked
right before it is handed to ``torch.distributed``, so a path that skips the copy fails on a CPU
machine with an error instead of only on the first multi-GPU run.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

STRICT_DEVICE_ENV = "HPA_STRICT_COMM_DEVICE"


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_device(group) -> torch.device:
    """The device a collective on ``group`` (None: the world) takes its tensors on."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return torch.device("cpu")  # gloo, or a world initialised with "cpu:gloo,cuda:nccl"
    return torch.device("cuda", torch.cuda.current_device())


def _strict() -> bool:
    return os.environ.get(STRICT_DEVICE_ENV, "0") not in ("", "0")


def _checked(tensor: torch.Tensor, group, device: torch.device, what: str) -> torch.Tensor:
    if _strict() and tensor.device != device:
        raise RuntimeError(f"hpa.distributed.comm.{what}: a tensor on {tensor.device} was about to be sent on "
                           f"a process group whose collectives run on {device} ({dist.get_backend(group)}); "
                           f"tensors sent through comm must be on the group's device")
    return tensor


def _on_group_device(tensor: torch.Tensor, group):
    """(the tensor to send, the group's device): ``tensor`` itself when it is already there."""
    device = group_device(group)
    return (tensor if tensor.device == device else tensor.to(device)), device


def _in_place(fn, tensor: torch.Tensor, group, what: str) -> torch.Tensor:
    """Run the in-place collective ``fn(sent)`` on the group's device; write the result into ``tensor``."""
    sent, device = _on_group_device(tensor, group)
    fn(_checked(sent, group, device, what))
    if sent is not tensor:
        tensor.copy_(sent.to(tensor.device))
    return tensor


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over ``group``; returns the tensor. A no-op for a group of one."""
    if _size(group) > 1:
        _in_place(lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group), tensor, group, "all_reduce_sum")
    return tensor


def all_reduce_max(tensor: torch.Tensor, group) -> torch.Tensor:
    if _size(group) > 1:
        _in_place(lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group), tensor, group, "all_reduce_max")
    return tensor


def all_reduce_mean(tensor: torch.Tensor, group) -> torch.Tensor:
    all_reduce_sum(tensor, group)
    return tensor.div_(_size(group))


def all_gather_cat(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Gather equally shaped tensors from every rank of ``group`` and concatenate along ``dim``."""
    n = _size(group)
    if n == 1:
        return tensor
    sent, device = _on_group_device(tensor.contiguous(), group)
    parts = [torch.empty_like(sent) for _ in range(n)]
    dist.all_gather([_checked(p, group, device, "all_gather_cat") for p in parts],
                    _checked(sent, group, device, "all_gather_cat"), group=group)
    return torch.cat(parts, dim=dim).to(tensor.device)


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
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=group_device(group))
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
        _in_place(lambda t: dist.broadcast(t, src=src, group=group), tensor, group, "broadcast_tensor")
    return tensor
