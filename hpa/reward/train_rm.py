"""``hpa train-rm``: Bradley-Terry training of a reward model ensemble on preference pairs.

One step: this DP rank's share of ``trainer.preference_batch_size`` pairs → micro-batches of
``trainer.micro_batch_size`` pairs, each one forward of ``[chosen; rejected]`` (``[2m, s]``,
right-padded) → scores at each sequence's last token ``[2m, K]`` → per-head Bradley-Terry loss
weighted by the heads' bootstrap counts → megatron's pipeline schedule, DDP and optimizer.

Loss: ``L = 1/(N·K) · Σ_pairs Σ_heads w_ik · −log σ(r_c,ik − r_r,ik − margin)`` with N the GLOBAL
number of pairs of the step (all DP ranks, all micro-batches), as ``hpa.engine.step`` requires.
The bootstrap counts ``w`` are drawn once for the whole training set from ``trainer.seed``, so every
TP/PP rank of a replica (every rank, in fact) holds the same table, independent of the layout.

Outputs in ``trainer.run_dir``: ``config.yaml``, ``rm_metrics.jsonl`` (one JSON object per step with
``step``; eval metrics on evaluation steps) and ``reward_model/`` (megatron distributed checkpoint,
loadable by ``hpa.reward.model.ModelReward`` under any TP/PP layout).

Metrics: ``rm/loss`` (the objective above), ``rm/accuracy`` (training pairs, ensemble mean, before the
update), ``rm/grad_norm``, ``rm/lr``, ``rm/updated``; on evaluation steps ``rm/eval_accuracy`` (ensemble mean),
``rm/eval_accuracy_head{k}``, ``rm/eval_loss`` (unweighted, with the margin), ``rm/eval_sigma_mean``
(population std over heads, averaged over chosen and rejected sequences), ``rm/eval_num_pairs``.
A tie counts as a wrong ordering.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from hpa.config import ConfigError, load_config, write_resolved
from hpa.config.schema import Config, ModelConfig
from hpa.data import DistributedBatchSampler, PreferenceDataset, build_tokenizer
from hpa.distributed import ParallelGroups, launched, read_launch_env, set_seed
from hpa.distributed.console import due as console_due
from hpa.distributed.console import progress_bar
from hpa.distributed.comm import all_reduce_sum, barrier, broadcast_tensor
from hpa.models import build_reward
from hpa.registry import Registry
from hpa.reward.model import (architecture_of, check_same_tokenizer, checkpoint_tokenizer, gather_last_token,
                              read_reward_model_info, score_sequences,
                              tokenizer_record, write_reward_model_info)
from hpa.models.weights import load_model_weights, save_model_weights
from hpa.engine.batching import Batching
from hpa.engine.collate import TokenRows, collate, pair_groups, pair_rows
from hpa.engine.micro_batch import MicroBatch
from hpa.engine.optimizer import make_trainable
from hpa.engine.step import forward_backward, optimizer_step, zero_grad

logger = logging.getLogger(__name__)

BOOTSTRAP_KINDS = Registry("bootstrap kind")

METRICS_FILE = "rm_metrics.jsonl"
REWARD_MODEL_DIR = "reward_model"
_EVAL_SPLIT_SALT = 0x5EED  # keeps the eval split independent of the sampler's shuffling stream


# ---------------------------------------------------------------------------------------------------
# Pure math


@BOOTSTRAP_KINDS.register("poisson")
def _poisson_bootstrap(num_pairs: int, num_heads: int, generator: torch.Generator) -> torch.Tensor:
    return torch.poisson(torch.ones(num_pairs, num_heads, dtype=torch.float64), generator=generator).long()


@BOOTSTRAP_KINDS.register("multinomial")
def _multinomial_bootstrap(num_pairs: int, num_heads: int, generator: torch.Generator) -> torch.Tensor:
    draws = torch.randint(0, num_pairs, (num_heads, num_pairs), generator=generator)  # [K, N]
    return torch.stack([torch.bincount(d, minlength=num_pairs) for d in draws], dim=1)  # [N, K]


def bootstrap_weights(num_pairs: int, num_heads: int, seed: int, kind: str = "poisson") -> torch.Tensor:
    """Integer bootstrap counts of every pair for every head: ``[N, K]`` int64.

    ``poisson``: independent Poisson(1) counts; ``multinomial``: each head draws N pairs with
    replacement. Deterministic in ``seed`` (a CPU generator), so all ranks compute the same table.
    """
    if num_pairs < 1 or num_heads < 1:
        raise ValueError(f"need num_pairs >= 1 and num_heads >= 1, got {num_pairs}, {num_heads}")
    generator = torch.Generator().manual_seed(seed)
    return BOOTSTRAP_KINDS.get(kind)(num_pairs, num_heads, generator)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, *, num_pairs: int, margin: float = 0.0,
                       weights: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``1/(N·K) · Σ_i Σ_k w_ik · −log σ(chosen_ik − rejected_ik − margin)``.

    Args:
        chosen, rejected: ``[b, K]`` scores of this micro-batch.
        num_pairs: N, the number of pairs the loss is normalised by (global over DP and micro-batches).
        margin: required gap between chosen and rejected.
        weights: ``[b, K]`` per-pair, per-head counts (bootstrap); None: all ones.

    Returns:
        The loss (a scalar) and detached sums: ``correct`` (pairs the ensemble mean orders right),
        ``num_pairs`` (b).
    """
    if chosen.shape != rejected.shape or chosen.dim() != 2:
        raise ValueError(f"chosen and rejected must both be [b, K], got {tuple(chosen.shape)} and "
                         f"{tuple(rejected.shape)}")
    per_pair = -F.logsigmoid(chosen.float() - rejected.float() - margin)  # [b, K]
    if weights is not None:
        per_pair = per_pair * weights.to(per_pair.dtype)
    loss = per_pair.sum() / (num_pairs * chosen.shape[1])
    with torch.no_grad():
        correct = (chosen.float().mean(dim=1) > rejected.float().mean(dim=1)).sum().float()
    return loss, {"loss": loss.detach(), "correct": correct,
                  "num_pairs": torch.tensor(float(chosen.shape[0]), device=chosen.device)}


def eval_sums(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Sums for held-out metrics of ``[n, K]`` scores: ``[K + 4]`` float64 =
    (correct per head [K], correct of the ensemble mean, Σ mean-over-heads BT loss, Σ σ over the 2n
    sequences, n)."""
    c, r = chosen.double(), rejected.double()
    per_head = (c > r).sum(dim=0).double()  # [K]
    ensemble = (c.mean(dim=1) > r.mean(dim=1)).sum().double()
    loss = (-F.logsigmoid(c - r - margin)).mean(dim=1).sum()
    sigma = torch.cat([c, r]).std(dim=1, correction=0).sum()
    return torch.cat([per_head, torch.stack([ensemble, loss, sigma, torch.tensor(float(c.shape[0]),
                                                                                  dtype=torch.float64)])])


def eval_metrics(sums: torch.Tensor) -> Dict[str, float]:
    """``rm/eval_*`` metrics from DP-summed ``eval_sums``."""
    k = sums.numel() - 4
    n = max(float(sums[-1]), 1.0)
    out = {"rm/eval_accuracy": float(sums[k]) / n, "rm/eval_loss": float(sums[k + 1]) / n,
           "rm/eval_sigma_mean": float(sums[k + 2]) / (2 * n), "rm/eval_num_pairs": float(sums[-1])}
    out.update({f"rm/eval_accuracy_head{i}": float(sums[i]) / n for i in range(k)})
    return out


def split_eval(num_pairs: int, eval_fraction: float, seed: int) -> Tuple[List[int], List[int]]:
    """A fixed, seeded split of ``range(num_pairs)`` into (train, eval) index lists (both ascending)."""
    num_eval = int(round(eval_fraction * num_pairs))
    if eval_fraction > 0:
        num_eval = max(num_eval, 1)
    if num_eval >= num_pairs:
        raise ConfigError("reward.training.eval_fraction", f"{eval_fraction} of {num_pairs} pairs leaves "
                          "no training pairs; lower it or add data")
    order = np.random.default_rng([seed, _EVAL_SPLIT_SALT]).permutation(num_pairs)
    return sorted(order[num_eval:].tolist()), sorted(order[:num_eval].tolist())


# ---------------------------------------------------------------------------------------------------
# Batches


def pair_token_rows(examples: Sequence, pad_id: int, weights: Optional[torch.Tensor] = None) -> TokenRows:
    """The pairs' rows, every chosen row, then every rejected row (``[2m, s]``, right-padded to the longest), with
    ``attention_mask`` ``[2m, s]`` and, when given, each pair's ``weights`` ``[m, K]`` on both its rows ``[2m, K]``."""
    rows = pair_rows(examples, pad_id)
    mask = (torch.arange(rows.input_ids.shape[1])[None, :] < rows.lengths[:, None]).long()  # [2m, s]
    per_row = {} if weights is None else {"weights": torch.cat([weights, weights])}
    return dataclasses.replace(rows, labels=None, positional={"attention_mask": mask}, per_row=per_row)


def pair_micro_batches(examples: Sequence, pad_id: int, micro_batch_size: int,
                       weights: Optional[torch.Tensor] = None, packed: bool = False) -> List[MicroBatch]:
    """Micro-batches of ``micro_batch_size`` pairs, chosen rows first (``pair_token_rows``): padded, every one
    of the step's whole width ``s``; ``packed`` (``trainer.sequence_packing``), their real tokens alone. On the
    host: ``forward_backward`` moves them."""
    rows = pair_token_rows(examples, pad_id, weights)
    return collate("pairs", rows, pair_groups(len(examples), micro_batch_size), packed=packed, cut=False)


# ---------------------------------------------------------------------------------------------------
# The run


def _check(cfg: Config, groups: ParallelGroups) -> None:
    p, t = cfg.parallel, cfg.trainer
    if (groups.tensor_model_parallel_size, groups.pipeline_model_parallel_size) != \
            (p.tensor_model_parallel_size, p.pipeline_model_parallel_size):
        raise ValueError(f"the process groups are {groups.layout} but the config asks for "
                         f"tp{p.tensor_model_parallel_size}_pp{p.pipeline_model_parallel_size}")
    per_rank = t.preference_batch_size // groups.data_parallel_size
    if t.preference_batch_size % groups.data_parallel_size or per_rank % t.micro_batch_size:
        raise ConfigError("trainer.preference_batch_size", f"{t.preference_batch_size} pairs per step must "
                          f"split into micro-batches of trainer.micro_batch_size={t.micro_batch_size} pairs on "
                          f"each of the {groups.data_parallel_size} data-parallel ranks; make it a multiple of "
                          f"{t.micro_batch_size * groups.data_parallel_size}")
    d = cfg.data
    if d.max_prompt_length + d.max_response_length > cfg.model.max_sequence_length:
        raise ConfigError("data.max_response_length", f"max_prompt_length + max_response_length = "
                          f"{d.max_prompt_length + d.max_response_length} exceeds model.max_sequence_length="
                          f"{cfg.model.max_sequence_length}; shorten them or raise the model's length")


def recorded_architecture(path: str) -> Tuple[Optional[Dict[str, object]], Optional[Path]]:
    """The architecture a starting checkpoint records, and the file it comes from: a reward model's
    ``hpa_reward_model.json``, else the ``config.yaml`` of the run that wrote it (``<run_dir>/sft``,
    ``<run_dir>/reward_model``); ``(None, None)`` when neither is there."""
    info = read_reward_model_info(path)
    if info is not None and "architecture" in info:
        return info["architecture"], Path(path, "hpa_reward_model.json")
    run_config = Path(path).resolve().parent / "config.yaml"
    if run_config.is_file():
        import yaml

        model = (yaml.safe_load(run_config.read_text()) or {}).get("model")
        if isinstance(model, dict):
            return model, run_config
    return None, None


def check_recorded_architecture(model: ModelConfig, path: str, key: str) -> None:
    """The reward model is built from ``model.*``; a starting checkpoint of another size (say, the SFT
    model of a smaller backbone) needs those dimensions: say which to set instead of a shape error."""
    arch, source = recorded_architecture(path)
    if arch is None:
        return
    ours = architecture_of(model)
    differ = {k: arch[k] for k in ours if k in arch and arch[k] != ours[k]}
    if differ:
        fix = " ".join(f"model.{k}={'null' if v is None else v}" for k, v in differ.items())
        raise ConfigError(key, f"{path} is a model with {differ} ({source}) but the reward model is built from "
                               f"model.* ({ {k: ours[k] for k in differ} }); give the reward model that backbone's "
                               f"dimensions: {fix}")


def _check_start_tokenizer(rt, tokenizer: Dict[str, object]) -> None:
    """A starting checkpoint trained with another tokenizer embeds other pieces under the same ids: refused by
    name where its record or its run's config.yaml says which tokenizer it had (``checkpoint_tokenizer``)."""
    for key, path in (("reward.training.init_path", rt.init_path), ("reward.training.backbone_path", rt.backbone_path)):
        recorded, source = checkpoint_tokenizer(path) if path is not None else (None, None)
        if recorded is not None:
            check_same_tokenizer(recorded, tokenizer, key=key, what=f"the starting checkpoint {path}", source=source)


class _MetricsSink:
    """Appends one JSON object per line to ``rm_metrics.jsonl`` on the main rank."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled

    def write(self, record: Dict[str, float]) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def _replica_sum(values: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Last-stage values → every rank of the pipeline, then summed over DP (float64 ``[n]``)."""
    broadcast_tensor(values, groups.last_stage_global_rank(), groups.pp_group)
    return all_reduce_sum(values, groups.dp_group)


def evaluate(model, examples: Sequence, groups: ParallelGroups, *, num_heads: int, pad_id: int,
             micro_batch_size: int, margin: float = 0.0, chunk_pairs: int = 256,
             packed: bool = False) -> Dict[str, float]:
    """Held-out ``rm/eval_*`` metrics; each DP rank scores ``examples[dp_rank::dp]``. Every rank of
    the job must call it with the same ``examples``; all get the same metrics."""
    shard = list(examples)[groups.dp_rank::groups.data_parallel_size]
    sums = torch.zeros(num_heads + 4, dtype=torch.float64)
    for start in range(0, len(shard), chunk_pairs):
        part = shard[start:start + chunk_pairs]
        rows = pair_token_rows(part, pad_id)
        scores, _ = score_sequences(model, rows.input_ids, rows.positional["attention_mask"], groups,
                                    num_heads=num_heads,
                                    batching=Batching(micro_batch_size=2 * micro_batch_size, pad_id=pad_id,
                                                      packed=packed))  # [2n, K]
        sums += eval_sums(scores[:len(part)].cpu(), scores[len(part):].cpu(), margin)
    return eval_metrics(all_reduce_sum(sums.to(groups.device), groups.dp_group).cpu())


def save_reward_model(model, run_dir: Path, groups: ParallelGroups, *, num_heads: int, model_cfg: ModelConfig,
                      tokenizer: Dict[str, object], step: int) -> Path:
    """Write ``run_dir/reward_model`` (replacing an older one only once the new one is complete), with
    its architecture (``model_cfg``) and tokenizer recorded, so it loads next to a policy of another size."""
    final, tmp = run_dir / REWARD_MODEL_DIR, run_dir / (REWARD_MODEL_DIR + ".tmp")
    if groups.is_main and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    save_model_weights(model, tmp, groups)
    if groups.is_main:
        write_reward_model_info(tmp, num_heads=num_heads, model=model_cfg, tokenizer=tokenizer, step=step)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    barrier()
    return final


def run_train_rm(cfg: Config, *, groups: Optional[ParallelGroups] = None) -> Dict[str, float]:
    """Train the reward model of ``cfg`` and return the final metrics (last step and final eval).

    Args:
        cfg: the whole config (this entry point reads model, parallel, data, reward, optim, trainer).
        groups: already initialised process groups (tests); None: initialise from the launcher's
            environment and tear down at the end.
    """
    if cfg.model.lora.enabled:  # before any process group or model: the reward model trains every weight
        raise ConfigError("model.lora.rank", f"hpa train-rm trains every weight of the reward model (model.lora.rank "
                          f"is {cfg.model.lora.rank}); LoRA is for hpa train: pass model.lora.rank=0 to train-rm")
    if groups is not None:
        return _train(cfg, groups)
    with launched(cfg) as (cfg, groups):
        return _train(cfg, groups)


def _datasets(cfg: Config, tokenizer, run_dir: Path, groups: ParallelGroups) -> Tuple[List, List]:
    """The training pairs and the held-out ones (``reward.training.eval_path``, else a split of the pairs)."""
    rt = cfg.reward.training
    rejects_dir = (cfg.data.rejects_dir or str(run_dir / "rejects")) if groups.is_main else None
    dataset = PreferenceDataset.from_config(cfg.data, tokenizer, rejects_dir=rejects_dir)
    if rt.eval_path is None:
        train_idx, eval_idx = split_eval(len(dataset), rt.eval_fraction, cfg.trainer.seed)
        return [dataset[i] for i in train_idx], [dataset[i] for i in eval_idx]
    d = cfg.data
    return list(dataset), list(PreferenceDataset.load(
        rt.eval_path, tokenizer, max_prompt_length=d.max_prompt_length, max_response_length=d.max_response_length,
        prompt_truncation=d.prompt_truncation, response_truncation=d.response_truncation, on_error=d.on_error,
        apply_chat_template=d.apply_chat_template, append_eos=d.append_eos))


def _train(cfg: Config, groups: ParallelGroups) -> Dict[str, float]:
    _check(cfg, groups)
    t, rt, num_heads = cfg.trainer, cfg.reward.training, cfg.reward.num_heads
    run_dir = Path(t.run_dir)
    if groups.is_main:
        write_resolved(cfg, run_dir)
        (run_dir / METRICS_FILE).unlink(missing_ok=True)
    barrier()

    tokenizer = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path, model_vocab_size=cfg.model.vocab_size)
    train_set, eval_set = _datasets(cfg, tokenizer, run_dir, groups)
    weights = (bootstrap_weights(len(train_set), num_heads, t.seed, rt.bootstrap_kind) if rt.bootstrap
               else torch.ones(len(train_set), num_heads, dtype=torch.long))  # [N, K]
    sampler = DistributedBatchSampler(len(train_set), global_batch_size=t.preference_batch_size,
                                      dp_rank=groups.dp_rank, dp_size=groups.data_parallel_size,
                                      seed=cfg.data.seed if cfg.data.seed is not None else t.seed,
                                      shuffle=cfg.data.shuffle)

    _check_start_tokenizer(rt, tokenizer_record(tokenizer))
    set_seed(t.seed)
    model = build_reward(cfg.model, cfg.parallel, groups, num_heads=num_heads)
    if rt.init_path is not None:
        check_recorded_architecture(cfg.model, rt.init_path, "reward.training.init_path")
        load_model_weights(model, rt.init_path, groups)
    elif rt.backbone_path is not None:  # the policy's output layer is the vocabulary, not the heads
        check_recorded_architecture(cfg.model, rt.backbone_path, "reward.training.backbone_path")
        load_model_weights(model, rt.backbone_path, groups, exclude_prefixes=("output_layer.",))
    trainable = make_trainable(model, cfg.optim, cfg.parallel, groups, t.total_steps)
    ddp, optimizer, scheduler = trainable.model, trainable.optimizer, trainable.scheduler
    sink = _MetricsSink(run_dir, groups.is_main)
    bar = progress_bar("train-rm", t.total_steps) if groups.is_main and cfg.logging.progress_bar else None
    pad_id, margin, num_pairs = tokenizer.pad_id, rt.margin, t.preference_batch_size

    def loss_fn(batch, output, hidden):
        scores = gather_last_token(MicroBatch.of(batch).unpack(output), batch["attention_mask"])  # [2m, K]
        m = scores.shape[0] // 2
        return bradley_terry_loss(scores[:m], scores[m:], num_pairs=num_pairs, margin=margin,
                                  weights=batch["weights"][:m])  # a pair's weights sit on both its rows

    def run_eval() -> Dict[str, float]:
        if not eval_set:
            return {}
        ddp.eval()
        out = evaluate(ddp, eval_set, groups, num_heads=num_heads, pad_id=pad_id,
                       micro_batch_size=t.micro_batch_size, margin=margin, packed=t.sequence_packing)
        ddp.train()
        return out

    record: Dict[str, float] = {}
    for step in range(1, t.total_steps + 1):
        indices = sampler.next_batch()
        micro_batches = pair_micro_batches([train_set[i] for i in indices], pad_id, t.micro_batch_size,
                                           weights[indices], packed=t.sequence_packing)
        zero_grad(ddp, optimizer)
        results = forward_backward(ddp, micro_batches, loss_fn, groups)
        updated, grad_norm = optimizer_step(optimizer, scheduler)
        totals = torch.zeros(3, dtype=torch.float64, device=groups.device)  # loss, correct, pairs
        for x in results:  # [] except on the last stage
            totals += torch.stack([x["loss"], x["correct"], x["num_pairs"]]).double().to(groups.device)
        totals = _replica_sum(totals, groups).tolist()
        record = {"step": step, "rm/loss": totals[0], "rm/accuracy": totals[1] / max(totals[2], 1.0),
                  "rm/grad_norm": grad_norm, "rm/lr": float(optimizer.param_groups[0]["lr"]),
                  "rm/updated": float(updated),  # this rank's real tokens and the positions its model computed
                  "perf/tokens": float(sum(mb.tokens for mb in micro_batches)),
                  "perf/computed_tokens": float(sum(mb.computed_tokens for mb in micro_batches))}
        if (t.eval_interval and step % t.eval_interval == 0) or step == t.total_steps:
            record.update(run_eval())
        if (cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0) or step == t.total_steps:
            save_reward_model(ddp, run_dir, groups, num_heads=num_heads, model_cfg=cfg.model,
                              tokenizer=tokenizer_record(tokenizer), step=step)
        sink.write(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix({"rm/loss": f"{record['rm/loss']:.4g}", "rm/accuracy": f"{record['rm/accuracy']:.3g}"})
        if groups.is_main and cfg.logging.console and console_due(step, cfg.logging.log_interval, t.total_steps):
            logger.info("train-rm step %d: %s", step, {k: round(v, 4) for k, v in record.items() if k != "step"})
    if bar is not None:
        bar.close()
    barrier()  # the metrics file and checkpoint are complete when any rank returns
    return record


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``hpa train-rm --config FILE [section.key=value ...]``; prints the final metrics as JSON."""
    parser = argparse.ArgumentParser(prog="hpa train-rm", description="train a Bradley-Terry reward model ensemble")
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, world_size=read_launch_env().world_size,
                          command="train-rm")
        metrics = run_train_rm(cfg)
    except ConfigError as exc:
        print(f"hpa train-rm: {exc}", file=sys.stderr)
        return 2
    if read_launch_env().rank == 0:
        print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
