"""Rows to OpenAI response pieces: texts cut at stop strings, each token's text, and the log-probs objects
of the completions and chat APIs."""

from __future__ import annotations

from typing import Any, Dict, List

from .scheduler import Row


def finish(tokenizer, row: Row, stops: List[str]):
    """``(text, the row's tokens kept, finish reason)`` with the first stop string and what follows cut off
    (tokens up to the one where it begins are kept)."""
    text = tokenizer.decode(row.token_ids)
    cuts = [text.find(s) for s in stops if s in text]
    if not cuts:
        return text, len(row.token_ids), row.finish_reason
    cut = min(cuts)
    kept = next(k for k in range(1, len(row.token_ids) + 1) if len(tokenizer.decode(row.token_ids[:k])) > cut)
    return text[:cut], kept, "stop"


def token_texts(tokenizer, ids: List[int]) -> List[str]:
    """Each token's text, as the increments of the prefix decodes (so they join to the whole text)."""
    out, previous = [], ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        out.append(text[len(previous):] if text.startswith(previous) else tokenizer.decode([ids[k - 1]]))
        previous = text
    return out


def hpa_field(row: Row) -> Dict[str, Any]:
    return {"kl": row.kl, "regenerated": row.regenerated}


def completion_logprobs(tokenizer, row: Row, kept: int, pieces: List[str]):
    if row.logprobs is None:
        return None
    offsets, at = [], 0
    for piece in pieces[:kept]:
        offsets.append(at)
        at += len(piece)
    top = [{tokenizer.decode([t]): v for t, v in alts} for alts in row.top_logprobs[:kept]]
    return {"tokens": pieces[:kept], "token_logprobs": row.logprobs[:kept],
            "top_logprobs": top if any(row.top_logprobs[:kept]) else None, "text_offset": offsets}


def chat_logprobs(tokenizer, row: Row, kept: int, pieces: List[str]):
    if row.logprobs is None:
        return None

    def entry(token: str, value: float):
        return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8"))}

    return {"content": [dict(entry(pieces[j], row.logprobs[j]),
                             top_logprobs=[entry(tokenizer.decode([t]), v) for t, v in row.top_logprobs[j]])
                        for j in range(kept)]}
