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

The guard is ``KLGuard`` (one implementation: ``hpa serve`` samples through it too), the loading of
the checkpoints and the engine ``load_policy``.

Layering note: this entry point sits at the trainer/cli level (it loads checkpoints and runs the
training forward); it imports ``hpa.trainer`` lazily inside ``run_generate`` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from hpa.rollout.base import RolloutBatch, SamplingParams, TokenizerInfo, decode_responses

logger = logging.getLogger(__name__)

_RETRY_SEED_STRIDE = 1_000_003  # separates the seeds of retry rounds from the first round's


def _response_kl(policy, reference, batch: RolloutBatch, groups, *, micro_batch_size: int,
                 vocab_size: int) -> torch.Tensor:
    """Per-response mean k1 KL to the reference ``[b]`` (temperature 1, sampled tokens)."""
    from hpa.algorithms.masked import masked_mean
    from hpa.engine.forward import response_kl

    kl = response_kl(policy, reference, batch, groups, micro_batch_size=micro_batch_size, vocab_size=vocab_size)
    return masked_mean(kl, batch.response_mask.float().cpu(), dim=1)  # [b]


def check_guard_args(*, guard_temperature: float, max_retries: int) -> None:
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    if guard_temperature < 0:
        raise ValueError(f"guard_temperature must be >= 0 (0 = greedy), got {guard_temperature}")


@dataclasses.dataclass
class GuardedBatch:
    """What ``KLGuard.generate`` returns.

    Attributes:
        batch: the responses, regenerated rows replaced.
        kl: ``[b]`` the KL of each returned response (NaN when the guard is off and no KL is scored).
        kl_before: ``[b]`` the KL of the first-round response.
        regenerated: ``[b]`` bool, the row was sampled again at the guard temperature.
    """

    batch: RolloutBatch
    kl: torch.Tensor
    kl_before: torch.Tensor
    regenerated: torch.Tensor


class KLGuard:
    """The HPA KL guard around a rollout engine (see the module docstring); ``hpa generate`` and
    ``hpa serve`` both sample through it.

    Args:
        engine: a ``RolloutEngine`` on ``policy``'s weights.
        policy, reference: the models the KL is scored with (``reference is policy``: KL 0, no second forward).
        groups: the policy's ``ParallelGroups``; the regenerate-or-not decision is collective over DP.
        micro_batch_size: rows per log-prob forward.
        vocab_size: the tokenizer's true vocabulary.
        kl_threshold: responses whose KL is above it are regenerated.
        guard_temperature: the sampling temperature of regenerations.
        max_retries: regeneration rounds (0: none, the KL is still scored).
        score: score the KL at all (False: no reference forward, ``kl`` is NaN, nothing is regenerated).
    """

    def __init__(self, engine, policy, reference, groups, *, micro_batch_size: int, vocab_size: int,
                 kl_threshold: float = 0.1, guard_temperature: float = 0.5, max_retries: int = 1,
                 score: bool = True):
        check_guard_args(guard_temperature=guard_temperature, max_retries=max_retries)
        self.engine, self.policy, self.reference, self.groups = engine, policy, reference, groups
        self.micro_batch_size, self.vocab_size = micro_batch_size, vocab_size
        self.kl_threshold, self.guard_temperature = kl_threshold, guard_temperature
        self.max_retries, self.score = max_retries, score

    def _kl(self, batch: RolloutBatch) -> torch.Tensor:
        return _response_kl(self.policy, self.reference, batch, self.groups,
                            micro_batch_size=self.micro_batch_size, vocab_size=self.vocab_size)  # [b]

    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams) -> GuardedBatch:
        """``params.n`` responses per prompt; rows above the threshold are sampled again (one response
        each, at ``guard_temperature``, with seeds derived from ``params.seed``). Collective over DP:
        every DP rank must call it the same number of times."""
        from hpa.distributed import comm

        batch = self.engine.generate(prompts, params)
        b = batch.batch_size
        if not self.score:
            nan = torch.full((b,), float("nan"))
            return GuardedBatch(batch, nan, nan.clone(), torch.zeros(b, dtype=torch.bool))
        kl = self._kl(batch)  # [b]
        kl_before = kl.clone()
        regenerated = torch.zeros(b, dtype=torch.bool)
        row_prompts = [prompts[int(i)] for i in batch.group_ids.tolist()]
        for attempt in range(self.max_retries):
            # a collective decision: every DP rank runs (or skips) the round together
            over = (kl > self.kl_threshold).nonzero(as_tuple=True)[0]  # [k]
            flag = torch.tensor([float(len(over) > 0)])
            if comm.all_reduce_max(flag, self.groups.dp_group).item() == 0:
                break
            keep_result = len(over) > 0
            if not keep_result:
                over = torch.tensor([0])  # dummy row, result discarded
            retry = self.engine.generate([row_prompts[i] for i in over.tolist()], dataclasses.replace(
                params, n=1, temperature=self.guard_temperature,
                seed=params.seed + (attempt + 1) * _RETRY_SEED_STRIDE))
            retry_kl = self._kl(retry)  # [k]
            if not keep_result:
                continue
            batch = _replace_rows(batch, over, retry)
            kl[over] = retry_kl
            regenerated[over] = True
        return GuardedBatch(batch, kl, kl_before, regenerated)


@dataclasses.dataclass
class LoadedPolicy:
    """A policy checkpoint ready to sample from: its tokenizer, models, engine and ``KLGuard``."""

    tokenizer: Any
    policy: Any
    reference: Any
    engine: Any
    reference_is_policy: bool


def load_policy(cfg, groups, *, command: str, load_reference: bool = True,
                engine_kwargs: Optional[Dict[str, Any]] = None) -> LoadedPolicy:
    """Build and load ``model.policy_path`` (and ``model.reference_path``), and the rollout engine on it.

    Args:
        cfg: the root ``Config`` (``model``, ``parallel``, ``data`` tokenizer, ``rollout``).
        groups: ``ParallelGroups`` matching ``cfg.parallel``.
        command: named in messages (``hpa generate``, ``hpa serve``).
        load_reference: False: the reference is not built (no KL will be scored).
        engine_kwargs: engine-specific ``build_rollout_engine`` arguments.
    """
    from hpa.data.tokenizer import build_tokenizer
    from hpa.models import build_policy, build_reference, unwrap
    from hpa.models.weights import load_model_weights
    from hpa.rollout import build_rollout_engine

    m, g = cfg.model, groups
    if not m.policy_path:
        raise ValueError(f"{command} needs model.policy_path (a checkpoint written by save_model_weights, "
                         "e.g. <run_dir>/sft)")
    tokenizer = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path, model_vocab_size=m.vocab_size)
    policy = build_policy(m, cfg.parallel, g)
    load_model_weights(policy, m.policy_path, g)
    reference_is_policy = (not m.reference_path
                           or os.path.realpath(m.reference_path) == os.path.realpath(m.policy_path))
    if reference_is_policy or not load_reference:
        if load_reference:
            logger.info("%s: the reference is the policy checkpoint %s, so every KL is 0 and the guard "
                        "never fires; set model.reference_path to guard against another model", command,
                        m.policy_path)
        reference = policy
    else:
        reference = build_reference(m, cfg.parallel, g)
        load_model_weights(reference, m.reference_path, g)
    policy.eval()
    reference.eval()
    engine = build_rollout_engine(cfg.rollout, unwrap(policy), g, TokenizerInfo.from_tokenizer(tokenizer),
                                  model_cfg=m, checkpoint_path=m.policy_path, **(engine_kwargs or {}))
    engine.sync_weights()  # the policy does not change here: one sync (vLLM) serves every call
    return LoadedPolicy(tokenizer, policy, reference, engine, reference_is_policy)


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
    from hpa.data.prompts import PromptDataset
    from hpa.distributed import comm

    check_guard_args(guard_temperature=guard_temperature, max_retries=max_retries)
    g = groups
    loaded = load_policy(cfg, g, command="hpa generate")
    tokenizer, reference_is_policy = loaded.tokenizer, loaded.reference_is_policy
    guard = KLGuard(loaded.engine, loaded.policy, loaded.reference, g, micro_batch_size=cfg.trainer.micro_batch_size,
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
    if g.is_main:
        os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
        with open(output_path, "w") as f:
            for r in gathered:
                f.write(json.dumps({k: r[k] for k in ("prompt", "response", "kl", "regenerated",
                                                      "finish_reason")}) + "\n")
    return summary


def _replace_rows(batch: RolloutBatch, rows: torch.Tensor, new: RolloutBatch) -> RolloutBatch:
    """``batch`` with rows ``rows`` replaced by ``new``'s rows (in order); group ids kept."""
    order = list(range(batch.batch_size))
    new_pos = {int(r): k for k, r in enumerate(rows.tolist())}
    keep = [i for i in order if i not in new_pos]
    merged = RolloutBatch.concat([batch.select(keep), new.select(list(range(new.batch_size)))]) if keep \
        else new.select(list(range(new.batch_size)))
    # merged rows: keep... then new...; put them back into the original order
    where = {i: k for k, i in enumerate(keep)}
    where.update({i: len(keep) + new_pos[i] for i in new_pos})
    out = merged.select([where[i] for i in order])
    out.group_ids = batch.group_ids.clone()
    return out


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
    from hpa.config import ConfigError, load_config
    from hpa.distributed import launched

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        with launched(load_config(args.config, args.overrides)) as (cfg, groups):
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
