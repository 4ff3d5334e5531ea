"""Synthetic preference pairs from a strong and a weak policy (the HPA recipe).

For every prompt, ``k`` responses are sampled from the strong policy (temperature 0.7) and ``k``
from the weak one (0.9); each is scored with the configured reward (``hpa.reward.scoring``: r̂, the
mean over the reward-model heads and rule rewards of ``reward.*``). Of the ``k × k`` cross pairs
(strong response, weak response) those with ``reward(strong) > reward(weak) + margin`` (1.0) are kept,
the strong response as ``chosen``.

Every candidate pair ends in exactly one count: ``empty_response`` (a response with no text),
``nonfinite_reward``, ``identical`` (the two texts are equal), ``below_margin``, ``duplicate`` (the same
``(prompt, chosen, rejected)`` was kept before, for this prompt or an earlier record of the same
prompt text) or kept.

A kept pair is written as a ``PreferenceDataset`` record with tags::

    {"prompt", "chosen", "rejected", "ground_truth"?,   # ground_truth when the prompt record has one
     "source": "synthetic", "chosen_source": "strong", "rejected_source": "weak",
     "chosen_reward": r_s, "rejected_reward": r_w, "margin": r_s - r_w, "confidence": sigmoid(r_s - r_w)}

``confidence`` is the Bradley–Terry probability that the strong response is preferred,
``P(strong ≻ weak) = sigmoid(r_s − r_w)``: the model a reward model is trained under, read with the
rewards as its logits (a pair kept at margin 1.0 has confidence > 0.73).

CLI (one process, or torchrun for TP/PP/DP: prompts are DP-sharded, every rank of a model replica
samples the same rows, the samples are gathered and the main rank writes the output)::

    python -m data_tools.synth_preferences --config CFG --strong CKPT --weak CKPT --prompts P.jsonl \\
        --output O.jsonl [--k 3] [--strong-temperature 0.7] [--weak-temperature 0.9] [--margin 1.0] \\
        [--batch-size N] [--rejects R.jsonl] [section.key=value ...]

Both checkpoints are policies of ``model.*`` (as written by ``hpa sft`` / ``hpa train``); top-p, top-k,
``max_new_tokens`` and the base seed come from ``rollout.*``. A JSON summary is printed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

DROP_REASONS = ("empty_response", "nonfinite_reward", "identical", "below_margin", "duplicate")
# separates the weak side's sampling seeds from the strong side's
WEAK_SEED_OFFSET = 1_000_003

Sample = Tuple[str, float]  # (response text, reward)
# (batch, response texts, ground truths) -> one reward per row
BatchRewardFn = Callable[[Any, List[str], List[Optional[str]]], Sequence[float]]


def bradley_terry_confidence(reward_chosen: float, reward_rejected: float) -> float:
    """``sigmoid(reward_chosen − reward_rejected)``, without overflow for large differences."""
    d = reward_chosen - reward_rejected
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


def cross_pairs(prompt: str, strong: Sequence[Sample], weak: Sequence[Sample], *, margin: float = 1.0,
                source: str = "synthetic", extra: Optional[Dict[str, Any]] = None,
                seen: Optional[Set[Tuple[str, str, str]]] = None) -> Tuple[List[Dict[str, Any]], Dict[str, int]]:
    """The kept cross pairs of one prompt's samples (see the module docstring).

    Args:
        prompt: the prompt text.
        strong, weak: ``(text, reward)`` samples of the strong and the weak policy.
        margin: a pair is kept when ``reward(strong) > reward(weak) + margin``.
        source: the ``source`` tag of the records.
        extra: fields copied into every record (e.g. ``{"ground_truth": ...}``).
        seen: ``(prompt, chosen, rejected)`` keys kept so far; updated in place, so passing the same
            set over several calls deduplicates across them.

    Returns:
        The records in (strong, weak) sample order, and the counts
        ``{"candidates", "kept", <each of DROP_REASONS>}``.
    """
    if not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number, got {margin}")
    seen = set() if seen is None else seen
    counts = {"candidates": len(strong) * len(weak), "kept": 0, **{r: 0 for r in DROP_REASONS}}
    records = []
    for chosen, r_s in strong:
        for rejected, r_w in weak:
            if not chosen.strip() or not rejected.strip():
                reason = "empty_response"
            elif not (math.isfinite(r_s) and math.isfinite(r_w)):
                reason = "nonfinite_reward"
            elif chosen == rejected:
                reason = "identical"
            elif not r_s > r_w + margin:
                reason = "below_margin"
            elif (prompt, chosen, rejected) in seen:
                reason = "duplicate"
            else:
                seen.add((prompt, chosen, rejected))
                records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, **(extra or {}),
                                "source": source, "chosen_source": "strong", "rejected_source": "weak",
                                "chosen_reward": r_s, "rejected_reward": r_w, "margin": r_s - r_w,
                                "confidence": bradley_terry_confidence(r_s, r_w)})
                counts["kept"] += 1
                continue
            counts[reason] += 1
    return records, counts


def synthesize(strong_engine, weak_engine, reward_fn: BatchRewardFn, prompts: Sequence, *, tokenizer,
               strong_params, weak_params, margin: float = 1.0, batch_size: int = 16, groups=None,
               source: str = "synthetic") -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Sample from two engines, score, and keep the cross pairs above the margin.

    Args:
        strong_engine, weak_engine: any two ``hpa.rollout.base.RolloutEngine``s.
        reward_fn: ``(batch, texts, ground_truths) -> [b]`` rewards of a ``RolloutBatch``'s rows
            (``hpa.reward.scoring.Scorer.batch_rewards``).
        prompts: ``hpa.data.prompts.PromptExample``s (``prompt``, ``prompt_ids``, ``ground_truth``).
        tokenizer: decodes the responses.
        strong_params, weak_params: ``SamplingParams`` (``n`` = k samples per prompt); chunk ``c`` of
            DP rank ``d`` samples with seed ``params.seed + c·dp + d``.
        margin: see ``cross_pairs``.
        batch_size: prompts per ``generate`` call on each DP rank.
        groups: ``ParallelGroups`` (prompts are DP-sharded and the samples gathered over DP); None for
            one process.

    Returns:
        The records (prompt order; identical on every rank) and a summary: ``num_prompts``,
        ``num_samples``, ``num_candidate_pairs``, ``num_kept``, ``dropped`` (by reason),
        ``mean_margin`` (kept pairs; None without any), ``mean_reward_strong``, ``mean_reward_weak``.
    """
    import torch

    from hpa.distributed import comm
    from hpa.engine.collate import chunks
    from hpa.rollout.base import decode_responses

    if not prompts:
        raise ValueError("no prompts to sample from")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    dp, dp_rank = (groups.data_parallel_size, groups.dp_rank) if groups is not None else (1, 0)
    mine = list(range(dp_rank, len(prompts), dp))
    local: Dict[int, Dict[str, List[Sample]]] = {}
    for c, rows in enumerate(chunks(len(mine), batch_size)):
        index = [mine[j] for j in rows]
        prompt_ids = [prompts[i].prompt_ids for i in index]
        for side, engine, params in (("strong", strong_engine, strong_params), ("weak", weak_engine, weak_params)):
            params = dataclasses.replace(params, seed=params.seed + c * dp + dp_rank)
            with torch.no_grad():
                batch = engine.generate(prompt_ids, params)
            texts = decode_responses(tokenizer, batch)
            owners = [index[int(g)] for g in batch.group_ids.tolist()]
            rewards = [float(r) for r in reward_fn(batch, texts, [prompts[i].ground_truth for i in owners])]
            for i, text, reward in zip(owners, texts, rewards):
                local.setdefault(i, {"strong": [], "weak": []})[side].append((text, reward))
    parts = [local] if groups is None else comm.all_gather_objects(local, groups.dp_group)
    samples = {i: s for part in parts for i, s in part.items()}
    if sorted(samples) != list(range(len(prompts))):
        raise RuntimeError("synthesize: the gathered samples do not cover every prompt exactly once")

    records: List[Dict[str, Any]] = []
    counts: Dict[str, int] = collections.Counter()
    seen: Set[Tuple[str, str, str]] = set()
    for i in range(len(prompts)):
        example = prompts[i]
        extra = {"ground_truth": example.ground_truth} if example.ground_truth is not None else None
        kept, c = cross_pairs(example.prompt, samples[i]["strong"], samples[i]["weak"], margin=margin,
                              source=source, extra=extra, seen=seen)
        records.extend(kept)
        counts.update(c)
    strong = [r for s in samples.values() for _, r in s["strong"]]
    weak = [r for s in samples.values() for _, r in s["weak"]]

    def mean(values):
        finite = [v for v in values if math.isfinite(v)]
        return sum(finite) / len(finite) if finite else None

    summary = {
        "num_prompts": len(prompts),
        "num_samples": len(strong) + len(weak),
        "num_candidate_pairs": counts["candidates"],
        "num_kept": counts["kept"],
        "dropped": {reason: counts[reason] for reason in DROP_REASONS},
        "mean_margin": mean([r["margin"] for r in records]),
        "mean_reward_strong": mean(strong),
        "mean_reward_weak": mean(weak),
    }
    return records, summary


def run_synth(cfg, groups, *, strong_path: str, weak_path: str, prompts_path: str, output_path: str, k: int = 3,
              strong_temperature: float = 0.7, weak_temperature: float = 0.9, margin: float = 1.0,
              batch_size: Optional[int] = None, rejects_path: Optional[str] = None) -> Dict[str, Any]:
    """Load both policies and the reward, run ``synthesize`` on ``prompts_path``, write ``output_path``.

    Args:
        cfg: the root ``Config`` (``model``, ``parallel``, ``data``, ``rollout``, ``reward``,
            ``trainer.micro_batch_size``).
        groups: ``ParallelGroups`` matching ``cfg.parallel``.
        rejects_path: where malformed prompt records go with ``data.on_error=skip`` (default
            ``<output name>.rejects.jsonl`` next to the output).
        batch_size: prompts per ``generate`` call on each DP rank (default
            ``trainer.global_batch_size / dp``).

    Returns:
        The ``synthesize`` summary plus the settings, paths and prompt-file counts (every rank).
    """
    from hpa.data.prompts import PromptDataset, rejects_path_for
    from hpa.data.tokenizer import build_tokenizer
    from hpa.models import build_policy, unwrap
    from hpa.rollout import build_rollout_engine
    from hpa.models.weights import load_model_weights
    from hpa.reward.scoring import Scorer, needs_ground_truth
    from hpa.rollout.base import SamplingParams, TokenizerInfo, WeightsFrom

    if k < 1:
        raise ValueError(f"--k must be >= 1, got {k}")
    if not math.isfinite(margin):
        raise ValueError(f"--margin must be a finite number, got {margin}")
    for flag, t in (("--strong-temperature", strong_temperature), ("--weak-temperature", weak_temperature)):
        if t < 0:
            raise ValueError(f"{flag} must be >= 0 (0 = greedy), got {t}")
    for flag, path in (("--strong", strong_path), ("--weak", weak_path)):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{flag} {path!r} is not a directory; give a policy checkpoint written by "
                                    "'hpa sft' or 'hpa train' (e.g. <run_dir>/sft)")
    g = groups
    tokenizer = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path)
    if rejects_path is None:
        rejects_path = rejects_path_for(os.path.dirname(os.path.abspath(output_path)), output_path)
    data = PromptDataset.load(prompts_path, tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                              prompt_truncation=cfg.data.prompt_truncation, on_error=cfg.data.on_error,
                              rejects_path=rejects_path if g.is_main else None,
                              apply_chat_template=cfg.data.apply_chat_template)
    if len(data) == 0:
        raise ValueError(f"no usable prompts in {prompts_path} ({data.stats['num_rejected']} rejected, "
                         f"see {rejects_path})")
    if needs_ground_truth(cfg.reward):
        missing = next((e for e in data if e.ground_truth is None), None)
        if missing is not None:
            raise ValueError(f"{missing.source}: key 'ground_truth' is missing, but the rule rewards "
                             f"reward.rules={list(cfg.reward.rules)} score against it; add a ground_truth to every "
                             "prompt record, or set reward.rules=[] and score with reward.model_paths")

    scorer = Scorer(cfg, g, reward=True, tokenizer=tokenizer)
    policies = []
    for path in (strong_path, weak_path):
        policy = build_policy(cfg.model, cfg.parallel, g)
        load_model_weights(policy, path, g)
        policy.eval()
        policies.append(unwrap(policy))
    engines = [build_rollout_engine(cfg.rollout, policies[0], g, TokenizerInfo.from_tokenizer(tokenizer),
                                    model_cfg=cfg.model, checkpoint_path=strong_path)]
    # one weight-copying engine (vLLM), synced from each policy in turn: one copy of the weights in memory
    # (and vLLM's sleep-mode allocator takes one engine per process)
    if engines[0].copies_weights:
        engines = [WeightsFrom(engines[0], policy) for policy in policies]
    else:
        engines.append(build_rollout_engine(cfg.rollout, policies[1], g, TokenizerInfo.from_tokenizer(tokenizer),
                                            model_cfg=cfg.model, checkpoint_path=weak_path))
    strong_params = SamplingParams.from_config(cfg.rollout, n=k, temperature=strong_temperature)
    weak_params = SamplingParams.from_config(cfg.rollout, n=k, temperature=weak_temperature,
                                             seed=cfg.rollout.seed + WEAK_SEED_OFFSET)
    if batch_size is None:
        batch_size = max(1, cfg.trainer.global_batch_size // g.data_parallel_size)
    records, summary = synthesize(engines[0], engines[1], scorer.batch_rewards, data, tokenizer=tokenizer,
                                  strong_params=strong_params, weak_params=weak_params, margin=margin,
                                  batch_size=batch_size, groups=g)
    if g.is_main:
        os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
        with open(output_path, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    summary.update(k=k, strong_temperature=strong_temperature, weak_temperature=weak_temperature, margin=margin,
                   strong=strong_path, weak=weak_path, prompts=prompts_path, output=output_path,
                   num_prompt_records_rejected=data.stats["num_rejected"],
                   rejects=rejects_path if data.stats["num_rejected"] else None)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_tools.synth_preferences", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu.yaml)")
    p.add_argument("--strong", required=True, help="the strong policy checkpoint (chosen side)")
    p.add_argument("--weak", required=True, help="the weak policy checkpoint (rejected side)")
    p.add_argument("--prompts", required=True, help='JSONL/Parquet of {"prompt", "ground_truth"?} records')
    p.add_argument("--output", required=True, help="JSONL of preference pairs to write")
    p.add_argument("--k", type=int, default=3, help="samples per prompt from each policy")
    p.add_argument("--strong-temperature", type=float, default=0.7)
    p.add_argument("--weak-temperature", type=float, default=0.9)
    p.add_argument("--margin", type=float, default=1.0, help="keep pairs with reward(strong) > reward(weak) + margin")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per generate call on each DP rank")
    p.add_argument("--rejects", default=None, help="malformed prompt records (data.on_error=skip); default: "
                                                   "<output name>.rejects.jsonl next to the output")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted config overrides")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, initialise distributed like ``hpa generate`` (torchrun or one process), run, print the summary."""
    from hpa.config import ConfigError, load_config
    from hpa.distributed import launched

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        with launched(load_config(args.config, args.overrides)) as (cfg, groups):
            summary = run_synth(cfg, groups, strong_path=args.strong, weak_path=args.weak, prompts_path=args.prompts,
                                output_path=args.output, k=args.k, strong_temperature=args.strong_temperature,
                                weak_temperature=args.weak_temperature, margin=args.margin,
                                batch_size=args.batch_size, rejects_path=args.rejects)
            if groups.is_main:
                print(json.dumps(summary, indent=2))
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"synth_preferences: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
