"""A rollout worker for asynchronous rollouts: samples from its own copy of the policy weights in a background
thread of the trainer process (colocated placement), so the trainer can update its weights meanwhile.

``submit`` queues a job, ``poll`` / ``wait`` hand back finished ones tagged with the policy version whose
weights sampled them, ``push_weights`` brings a new version in. A push waits for the jobs in flight, so each
job samples with the weights of the version at which it was submitted. After the copy the worker reports
checksums of a watched set of tensors; ``check_delivery`` compares them with the trainer's and raises
``WeightPushError`` naming what did not arrive (a push that silently fails looks like staleness otherwise).

torch ops release the GIL, so generation overlaps the trainer's update on CPU; on CUDA the worker decodes on
its own stream (not run on a GPU so far).
"""

from __future__ import annotations

import dataclasses
import queue as queue_lib
import threading
import weakref
from typing import Dict, List, Mapping, Optional

import torch

from hpa.rollout.base import RolloutBatch, RolloutEngine, SamplingParams

# watched for the delivery check: the first, middle and last parameter (embedding, a middle layer, the head
# side); each checksum reads the whole tensor, so a partial copy of one shows too
NUM_WATCHED = 3


class WeightPushError(RuntimeError):
    """A weight push did not change the worker's copy of the tensors the trainer changed."""


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """A finished job: ``batch`` (or the ``error`` it raised), sampled by policy ``version``."""

    tag: object
    version: int
    batch: Optional[RolloutBatch]
    error: Optional[BaseException] = None


def checksum(tensor: torch.Tensor) -> float:
    """A float64 fingerprint of ``tensor``'s values and their order (a sum, and a sum weighted by position
    mod 7, so a permutation shows); equal bits give equal sums."""
    flat = tensor.detach().reshape(-1).double()
    weights = (torch.arange(flat.numel(), device=flat.device) % 7 + 1).double()
    return float(flat.sum()) + 1e-3 * float((flat * weights).sum())


def watched_names(names: List[str]) -> List[str]:
    """The tensors the delivery check watches, among ``names`` (in the model's order)."""
    if len(names) <= NUM_WATCHED:
        return list(names)
    return [names[0], names[len(names) // 2], names[-1]]


def check_delivery(version: int, sent: Mapping[str, float], received: Mapping[str, float]) -> None:
    """Raise ``WeightPushError`` naming each watched tensor whose checksum on the worker after the push of
    ``version`` differs from the trainer's (``sent``)."""
    missing = [name for name in sent if received.get(name) != sent[name]]
    if missing:
        raise WeightPushError(f"the weight push of policy version {version} did not reach the rollout worker: "
                              f"{', '.join(missing)} differ from the trainer's after the push; the worker would "
                              f"sample from stale weights")


class _Jobs:
    """What the worker's thread shares with the trainer side (the thread holds no reference to the
    ``RolloutWorker``, so a worker that is no longer used is collected and its thread stopped)."""

    def __init__(self, engine: RolloutEngine, stream):
        self.engine, self.stream = engine, stream
        self.queue: "queue_lib.Queue" = queue_lib.Queue()
        self.done: Dict[object, WorkerResult] = {}
        self.cond = threading.Condition()
        self.pending = 0  # jobs submitted and not finished

    def serve(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            tag, prompts, params, version = job
            try:
                batch, error = self.generate(prompts, params), None
            except BaseException as exc:  # handed to the trainer by ``wait``
                batch, error = None, exc
            with self.cond:
                self.done[tag] = WorkerResult(tag=tag, version=version, batch=batch, error=error)
                self.pending -= 1
                self.cond.notify_all()

    def generate(self, prompts, params: SamplingParams) -> RolloutBatch:
        with torch.no_grad():
            if self.stream is None:
                return self.engine.generate(prompts, params)
            with torch.cuda.stream(self.stream):
                batch = self.engine.generate(prompts, params)
            self.stream.synchronize()
            # made on the worker's stream, used and freed on the trainer's: the allocator must wait for the latter
            trainer_stream = torch.cuda.default_stream(self.stream.device)
            for value in (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask,
                          batch.log_probs, batch.group_ids, *batch.extras.values()):
                if value.is_cuda:
                    value.record_stream(trainer_stream)
            return batch


def _stop(jobs: _Jobs, thread: threading.Thread) -> None:
    jobs.queue.put(None)
    if thread is not threading.current_thread():
        thread.join()


class RolloutWorker:
    """Samples with ``engine`` (which must own its weights: ``MegatronRolloutEngine.detached_copy()``) in a
    daemon thread, one job at a time, in submission order. A job samples with the weights of the version at
    which it was submitted (a push waits for the jobs in flight). The thread stops when the worker is
    collected, and at exit after the job in flight.

    Args:
        engine: the worker's engine over its own copy of the policy.
        module: that copy (the tensors ``push_weights`` writes).
        version: the policy version of the copy's weights now.
    """

    def __init__(self, engine: RolloutEngine, module: torch.nn.Module, *, version: int = 0):
        self.engine, self.module = engine, module
        self.version = int(version)
        self._params = dict(module.named_parameters())
        self.watched = watched_names(list(self._params))
        device = next(iter(self._params.values())).device if self._params else torch.device("cpu")
        self._jobs = _Jobs(engine, torch.cuda.Stream(device=device) if device.type == "cuda" else None)
        thread = threading.Thread(target=self._jobs.serve, name="hpa-rollout-worker", daemon=True)
        thread.start()
        weakref.finalize(self, _stop, self._jobs, thread)

    # ---------------------------------------------------------------------------------------------- trainer side
    def submit(self, prompts, params: SamplingParams, tag) -> None:
        """Queue a job: ``params.n`` responses to each of ``prompts`` (token-id lists), handed back under ``tag``."""
        jobs = self._jobs
        with jobs.cond:
            jobs.pending += 1
        jobs.queue.put((tag, list(prompts), params, self.version))

    def poll(self) -> List[WorkerResult]:
        """The jobs finished since the last ``poll``/``wait`` (submission order), without waiting."""
        jobs = self._jobs
        with jobs.cond:
            results, jobs.done = list(jobs.done.values()), {}
        return results

    def wait(self, tag) -> WorkerResult:
        """Block until the job ``tag`` has finished and return it (raising the error it raised)."""
        jobs = self._jobs
        with jobs.cond:
            jobs.cond.wait_for(lambda: tag in jobs.done)
            result = jobs.done.pop(tag)
        if result.error is not None:
            raise result.error
        return result

    def drain(self) -> None:
        """Block until no job is in flight (finished ones stay for ``poll``/``wait``)."""
        jobs = self._jobs
        with jobs.cond:
            jobs.cond.wait_for(lambda: jobs.pending == 0)

    def push_weights(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> Dict[str, float]:
        """Copy the trainer's tensors of policy ``version`` into the worker's copy, after the jobs in flight;
        returns the worker's checksums of its watched tensors after the copy (``check_delivery`` reads them).

        Raises:
            KeyError: a name that the worker's copy does not have.
        """
        self.drain()
        self._copy_in(named_tensors)
        if self._jobs.stream is not None:  # the copy ran on the trainer's stream; the next job reads it on its own
            torch.cuda.current_stream(self._jobs.stream.device).synchronize()
        self.version = int(version)
        return self.checksums()

    def _copy_in(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                self._params[name].copy_(tensor)

    def checksums(self) -> Dict[str, float]:
        """The worker's checksums of its watched tensors."""
        return {name: checksum(self._params[name]) for name in self.watched}
