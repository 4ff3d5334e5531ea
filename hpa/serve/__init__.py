"""``hpa serve``: a policy checkpoint behind an OpenAI-compatible HTTP endpoint, with the KL guard.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``
(503 while the checkpoint loads), ``GET /metrics`` (Prometheus text). Every response goes through
``hpa.inference.KLGuard``, the guard of ``hpa generate``: its KL to the reference is scored and a
response above ``serve.kl_threshold`` is sampled again at ``serve.guard_temperature``. Each choice carries
``"hpa": {"kl": ..., "regenerated": ...}``.

Threads: uvicorn (FastAPI) runs the HTTP side in a thread of its own (tokenizing in a small pool); the
main thread loads the models and then runs the ``Scheduler``, the only code that touches them.

The parts, as vLLM's OpenAI server: ``protocol`` (request bodies, the API's limits), ``params`` (a
request's checks and sampling parameters), ``scheduler`` (engine batches), ``serving`` (the state and
one reply), ``completions`` and ``chat`` (the routes), ``outputs`` (rows to response pieces), ``errors``
(the OpenAI error shape), ``gate`` (body limit, API key, catch-all), ``metrics``, ``app``, ``cli``.

Layering note: a command (cli level); it imports ``hpa.inference`` (the layer of ``hpa generate``) and below.
"""

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ModuleNotFoundError as exc:  # the serve extra is not installed
    raise ModuleNotFoundError(f"hpa serve needs {exc.name}: pip install -e '.[serve]' (or 'hpa[serve]')") from exc

from .cli import _import_hf, main  # noqa: E402

__all__ = ["main", "_import_hf"]
