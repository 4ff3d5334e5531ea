"""Convert UltraFeedback-binarized style pairs to ``{"prompt", "chosen", "rejected"}`` JSONL.

Input records: ``{"prompt": str, "chosen": [messages], "rejected": [messages], "score_chosen"?: float,
"score_rejected"?: float}`` where messages are ``{"role", "content"}`` and the last one of each list
is the assistant's answer. The messages before it must be the same in both lists. Output::

    {"prompt": str, "chosen": str, "rejected": str, "score_chosen"?: float, "score_rejected"?: float,
     "prompt_messages"?: [messages]}

``prompt_messages`` is written only for multi-turn context (more than the one user message).

Usage::

    python -m data_tools.prepare_ultrafeedback --input train_prefs.parquet --output uf.jsonl
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Sequence

from data_tools.common import add_common_args, run_from_args

FIELDS = {"prompt": ((str,), True), "chosen": ((list,), True), "rejected": ((list,), True),
          "score_chosen": ((int, float), False), "score_rejected": ((int, float), False)}


def _check_messages(messages: List[Any], key: str) -> None:
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"{key}[{i}] must be an object with string 'role' and 'content'")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"the last message of {key} has role {messages[-1]['role']!r}, expected 'assistant'")
    if not messages[-1]["content"].strip():
        raise ValueError(f"the assistant answer of {key} is empty")


def convert(record: Dict[str, Any]) -> Dict[str, Any]:
    chosen, rejected = record["chosen"], record["rejected"]
    _check_messages(chosen, "chosen")
    _check_messages(rejected, "rejected")
    context = [{"role": m["role"], "content": m["content"]} for m in chosen[:-1]]
    if context != [{"role": m["role"], "content": m["content"]} for m in rejected[:-1]]:
        raise ValueError("chosen and rejected have different messages before the final answer")
    if chosen[-1]["content"] == rejected[-1]["content"]:
        raise ValueError("chosen and rejected answers are identical")
    out: Dict[str, Any] = {"prompt": record["prompt"], "chosen": chosen[-1]["content"],
                           "rejected": rejected[-1]["content"]}
    for key in ("score_chosen", "score_rejected"):
        if record.get(key) is not None:
            out[key] = float(record[key])
    if len(context) > 1:
        out["prompt_messages"] = context
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    return run_from_args(args, convert, fields=FIELDS, dedup_keys=("prompt", "chosen", "rejected"),
                         response_keys=("chosen", "rejected"))


if __name__ == "__main__":
    main()
