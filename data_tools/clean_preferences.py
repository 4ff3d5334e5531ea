"""Clean preference pairs with the HPA recipe's three rules.

A pair is dropped by the first rule that fires, checked in this order (cheapest first):

1. ``similarity``: chosen and rejected are more than ``max_similarity`` (0.9) similar: cosine of
   ``embed_fn`` embeddings when an embedding function is given, else normalised edit similarity
   ``1 - levenshtein(chosen, rejected) / max(len)`` on characters.
2. ``reward_margin``: ``reward_fn(prompt, chosen) - reward_fn(prompt, rejected) < min_reward_margin``
   (0.5); negative margins (mislabelled pairs) are dropped too.
3. ``logprob_gap``: the policy already separates them, ``|logprob_fn(prompt, chosen) -
   logprob_fn(prompt, rejected)| > max_logprob_gap`` (2.0). As in the recipe the gap is absolute.

Scorers are injected callables; a rule whose scorer is absent is skipped and reported as
``"skipped"``. Every rule reports how many pairs it checked and dropped; dropped pairs go to the
rejects file with the rule and the value that dropped them.

CLI. Without a model, the similarity rule applies (edit similarity) and ``--score-keys`` turns
precomputed per-record scores, e.g. UltraFeedback's ``score_chosen score_rejected``, into the
reward-margin rule::

    python -m data_tools.clean_preferences --input prefs.jsonl --output clean.jsonl \\
        [--max-similarity 0.9] [--score-keys score_chosen score_rejected] [--min-reward-margin 0.5]

``--config CFG [section.key=value ...]`` turns on the model-backed rules (``hpa.reward.scoring``;
one process, or torchrun with TP/PP/DP): the reward margin from ``reward.*`` (the reward models of
``reward.model_paths``, r̂ = mean over their heads, and/or the rule rewards of ``reward.rules``, which
read a ``ground_truth`` key of each record), the log-prob gap from the policy of ``model.policy_path``
(summed response log-probs, as DPO sees them), and with ``--similarity embedding`` the cosine of the
first reward model's mean-pooled hidden states of the two responses::

    python -m data_tools.clean_preferences --input prefs.jsonl --output clean.jsonl --config CFG \\
        [--similarity embedding] reward.model_paths=[runs/rm/reward_model] reward.rules=[] \\
        model.policy_path=runs/demo/sft

Every distinct ``(prompt, response)`` is scored once, in batches, before the rules run; a pair the
data policy cannot score (e.g. a response longer than ``data.max_response_length`` under ``skip``) is
written to the rejects file with that reason and counted in ``unscorable``.
"""

from __future__ import annotations

import argparse
import collections
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


def has_reward_source(reward_cfg) -> bool:
    """Whether a ``reward`` config section names anything to score with."""
    return bool(reward_cfg.model_paths or reward_cfg.rules or reward_cfg.custom_function)


def model_scores(cfg, groups, records: Sequence[Tuple[str, Dict[str, Any]]], *, reward: bool, log_prob: bool,
                 embedding: bool, on_error: str, rejects: RejectLog, batch_size: int = 256
                 ) -> Tuple[List[Tuple[str, Dict[str, Any]]], Dict[str, Any]]:
    """Score every distinct ``(prompt, response)`` of ``records`` up front, in batches, with the models
    of ``cfg`` (``hpa.reward.scoring``), and return lookups for ``clean_preferences``.

    Args:
        reward: r̂ of ``reward.*`` (model heads and/or rule rewards; rules read a ``ground_truth`` key).
        log_prob: the sequence log-prob under ``model.policy_path``.
        embedding: the reward model's embedding of each response (scored alone).
        on_error: a record without the ``ground_truth`` the rule rewards need is raised or skipped.
        rejects: where skipped records go (reason ``malformed``, or the data policy's reason, e.g.
            ``response_too_long``, for a pair that cannot be scored).

    Returns:
        The records that can be scored, and ``{"reward_fn", "logprob_fn", "embed_fn", "num_scored_items",
        "unscorable"}`` (the functions are None where not asked for).
    """
    from hpa.data.prompts import RecordError
    from hpa.reward.scoring import Scorer, TextScores, needs_ground_truth

    with_truths = reward and needs_ground_truth(cfg.reward)
    usable = []
    for location, record in records:
        truth = record.get("ground_truth")
        if with_truths and (not isinstance(truth, str) or not truth.strip()):
            message = (f"is {'missing' if truth is None else 'not a non-empty string'}, but the rule rewards "
                       f"(reward.rules={list(cfg.reward.rules)}, reward.custom_function="
                       f"{cfg.reward.custom_function}) score against it; add it to every record, or set "
                       "reward.rules=[] to use reward.model_paths alone")
            if on_error == "raise":
                raise RecordError(location, message, key="ground_truth")
            rejects.add(location, "malformed", record, key="ground_truth", message=message)
            continue
        usable.append((location, record))

    scorer = Scorer(cfg, groups, reward=reward, log_prob=log_prob, embedding=embedding, batch_size=batch_size)
    items: Dict[Tuple[str, str], int] = {}  # (prompt, response) -> item index
    truths: List[Optional[str]] = []
    for location, record in usable:
        truth = record.get("ground_truth") if with_truths else None
        for key in ("chosen", "rejected"):
            item = (record["prompt"], record[key])
            if item not in items:
                items[item] = len(truths)
                truths.append(truth)
            elif truths[items[item]] != truth:
                raise ValueError(f"{location}: the {key} response has ground_truth {truth!r} here but "
                                 f"{truths[items[item]]!r} in an earlier record with the same prompt; a "
                                 "(prompt, response) has one reward, so make the ground truths agree")
    scores = TextScores()
    if reward or log_prob:
        scores = scorer.score_texts([p for p, _ in items], [r for _, r in items],
                                    truths if with_truths else None)
    texts: Dict[str, int] = {}
    embeddings = TextScores()
    if embedding:
        for _, response in items:
            texts.setdefault(response, len(texts))
        embeddings = scorer.embed_texts(list(texts))

    scorable = []
    unscorable: Dict[str, int] = collections.Counter()
    for location, record in usable:
        problem = None
        for key in ("chosen", "rejected"):
            skipped = scores.skipped.get(items[(record["prompt"], record[key])]) or \
                (embeddings.skipped.get(texts[record[key]]) if embedding else None)
            if skipped is not None:
                problem = (key, *skipped)
                break
        if problem is None:
            scorable.append((location, record))
            continue
        key, reason, message = problem
        unscorable[reason] += 1
        rejects.add(location, reason, record, key=key, message=f"{key}: {message}")

    def lookup(values):
        return lambda prompt, response: values[items[(prompt, response)]]

    return scorable, {
        "reward_fn": lookup(scores.reward) if reward else None,
        "logprob_fn": lookup(scores.log_prob) if log_prob else None,
        "embed_fn": (lambda text: embeddings.embedding[texts[text]]) if embedding else None,
        "num_scored_items": len(items),
        "unscorable": dict(unscorable),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_tools.clean_preferences", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help=".jsonl or .parquet of {prompt, chosen, rejected}")
    parser.add_argument("--output", required=True)
    parser.add_argument("--rejects", default=None, help="default: <output name>.rejects.jsonl next to the output")
    parser.add_argument("--on-error", choices=("raise", "skip"), default="raise")
    parser.add_argument("--max-similarity", type=float, default=0.9)
    parser.add_argument("--min-reward-margin", type=float, default=0.5)
    parser.add_argument("--max-logprob-gap", type=float, default=2.0)
    parser.add_argument("--score-keys", nargs=2, metavar=("CHOSEN_KEY", "REJECTED_KEY"), default=None,
                        help="record fields holding reward scores; enables the reward-margin rule")
    parser.add_argument("--config", default=None,
                        help="YAML config: turns on the model-backed rules (reward margin from reward.*, "
                             "log-prob gap from model.policy_path)")
    parser.add_argument("--similarity", choices=("edit", "embedding"), default="edit",
                        help="edit similarity, or the cosine of reward-model embeddings (needs --config with "
                             "reward.model_paths)")
    parser.add_argument("--batch-size", type=int, default=256, help="responses per forward call on each DP rank")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="dotted config overrides (with --config)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the cleaner; with ``--config``, initialise distributed like ``hpa generate`` (torchrun or one
    process) and score with the configured models. Returns the report (printed by the main rank)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config is None:
        if args.overrides:
            parser.error(f"config overrides {args.overrides} need --config")
        if args.similarity == "embedding":
            parser.error("--similarity embedding reads a reward model: give --config with reward.model_paths")
        return _run(args)

    from hpa.config import ConfigError, load_config
    from hpa.distributed import launched

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        raise SystemExit(f"clean_preferences: {exc}") from None
    if args.score_keys and has_reward_source(cfg.reward):
        raise SystemExit("clean_preferences: --score-keys and the config's reward (reward.model_paths, reward.rules "
                         "or reward.custom_function) both define the reward margin; drop --score-keys, or set "
                         "reward.rules=[] without reward.model_paths to use the stored scores")
    try:
        with launched(cfg) as (cfg, groups):
            return _run(args, cfg, groups)
    except ConfigError as exc:
        raise SystemExit(f"clean_preferences: {exc}") from None


def _run(args, cfg=None, groups=None) -> Dict[str, Any]:
    is_main = groups is None or groups.is_main
    rejects_path = args.rejects or rejects_path_for(os.path.dirname(os.path.abspath(args.output)), args.output)
    rejects = RejectLog(rejects_path if is_main else None)  # other ranks count the same rejects, unwritten
    scored: Dict[str, Any] = {"reward_fn": None, "logprob_fn": None, "embed_fn": None}
    try:
        records = list(read_records(args.input, PREFERENCE_FIELDS, on_error=args.on_error, rejects=rejects))
        if args.score_keys:
            scored["reward_fn"] = score_lookup(records, *args.score_keys)
        if cfg is not None:
            use_reward = has_reward_source(cfg.reward)
            use_log_prob = bool(cfg.model.policy_path)
            use_embedding = args.similarity == "embedding"
            if use_reward or use_log_prob or use_embedding:
                records, model = model_scores(cfg, groups, records, reward=use_reward, log_prob=use_log_prob,
                                              embedding=use_embedding, on_error=args.on_error, rejects=rejects,
                                              batch_size=args.batch_size)
                scored.update(num_scored_items=model["num_scored_items"], unscorable=model["unscorable"])
                for name in ("reward_fn", "logprob_fn", "embed_fn"):
                    if model[name] is not None:
                        scored[name] = model[name]
        kept, report = clean_preferences(records, reward_fn=scored["reward_fn"], logprob_fn=scored["logprob_fn"],
                                         embed_fn=scored["embed_fn"], min_reward_margin=args.min_reward_margin,
                                         max_similarity=args.max_similarity, max_logprob_gap=args.max_logprob_gap,
                                         rejects=rejects)
        report["num_malformed"] = rejects.counts.get("malformed", 0)
        if "unscorable" in scored:
            report["num_scored_items"] = scored["num_scored_items"]
            report["unscorable"] = scored["unscorable"]
    finally:
        if is_main:
            rejects.close()
    hints = {"reward_margin": "give --score-keys, or --config with reward.model_paths and/or reward.rules",
             "logprob_gap": "give --config with model.policy_path"}
    for rule, hint in hints.items():
        if report["rules"][rule]["status"] != "applied":
            report["rules"][rule]["status"] = f"skipped ({hint})"
    report["scores"] = {
        "reward": (f"--score-keys {' '.join(args.score_keys)}" if args.score_keys else
                   _reward_description(cfg.reward) if scored["reward_fn"] is not None else None),
        "log_prob": cfg.model.policy_path if scored["logprob_fn"] is not None else None,
        "similarity": "reward-model embedding cosine" if scored["embed_fn"] is not None else "edit similarity",
    }
    if is_main:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as f:
            for record in kept:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    report.update(input=args.input, output=args.output, rejects=rejects_path if rejects.total else None)
    if is_main:
        print(json.dumps(report, indent=2))
    return report


def _reward_description(reward_cfg) -> str:
    parts = [f"reward models {list(reward_cfg.model_paths)}"] if reward_cfg.model_paths else []
    if reward_cfg.rules:
        parts.append(f"rules {list(reward_cfg.rules)} x {reward_cfg.rule_weight}")
    if reward_cfg.custom_function:
        parts.append(f"custom {reward_cfg.custom_function}")
    return " + ".join(parts) + " (r̂: mean over heads)"


if __name__ == "__main__":
    main()
