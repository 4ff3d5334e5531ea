"""``hpa sft``: supervised fine-tuning (NLL on response tokens) through the same machinery as HPA."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict


from hpa.config import ConfigError, write_resolved
from hpa.config.schema import Config, OptimConfig
from hpa.data.preferences import SFTDataset
from hpa.data.sampler import DistributedBatchSampler
from hpa.data.tokenizer import build_tokenizer
from hpa.distributed.groups import ParallelGroups
from hpa.models import build_policy
from hpa.trainer import objective
from hpa.trainer.micro_batches import sft_micro_batches
from hpa.models.weights import load_model_weights, save_model_weights
from hpa.trainer.metrics import MetricsWriter
from hpa.engine.batching import Batching
from hpa.engine.head import label_log_probs
from hpa.engine.optimizer import make_trainable
from hpa.engine.step import forward_backward, optimizer_step, zero_grad

logger = logging.getLogger("hpa")


def run_sft(cfg: Config, groups: ParallelGroups) -> Dict[str, float]:
    """Train the policy with token-mean NLL over response tokens; save to ``sft.output_dir``."""
    if cfg.model.lora.enabled:  # sft saves full weights; adapters saved there would be dropped on load
        raise ConfigError("model.lora.rank", f"hpa sft trains every weight (model.lora.rank is "
                          f"{cfg.model.lora.rank}); LoRA is for hpa train: pass model.lora.rank=0 to sft")
    run_dir = Path(cfg.trainer.run_dir)
    out_dir = Path(cfg.sft.output_dir or run_dir / "sft")
    if groups.is_main:
        write_resolved(cfg, run_dir)
    tokenizer = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path)
    data = SFTDataset.from_config(cfg.data, tokenizer, rejects_dir=cfg.data.rejects_dir or str(run_dir / "rejects"))
    sampler = DistributedBatchSampler(len(data), global_batch_size=cfg.sft.global_batch_size, dp_rank=groups.dp_rank,
                                      dp_size=groups.data_parallel_size, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    model = build_policy(cfg.model, cfg.parallel, groups)
    if cfg.model.policy_path:
        load_model_weights(model, cfg.model.policy_path, groups)
    optim: OptimConfig = cfg.optim if cfg.sft.lr is None else \
        type(cfg.optim)(**{**cfg.optim.__dict__, "lr": cfg.sft.lr, "min_lr": min(cfg.optim.min_lr, cfg.sft.lr)})
    trainable = make_trainable(model, optim, cfg.parallel, groups, cfg.sft.total_steps)
    ddp, opt, sched = trainable.model, trainable.optimizer, trainable.scheduler
    writer = MetricsWriter(run_dir / "sft_logs", cfg.logging, is_main=groups.is_main,
                           total_steps=cfg.sft.total_steps, phase="sft")
    batching = Batching.from_config(cfg.trainer, tokenizer.pad_id)  # cut by the update's token budget when set
    vocab = tokenizer.vocab_size  # rows beyond the tokenizer's vocabulary are never normalised over
    metrics: Dict[str, float] = {}
    for step in range(1, cfg.sft.total_steps + 1):
        examples = [data[i] for i in sampler.next_batch()]
        mbs = sft_micro_batches(examples, batching, dp_group=groups.dp_group)
        counts = objective.global_counts([{"input_ids": mb["label_mask"], "mask": mb["label_mask"]} for mb in mbs],
                                         [], groups)

        def nll(batch, logits, hidden):
            logp = label_log_probs(batch, logits, groups.tp_group, vocab_size=vocab)  # [b, s]
            token_nll = -(logp * batch["label_mask"])
            share = token_nll.sum() / counts.tokens
            return share, {"sft/nll": share.detach()}

        zero_grad(ddp, opt)
        records = forward_backward(ddp, mbs, nll, groups, hidden_head=True)
        _, grad_norm = optimizer_step(opt, sched)
        metrics = objective.step_metrics(records, groups, share_keys=frozenset({"sft/nll"}))
        metrics["sft/grad_norm"] = grad_norm
        writer.write(step, metrics)
    writer.close()
    save_model_weights(ddp, out_dir, groups)
    logger.info("sft: saved the policy to %s", out_dir)
    return metrics
