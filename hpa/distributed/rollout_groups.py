"""The process groups of disaggregated rollouts (``rollout.placement: disaggregated``).

A launch of W ranks is split in two worlds: the first T = W − R ranks train, the last R (``rollout.num_ranks``)
sample. Each world is torch.distributed's default group of its own processes (a prefix of one store), so
megatron's ``parallel_state``, its checkpoints and every collective that names no group stay inside the
trainer ranks, as in a colocated run (megatron-core 0.16's ``initialize_model_parallel`` builds its groups from
``torch.distributed.get_world_size()`` and has no way to leave ranks out). Between the worlds, two groups made
directly from the same store, outside the default world:

- ``bridge``: gloo over all W ranks, for the messages (jobs, finished rollouts, push headers, checksums, stop):
  pickled objects, sent point to point; on GPU too (rows and prompts are small next to the weights);
- ``push``: trainer rank 0 and the R rollout ranks (NCCL on GPU, gloo on CPU), over which trainer rank 0
  broadcasts the weights.

Trainer DP rank ``i`` is served by rollout rank ``i mod R``.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist

TRAINER, ROLLOUT = "trainer", "rollout"


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where this process sits in a disaggregated launch.

    Attributes:
        role: ``trainer`` or ``rollout``.
        global_rank: the rank in the launch (trainers first).
        num_trainer_ranks: T, the trainer world.
        num_rollout_ranks: R, the rollout world (global ranks T .. T+R−1).
        bridge: the gloo group of all T+R ranks (messages; its ranks are the global ranks).
        push: the weight-push group of trainer rank 0 (its rank 0) and the rollout ranks (1 .. R); None on the
            other trainer ranks.
        device: the device the push group's broadcasts take tensors on.
    """

    role: str
    global_rank: int
    num_trainer_ranks: int
    num_rollout_ranks: int
    bridge: Any
    push: Any
    device: torch.device

    @property
    def rollout_ranks(self) -> List[int]:
        return list(range(self.num_trainer_ranks, self.num_trainer_ranks + self.num_rollout_ranks))

    def server_of(self, trainer_rank: int) -> int:
        """The global rank of the rollout rank that serves ``trainer_rank``."""
        return self.num_trainer_ranks + trainer_rank % self.num_rollout_ranks

    def clients(self) -> List[int]:
        """On a rollout rank: the trainer ranks it serves, in order."""
        return [t for t in range(self.num_trainer_ranks) if self.server_of(t) == self.global_rank]


def split_world(*, rank: int, world_size: int, num_rollout_ranks: int) -> tuple:
    """``(role, rank in its world, size of its world, store prefix)`` of global ``rank``."""
    trainers = world_size - num_rollout_ranks
    if rank < trainers:
        return TRAINER, rank, trainers, "hpa/trainer"
    return ROLLOUT, rank - trainers, num_rollout_ranks, "hpa/rollout"


def build_placement(store, *, rank: int, world_size: int, num_rollout_ranks: int, backend: str,
                    device: torch.device, timeout: datetime.timedelta) -> Placement:
    """The bridge and push groups over ``store`` (every rank of the launch calls it, after its own world's
    ``init_process_group``)."""
    role, _, _, _ = split_world(rank=rank, world_size=world_size, num_rollout_ranks=num_rollout_ranks)
    trainers = world_size - num_rollout_ranks
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("hpa/bridge", store), rank, world_size, timeout)
    push = None
    if rank == 0 or role == ROLLOUT:
        push_rank, push_size = (0 if rank == 0 else rank - trainers + 1), num_rollout_ranks + 1
        push_store = dist.PrefixStore("hpa/push", store)
        if backend == "nccl":
            push = dist.ProcessGroupNCCL(push_store, push_rank, push_size)
        else:
            push = dist.ProcessGroupGloo(push_store, push_rank, push_size, timeout)
    return Placement(role=role, global_rank=rank, num_trainer_ranks=trainers, num_rollout_ranks=num_rollout_ranks,
                     bridge=bridge, push=push, device=device if backend == "nccl" else torch.device("cpu"))


# ------------------------------------------------------------------------------------------------- messages
class Outbox:
    """Objects sent on the bridge without waiting for the receiver (a send completes when the peer takes it);
    the buffers stay alive until then. ``flush`` waits for all."""

    def __init__(self, bridge):
        self.bridge = bridge
        self._works: list = []

    def send(self, obj, dst: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self._works = [(w, b) for w, b in self._works if not w.is_completed()]
        for buffer in (size, payload):
            self._works.append((self.bridge.send([buffer], dst, 0), buffer))

    def flush(self) -> None:
        for work, _ in self._works:
            work.wait()
        self._works = []


def receive(bridge, src: int) -> Any:
    """The next object ``src`` sent on the bridge (blocks)."""
    size = torch.zeros(1, dtype=torch.int64)
    bridge.recv([size], src, 0).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    bridge.recv([payload], src, 0).wait()
    return pickle.loads(payload.numpy().tobytes())


def broadcast_tensors(push, tensors: List[torch.Tensor], device: torch.device) -> None:
    """Broadcast ``tensors`` in place from the push group's rank 0 (trainer rank 0) to the rollout ranks."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for tensor in tensors:
        sent = tensor.detach()
        staged = sent if sent.device == device and sent.is_contiguous() else sent.to(device).contiguous()
        push.broadcast([staged], options).wait()
        if staged is not sent:
            sent.copy_(staged)



_stopped: set = set()  # the trainer ranks (global) of this process that told their rollout rank they are done


def stop_serving(placement: Placement) -> None:
    """On a trainer rank: tell its rollout rank that it is done (once; at ``hpa.distributed.destroy``, also when
    the run failed before it sampled, so the rollout rank does not wait for it until the timeout)."""
    if placement.role != TRAINER or placement.global_rank in _stopped:
        return
    _stopped.add(placement.global_rank)
    outbox = Outbox(placement.bridge)
    outbox.send(("stop",), placement.server_of(placement.global_rank))
    outbox.flush()
