"""A rollout worker for asynchronous rollouts: samples from its own copy of the policy weights in a background
thread of the trainer process (colocated placement), so the trainer can update its weights meanwhile; a rollout
rank of a disaggregated run samples in one too (``hpa/rollout/remote.py``'s ``serve``, which receives the pushes
into the copy through ``write_weights``).

``submit`` queues a job, ``poll`` / ``wait`` hand back finished ones tagged with the policy version whose
weights sampled them, ``push_weights`` brings a new version in. A push waits for the jobs in flight, so each
job samples with the weights of the version at which it was submitted.

Partial rollouts (``partial=True``, ``rollout.partial``; an engine with ``can_resume``): a push does not wait. It
asks the job in flight to stop before its next decode step (``RolloutEngine.resume``'s ``stop``), copies the
weights while the job's rows wait as a ``PartialRollout``, and the job continues them with the new weights. The
finished batch carries ``extras["token_versions"]`` ``[b, r]`` int64 (``hpa.rollout.queue.TOKEN_VERSIONS``): the
version whose weights sampled each token, those before the push the old one, those after the new one; the
queue's lag counts the oldest (``rollout_entry``). The result's ``version`` is the oldest of them.

After the copy the worker reports checksums of a watched set of tensors; ``check_delivery`` compares them with the
trainer's and raises ``WeightPushError`` naming what did not arrive (a push that silently fails looks like
staleness otherwise).

torch ops release the GIL, so generation overlaps the trainer's update on CPU; on CUDA the worker decodes on
its own stream (not run on a GPU so far).
"""

from __future__ import annotations

import dataclasses
import queue as queue_lib
import threading
import weakref
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from hpa.config.errors import ConfigError
from hpa.rollout.base import PartialRollout, RolloutBatch, RolloutEngine, SamplingParams
from hpa.rollout.queue import TOKEN_VERSIONS

# watched for the delivery check: the first, middle and last parameter (embedding, a middle layer, the head
# side); each checksum reads the whole tensor, so a partial copy of one shows too
NUM_WATCHED = 3


class WeightPushError(RuntimeError):
    """A weight push did not change the worker's copy of the tensors the trainer changed."""


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """A finished job: ``batch`` (or the ``error`` it raised), sampled by policy ``version`` (a partial rollout
    that continued across pushes: the oldest version of its tokens, each in ``batch.extras["token_versions"]``)."""

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


def token_versions(segments: List[Tuple[int, int]], shape: Tuple[int, int]) -> torch.Tensor:
    """``[b, r]`` int64: the version of each decode step's tokens, from ``segments`` ``(first step, version)`` in
    order (a segment that decoded nothing is overridden by the next, which starts at the same step)."""
    versions = torch.empty(shape, dtype=torch.int64)
    for first, version in segments:
        versions[:, first:] = version
    return versions


class _Jobs:
    """What the worker's thread shares with the trainer side (the thread holds no reference to the
    ``RolloutWorker``, so a worker that is no longer used is collected and its thread stopped)."""

    def __init__(self, engine: RolloutEngine, stream, *, version: int, partial: bool):
        self.engine, self.stream, self.partial = engine, stream, partial
        self.queue: "queue_lib.Queue" = queue_lib.Queue()
        self.done: Dict[object, WorkerResult] = {}
        self.cond = threading.Condition()
        self.pending = 0  # jobs submitted and not finished
        self.version = version  # of the weights now (partial rollouts stamp their steps with it)
        self.stop = threading.Event()  # partial: a push asks the job in flight to stop before its next step
        self.paused = False  # partial: the job in flight stopped and waits for the push to end

    def serve(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            tag, prompts, params, version = job
            try:
                if self.partial:
                    batch, version = self.generate_partial(prompts, params)
                else:
                    batch = self.run(lambda: self.engine.generate(prompts, params))
                error = None
            except BaseException as exc:  # handed to the trainer by ``wait``
                batch, error = None, exc
            with self.cond:
                self.done[tag] = WorkerResult(tag=tag, version=version, batch=batch, error=error)
                self.pending -= 1
                self.cond.notify_all()

    def generate_partial(self, prompts, params: SamplingParams) -> Tuple[RolloutBatch, int]:
        """The job's batch, continued across the pushes that came while it ran, and its oldest version."""
        work, segments = PartialRollout.start(prompts, params), []
        while True:
            with self.cond:
                segments.append((work.steps, self.version))  # no push copies while the segment decodes
            out = self.run(lambda: self.engine.resume(work, stop=self.stop.is_set))
            if isinstance(out, RolloutBatch):
                break
            work = out
            with self.cond:  # the push copies the weights now
                self.paused = True
                self.cond.notify_all()
                self.cond.wait_for(lambda: not self.stop.is_set())
                self.paused = False
        versions = token_versions(segments, tuple(out.log_probs.shape))
        out.set(TOKEN_VERSIONS, versions)
        return out, int(versions.min()) if versions.numel() else segments[-1][1]

    def run(self, generate):
        """``generate()`` without gradients, on the worker's stream where it has one."""
        with torch.no_grad():
            if self.stream is None:
                return generate()
            with torch.cuda.stream(self.stream):
                out = generate()
            self.stream.synchronize()
            if not isinstance(out, RolloutBatch):  # a PartialRollout's tensors are on the CPU
                return out
            # made on the worker's stream, used and freed on the trainer's: the allocator must wait for the latter
            trainer_stream = torch.cuda.default_stream(self.stream.device)
            for value in (out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
                          out.log_probs, out.group_ids, *out.extras.values()):
                if value.is_cuda:
                    value.record_stream(trainer_stream)
            return out


def _stop(jobs: _Jobs, thread: threading.Thread) -> None:
    jobs.queue.put(None)
    if thread is not threading.current_thread():
        thread.join()


class RolloutWorker:
    """Samples with ``engine`` (which must own its weights: ``MegatronRolloutEngine.detached_copy()``) in a
    daemon thread, one job at a time, in submission order. A job samples with the weights of the version at
    which it was submitted (a push waits for the jobs in flight), or with ``partial``, each token with the
    weights of the version current when it was decoded (a push stops the job in flight between two decode steps;
    see the module docstring). The thread stops when the worker is collected, and at exit after the job in flight.

    Args:
        engine: the worker's engine over its own copy of the policy.
        module: that copy (the tensors ``push_weights`` writes).
        version: the policy version of the copy's weights now.
        partial: a push stops the job in flight and continues its rows with the new weights (``rollout.partial``);
            the engine must be able to (``can_resume``).

    Raises:
        ConfigError: ``partial`` with an engine that cannot resume a row (naming ``rollout.partial``).
    """

    def __init__(self, engine: RolloutEngine, module: torch.nn.Module, *, version: int = 0, partial: bool = False):
        if partial and not engine.can_resume:
            raise ConfigError("rollout.partial", f"the {engine.name!r} rollout engine cannot stop a row at a weight "
                                                 f"push and resume it; set rollout.partial=false or "
                                                 f"rollout.engine=megatron")
        self.engine, self.module, self.partial = engine, module, bool(partial)
        self.version = int(version)
        self._params = dict(module.named_parameters())
        self.watched = watched_names(list(self._params))
        device = next(iter(self._params.values())).device if self._params else torch.device("cpu")
        self._jobs = _Jobs(engine, torch.cuda.Stream(device=device) if device.type == "cuda" else None,
                           version=self.version, partial=self.partial)
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
        """Copy the trainer's tensors of policy ``version`` into the worker's copy, after the jobs in flight (with
        ``partial``: once the job in flight stopped between two decode steps; it continues after the copy);
        returns the worker's checksums of its watched tensors after the copy (``check_delivery`` reads them).

        Raises:
            KeyError: a name that the worker's copy does not have.
        """
        return self.write_weights(version, lambda params: self._copy_in(named_tensors))

    def write_weights(self, version: int, write: Callable[[Dict[str, torch.Tensor]], None]) -> Dict[str, float]:
        """``push_weights`` with the copy done by ``write(params)``, which writes policy ``version``'s weights into
        the worker's copy (its named parameters, in place; a rollout rank receives a broadcast into them), when
        ``push_weights`` would copy; returns the checksums."""
        jobs = self._jobs
        if self.partial:
            with jobs.cond:
                jobs.stop.set()
                jobs.cond.wait_for(lambda: jobs.pending == 0 or jobs.paused)
        else:
            self.drain()
        try:
            with torch.no_grad():
                write(self._params)
            if jobs.stream is not None:  # the copy ran on the trainer's stream; the next job reads it on its own
                torch.cuda.current_stream(jobs.stream.device).synchronize()
            self.version = int(version)
        finally:
            with jobs.cond:
                jobs.version = self.version
                jobs.stop.clear()
                jobs.cond.notify_all()
        return self.checksums()

    def _copy_in(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in named_tensors.items():
            self._params[name].copy_(tensor)

    def checksums(self) -> Dict[str, float]:
        """The worker's checksums of its watched tensors."""
        return {name: checksum(self._params[name]) for name in self.watched}
