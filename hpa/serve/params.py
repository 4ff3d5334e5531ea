"""A request's checks and its ``SamplingParams``: every refusal an ``APIError`` naming the field. The cheap
checks (counts, seeds, lengths in characters) run before a prompt is tokenized."""

from __future__ import annotations

from typing import List, Optional

from hpa.rollout import SamplingParams

from .errors import APIError, echo
from .protocol import MAX_N, MAX_SEED, UNSUPPORTED, BaseRequest


def check_request(state, req: BaseRequest, num_prompts: int) -> None:
    """What can be refused before tokenizing: unsupported fields, ``n``, the rows, the seed."""
    extra = req.model_extra or {}
    for name, defaults in UNSUPPORTED.items():
        if name in extra and extra[name] not in defaults:
            raise APIError(400, f"{name}={echo(extra[name])} is not supported by hpa serve", param=name,
                           code="unsupported_parameter")
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    rows, most = num_prompts * req.n, state.cfg.serve.max_rows_per_request
    if rows > most:
        raise APIError(400, f"this request asks for {rows} responses ({num_prompts} prompt(s) x n={req.n}); this "
                            f"server returns at most {most} per request (serve.max_rows_per_request)", param="n")
    if req.seed is not None and not 0 <= req.seed < MAX_SEED:
        raise APIError(400, f"seed must be in [0, 2**63), got {echo(req.seed)}", param="seed")


def check_text(text: str, param: str, max_chars: Optional[int] = None) -> None:
    """Text the tokenizer can take: no lone surrogates, and not longer than the context can hold
    (``max_chars``: the context length times the longest token's characters)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} holds a lone surrogate ({echo(text[exc.start:exc.end])}), which is not "
                            "text: send pairs or real characters", param=param) from None
    if max_chars is not None and len(text) > max_chars:
        raise APIError(400, f"{param} has {len(text)} characters, more than this model's context can hold (at most "
                            f"{max_chars}): shorten it", param=param, code="context_length_exceeded")


def sampling(state, req: BaseRequest, prompts: List[List[int]], max_tokens: Optional[int]):
    """``SamplingParams`` (n=1) of a request whose prompts are tokenized."""
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


def stops(req: BaseRequest) -> List[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "stop takes at most 4 non-empty strings", param="stop")
    return stop
