"""Rollouts on rollout ranks of their own (``rollout.placement: disaggregated``; the groups are
``hpa/distributed/rollout_groups.py``).

Trainer side: ``RemoteRolloutWorker``, with ``RolloutWorker``'s interface (``submit`` / ``poll`` / ``wait`` /
``drain`` / ``push_weights`` / ``checksums`` / ``version`` / ``watched``), so ``RolloutStep`` drives either.
Rollout side: ``serve``, the loop of a rollout rank. A rollout rank serves its trainer ranks in turn, one
message each: every trainer DP rank sends the same sequence of messages (jobs, pushes, the stop), so taking
them in turn never waits on a message that will not come. The messages:

- ``("job", tag, prompts, params, version)``: sample; the rollout rank sends back a ``WorkerResult``;
- ``("push", push_id, names, version)``: the first of a push's headers that a rollout rank takes joins trainer
  rank 0's broadcast of ``names`` (in that order) of policy ``version`` into its copy (the jobs in flight
  finished first; with ``rollout.partial`` the job in flight paused between two decode steps, continued after);
  every header is answered with the checksums of the watched tensors, which the trainer checks
  (``check_delivery``), after the jobs that finished before it;
- ``("stop",)``: the trainer rank is done (sent from ``hpa.distributed.destroy``, before the groups go).

Results are sent without waiting for the trainer to take them, so a rollout rank samples one trainer's next
job while another trains. The rollout rank samples in a ``RolloutWorker`` thread and receives in another, so a
push header is taken while a job samples (``rollout.partial`` needs that).
"""

from __future__ import annotations

import dataclasses
import logging
import queue as queue_lib
import threading
from typing import Callable, Dict, List, Mapping, Optional

import torch

from hpa.distributed.init import on_destroy
from hpa.distributed.rollout_groups import Outbox, Placement, broadcast_tensors, receive, stop_serving
from hpa.rollout.base import RolloutEngine, SamplingParams
from hpa.rollout.worker import RolloutWorker, WorkerResult, checksum, watched_names

logger = logging.getLogger(__name__)

# how long the rollout rank waits for a message before it looks for finished jobs again
POLL_INTERVAL_S = 0.001


class RemoteRolloutWorker:
    """The trainer side of a rollout rank: jobs go to ``placement.server_of(rank)``, finished rollouts come back
    in submission order.

    Args:
        placement: the groups of the disaggregated launch (``ParallelGroups.placement``).
        names: the names of the policy's parameters, in the model's order (as the rollout rank's copy has them).
        version: the policy version of the rollout ranks' weights now (-1: none pushed yet).
        partial: a push does not wait for the jobs in flight: the rollout rank stops the one it samples between
            two decode steps and continues it with the new weights (``rollout.partial``).
    """

    def __init__(self, placement: Placement, names: List[str], *, version: int = -1, partial: bool = False):
        self.placement, self.version, self.partial = placement, int(version), bool(partial)
        self.server = placement.server_of(placement.global_rank)
        self.watched = watched_names(list(names))
        self._outbox = Outbox(placement.bridge)
        self._pending: List[object] = []  # tags submitted, not yet received (the server answers in this order)
        self._done: Dict[object, WorkerResult] = {}
        self._pushes = 0
        self._last_checksums: Dict[str, float] = {}
        on_destroy(self.close)

    def submit(self, prompts, params: SamplingParams, tag) -> None:
        """Send a job: ``params.n`` responses to each of ``prompts`` (token-id lists), handed back under ``tag``."""
        self._outbox.send(("job", tag, [[int(t) for t in p] for p in prompts], params, self.version), self.server)
        self._pending.append(tag)

    def _receive_one(self) -> Optional[Dict[str, float]]:
        """Take the rollout rank's next message: a finished job (kept for ``poll``/``wait``), or the checksums that
        answer a push (returned)."""
        result = receive(self.placement.bridge, self.server)
        if not isinstance(result, WorkerResult):
            return result
        expected = self._pending.pop(0)
        if result.tag != expected:  # a protocol error, not a user's: the two sides disagree on the order
            raise RuntimeError(f"rollout rank {self.server} answered job {result.tag!r}, expected {expected!r}")
        if result.batch is not None:
            result = dataclasses.replace(result, batch=to_device(result.batch, self.placement.device))
        self._done[result.tag] = result
        return None

    def poll(self) -> List[WorkerResult]:
        """The jobs received since the last ``poll``/``wait`` (after a ``drain``: every job finished)."""
        results, self._done = list(self._done.values()), {}
        return results

    def wait(self, tag) -> WorkerResult:
        """Block until the job ``tag`` has come back and return it (raising the error it raised)."""
        while tag not in self._done:
            if tag not in self._pending:
                raise KeyError(f"no job {tag!r} was submitted to rollout rank {self.server}")
            self._take_job()
        result = self._done.pop(tag)
        if result.error is not None:
            raise result.error
        return result

    def drain(self) -> None:
        """Block until every job submitted has come back (they stay for ``poll``/``wait``)."""
        while self._pending:
            self._take_job()

    def _take_job(self) -> None:
        if self._receive_one() is not None:  # a protocol error: no push is waiting for its answer
            raise RuntimeError(f"rollout rank {self.server} answered a weight push that was not sent")

    def push_weights(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> Dict[str, float]:
        """Send the trainer's tensors of policy ``version`` to the rollout ranks (trainer rank 0 broadcasts, every
        trainer rank tells its rollout rank), after the jobs in flight (with ``partial``: at once; the job in flight
        continues with them); returns the rollout rank's checksums of its watched tensors after the push
        (``check_delivery`` reads them)."""
        if not self.partial:
            self.drain()
        self._pushes += 1
        names = list(named_tensors)
        self._outbox.send(("push", self._pushes, names, int(version)), self.server)
        if self.placement.push is not None:  # trainer rank 0
            broadcast_tensors(self.placement.push, [named_tensors[n] for n in names], self.placement.device)
        checksums = None
        while checksums is None:  # jobs finished before the push come first
            checksums = self._receive_one()
        self._last_checksums = checksums
        self.version = int(version)
        return dict(self._last_checksums)

    def checksums(self) -> Dict[str, float]:
        """The rollout rank's checksums of its watched tensors after the last push."""
        return dict(self._last_checksums)

    def close(self) -> None:
        """Tell the rollout rank this trainer rank is done (once; ``hpa.distributed.destroy`` calls it). Jobs
        still in flight (a run that stops with a step sampled ahead) are taken first and dropped: the rollout
        rank's answers must arrive before this process goes, or its sends fail."""
        try:
            self.drain()
        except RuntimeError as exc:  # the run is ending anyway; the stop below still tells the rollout rank
            logger.warning("rollout rank %d: the jobs in flight at the end could not be taken back: %s",
                           self.server, exc)
        if self._done:
            logger.info("dropped %d rollout job(s) sampled ahead and not trained on at the end of the run",
                        len(self._done))
        self._outbox.flush()
        stop_serving(self.placement)


def receive_weights(placement: Placement, params: Mapping[str, torch.Tensor], names: List[str]) -> None:
    """The rollout side of a push: trainer rank 0's broadcast of ``names`` into ``params`` (in place)."""
    with torch.no_grad():
        broadcast_tensors(placement.push, [params[n] for n in names], placement.device)


def serve(engine: RolloutEngine, module: torch.nn.Module, placement: Placement, *, partial: bool = False,
          on_push: Optional[Callable[[int], None]] = None) -> Dict[str, int]:
    """The loop of a rollout rank: sample the jobs of its trainer ranks with ``engine`` (over ``module``, this
    rank's copy of the policy) in a ``RolloutWorker`` thread, take the weight pushes into ``module``, until every
    trainer rank has stopped. A thread receives the messages (in turn), so a push header is taken while a job
    samples; each finished job is sent back as soon as it is done. With ``partial`` (``rollout.partial``) a push
    stops the job in flight between two decode steps, the broadcast lands in the paused copy and the job continues
    with the new weights (the worker's partial push); without, it waits for the jobs in flight. ``on_push(version)``
    runs as a push's first header is taken, before its weights (the fault injection's kill). Returns counts
    (``jobs``, ``pushes``). Without ``partial`` nothing needs a job and a push at once (the trainer waits for
    its jobs before it pushes): the jobs are sampled in this thread (``_serve_in_turn``), which vLLM needs (its
    engine sampling in a second thread hung a disaggregated run of the vLLM tier once)."""
    if not partial:
        return _serve_in_turn(engine, module, placement, on_push)
    worker = RolloutWorker(engine, module, version=-1, partial=partial)  # the first push sets the weights
    params = dict(module.named_parameters())
    outbox, inbox = Outbox(placement.bridge), queue_lib.Queue()
    threading.Thread(target=_receive_in_turn, args=(placement.bridge, placement.clients(), inbox),
                     name="hpa-rollout-inbox", daemon=True).start()
    active, pushed, counts = set(placement.clients()), 0, {"jobs": 0, "pushes": 0}
    module.eval()
    while active:
        _send_finished(worker, outbox, placement.global_rank)
        try:
            trainer, message = inbox.get(timeout=POLL_INTERVAL_S)
        except queue_lib.Empty:
            continue
        if isinstance(message, BaseException):
            raise RuntimeError(f"rollout rank {placement.global_rank}: receiving from trainer rank {trainer} "
                               f"failed: {message!r}") from message
        kind = message[0]
        if kind == "stop":
            active.discard(trainer)
        elif kind == "push":
            _, push_id, names, version = message
            if push_id != pushed:  # the first header of this push: join the broadcast
                if on_push is not None:
                    on_push(version)
                worker.write_weights(version, lambda params: receive_weights(placement, params, names))
                engine.sync_weights()  # an engine with a copy of its own (vLLM) takes the pushed weights
                pushed = push_id
                counts["pushes"] += 1
            _send_finished(worker, outbox, placement.global_rank)  # the trainer takes its messages in order
            held = engine.weights_held({name: params[name] for name in worker.watched})  # vLLM: as it holds them
            outbox.send({name: checksum(held[name]) for name in worker.watched}, trainer)
        elif kind == "job":
            _, tag, prompts, sampling, _ = message
            worker.submit(prompts, sampling, tag=(trainer, tag))  # tags are the trainer ranks' steps: not unique
            counts["jobs"] += 1
        else:
            raise RuntimeError(f"rollout rank {placement.global_rank}: unknown message {kind!r} from {trainer}")
    outbox.flush()
    return counts


def _serve_in_turn(engine: RolloutEngine, module: torch.nn.Module, placement: Placement,
                   on_push: Optional[Callable[[int], None]]) -> Dict[str, int]:
    """``serve`` without partial rollouts: one message from each trainer rank in turn, each job sampled as it
    comes, in this thread."""
    params = dict(module.named_parameters())
    watched = watched_names(list(params))
    outbox = Outbox(placement.bridge)
    active, pushed, counts = list(placement.clients()), 0, {"jobs": 0, "pushes": 0}
    module.eval()
    while active:
        for trainer in list(active):
            message = receive(placement.bridge, trainer)
            kind = message[0]
            if kind == "stop":
                active.remove(trainer)
            elif kind == "push":
                _, push_id, names, version = message
                if push_id != pushed:  # the first header of this push: join the broadcast
                    if on_push is not None:
                        on_push(version)
                    receive_weights(placement, params, names)
                    engine.sync_weights()  # an engine with a copy of its own (vLLM) takes the pushed weights
                    pushed = push_id
                    counts["pushes"] += 1
                held = engine.weights_held({name: params[name] for name in watched})  # vLLM: as it holds them
                outbox.send({name: checksum(held[name]) for name in watched}, trainer)
            elif kind == "job":
                _, tag, prompts, sampling, version = message
                try:
                    with torch.no_grad():
                        batch, error = engine.generate(prompts, sampling), None
                    batch = to_device(batch, torch.device("cpu"))
                except Exception as exc:  # handed to the trainer rank, whose ``wait`` raises it
                    batch, error = None, RuntimeError(f"rollout rank {placement.global_rank}: {exc!r}")
                outbox.send(WorkerResult(tag=tag, version=version, batch=batch, error=error), trainer)
                counts["jobs"] += 1
            else:
                raise RuntimeError(f"rollout rank {placement.global_rank}: unknown message {kind!r} from {trainer}")
    outbox.flush()
    return counts


def _receive_in_turn(bridge, clients: List[int], inbox: "queue_lib.Queue") -> None:
    """Put each of ``clients``' messages into ``inbox`` as ``(trainer, message)``, one from each in turn, until
    each has sent its stop (a gloo receive cannot be polled: its ``is_completed`` stays false, hence a thread)."""
    active, trainer = list(clients), None
    try:
        while active:
            for trainer in list(active):
                message = receive(bridge, trainer)
                inbox.put((trainer, message))
                if message[0] == "stop":
                    active.remove(trainer)
    except BaseException as exc:  # raised by ``serve``
        inbox.put((trainer, exc))


def _send_finished(worker: RolloutWorker, outbox: Outbox, rank: int) -> None:
    """Send each job the worker finished to its trainer rank."""
    for result in worker.poll():
        trainer, tag = result.tag
        batch, error = to_device(result.batch, torch.device("cpu")), None
        if result.error is not None:  # handed to the trainer rank, whose ``wait`` raises it
            error = RuntimeError(f"rollout rank {rank}: {result.error!r}")
        outbox.send(WorkerResult(tag=tag, version=result.version, batch=batch, error=error), trainer)


def to_device(batch, device: torch.device):
    """``batch`` with its tensors on ``device`` (it travels pickled, on the CPU, over the gloo bridge)."""
    if batch is None or batch.prompt_ids.device == device:
        return batch
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.init}
    moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
    moved["extras"] = {k: v.to(device) for k, v in batch.extras.items()}
    return type(batch)(**moved)
