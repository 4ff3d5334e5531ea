"""Convert Anthropic HH-RLHF style pairs to ``{"prompt", "chosen", "rejected"}`` JSONL.

Input records: ``{"chosen": str, "rejected": str}``, full transcripts
``"\\n\\nHuman: ...\\n\\nAssistant: ..."``. The prompt is the common prefix of both up to and including
the last ``"\\n\\nAssistant:"`` in it; chosen and rejected are what follows (leading whitespace kept,
so ``prompt + chosen`` is the original transcript). A record whose transcripts share no assistant
turn, or whose responses are empty or identical, is malformed (``--on-error``).

Usage::

    python -m data_tools.prepare_hh_rlhf --input train.jsonl --output hh.jsonl [--tokenizer tok.model]
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Optional, Sequence

from data_tools.common import add_common_args, run_from_args

ASSISTANT = "\n\nAssistant:"
FIELDS = {"chosen": ((str,), True), "rejected": ((str,), True)}


def split_transcripts(chosen: str, rejected: str) -> Dict[str, str]:
    """Split two transcripts into their shared prompt and the two responses. Raises ValueError."""
    common = os.path.commonprefix([chosen, rejected])
    cut = common.rfind(ASSISTANT)
    if cut < 0:
        raise ValueError("chosen and rejected share no '\\n\\nAssistant:' turn; cannot find the prompt")
    prompt = chosen[:cut + len(ASSISTANT)]
    out = {"prompt": prompt, "chosen": chosen[len(prompt):], "rejected": rejected[len(prompt):]}
    for key in ("chosen", "rejected"):
        if not out[key].strip():
            raise ValueError(f"the {key} response after the last shared assistant turn is empty")
    if out["chosen"] == out["rejected"]:
        raise ValueError("chosen and rejected transcripts are identical")
    return out


def convert(record: Dict[str, Any]) -> Dict[str, str]:
    return split_transcripts(record["chosen"], record["rejected"])


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    return run_from_args(args, convert, fields=FIELDS, dedup_keys=("prompt", "chosen", "rejected"),
                         response_keys=("chosen", "rejected"))


if __name__ == "__main__":
    main()
