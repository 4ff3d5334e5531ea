"""The ASGI layer in front of the routes: the body size limit (413 before anything is parsed), the API key
(401) and the catch-all for unexpected failures (one log line, a 500 in the OpenAI shape)."""

from __future__ import annotations

import hmac
import json

from .errors import APIError, echo, endpoint_label, logger


class RequestMiddleware:
    """Wraps the FastAPI app. ``api_key`` None: no key needed; it guards the ``/v1`` routes (``/health``
    and ``/metrics`` stay open to probes, as in vLLM)."""

    def __init__(self, app, *, metrics, max_body_bytes: int, api_key=None):
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes
        self.api_key = api_key.encode() if api_key else None

    async def _reject(self, scope, send, exc: APIError) -> None:
        self.metrics.requests.labels(endpoint_label(scope["path"]), str(exc.status)).inc()
        headers = [(b"content-type", b"application/json")]
        if exc.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(exc.body()).encode()})

    def _check(self, scope) -> None:
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and not length.isdigit():
            raise APIError(400, f"content-length {echo(length.decode('latin-1'))} is not a number")
        if length is not None and int(length) > self.max_body_bytes:
            raise APIError(413, f"the body has {int(length)} bytes; this server takes at most "
                                f"{self.max_body_bytes} (serve.max_body_bytes)", code="request_too_large")
        if self.api_key is not None and scope["path"].startswith("/v1"):
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
                raise APIError(401, "a missing or wrong API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._check(scope)
        except APIError as exc:
            return await self._reject(scope, send, exc)
        started, received = False, 0

        async def counted_receive():  # a body without a content-length is counted as it arrives
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise APIError(413, f"the body is over {self.max_body_bytes} bytes (serve.max_body_bytes)",
                               code="request_too_large")
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except Exception as exc:  # the catch-all: one line, a 500 where nothing was sent yet
            logger.error("hpa serve: %s %s failed: %s: %s", scope.get("method"), scope["path"][:80],
                         type(exc).__name__, echo(str(exc)))
            if not started:
                await self._reject(scope, send, exc if isinstance(exc, APIError) else
                                   APIError(500, f"internal error: {type(exc).__name__}"))
