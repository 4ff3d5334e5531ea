"""Clean preference pairs with the HPA recipe's three rules.

A pair is dropped by the first rule that fires, checked in this order (cheapest first):

1. ``similarity``: chosen and rejected are more than ``max_similarity`` (0.9) similar: cosine of
   ``embed_fn`` embeddings when an embedding function is given, else normalised edit similarity
   ``1 - levenshtein(chosen, rejected) / max(len)`` on characters.
2. ``reward_margin``: ``reward_fn(prompt, chosen) - reward_fn(prompt, rejected) < min_reward_margin``
   (0.5); negative margins (mislabelled pairs) are dropped too.
3. ``logprob_gap``: the policy already separates them, ``|logprob_fn(prompt, chosen) -
   logprob_fn(prompt, rejected)| > max_logprob_gap`` (2.0). As in the recipe the gap is absolute.

Scorers are injected callables so model-backed ones plug in later; a rule whose scorer is absent
is skipped and reported as ``"skipped"``. Every rule reports how many pairs it checked and dropped;
dropped pairs go to the rejects file with the rule and the value that dropped them.

CLI (the similarity rule needs no model; ``--score-keys`` turns precomputed per-record scores, e.g.
UltraFeedback's ``score_chosen score_rejected``, into the reward-margin rule)::

    python -m data_tools.clean_preferences --input prefs.jsonl --output clean.jsonl \\
        [--max-similarity 0.9] [--score-keys score_chosen score_rejected] [--min-reward-margin 0.5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from hpa.data.preferences import PREFERENCE_FIELDS
from hpa.data.prompts import RejectLog, read_records, rejects_path_for

RULES = ("similarity", "reward_margin", "logprob_gap")

ScoreFn = Callable[[str, str], float]  # (prompt, response) -> score
EmbedFn = Callable[[str], Sequence[float]]


def levenshtein(a: str, b: str, max_distance: Optional[int] = None) -> int:
    """Edit distance; when it exceeds ``max_distance`` returns ``max_distance + 1`` early.

    Only the diagonal band of width ``max_distance`` is computed, so a threshold check on long texts
    costs O(len · max_distance).
    """
    if len(a) < len(b):
        a, b = b, a
    if max_distance is None:
        max_distance = len(a)
    if len(a) - len(b) > max_distance:
        return max_distance + 1
    big = max_distance + 1
    previous = [j if j <= max_distance else big for j in range(len(b) + 1)]
    for i in range(1, len(a) + 1):
        lo, hi = max(1, i - max_distance), min(len(b), i + max_distance)
        current = [big] * (len(b) + 1)
        current[0] = i if i <= max_distance else big
        row_min = current[0]
        for j in range(lo, hi + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            value = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            current[j] = value if value <= max_distance else big
            row_min = min(row_min, current[j])
        if row_min > max_distance:
            return big
        previous = current
    return min(previous[len(b)], big)


def edit_similarity(a: str, b: str, min_similarity: float = 0.0) -> float:
    """``1 - levenshtein / max(len)``, exact when >= ``min_similarity``; below it, an upper bound (still below)."""
    longest = max(len(a), len(b))
    if longest == 0:
        return 1.0
    max_distance = math.floor((1.0 - min_similarity) * longest)
    return 1.0 - min(levenshtein(a, b, max_distance), longest) / longest


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(u, v))
    norm = math.sqrt(sum(x * x for x in u)) * math.sqrt(sum(y * y for y in v))
    return dot / norm if norm else 0.0


def clean_preferences(records: Iterable[Tuple[str, Dict[str, Any]]], *, reward_fn: Optional[ScoreFn] = None,
                      logprob_fn: Optional[ScoreFn] = None, embed_fn: Optional[EmbedFn] = None,
                      min_reward_margin: float = 0.5, max_similarity: float = 0.9, max_logprob_gap: float = 2.0,
                      rejects: Optional[RejectLog] = None) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Apply the rules to ``(location, {"prompt", "chosen", "rejected", ...})`` pairs.

    Args:
        reward_fn: ``(prompt, response) -> reward``; None skips ``reward_margin``.
        logprob_fn: ``(prompt, response) -> policy sequence log-prob``; None skips ``logprob_gap``.
        embed_fn: ``text -> vector``; given, similarity is embedding cosine, else edit similarity.
        rejects: where dropped pairs are written (with ``rule`` and ``value``).

    Returns:
        the kept records (input order) and a report
        ``{"num_input", "num_kept", "rules": {rule: {"status", "threshold", "checked", "dropped"}}}``.
    """
    rejects = rejects if rejects is not None else RejectLog(None)
    similarity_kind = "embedding_cosine" if embed_fn is not None else "edit_similarity"

    def similarity(r):
        if embed_fn is not None:
            return cosine(embed_fn(r["chosen"]), embed_fn(r["rejected"]))
        return edit_similarity(r["chosen"], r["rejected"], min_similarity=max_similarity)

    def margin(r):
        return reward_fn(r["prompt"], r["chosen"]) - reward_fn(r["prompt"], r["rejected"])

    def gap(r):
        return abs(logprob_fn(r["prompt"], r["chosen"]) - logprob_fn(r["prompt"], r["rejected"]))

    rules = [  # (name, scorer present, value fn, drop predicate, threshold)
        ("similarity", True, similarity, lambda v: v > max_similarity, max_similarity),
        ("reward_margin", reward_fn is not None, margin, lambda v: v < min_reward_margin, min_reward_margin),
        ("logprob_gap", logprob_fn is not None, gap, lambda v: v > max_logprob_gap, max_logprob_gap),
    ]
    report: Dict[str, Any] = {"num_input": 0, "num_kept": 0, "rules": {}}
    for name, present, _, _, threshold in rules:
        report["rules"][name] = {"status": "applied" if present else "skipped (no scorer given)",
                                 "threshold": threshold, "checked": 0, "dropped": 0}
    report["rules"]["similarity"]["measure"] = similarity_kind
    kept = []
    for location, record in records:
        report["num_input"] += 1
        for name, present, value_fn, drops, threshold in rules:
            if not present:
                continue
            value = value_fn(record)
            report["rules"][name]["checked"] += 1
            if drops(value):
                report["rules"][name]["dropped"] += 1
                rejects.add(location, name, record, message=f"{name} = {value:.4g} (threshold {threshold})",
                            rule=name, value=value)
                break
        else:
            kept.append(record)
    report["num_kept"] = len(kept)
    return kept, report


def score_lookup(records: Sequence[Tuple[str, Dict[str, Any]]], chosen_key: str, rejected_key: str) -> ScoreFn:
    """A ``reward_fn`` answering from scores stored in the records (e.g. UltraFeedback's).

    Raises ValueError naming the record when a score is missing or one response has two scores.
    """
    table: Dict[Tuple[str, str], float] = {}
    for location, record in records:
        for response_key, score_key in (("chosen", chosen_key), ("rejected", rejected_key)):
            score = record.get(score_key)
            if not isinstance(score, (int, float)) or isinstance(score, bool):
                raise ValueError(f"{location}: key {score_key!r} must be a number for --score-keys, got {score!r}")
            key = (record["prompt"], record[response_key])
            if table.setdefault(key, float(score)) != float(score):
                raise ValueError(f"{location}: the {response_key} response has score {score} here but "
                                 f"{table[key]} in an earlier record; scores must be per (prompt, response)")
    return lambda prompt, response: table[(prompt, response)]


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help=".jsonl or .parquet of {prompt, chosen, rejected}")
    parser.add_argument("--output", required=True)
    parser.add_argument("--rejects", default=None, help="default: <output name>.rejects.jsonl next to the output")
    parser.add_argument("--on-error", choices=("raise", "skip"), default="raise")
    parser.add_argument("--max-similarity", type=float, default=0.9)
    parser.add_argument("--min-reward-margin", type=float, default=0.5)
    parser.add_argument("--max-logprob-gap", type=float, default=2.0)
    parser.add_argument("--score-keys", nargs=2, metavar=("CHOSEN_KEY", "REJECTED_KEY"), default=None,
                        help="record fields holding reward scores; enables the reward-margin rule")
    args = parser.parse_args(argv)
    rejects_path = args.rejects or rejects_path_for(os.path.dirname(os.path.abspath(args.output)), args.output)
    with RejectLog(rejects_path) as rejects:
        records = list(read_records(args.input, PREFERENCE_FIELDS, on_error=args.on_error, rejects=rejects))
        reward_fn = score_lookup(records, *args.score_keys) if args.score_keys else None
        kept, report = clean_preferences(records, reward_fn=reward_fn, min_reward_margin=args.min_reward_margin,
                                         max_similarity=args.max_similarity, max_logprob_gap=args.max_logprob_gap,
                                         rejects=rejects)
        report["num_malformed"] = rejects.counts.get("malformed", 0)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        for record in kept:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    report.update(input=args.input, output=args.output, rejects=rejects_path if rejects.total else None)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
