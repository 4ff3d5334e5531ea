"""What every converter shares: reading, validation, length filter, de-duplication, rejects, stats.

A converter supplies the input fields it needs and a ``convert(record) -> dict`` function; it raises
``ValueError`` for a malformed record (handled per ``--on-error``, with file and line) or
``SkipRecord`` for a record it leaves out by policy. Everything left out is counted by reason and
written to the rejects file (default ``<output name>.rejects.jsonl`` next to the output).

Input: JSONL (read line by line so errors can name the line; a line that is not UTF-8 or holds a NUL
byte is a malformed record) or Parquet (read with pyarrow; a truncated file or a column of the wrong
type stops the conversion with an error naming the file and column).
Output: JSONL, one converted record a line, in input order. Statistics are printed as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from hpa.data.prompts import FieldSpec, RejectLog, SkipRecord, build_records, rejects_path_for
from hpa.data.tokenizer import TOKENIZERS, Tokenizer, build_tokenizer

__all__ = ["SkipRecord", "add_common_args", "convert_file", "run_from_args", "tokenizer_from_args"]


def _length_summary(values: List[int]) -> Dict[str, float]:
    if not values:
        return {"mean": 0.0, "max": 0}
    return {"mean": round(sum(values) / len(values), 2), "max": max(values)}


def convert_file(input_path: str, output_path: str, convert: Callable[[Dict[str, Any]], Dict[str, Any]], *,
                 fields: FieldSpec, dedup_keys: Sequence[str], prompt_keys: Sequence[str] = ("prompt",),
                 response_keys: Sequence[str] = (), tokenizer: Optional[Tokenizer] = None,
                 max_prompt_length: Optional[int] = None, max_response_length: Optional[int] = None,
                 on_error: str = "raise", rejects_path: Optional[str] = None) -> Dict[str, Any]:
    """Convert ``input_path`` to JSONL at ``output_path``; returns the statistics.

    Args:
        convert: input record -> output record.
        fields: input keys and types every record must have (checked before ``convert``).
        dedup_keys: output keys whose values identify a record; later copies are rejected as ``duplicate``.
        prompt_keys, response_keys: output keys limited by ``max_prompt_length`` / ``max_response_length``
            tokens (only with a ``tokenizer``; EOS not counted).
        on_error: ``raise`` on a malformed record, or ``skip`` it into the rejects file.
        rejects_path: default ``<output dir>/<output name>.rejects.jsonl``.
    """
    if rejects_path is None:
        rejects_path = rejects_path_for(os.path.dirname(os.path.abspath(output_path)), output_path)
    limits = {key: max_prompt_length for key in prompt_keys}
    limits.update({key: max_response_length for key in response_keys})
    counters: Dict[str, int] = collections.Counter()
    seen: Dict[tuple, str] = {}
    token_lengths: Dict[str, List[int]] = {key: [] for key in limits}
    char_lengths: Dict[str, List[int]] = {key: [] for key in limits}
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    with RejectLog(rejects_path) as rejects, open(output_path, "w", encoding="utf-8") as out:
        for location, _, converted in build_records(input_path, fields, convert, on_error=on_error, rejects=rejects,
                                                    stats=counters):
            lengths = {key: len(tokenizer.encode(converted[key])) for key in limits} if tokenizer else {}
            too_long = [key for key, n in lengths.items() if limits[key] is not None and n > limits[key]]
            if too_long:
                key = too_long[0]
                rejects.add(location, f"{key}_too_long", converted, key=key,
                            message=f"{key} has {lengths[key]} tokens > limit {limits[key]}")
                continue
            identity = tuple(json.dumps(converted.get(k), sort_keys=True) for k in dedup_keys)
            if identity in seen:
                rejects.add(location, "duplicate", converted, message=f"duplicate of {seen[identity]}")
                continue
            seen[identity] = location
            for key in limits:
                char_lengths[key].append(len(converted[key]))
                if tokenizer:
                    token_lengths[key].append(lengths[key])
            out.write(json.dumps(converted, ensure_ascii=False) + "\n")
            counters["num_written"] += 1
    stats: Dict[str, Any] = {
        "input": input_path, "output": output_path, "rejects": rejects_path if rejects.total else None,
        "num_read": counters["num_read"], "num_written": counters["num_written"],
        "num_rejected": rejects.total, "rejected_by_reason": dict(sorted(rejects.counts.items())),
        "num_blank_lines": counters["num_blank_lines"],
        "char_lengths": {k: _length_summary(v) for k, v in char_lengths.items()},
    }
    if tokenizer:
        stats["token_lengths"] = {k: _length_summary(v) for k, v in token_lengths.items()}
    return stats


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="input .jsonl or .parquet")
    parser.add_argument("--output", required=True, help="output .jsonl")
    parser.add_argument("--rejects", default=None, help="rejects file (default: <output name>.rejects.jsonl)")
    parser.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                        help="a malformed record stops the run (raise) or goes to the rejects file (skip)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path; enables the length filter")
    parser.add_argument("--tokenizer-kind", choices=TOKENIZERS.names(), default="sentencepiece")
    parser.add_argument("--max-prompt-length", type=int, default=1024, help="prompt tokens (with --tokenizer)")
    parser.add_argument("--max-response-length", type=int, default=1024, help="response tokens (with --tokenizer)")


def tokenizer_from_args(args: argparse.Namespace) -> Optional[Tokenizer]:
    return build_tokenizer(args.tokenizer_kind, args.tokenizer) if args.tokenizer else None


def run_from_args(args: argparse.Namespace, convert: Callable[[Dict[str, Any]], Dict[str, Any]], *,
                  fields: FieldSpec, dedup_keys: Sequence[str], prompt_keys: Sequence[str] = ("prompt",),
                  response_keys: Sequence[str] = ()) -> Dict[str, Any]:
    """Run ``convert_file`` with the options of ``add_common_args`` and print the statistics as JSON."""
    stats = convert_file(args.input, args.output, convert, fields=fields, dedup_keys=dedup_keys,
                         prompt_keys=prompt_keys, response_keys=response_keys, tokenizer=tokenizer_from_args(args),
                         max_prompt_length=args.max_prompt_length, max_response_length=args.max_response_length,
                         on_error=args.on_error, rejects_path=args.rejects)
    print(json.dumps(stats, indent=2, ensure_ascii=False))
    return stats
