"""The engine side of ``hpa serve``: queued requests run through ``KLGuard.generate`` in engine batches
(main thread, the only code that touches the models).

Each round takes what waits (up to ``serve.max_batch_size`` responses; an idle engine waits
``serve.batch_wait_ms`` for company) and runs one group of requests with equal sampling parameters. A
request with more responses than a batch runs in slices of at most ``max_batch_size`` rows; requests
that have not started go before its next slice, so they interleave with it. A request with a ``seed``
runs alone (its slices seeded ``seed + first row``), so the seed reproduces it whatever else is served.
After ``stop_at``'s deadline the engine stops between decode steps and every request left gets a 503.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import time
from typing import Any, List, Optional, Tuple

from hpa.engine.forward import response_top_log_probs
from hpa.rollout.base import GenerationStopped

from .errors import APIError, logger


@dataclasses.dataclass
class Pending:
    """One request's work: ``n`` responses for each prompt (rows ``[p0 x n, p1 x n, ...]``)."""

    prompts: List[List[int]]
    n: int
    params: Any  # SamplingParams with n=1; its seed is the request's when ``seeded``
    seeded: bool
    top_logprobs: Optional[int]  # None: no log-probs; k >= 0: the sampled token's and the k most likely
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    cancelled: bool = False  # the client went away: nothing more is run for it
    rows: List["Row"] = dataclasses.field(default_factory=list)  # the responses done so far

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * self.n

    def key(self):
        """Requests with equal keys share an engine call."""
        if self.seeded and not self.params.greedy:
            return ("seeded", id(self))
        return dataclasses.replace(self.params, seed=0)


@dataclasses.dataclass
class Row:
    """One response: its token ids (masked in, EOS dropped), why it ended, the guard's verdict and, when
    asked for, log-probs at temperature 1 (the policy's own distribution, as the guard's KL)."""

    token_ids: List[int]
    finish_reason: str
    kl: Optional[float]
    regenerated: bool
    logprobs: Optional[List[float]] = None
    top_logprobs: Optional[List[List[tuple]]] = None  # per token: [(token id, log-prob)] most likely first


Slice = Tuple[Pending, int, int]  # a request's rows [start, stop)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down: this request was cut at serve.drain_timeout_s; retry "
                         "on another replica", code="shutting_down")


class Scheduler:
    """Runs queued ``Pending`` requests in engine batches (see the module docstring)."""

    def __init__(self, serve_cfg, metrics, *, seed: int = 0):
        self.cfg, self.metrics = serve_cfg, metrics
        self.queue: "queue.Queue[Pending]" = queue.Queue()
        self.guard = self.tokenizer = None
        self.vocab_size = 0
        self.deadline: Optional[float] = None  # time.monotonic() at which the engine stops
        self._seed = seed
        self._carry: List[Pending] = []  # taken from the queue and not finished

    def attach(self, guard, tokenizer) -> None:
        self.guard, self.tokenizer = guard, tokenizer
        self.vocab_size = tokenizer.vocab_size
        guard.engine.should_stop = self.stopping

    def submit(self, pending: Pending) -> concurrent.futures.Future:
        self.queue.put(pending)
        return pending.future

    def stop_at(self, deadline: float) -> None:
        self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)

    def stopping(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _take(self, timeout: float) -> List[Pending]:
        """What waits (at most ``max_batch_size`` rows besides the carried requests); an idle engine
        waits ``batch_wait_ms`` for more after the first arrival."""
        taken = [p for p in self._carry if not p.cancelled and not p.future.done()]
        rows = sum(p.num_rows for p in taken if not p.rows)  # a started request leaves room for new ones
        self._carry = []
        if not taken:
            try:
                first = self.queue.get(timeout=timeout)
            except queue.Empty:
                return []
            taken, rows = [first], first.num_rows
            deadline = time.monotonic() + self.cfg.batch_wait_ms / 1000.0
        else:
            deadline = time.monotonic()
        while rows < self.cfg.max_batch_size:
            try:
                nxt = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            taken.append(nxt)
            rows += nxt.num_rows
        return taken

    def _group(self, taken: List[Pending]) -> List[Slice]:
        """The first request's group (its key, up to the row budget); the rest is carried."""
        taken = sorted(taken, key=lambda p: len(p.rows) > 0)  # not started first: they interleave with slices
        key, budget, group = taken[0].key(), self.cfg.max_batch_size, []
        for p in taken:
            if budget > 0 and p.key() == key:
                start = len(p.rows)
                stop = min(p.num_rows, start + budget)
                group.append((p, start, stop))
                budget -= stop - start
                if stop < p.num_rows:
                    self._carry.append(p)
            else:
                self._carry.append(p)
        return group

    def step(self, timeout: float = 0.1) -> None:
        """One round (see the module docstring)."""
        taken = [p for p in self._take(timeout) if not p.cancelled]
        if taken and self.stopping():
            self._fail(taken, shutting_down())
            return
        if not taken:
            return
        group = self._group(taken)
        try:
            results = self._run(group)
        except GenerationStopped:
            self._fail([p for p, _, _ in group], shutting_down())
            return
        except Exception as exc:  # one failing batch must not stop the server
            logger.exception("hpa serve: a batch of %d request(s) failed", len(group))
            self._fail([p for p, _, _ in group], exc)
            return
        for (p, _, _), rows in zip(group, results):
            p.rows.extend(rows)
            if len(p.rows) == p.num_rows and not p.future.done():
                p.future.set_result(p.rows)

    def _fail(self, pendings: List[Pending], exc: Exception) -> None:
        for p in pendings:
            if not p.future.done():
                p.future.set_exception(exc)

    def _run(self, group: List[Slice]) -> List[List[Row]]:
        prompts = [p.prompts[j // p.n] for p, start, stop in group for j in range(start, stop)]
        first, start = group[0][0], group[0][1]
        params = first.params
        if first.seeded:
            params = dataclasses.replace(params, seed=params.seed + start)
        else:
            self._seed += 1  # fresh samples for every unseeded batch
            params = dataclasses.replace(params, seed=self._seed)
        self.metrics.batch_rows.observe(len(prompts))
        out = self.guard.generate(prompts, params)
        want = [p.top_logprobs for p, start, stop in group for _ in range(start, stop)]
        rows = self._rows(out, want)
        results, at = [], 0
        for _, start, stop in group:
            results.append(rows[at:at + stop - start])
            at += stop - start
        return results

    def _rows(self, out, want: List[Optional[int]]) -> List[Row]:
        """The guard's responses as ``Row``s, with log-probs where ``want`` asks for them."""
        batch, eos = out.batch, self.tokenizer.eos_id
        lp = None
        if any(k is not None for k in want):
            lp = self._logprobs(batch, max(k for k in want if k is not None))
        rows: List[Row] = []
        for i, (ids, mask) in enumerate(zip(batch.response_ids.tolist(), batch.response_mask.tolist())):
            keep = [j for j, (t, m) in enumerate(zip(ids, mask)) if m and t != eos]
            kl = float(out.kl[i])
            row = Row([ids[j] for j in keep], batch.finish_reasons[i], None if kl != kl else kl,
                      bool(out.regenerated[i]))
            if want[i] is not None:
                row.logprobs = [float(lp["log_probs"][i, j]) for j in keep]
                row.top_logprobs = [list(zip(lp["top_ids"][i, j, :want[i]].tolist(),
                                             lp["top_values"][i, j, :want[i]].tolist())) for j in keep]
            rows.append(row)
            self.metrics.regenerations.inc(int(row.regenerated))
            if row.kl is not None:
                self.metrics.kl.observe(row.kl)
        return rows

    def _logprobs(self, batch, k: int):
        """At temperature 1 (the policy's own distribution), at the response positions, through the
        engine's forward (its host-to-device point), ``guard.batching.micro_batch_size`` rows at a time."""
        g = self.guard
        return response_top_log_probs(g.policy, batch, g.groups, batching=g.batching,
                                      vocab_size=self.vocab_size, k=max(k, 1))
