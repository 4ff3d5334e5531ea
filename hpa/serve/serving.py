"""What the routes share: the server's state, waiting for the scheduler, and one request's reply (a JSON
body, or server-sent events once the guard has decided on every response: a response that may be
replaced cannot be sent before its KL is known)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

from . import outputs
from .errors import APIError, echo
from .params import sampling, stops
from .protocol import BaseRequest
from .scheduler import Pending, Row


@dataclasses.dataclass
class ServeState:
    """What the HTTP handlers share with the main thread."""

    cfg: Any  # the root Config
    scheduler: Any
    metrics: Any
    model_name: str
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    tokenizer: Any = None
    context_length: int = 0
    default_max_tokens: int = 16
    max_prompt_chars: Optional[int] = None  # no text longer than this fits the context (see load_into)
    workdir: Any = None
    # tokenizing off the event loop, as vLLM does: a long prompt does not stall the other requests
    pool: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hpa-serve-tokenize"))


def check_ready(state: ServeState, model: Optional[str] = None) -> None:
    if not state.ready.is_set():
        raise APIError(503, "the model is loading; retry shortly", code="loading")
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {echo(model)} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


async def off_loop(state: ServeState, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(state.pool, fn, *args)


async def wait(state: ServeState, pending: Pending, request) -> List[Row]:
    """The request's rows; a client that goes away while it waits gives its place up."""
    waiting = asyncio.wrap_future(state.scheduler.submit(pending))
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=0.2)
        if done:
            return waiting.result()
        if await request.is_disconnected():
            pending.cancelled = True
            raise asyncio.CancelledError("client disconnected")


class Reply:
    """One request's answer: its id, its usage, its metrics, its body or events."""

    def __init__(self, state: ServeState, endpoint: str, chat: bool, prompt_tokens: int):
        self.state, self.endpoint, self.chat, self.prompt_tokens = state, endpoint, chat, prompt_tokens
        self.started, self.created = time.monotonic(), int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def usage(self, completion_tokens: int) -> Dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def done(self, status: str, completion_tokens: int = 0) -> None:
        m = self.state.metrics
        m.requests.labels(self.endpoint, status).inc()
        m.latency.labels(self.endpoint).observe(time.monotonic() - self.started)
        if status == "200":
            m.prompt_tokens.inc(self.prompt_tokens)
            m.completion_tokens.inc(completion_tokens)

    def choices(self, rows: List[Row], stop: List[str]):
        tok, out, completion_tokens = self.state.tokenizer, [], 0
        for index, row in enumerate(rows):
            text, kept, reason = outputs.finish(tok, row, stop)
            completion_tokens += kept
            out.append((index, text, kept, reason, outputs.token_texts(tok, row.token_ids), row))
        return out, completion_tokens

    def body(self, made, completion_tokens: int) -> Dict[str, Any]:
        tok, choices = self.state.tokenizer, []
        for index, text, kept, reason, pieces, row in made:
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": outputs.chat_logprobs(tok, row, kept, pieces), "finish_reason": reason,
                                "hpa": outputs.hpa_field(row)})
            else:
                choices.append({"index": index, "text": text,
                                "logprobs": outputs.completion_logprobs(tok, row, kept, pieces),
                                "finish_reason": reason, "hpa": outputs.hpa_field(row)})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.state.model_name, "choices": choices,
                "usage": self.usage(completion_tokens)}

    def event(self, choices: List[Dict[str, Any]], **extra) -> str:
        return "data: " + json.dumps({"id": self.id, "object": "chat.completion.chunk" if self.chat
                                      else "text_completion", "created": self.created,
                                      "model": self.state.model_name, "choices": choices, **extra}) + "\n\n"

    def _token_chunk(self, index: int, text: str, pieces: List[str], j: int, row: Row) -> str:
        """The chunk of token ``j``: its text (cut where a stop string begins), its log-probs."""
        tok, piece = self.state.tokenizer, pieces[j]
        if len("".join(pieces[:j + 1])) > len(text):  # the token where a stop string begins
            piece = piece[:max(0, len(text) - len("".join(pieces[:j])))]
        one = dataclasses.replace(row, logprobs=row.logprobs[j:j + 1], top_logprobs=row.top_logprobs[j:j + 1]) \
            if row.logprobs is not None else row
        if self.chat:
            return self.event([{"index": index, "delta": {"content": piece},
                                "logprobs": outputs.chat_logprobs(tok, one, 1, [pieces[j]]), "finish_reason": None}])
        return self.event([{"index": index, "text": piece,
                            "logprobs": outputs.completion_logprobs(tok, one, 1, [pieces[j]]),
                            "finish_reason": None}])

    async def events(self, made, completion_tokens: int, include_usage: bool):
        status = "499"  # a client gone mid-stream
        try:
            for index, text, kept, reason, pieces, row in made:
                if self.chat:
                    yield self.event([{"index": index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}])
                for j in range(kept):
                    yield self._token_chunk(index, text, pieces, j, row)
                last = {"index": index, "logprobs": None, "finish_reason": reason, "hpa": outputs.hpa_field(row)}
                last.update({"delta": {}} if self.chat else {"text": ""})
                yield self.event([last])
            if include_usage:
                yield self.event([], usage=self.usage(completion_tokens))
            yield "data: [DONE]\n\n"
            status = "200"
        finally:
            self.done(status, completion_tokens)


async def respond(state: ServeState, request, req: BaseRequest, endpoint: str, prompts: List[List[int]],
                  max_tokens: Optional[int], top_logprobs: Optional[int], chat: bool):
    """Queue the request, wait for its rows, answer (JSON or events)."""
    from fastapi.responses import JSONResponse, StreamingResponse

    params, stop = sampling(state, req, prompts, max_tokens), stops(req)
    pending = Pending(prompts=prompts, n=req.n, params=params, seeded=req.seed is not None,
                      top_logprobs=top_logprobs)
    reply = Reply(state, endpoint, chat, sum(len(p) for p in prompts))
    state.metrics.in_flight.inc()
    try:
        rows = await wait(state, pending, request)
    except asyncio.CancelledError:
        reply.done("499")
        raise
    except APIError as exc:  # cut by the drain deadline
        reply.done(str(exc.status))
        return JSONResponse(exc.body(), status_code=exc.status)
    except Exception as exc:
        reply.done("500")
        return JSONResponse(APIError(500, f"generation failed: {str(exc)[:200]}").body(), status_code=500)
    finally:
        state.metrics.in_flight.dec()
    made, completion_tokens = reply.choices(rows, stop)
    if not req.stream:
        reply.done("200", completion_tokens)
        return reply.body(made, completion_tokens)
    include_usage = bool((req.stream_options or {}).get("include_usage"))
    return StreamingResponse(reply.events(made, completion_tokens, include_usage), media_type="text/event-stream")
