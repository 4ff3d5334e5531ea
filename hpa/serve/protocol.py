"""The request bodies of the OpenAI API that ``hpa serve`` accepts, and the API's limits.

Strict pydantic models: a field of the wrong type is a 400, not a silent coercion.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict

MAX_N = 128  # OpenAI's limit on n
MAX_LOGPROBS = 5  # the completions API's limit
MAX_TOP_LOGPROBS = 20  # the chat API's limit
MAX_SEED = 2 ** 63  # seeds are int64, as OpenAI's
# sampling parameters the OpenAI API has and hpa does not implement: refused unless left at their default
UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "logit_bias": (None, {}),
               "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "tools": (None, []),
               "response_format": (None, {"type": "text"})}


class BaseRequest(BaseModel):
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


class CompletionRequest(BaseRequest):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    logprobs: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: Union[str, List[Dict[str, Any]]]


class ChatRequest(BaseRequest):
    messages: List[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
