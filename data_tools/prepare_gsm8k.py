"""Convert GSM8K to prompt JSONL with a ground truth for the rule reward.

Input records: ``{"question": str, "answer": str}`` where the answer ends with ``"#### <number>"``.
Output: ``{"prompt": str, "ground_truth": str, "solution": str}``: the prompt is ``--template``
filled with the question, the ground truth is the text after the last ``"#### "`` with thousands
separators removed, the solution is the full worked answer. Duplicate prompts are rejected.

Usage::

    python -m data_tools.prepare_gsm8k --input test.jsonl --output gsm8k.jsonl [--tokenizer tok.model]
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, Optional, Sequence

from data_tools.common import add_common_args, run_from_args

MARKER = "#### "
DEFAULT_TEMPLATE = "{question}"
FIELDS = {"question": ((str,), True), "answer": ((str,), True)}


def extract_ground_truth(answer: str) -> str:
    """The final answer after the last ``"#### "``; raises ValueError when there is none."""
    cut = answer.rfind(MARKER)
    if cut < 0:
        raise ValueError("answer has no '#### <final answer>' line")
    truth = answer[cut + len(MARKER):].strip().replace(",", "")
    if not truth:
        raise ValueError("the final answer after '#### ' is empty")
    return truth


def make_converter(template: str = DEFAULT_TEMPLATE) -> Callable[[Dict[str, Any]], Dict[str, str]]:
    if "{question}" not in template:
        raise ValueError(f"--template must contain '{{question}}', got {template!r}")

    def convert(record: Dict[str, Any]) -> Dict[str, str]:
        return {"prompt": template.replace("{question}", record["question"].strip()),
                "ground_truth": extract_ground_truth(record["answer"]), "solution": record["answer"]}

    return convert


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--template", default=DEFAULT_TEMPLATE,
                        help="prompt text with a {question} placeholder (default: the bare question)")
    args = parser.parse_args(argv)
    return run_from_args(args, make_converter(args.template), fields=FIELDS, dedup_keys=("prompt",))


if __name__ == "__main__":
    main()
