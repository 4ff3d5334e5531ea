"""``POST /v1/chat/completions``: the messages through the tokenizer's chat template."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .errors import APIError
from .params import check_request, check_text
from .protocol import MAX_TOP_LOGPROBS, ChatRequest
from .serving import check_ready, off_loop, respond

router = APIRouter()


def _messages(req: ChatRequest, max_chars):
    """The messages as ``{"role", "content"}`` with text content (text parts joined), checked as text."""
    out, total = [], 0
    for i, m in enumerate(req.messages):
        content = m.content
        if not isinstance(content, str):  # content parts: the text ones, joined
            if any(part.get("type") != "text" for part in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages.{i}.content")
            content = "".join(str(part.get("text", "")) for part in content)
        check_text(m.role, f"messages.{i}.role")
        check_text(content, f"messages.{i}.content")
        total += len(content)
        out.append({"role": m.role, "content": content})
    if max_chars is not None and total > max_chars:
        raise APIError(400, f"the messages have {total} characters, more than this model's context can hold (at "
                            f"most {max_chars}): shorten them", param="messages", code="context_length_exceeded")
    return out


def _render(tokenizer, messages):
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, req: ChatRequest):
    state = request.app.state.serve
    check_ready(state, req.model)
    if not req.messages:
        raise APIError(400, "messages is empty", param="messages")
    check_request(state, req, 1)
    top = None
    if req.logprobs:
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
    prompt = await off_loop(state, _render, state.tokenizer, _messages(req, state.max_prompt_chars))
    if not prompt:
        raise APIError(400, "the messages render to no tokens", param="messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return await respond(state, request, req, "/v1/chat/completions", [prompt], max_tokens, top, chat=True)
