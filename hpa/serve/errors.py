"""Errors in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``, for every failure: the
server's own checks, FastAPI's (validation, unknown routes, wrong methods, unparsable bodies) and anything
unexpected (one log line, a 500). Each is counted in ``/metrics``; echoed input is cut short."""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

logger = logging.getLogger("hpa.serve")

ECHO_CHARS = 80  # at most this much of a client's value comes back in an error message
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


def echo(value: Any) -> str:
    """``repr(value)`` cut to ``ECHO_CHARS`` (escapes make lone surrogates safe to send)."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + f"... ({len(text)} characters)"


def endpoint_label(path: str) -> str:
    """The ``endpoint`` label of a path: the served ones, else ``other`` (clients do not make new series)."""
    return path if path in ENDPOINTS else "other"


class APIError(Exception):
    """An OpenAI-style error with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def install_handlers(app, metrics) -> None:
    """FastAPI's own errors in the OpenAI shape, counted."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def respond(request: Request, exc: APIError) -> JSONResponse:
        metrics.requests.labels(endpoint_label(request.url.path), str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return respond(request, APIError(400, "the body is not valid JSON"))
        where = ".".join(str(x) for x in first.get("loc", ())[1:])[:ECHO_CHARS] or None
        what = f"{where or 'body'}: {first.get('msg', 'invalid')}"
        if "input" in first and where:
            what += f" (got {echo(first['input'])})"
        return respond(request, APIError(400, what, param=where))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # 404, 405, a body FastAPI cannot parse
        if isinstance(exc.__cause__, APIError):  # raised while the body was read (the size limit)
            return respond(request, exc.__cause__)
        message = {404: f"no route {request.url.path[:ECHO_CHARS]!r}", 405: f"{request.method} is not allowed "
                   f"on {request.url.path[:ECHO_CHARS]!r}"}.get(exc.status_code, str(exc.detail)[:ECHO_CHARS])
        return respond(request, APIError(exc.status_code, message))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return respond(request, exc)
