"""``hpa generate``: sample one response per prompt from a checkpoint, with the HPA KL guard.

The HPA recipe: "when a response's KL to the reference is above 0.1, regenerate it at temperature
0.5". For each sampled response ``y`` the guard computes

    kl(y) = mean_t [ log π(y_t | y_<t) − log π_ref(y_t | y_<t) ]

over the response tokens (the k1 estimator, ``hpa.algorithms.kl.kl_penalty(kind="k1")``, on the
sampled tokens), with both log-probs at temperature 1 (the models' own distributions, whatever
temperature sampled the tokens), over the tokenizer's true vocabulary. Responses above
``kl_threshold`` are sampled again at ``guard_temperature`` (up to ``max_retries`` rounds; each round
retries the rows still above the threshold); the regenerated response and its KL are kept.

The reference defaults to the policy checkpoint (``model.reference_path`` unset or equal to
``model.policy_path``): the same model then scores both sides, every KL is exactly 0 and nothing is
regenerated (the summary says ``reference_is_policy``).

Layout: prompts are DP-sharded round-robin (prompt ``i`` on DP rank ``i % dp``); every rank of a
TP×PP model-parallel group generates and scores the same rows. The records are gathered over DP and
written by the main rank in prompt order.

The guard is ``hpa.inference.KLGuard`` (one implementation: ``hpa serve`` samples through it
too), the loading of the checkpoints and the engine ``hpa.inference.load_policy``.

Layering note: this entry point sits at the trainer/cli level (it loads checkpoints and runs the
training forward); its guard and loading live in ``hpa.inference``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Optional

from hpa import distributed
from hpa.config import ConfigError, load_config
from hpa.data.prompts import PromptDataset
from hpa.distributed import comm
from hpa.distributed.init import read_launch_env
from hpa.engine.batching import Batching
from hpa.inference import KLGuard, check_guard_args, load_policy
from hpa.rollout.base import SamplingParams, decode_responses


def run_generate(cfg, groups, *, prompts_path: str, output_path: str, kl_threshold: float = 0.1,
                 guard_temperature: float = 0.5, max_retries: int = 1,
                 batch_size: Optional[int] = None) -> Dict[str, Any]:
    """Generate one response per prompt with the KL guard and write JSONL (see the module docstring).

    Args:
        cfg: the root ``Config``; uses ``model`` (``policy_path`` required, ``reference_path``),
            ``parallel``, ``data`` (tokenizer, prompt length/truncation), ``rollout`` (sampling) and
            ``trainer.micro_batch_size`` (log-prob forward).
        groups: ``ParallelGroups`` matching ``cfg.parallel``.
        prompts_path: JSONL/Parquet of ``{"prompt": str}`` records.
        output_path: JSONL written by the main rank, one record per prompt in input order:
            ``{"prompt", "response", "kl", "regenerated", "finish_reason"}``.
        kl_threshold: responses whose KL is above it are regenerated.
        guard_temperature: the sampling temperature of regenerations.
        max_retries: regeneration rounds (0 turns the guard off; the KL is still reported).
        batch_size: prompts per ``generate`` call on each DP rank (default
            ``trainer.global_batch_size / dp``).

    Returns:
        Summary (identical on every rank): ``num_prompts``, ``num_regenerated``, ``kl_mean_before``,
        ``kl_mean_after``, ``kl_max_after``, ``reference_is_policy``, ``output_path``.
    """
    check_guard_args(guard_temperature=guard_temperature, max_retries=max_retries)
    g = groups
    loaded = load_policy(cfg, g, command="hpa generate")
    tokenizer, reference_is_policy = loaded.tokenizer, loaded.reference_is_policy
    guard = KLGuard(loaded.engine, loaded.policy, loaded.reference, g,
                    batching=Batching(micro_batch_size=cfg.trainer.micro_batch_size, pad_id=tokenizer.pad_id),
                    vocab_size=tokenizer.vocab_size, kl_threshold=kl_threshold,
                    guard_temperature=guard_temperature, max_retries=max_retries)

    data = PromptDataset.load(prompts_path, tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                              prompt_truncation=cfg.data.prompt_truncation, on_error=cfg.data.on_error,
                              apply_chat_template=cfg.data.apply_chat_template)
    if len(data) == 0:
        raise ValueError(f"no prompts in {prompts_path}")
    dp, dp_rank = g.data_parallel_size, g.dp_rank
    mine = list(range(dp_rank, len(data), dp))  # global prompt indices of this DP rank
    if batch_size is None:
        batch_size = max(1, cfg.trainer.global_batch_size // dp)
    # every DP rank runs the same number of generate calls (the last ones may be short or repeats)
    per_rank = -(-len(data) // dp)  # ceil
    num_chunks = -(-per_rank // batch_size)  # ceil
    base = SamplingParams.from_config(cfg.rollout, n=1)

    records: List[Dict[str, Any]] = []
    for c in range(num_chunks):
        index = mine[c * batch_size:(c + 1) * batch_size]
        real = len(index)
        if real == 0:  # this rank ran out: a dummy call keeps the ranks in step
            index = [0]
        prompts = [data[i].prompt_ids for i in index]
        out = guard.generate(prompts, dataclasses.replace(base, seed=base.seed + c * dp + dp_rank))
        batch, kl, kl_before, regenerated = out.batch, out.kl, out.kl_before, out.regenerated
        texts = decode_responses(tokenizer, batch)
        for j in range(real):
            records.append({"index": index[j], "prompt": data[index[j]].prompt,
                            "response": texts[j], "kl": float(kl[j]),
                            "kl_before": float(kl_before[j]), "regenerated": bool(regenerated[j]),
                            "finish_reason": batch.finish_reasons[j]})

    gathered = [r for part in comm.all_gather_objects(records, g.dp_group) for r in part]
    gathered.sort(key=lambda r: r["index"])
    if [r["index"] for r in gathered] != list(range(len(data))):
        raise RuntimeError("hpa generate: gathered records do not cover every prompt exactly once")
    return _summary(gathered, output_path, kl_threshold=kl_threshold, guard_temperature=guard_temperature,
                    reference_is_policy=reference_is_policy, is_main=g.is_main)


def _summary(gathered: List[Dict[str, Any]], output_path: str, *, kl_threshold: float, guard_temperature: float,
             reference_is_policy: bool, is_main: bool) -> Dict[str, Any]:
    """The summary of every prompt's record (in input order); the main rank writes the records' JSONL."""
    n = len(gathered)
    summary = {
        "num_prompts": n,
        "num_regenerated": sum(r["regenerated"] for r in gathered),
        "kl_mean_before": sum(r["kl_before"] for r in gathered) / n,
        "kl_mean_after": sum(r["kl"] for r in gathered) / n,
        "kl_max_after": max(r["kl"] for r in gathered),
        "kl_threshold": kl_threshold,
        "guard_temperature": guard_temperature,
        "reference_is_policy": reference_is_policy,
        "output_path": output_path,
    }
    if is_main:
        os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
        with open(output_path, "w") as f:
            for r in gathered:
                f.write(json.dumps({k: r[k] for k in ("prompt", "response", "kl", "regenerated",
                                                      "finish_reason")}) + "\n")
    return summary



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpa generate",
                                description="generate from a checkpoint, with a KL guard")
    p.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu.yaml)")
    p.add_argument("--prompts", required=True, help='JSONL of {"prompt": ...} records')
    p.add_argument("--output", required=True, help="JSONL to write")
    p.add_argument("--kl-threshold", type=float, default=0.1)
    p.add_argument("--guard-temperature", type=float, default=0.5)
    p.add_argument("--max-retries", type=int, default=1)
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """``hpa generate --config X --prompts P --output O [--kl-threshold 0.1] [--guard-temperature 0.5]
    [overrides...]``; initialises distributed like ``hpa train`` (torchrun or a single process)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if not os.path.isfile(args.prompts):
            raise ConfigError("--prompts", f"{args.prompts!r} is not a file; give a JSONL or Parquet file of "
                                           "prompts", source="command line")
        cfg = load_config(args.config, args.overrides, world_size=read_launch_env().world_size, command="generate")
        with distributed.launched(cfg) as (cfg, groups):
            summary = run_generate(cfg, groups, prompts_path=args.prompts, output_path=args.output,
                                   kl_threshold=args.kl_threshold, guard_temperature=args.guard_temperature,
                                   max_retries=args.max_retries)
            if groups.is_main:
                print(json.dumps(summary))
    except ConfigError as exc:
        print(f"hpa generate: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
