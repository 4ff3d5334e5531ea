"""``hpa.distributed.comm`` sends every tensor on its process group's device.

An NCCL group takes CUDA tensors only, and the trainer hands comm CPU tensors (stop flags, metric
vectors, counts). On a CPU machine a fake two-rank "NCCL" group stands in: its collectives run on
torch's lazy device (a non-CPU device that exists without a GPU) and, like NCCL, refuse any tensor
that is not there.
"""

import pytest
import torch
import torch.distributed as dist

from hpa.distributed import comm

FAKE_DEVICE = torch.device("lazy", 0)


@pytest.fixture(scope="module")
def lazy_device():
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()


class FakeNcclGroup:
    """Two ranks whose other rank holds the same values; records the device of every tensor sent."""

    def __init__(self):
        self.sent = []

    def _take(self, tensor):
        self.sent.append(tensor.device)
        if tensor.device != FAKE_DEVICE:
            raise RuntimeError(f"No backend type associated with device type {tensor.device.type}")

    def all_reduce(self, tensor, op=None, group=None):
        self._take(tensor)
        if op == dist.ReduceOp.SUM:
            tensor.mul_(2)

    def broadcast(self, tensor, src, group=None):
        self._take(tensor)
        tensor.add_(1)  # what the source rank holds

    def all_gather(self, parts, tensor, group=None):
        self._take(tensor)
        for p in parts:
            self._take(p)
            p.copy_(tensor)


@pytest.fixture
def nccl_group(monkeypatch, lazy_device):
    fake = FakeNcclGroup()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)
    monkeypatch.setattr(dist, "broadcast", fake.broadcast)
    monkeypatch.setattr(dist, "all_gather", fake.all_gather)
    monkeypatch.setattr(comm, "group_device", lambda group: FAKE_DEVICE)
    return fake


def test_cpu_tensors_from_the_trainer_are_sent_on_the_group_device(nccl_group):
    flags = torch.tensor([0, 1])  # a stop flag, built on the CPU as the loop builds it
    assert comm.all_reduce_max(flags, None) is flags and flags.device.type == "cpu"
    assert flags.tolist() == [0, 1]
    counts = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    comm.all_reduce_sum(counts, "dp")
    assert counts.tolist() == [2.0, 4.0, 6.0]  # the result is written back into the caller's tensor
    assert comm.all_reduce_mean(torch.tensor([3.0]), "dp").tolist() == [3.0]
    assert comm.reduce_metrics({"a": 1.0, "b": 4.0}, "dp") == {"a": 1.0, "b": 4.0}
    assert comm.reduce_metrics({"a": 1.0, "b": 4.0}, "dp", op="sum") == {"a": 2.0, "b": 8.0}
    vec = torch.zeros(2)
    assert comm.broadcast_tensor(vec, src=1, group="pp").tolist() == [1.0, 1.0]
    gathered = comm.all_gather_cat(torch.tensor([[1.0, 2.0]]), "dp")
    assert gathered.device.type == "cpu" and gathered.tolist() == [[1.0, 2.0], [1.0, 2.0]]
    assert nccl_group.sent and set(nccl_group.sent) == {FAKE_DEVICE}


def test_strict_mode_stops_a_tensor_on_the_wrong_device(nccl_group, monkeypatch):
    # a path that skips the copy to the group's device is caught before torch.distributed sees it
    monkeypatch.setenv(comm.STRICT_DEVICE_ENV, "1")
    monkeypatch.setattr(comm, "_on_group_device", lambda tensor, group: (tensor, FAKE_DEVICE))
    with pytest.raises(RuntimeError, match=r"all_reduce_sum: a tensor on cpu .* collectives run on lazy:0"):
        comm.all_reduce_sum(torch.ones(2), "dp")
    assert nccl_group.sent == []


def test_the_suite_runs_in_strict_mode():
    import os

    assert os.environ.get(comm.STRICT_DEVICE_ENV) == "1"


@pytest.mark.parametrize("backend,device", [("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("nccl", "cuda:3")])
def test_group_device(monkeypatch, backend, device):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm.group_device(None) == torch.device(device)
