"""The FastAPI application: the routes per endpoint, the error handlers and the gate in front (handlers run
on uvicorn's event loop; the models only in the scheduler)."""

from __future__ import annotations

import prometheus_client
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from . import chat, completions
from .errors import install_handlers
from .middleware import RequestMiddleware
from .serving import ServeState, check_ready

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    if not request.app.state.serve.ready.is_set():
        return JSONResponse({"status": "loading"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus(request: Request):
    return PlainTextResponse(prometheus_client.generate_latest(request.app.state.serve.metrics.registry),
                             media_type=prometheus_client.CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state.serve
    check_ready(state)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0, "owned_by": "hpa"}]}


def build_app(state: ServeState, *, api_key=None) -> FastAPI:
    """The application; ``api_key`` (None: none) guards the ``/v1`` routes. No docs pages, no schema."""
    app = FastAPI(title="hpa serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    install_handlers(app, state.metrics)
    for r in (router, completions.router, chat.router):
        app.include_router(r)
    app.add_middleware(RequestMiddleware, metrics=state.metrics, max_body_bytes=state.cfg.serve.max_body_bytes, api_key=api_key)
    return app
