"""``POST /v1/completions``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .errors import APIError
from .params import check_request, check_text
from .protocol import MAX_LOGPROBS, CompletionRequest
from .serving import check_ready, off_loop, respond

router = APIRouter()


def _encode_all(tokenizer, texts):
    return [tokenizer.encode(t) if isinstance(t, str) else list(t) for t in texts]


@router.post("/v1/completions")
async def completions(request: Request, req: CompletionRequest):
    state = request.app.state.serve
    check_ready(state, req.model)
    raw = req.prompt
    texts = [raw] if isinstance(raw, str) or (raw and all(isinstance(x, int) for x in raw)) else list(raw)
    if not texts:
        raise APIError(400, "prompt is empty", param="prompt")
    check_request(state, req, len(texts))
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", param="logprobs")
    for t in texts:
        if isinstance(t, str):
            check_text(t, "prompt", state.max_prompt_chars)
    prompts = await off_loop(state, _encode_all, state.tokenizer, texts)
    if any(len(p) == 0 for p in prompts):
        raise APIError(400, "a prompt has no tokens", param="prompt")
    return await respond(state, request, req, "/v1/completions", prompts, req.max_tokens, req.logprobs, chat=False)
