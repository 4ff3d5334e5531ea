"""``hpa serve``: a policy checkpoint behind an OpenAI-compatible HTTP endpoint, with the KL guard.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``
(503 while the checkpoint loads), ``GET /metrics`` (Prometheus text). Every response goes through
``hpa.generate.KLGuard``, the guard of ``hpa generate``: its KL to the reference is scored and a response
above ``serve.kl_threshold`` is sampled again at ``serve.guard_temperature``. Each choice carries
``"hpa": {"kl": ..., "regenerated": ...}``.

Threads: uvicorn (FastAPI) runs the HTTP side in a thread of its own; the main thread loads the models
and then runs ``Scheduler``, the only code that touches them. Requests wait in a queue; the scheduler
takes what has arrived (up to ``serve.max_batch_size`` responses, waiting ``serve.batch_wait_ms`` when
it was idle) and samples every group of requests with the same sampling parameters in one engine call.
A request with a ``seed`` runs alone, so the seed reproduces it whatever else is being served.

Streaming sends the response as server-sent events once the guard has decided on it: a response that
may be replaced cannot be sent before its KL is known. SIGTERM stops accepting connections, lets the
in-flight requests finish (``serve.drain_timeout_s`` at most) and exits 0.

Layering note: a command (cli level); it imports ``hpa.generate`` (trainer level) and below.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Union

try:
    import fastapi
    import prometheus_client
    import uvicorn
    from fastapi import Request  # at module level: FastAPI resolves the handlers' annotations here
    from pydantic import BaseModel, ConfigDict
except ModuleNotFoundError as exc:  # the serve extra is not installed
    raise ModuleNotFoundError(f"hpa serve needs {exc.name}: pip install -e '.[serve]' (or 'hpa[serve]')") from exc

logger = logging.getLogger("hpa.serve")

KL_BUCKETS = (-0.5, -0.1, -0.05, 0.0, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, float("inf"))
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
MAX_LOGPROBS = 5  # the completions API's limit
MAX_TOP_LOGPROBS = 20  # the chat API's limit
# sampling parameters the OpenAI API has and hpa does not implement: refused unless left at their default
UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "logit_bias": (None, {}),
               "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "tools": (None, []),
               "response_format": (None, {"type": "text"})}


# ------------------------------------------------------------------------------------------------
# Request bodies (strict: a field of the wrong type is a 400, not a silent coercion)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[Dict[str, Any]] = None


class CompletionRequest(_Request):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    logprobs: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: Union[str, List[Dict[str, Any]]]


class ChatRequest(_Request):
    messages: List[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None


class APIError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> Dict[str, Any]:
        kind = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}.get(
            self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# ------------------------------------------------------------------------------------------------
# The scheduler: batches queued requests into engine calls (main thread)


@dataclasses.dataclass
class Pending:
    """One request's work: ``n`` responses for each prompt (rows ``[p0 x n, p1 x n, ...]``)."""

    prompts: List[List[int]]
    n: int
    params: Any  # SamplingParams with n=1; its seed is the request's when ``seeded``
    seeded: bool
    top_logprobs: Optional[int]  # None: no log-probs; k >= 0: the sampled token's and the k most likely
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    cancelled: bool = False  # the client went away: skip it if it has not started

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


class Scheduler:
    """Runs queued ``Pending`` requests through ``KLGuard.generate`` in batches (see the module docstring)."""

    def __init__(self, serve_cfg, metrics: "Metrics", *, seed: int = 0):
        self.cfg, self.metrics = serve_cfg, metrics
        self.queue: "queue.Queue[Pending]" = queue.Queue()
        self.guard = self.tokenizer = self.policy = None
        self.vocab_size = 0
        self._seed = seed
        self._carry: List[Pending] = []  # taken from the queue but not run in the last round

    def attach(self, guard, tokenizer, policy) -> None:
        self.guard, self.tokenizer, self.policy = guard, tokenizer, policy
        self.vocab_size = tokenizer.vocab_size

    def submit(self, pending: Pending) -> concurrent.futures.Future:
        self.queue.put(pending)
        return pending.future

    def _take(self, timeout: float) -> List[Pending]:
        """What waits (at most ``max_batch_size`` rows, or one bigger request); an idle engine waits
        ``batch_wait_ms`` for more after the first arrival."""
        taken, rows = list(self._carry), sum(p.num_rows for p in self._carry)
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

    def step(self, timeout: float = 0.1) -> None:
        """One round: the first waiting request's group (requests with its key, up to the row budget) runs;
        the others wait for the next round."""
        taken = [p for p in self._take(timeout) if not p.cancelled]
        if not taken:
            return
        key, group, rows = taken[0].key(), [], 0
        for p in taken:
            if p.key() == key and (not group or rows + p.num_rows <= self.cfg.max_batch_size):
                group.append(p)
                rows += p.num_rows
            else:
                self._carry.append(p)
        try:
            results = self._run(group)
        except Exception as exc:  # one failing batch must not stop the server
            logger.exception("hpa serve: a batch of %d request(s) failed", len(group))
            for p in group:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        for p, rows_of_p in zip(group, results):
            if not p.future.done():
                p.future.set_result(rows_of_p)

    def _run(self, group: List[Pending]) -> List[List[Row]]:
        prompts = [prompt for p in group for prompt in p.prompts for _ in range(p.n)]
        params = group[0].params
        if not group[0].seeded:
            self._seed += 1  # fresh samples for every unseeded batch
            params = dataclasses.replace(params, seed=self._seed)
        self.metrics.batch_rows.observe(len(prompts))
        out = self.guard.generate(prompts, params)
        batch, eos = out.batch, self.tokenizer.eos_id
        want = [k for p in group for k in [p.top_logprobs] * p.num_rows]
        lp = top = None
        if any(k is not None for k in want):
            lp, top = self._logprobs(batch, max(k for k in want if k is not None))
        rows: List[Row] = []
        for i, (ids, mask) in enumerate(zip(batch.response_ids.tolist(), batch.response_mask.tolist())):
            keep = [j for j, (t, m) in enumerate(zip(ids, mask)) if m and t != eos]
            kl = float(out.kl[i])
            row = Row([ids[j] for j in keep], batch.finish_reasons[i], None if kl != kl else kl,
                      bool(out.regenerated[i]))
            if want[i] is not None:
                row.logprobs = [float(lp[i, j]) for j in keep]
                row.top_logprobs = [[(int(t), float(v)) for t, v in zip(top[1][i, j, :want[i]].tolist(),
                                                                        top[0][i, j, :want[i]].tolist())]
                                    for j in keep]
            rows.append(row)
            self.metrics.regenerations.inc(int(row.regenerated))
            if row.kl is not None:
                self.metrics.kl.observe(row.kl)
        results, start = [], 0
        for p in group:
            results.append(rows[start:start + p.num_rows])
            start += p.num_rows
        return results

    def _logprobs(self, batch, k: int):
        """``[b, r]`` log-probs of the sampled tokens and the ``k`` most likely ``(values, ids)`` ``[b, r, k]``,
        at temperature 1, from one forward of the policy (one process: the whole model is here)."""
        import torch

        ts = batch.sequences
        with torch.no_grad():
            logits = self.policy(ts.input_ids, ts.position_ids, None)[..., :self.vocab_size].float()  # [b, s, v]
        logp = torch.log_softmax(logits, dim=-1)  # [b, s, v]
        sampled = ts.to_response(logp.gather(2, ts.labels.unsqueeze(2))[..., 0])  # [b, r]
        values, ids = logp.topk(max(k, 1), dim=-1)  # [b, s, k]
        return sampled, (ts.to_response(values), ts.to_response(ids))  # [b, r], ([b, r, k], [b, r, k])


# ------------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    """Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("hpa_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("hpa_prompt_tokens", "prompt tokens of served requests", registry=r)
        self.completion_tokens = Counter("hpa_completion_tokens", "completion tokens returned", registry=r)
        self.latency = Histogram("hpa_request_latency_seconds", "time from request to last byte",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.regenerations = Counter("hpa_guard_regenerations", "responses the KL guard sampled again",
                                     registry=r)
        self.kl = Histogram("hpa_response_kl", "KL to the reference of returned responses (k1, per token)",
                            buckets=KL_BUCKETS, registry=r)
        self.in_flight = Gauge("hpa_requests_in_flight", "requests accepted and not finished", registry=r)
        self.batch_rows = Histogram("hpa_batch_rows", "responses sampled per engine call",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, float("inf")), registry=r)


# ------------------------------------------------------------------------------------------------
# The HTTP side


@dataclasses.dataclass
class ServeState:
    """What the HTTP handlers share with the main thread."""

    cfg: Any  # the root Config
    scheduler: Scheduler
    metrics: Metrics
    model_name: str
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    tokenizer: Any = None
    context_length: int = 0
    default_max_tokens: int = 16
    workdir: Any = None


def _check_unsupported(req: _Request) -> None:
    extra = req.model_extra or {}
    for name, defaults in UNSUPPORTED.items():
        if name in extra and extra[name] not in defaults:
            raise APIError(400, f"{name}={extra[name]!r} is not supported by hpa serve", param=name,
                           code="unsupported_parameter")


def _sampling(state: ServeState, req: _Request, prompts: List[List[int]], max_tokens: Optional[int]):
    """``SamplingParams`` (n=1) of a request, or an ``APIError`` naming the field."""
    from hpa.rollout import SamplingParams

    _check_unsupported(req)
    if req.n < 1:
        raise APIError(400, f"n must be >= 1, got {req.n}", param="n")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    longest = max(len(p) for p in prompts)
    room = state.context_length - longest
    if room <= 0:
        raise APIError(400, f"this model's maximum context length is {state.context_length} tokens, and the "
                            f"prompt has {longest}: shorten the prompt", param="prompt",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(state.default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(400, f"this model's maximum context length is {state.context_length} tokens; the prompt "
                            f"has {longest} and max_tokens asks for {max_tokens} more: lower max_tokens to "
                            f"{room} or shorten the prompt", param="max_tokens", code="context_length_exceeded")
    for p in prompts:
        bad = [t for t in p if not 0 <= t < state.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {state.tokenizer.vocab_size})",
                           param="prompt")
    return SamplingParams(n=1, temperature=temperature, top_p=top_p, max_new_tokens=max_tokens,
                          seed=req.seed if req.seed is not None else 0)


def _stops(req: _Request) -> List[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "stop takes at most 4 non-empty strings", param="stop")
    return stop


def _finish(tokenizer, row: Row, stops: List[str]):
    """``(text, the row's tokens kept, finish reason)`` with the first stop string and what follows cut off
    (tokens up to the one where it begins are kept)."""
    text = tokenizer.decode(row.token_ids)
    cuts = [text.find(s) for s in stops if s in text]
    if not cuts:
        return text, len(row.token_ids), row.finish_reason
    cut = min(cuts)
    kept = next(k for k in range(1, len(row.token_ids) + 1) if len(tokenizer.decode(row.token_ids[:k])) > cut)
    return text[:cut], kept, "stop"


def _pieces(tokenizer, ids: List[int]) -> List[str]:
    """Each token's text, as the increments of the prefix decodes (so they join to the whole text)."""
    out, previous = [], ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        out.append(text[len(previous):] if text.startswith(previous) else tokenizer.decode([ids[k - 1]]))
        previous = text
    return out


async def _wait(state: ServeState, pending: Pending, request) -> List[Row]:
    """The request's rows; a client that goes away while it waits gives its place up."""
    waiting = asyncio.wrap_future(state.scheduler.submit(pending))
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=0.2)
        if done:
            return waiting.result()
        if await request.is_disconnected():
            pending.cancelled = True
            raise asyncio.CancelledError("client disconnected")


def _hpa_field(row: Row) -> Dict[str, Any]:
    return {"kl": row.kl, "regenerated": row.regenerated}


def _completion_logprobs(tokenizer, row: Row, kept: int, pieces: List[str]):
    if row.logprobs is None:
        return None
    offsets, at = [], 0
    for piece in pieces[:kept]:
        offsets.append(at)
        at += len(piece)
    top = [{tokenizer.decode([t]): v for t, v in alts} for alts in row.top_logprobs[:kept]]
    return {"tokens": pieces[:kept], "token_logprobs": row.logprobs[:kept],
            "top_logprobs": top if any(row.top_logprobs[:kept]) else None, "text_offset": offsets}


def _chat_logprobs(tokenizer, row: Row, kept: int, pieces: List[str]):
    if row.logprobs is None:
        return None

    def entry(token: str, value: float):
        return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8"))}

    return {"content": [dict(entry(pieces[j], row.logprobs[j]),
                             top_logprobs=[entry(tokenizer.decode([t]), v) for t, v in row.top_logprobs[j]])
                        for j in range(kept)]}


def build_app(state: ServeState):
    """The FastAPI application (handlers run on uvicorn's event loop; the models only in ``Scheduler``)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="hpa serve", docs_url=None, redoc_url=None)
    metrics, scheduler = state.metrics, state.scheduler

    def error_response(endpoint: str, exc: APIError) -> JSONResponse:
        metrics.requests.labels(endpoint, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(request.url.path, APIError(400, "the body is not valid JSON"))
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        what = f"{where or 'body'}: {first.get('msg', 'invalid')}"
        if "input" in first and where:
            what += f" (got {first['input']!r:.80})"
        return error_response(request.url.path, APIError(400, what, param=where))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    def check_ready(model: Optional[str] = None) -> None:
        if not state.ready.is_set():
            raise APIError(503, "the model is loading; retry shortly", code="loading")
        if model is not None and model != state.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        if not state.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(prometheus_client.generate_latest(metrics.registry),
                                 media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        check_ready()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "hpa"}]}

    async def serve(request: Request, req: _Request, endpoint: str, prompts: List[List[int]],
                    max_tokens: Optional[int], top_logprobs: Optional[int], chat: bool):
        params = _sampling(state, req, prompts, max_tokens)
        stops = _stops(req)
        pending = Pending(prompts=prompts, n=req.n, params=params, seeded=req.seed is not None,
                          top_logprobs=top_logprobs)
        started, tok = time.monotonic(), state.tokenizer
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        prompt_tokens = sum(len(p) for p in prompts)

        def choices(rows: List[Row]):
            out, completion_tokens = [], 0
            for index, row in enumerate(rows):
                text, kept, reason = _finish(tok, row, stops)
                pieces = _pieces(tok, row.token_ids)
                completion_tokens += kept
                out.append((index, text, kept, reason, pieces, row))
            return out, completion_tokens

        def usage(completion_tokens: int) -> Dict[str, int]:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}

        def done(status: str, completion_tokens: int = 0) -> None:
            metrics.requests.labels(endpoint, status).inc()
            metrics.latency.labels(endpoint).observe(time.monotonic() - started)
            if status == "200":
                metrics.prompt_tokens.inc(prompt_tokens)
                metrics.completion_tokens.inc(completion_tokens)

        if not req.stream:
            metrics.in_flight.inc()
            try:
                rows = await _wait(state, pending, request)
            except asyncio.CancelledError:
                done("499")
                raise
            except Exception as exc:
                done("500")
                return JSONResponse(APIError(500, f"generation failed: {exc}").body(), status_code=500)
            finally:
                metrics.in_flight.dec()
            made, completion_tokens = choices(rows)
            body_choices = []
            for index, text, kept, reason, pieces, row in made:
                if chat:
                    body_choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                         "logprobs": _chat_logprobs(tok, row, kept, pieces), "finish_reason": reason,
                                         "hpa": _hpa_field(row)})
                else:
                    body_choices.append({"index": index, "text": text,
                                         "logprobs": _completion_logprobs(tok, row, kept, pieces),
                                         "finish_reason": reason, "hpa": _hpa_field(row)})
            done("200", completion_tokens)
            return {"id": rid, "object": obj, "created": created, "model": state.model_name,
                    "choices": body_choices, "usage": usage(completion_tokens)}

        include_usage = bool((req.stream_options or {}).get("include_usage"))
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices_: List[Dict[str, Any]], **extra) -> str:
            return "data: " + json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                          "model": state.model_name, "choices": choices_, **extra}) + "\n\n"

        async def events():  # counted from its first step: a stream never started holds nothing
            status, completion_tokens = "499", 0
            metrics.in_flight.inc()
            try:
                try:
                    rows = await _wait(state, pending, request)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    status = "500"
                    yield "data: " + json.dumps(APIError(500, f"generation failed: {exc}").body()) + "\n\n"
                    return
                made, completion_tokens = choices(rows)
                for index, text, kept, reason, pieces, row in made:
                    if chat:
                        yield event([{"index": index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    for j in range(kept):
                        piece = pieces[j]
                        if len("".join(pieces[:j + 1])) > len(text):  # the token where a stop string begins
                            piece = piece[:max(0, len(text) - len("".join(pieces[:j])))]
                        one = dataclasses.replace(row, logprobs=row.logprobs[j:j + 1],
                                                  top_logprobs=row.top_logprobs[j:j + 1]) \
                            if row.logprobs is not None else row
                        if chat:
                            yield event([{"index": index, "delta": {"content": piece},
                                          "logprobs": _chat_logprobs(tok, one, 1, [pieces[j]]),
                                          "finish_reason": None}])
                        else:
                            yield event([{"index": index, "text": piece,
                                          "logprobs": _completion_logprobs(tok, one, 1, [pieces[j]]),
                                          "finish_reason": None}])
                    last = {"index": index, "logprobs": None, "finish_reason": reason, "hpa": _hpa_field(row)}
                    last.update({"delta": {}} if chat else {"text": ""})
                    yield event([last])
                if include_usage:
                    yield event([], usage=usage(completion_tokens))
                yield "data: [DONE]\n\n"
                status = "200"
            finally:
                pending.cancelled = True  # a client gone mid-stream: nothing more is done for it
                metrics.in_flight.dec()
                done(status, completion_tokens)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        check_ready(req.model)
        raw = req.prompt
        if isinstance(raw, str):
            texts = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            texts = [raw]
        else:
            texts = list(raw)
        if not texts:
            raise APIError(400, "prompt is empty", param="prompt")
        prompts = [state.tokenizer.encode(t) if isinstance(t, str) else list(t) for t in texts]
        if any(len(p) == 0 for p in prompts):
            raise APIError(400, "a prompt has no tokens", param="prompt")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", param="logprobs")
        return await serve(request, req, "/v1/completions", prompts, req.max_tokens, req.logprobs, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatRequest):
        check_ready(req.model)
        if not req.messages:
            raise APIError(400, "messages is empty", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if not isinstance(content, str):  # content parts: the text ones, joined
                if any(part.get("type") != "text" for part in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages.{i}.content")
                content = "".join(str(part.get("text", "")) for part in content)
            messages.append({"role": m.role, "content": content})
        prompt = state.tokenizer.encode(state.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        if not prompt:
            raise APIError(400, "the messages render to no tokens", param="messages")
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
            if not 0 <= top <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}",
                               param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await serve(request, req, "/v1/chat/completions", [prompt], max_tokens, top, chat=True)

    return app


# ------------------------------------------------------------------------------------------------
# The command


def _import_hf(cfg, groups, workdir: str):
    """An HF directory as ``model.policy_path`` or ``model.reference_path`` goes through the converter
    (``hpa convert hf-to-megatron``) into ``workdir``; the model section becomes the one derived from the
    policy's config.json."""
    from pathlib import Path

    from hpa.models.convert import import_hf_checkpoint

    m, paths, derived = cfg.model, {}, None
    for key in ("policy_path", "reference_path"):
        path = getattr(m, key)
        if not path or not (Path(path) / "config.json").is_file() or (Path(path) / "metadata.json").is_file():
            continue
        out = Path(workdir) / key
        logger.info("hpa serve: converting the HF checkpoint %s (model.%s) into %s", path, key, out)
        model = import_hf_checkpoint(path, out, cfg.parallel, groups, params_dtype=m.params_dtype,
                                     transformer_impl=m.transformer_impl)
        derived = derived if key == "reference_path" and derived is not None else model
        paths[key] = str(out)
    if not paths:
        return cfg
    model = dataclasses.replace(derived, **{"policy_path": m.policy_path, "reference_path": m.reference_path,
                                            "critic_path": m.critic_path, **paths})
    return dataclasses.replace(cfg, model=model)


def load_into(state: ServeState, cfg, groups) -> None:
    """Load the checkpoints and the engine (main thread), then open the doors."""
    import tempfile

    from hpa.generate import KLGuard, load_policy

    state.workdir = tempfile.TemporaryDirectory(prefix="hpa-serve-")  # converted HF checkpoints, if any
    cfg = _import_hf(cfg, groups, state.workdir.name)
    s = cfg.serve
    engine_kwargs = {"llm_kwargs": {"enable_prefix_caching": True}} if cfg.rollout.engine == "vllm" else None
    loaded = load_policy(cfg, groups, command="hpa serve", load_reference=s.guard, engine_kwargs=engine_kwargs)
    guard = KLGuard(loaded.engine, loaded.policy, loaded.reference, groups,
                    micro_batch_size=cfg.trainer.micro_batch_size, vocab_size=loaded.tokenizer.vocab_size,
                    kl_threshold=s.kl_threshold, guard_temperature=s.guard_temperature,
                    max_retries=s.guard_max_retries, score=s.guard)
    state.scheduler.attach(guard, loaded.tokenizer, loaded.policy)
    state.tokenizer = loaded.tokenizer
    state.context_length = cfg.model.max_sequence_length
    state.default_max_tokens = cfg.rollout.max_new_tokens
    state.ready.set()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpa serve", description="serve a checkpoint over an OpenAI-compatible HTTP "
                                                              "API, with the KL guard")
    p.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides (serve.port=8000)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """``hpa serve --config X [overrides]``: one process (no torchrun); exits 0 after SIGTERM has drained."""
    from hpa.config import ConfigError, load_config
    from hpa.distributed import launched
    from hpa.distributed.init import read_launch_env

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = load_config(args.config, args.overrides)
    if read_launch_env().world_size != 1:
        raise ConfigError("parallel.tensor_model_parallel_size",
                          "hpa serve runs as one process: start it without torchrun or srun, with "
                          "parallel.tensor_model_parallel_size=1 and parallel.pipeline_model_parallel_size=1")
    s = cfg.serve
    name = s.model_name or os.path.basename(os.path.normpath(cfg.model.policy_path or "hpa")) or "hpa"
    metrics = Metrics()
    state = ServeState(cfg=cfg, scheduler=Scheduler(s, metrics, seed=cfg.rollout.seed), metrics=metrics,
                       model_name=name)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host=s.host, port=s.port, log_level="warning",
                                           access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=s.drain_timeout_s))
    http = threading.Thread(target=server.run, name="hpa-serve-http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.01)
    if not http.is_alive():
        print(f"hpa serve: could not listen on {s.host}:{s.port} (serve.host, serve.port)", file=sys.stderr)
        return 1
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"hpa serve: listening on http://{s.host}:{port} (model {name!r}; loading)", flush=True)

    def stop(signum, frame):  # uvicorn drains the open requests; the scheduler serves them meanwhile
        server.should_exit = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        with launched(cfg) as (cfg, groups):
            load_into(state, cfg, groups)
            print(f"hpa serve: ready (model {name!r})", flush=True)
            while http.is_alive():
                state.scheduler.step(timeout=0.1)
    except (ValueError, FileNotFoundError) as exc:  # a missing or mismatched checkpoint: the message says which
        print(str(exc) if str(exc).startswith("hpa serve") else f"hpa serve: {exc}", file=sys.stderr)
        return 2
    finally:
        server.should_exit = True
        http.join(timeout=s.drain_timeout_s + 5)
    print("hpa serve: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
