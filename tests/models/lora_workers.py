"""Workers of tests/models/test_lora.py (run in gloo ranks by tests/multirank.py): one tiny base saved once,
LoRA attached to it under a layout, a few NLL steps, and what the tests compare."""

from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB = 64
LR = 1e-2


def model_config():
    from hpa.config.schema import ModelConfig

    return ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, vocab_size=VOCAB, max_sequence_length=32,
                       make_vocab_size_divisible_by=16)


def lora_config(rank: int = 4):
    from hpa.config.schema import LoRAConfig

    return LoRAConfig(rank=rank, alpha=8.0)


def micro_batches(num=2, b=2, s=10, seed=7):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = torch.randint(0, VOCAB, (b, s + 1), generator=g)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(s).expand(b, s)})
    return out


def parallel_config(groups, sequence_parallel=False, distributed_optimizer=False):
    from hpa.config.schema import ParallelConfig

    return ParallelConfig(tensor_model_parallel_size=groups.tensor_model_parallel_size,
                          pipeline_model_parallel_size=groups.pipeline_model_parallel_size,
                          sequence_parallel=sequence_parallel, use_distributed_optimizer=distributed_optimizer)


def save_base_worker(groups, directory):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.models.weights import save_model_weights

    torch.manual_seed(0)
    save_model_weights(build_policy(model_config(), ParallelConfig(), groups), directory, groups)


def build(groups, base_dir, parallel, *, lora=True):
    """The base loaded from ``base_dir`` (+ adapters), DDP-wrapped, with megatron's Adam."""
    from hpa.config.schema import OptimConfig
    from hpa.engine.optimizer import build_optimizer, wrap_ddp
    from hpa.models import build_policy
    from hpa.models.lora import attach_lora
    from hpa.models.weights import load_model_weights

    model = build_policy(model_config(), parallel, groups)
    load_model_weights(model, base_dir, groups)
    if lora:
        attach_lora(model, lora_config(), groups, seed=11)
    ddp = wrap_ddp(model, parallel, groups)
    return ddp, build_optimizer(ddp, OptimConfig(lr=LR, clip_grad=1.0), parallel, groups)


def log_probs(model, groups, mbs=None):
    """Token log-probs ``[rows, s]`` on the last stage (None elsewhere)."""
    from hpa.engine.step import forward_backward
    from hpa.ops.vocab_parallel import vocab_parallel_log_probs

    def fn(batch, logits, hidden):
        return logits.sum() * 0, {"logp": vocab_parallel_log_probs(logits, batch["labels"], groups.tp_group)}

    with torch.no_grad():
        out = forward_backward(model, mbs or micro_batches(), fn, groups, forward_only=True)
    return torch.cat([o["logp"] for o in out]).detach().clone() if groups.is_last_stage else None


def train_steps(ddp, opt, groups, num_steps):
    """``num_steps`` NLL steps over ``micro_batches()`` split across DP ranks; returns [(loss, grad_norm)]
    (this DP rank's part of the loss on the last stage, else None)."""
    from hpa.engine.step import forward_backward, optimizer_step, zero_grad
    from hpa.ops.vocab_parallel import vocab_parallel_log_probs

    every = micro_batches()
    num_tokens = sum(mb["labels"].numel() for mb in every)  # the global count: DDP sums gradients over DP
    mbs = every[groups.dp_rank::groups.data_parallel_size]  # this DP rank's micro-batches

    def nll(batch, logits, hidden):
        loss = -vocab_parallel_log_probs(logits, batch["labels"], groups.tp_group).sum() / num_tokens
        return loss, {"loss": loss.detach()}

    out = []
    for _ in range(num_steps):
        zero_grad(ddp, opt)
        res = forward_backward(ddp, mbs, nll, groups)
        updated, grad_norm = optimizer_step(opt)
        assert updated
        out.append((float(sum(r["loss"] for r in res)) if groups.is_last_stage else None, grad_norm))
    return out


def layout_worker(groups, base_dir, sequence_parallel, distributed_optimizer):
    """3 LoRA steps under this layout: per-step losses and grad norms, then the log-probs with the adapters
    on and off (the reference view)."""
    from hpa.models.lora import BaseView

    parallel = parallel_config(groups, sequence_parallel, distributed_optimizer)
    ddp, opt = build(groups, base_dir, parallel)
    steps = train_steps(ddp, opt, groups, 3)
    return {"steps": steps, "logp": log_probs(ddp, groups), "reference_logp": log_probs(BaseView(ddp), groups)}


def _base_state(model):
    from hpa.models.lora import is_adapter_key
    from hpa.models import unwrap

    return {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()
            if isinstance(v, torch.Tensor) and not is_adapter_key(k) and not k.endswith("_extra_state")}


def _optimizer_params(opt):
    """The parameters megatron's optimizer updates (fp32 torch Adam over the model's own parameters)."""
    return [p for g in opt.param_groups for p in g["params"]]


def core_worker(groups, base_dir):
    """TP1: step 0 = base, reference view = base, only adapters trained, merged = unmerged."""
    from hpa.models import build_policy, unwrap
    from hpa.models.lora import (BaseView, adapter_parameters, adapters, merge_adapters_, merged_state_dict)

    parallel = parallel_config(groups)
    plain, _ = build(groups, base_dir, parallel, lora=False)
    base_logp = log_probs(plain, groups)
    ddp, opt = build(groups, base_dir, parallel)
    gpt = unwrap(ddp)
    out = {"base_logp": base_logp, "step0_logp": log_probs(ddp, groups)}
    before = _base_state(ddp)
    adapter_ids = {id(p) for p in adapter_parameters(ddp).values()}
    out["num_adapter_params"] = len(adapter_ids)
    out["num_requires_grad"] = sum(p.requires_grad for p in gpt.parameters())
    out["num_grad_buffer_params"] = sum(len(b.params) for b in ddp.buffers)
    out["grad_buffer_params_are_adapters"] = all(id(p) in adapter_ids for b in ddp.buffers for p in b.params)
    out["steps"] = train_steps(ddp, opt, groups, 3)
    out["optimizer_params_are_adapters"] = sorted(map(id, _optimizer_params(opt))) == sorted(adapter_ids)
    out["optimizer_state_are_adapters"] = {id(p) for p in opt.optimizer.state} == adapter_ids
    after = _base_state(ddp)
    out["base_unchanged"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    out["B_norm"] = sum(float(a.B.norm()) for _, a in adapters(ddp))
    out["trained_logp"] = log_probs(ddp, groups)
    out["reference_logp"] = log_probs(BaseView(ddp), groups)
    merged = build_policy(model_config(), parallel, groups)
    merged.load_state_dict(merged_state_dict(ddp), strict=False)
    out["merged_logp"] = log_probs(merged, groups)
    merge_adapters_(ddp)
    out["merged_in_place_logp"] = log_probs(ddp, groups)
    return out


def resume_worker(groups, base_dir, run_dir, sequence_parallel=False):
    """2 steps, an adapter-only checkpoint, 2 more; then a fresh build resumed from the checkpoint, 2 steps."""
    from hpa.config.schema import CheckpointConfig
    from hpa.trainer.checkpoint import CheckpointManager

    parallel = parallel_config(groups, sequence_parallel)
    manager = CheckpointManager(CheckpointConfig(), run_dir, groups)
    ddp, opt = build(groups, base_dir, parallel)
    train_steps(ddp, opt, groups, 2)
    path = manager.save(2, {"policy": (ddp, opt)}, {"step": 2, "layout": groups.layout})
    uninterrupted = train_steps(ddp, opt, groups, 2)
    ddp2, opt2 = build(groups, base_dir, parallel)
    manager.load(path, {"policy": (ddp2, opt2)})
    resumed = train_steps(ddp2, opt2, groups, 2)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "checkpoint": str(path),
            "uninterrupted_logp": log_probs(ddp, groups), "resumed_logp": log_probs(ddp2, groups)}


def full_checkpoint_worker(groups, base_dir, run_dir):
    """A run checkpoint of the same model without LoRA (full weights + Adam state), for the size comparison."""
    from hpa.config.schema import CheckpointConfig
    from hpa.trainer.checkpoint import CheckpointManager

    ddp, opt = build(groups, base_dir, parallel_config(groups), lora=False)
    train_steps(ddp, opt, groups, 1)
    path = CheckpointManager(CheckpointConfig(), run_dir, groups).save(1, {"policy": (ddp, opt)},
                                                                       {"step": 1, "layout": groups.layout})
    return str(path)


def wrong_kind_worker(groups, base_dir, lora_checkpoint, full_checkpoint):
    """Each way of loading the wrong kind of checkpoint, with the error it gives (type name, message)."""
    from hpa.config.schema import CheckpointConfig
    from hpa.models import build_policy
    from hpa.models.weights import load_model_weights
    from hpa.trainer.checkpoint import CheckpointManager

    parallel = parallel_config(groups)
    manager = CheckpointManager(CheckpointConfig(), os.path.dirname(lora_checkpoint), groups)
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = None
        except Exception as exc:  # the test asserts the type and the message
            errors[name] = (type(exc).__name__, str(exc))

    plain, plain_opt = build(groups, base_dir, parallel, lora=False)
    attempt("weights_from_lora", lambda: load_model_weights(build_policy(model_config(), parallel, groups),
                                                            lora_checkpoint, groups))
    attempt("resume_full_from_lora", lambda: manager.load(Path(lora_checkpoint),
                                                          {"policy": (plain, plain_opt)}))
    ddp, opt = build(groups, base_dir, parallel)
    attempt("resume_lora_from_full", lambda: manager.load(Path(full_checkpoint),
                                                          {"policy": (ddp, opt)}))
    return errors


def save_trained_worker(groups, base_dir, run_dir, sequence_parallel):
    """2 LoRA steps under this layout, an adapter-only run checkpoint; returns its path and the log-probs."""
    from hpa.config.schema import CheckpointConfig
    from hpa.trainer.checkpoint import CheckpointManager

    ddp, opt = build(groups, base_dir, parallel_config(groups, sequence_parallel))
    train_steps(ddp, opt, groups, 2)
    path = CheckpointManager(CheckpointConfig(), run_dir, groups).save(2, {"policy": (ddp, opt)},
                                                                       {"step": 2, "layout": groups.layout})
    return {"checkpoint": str(path), "logp": log_probs(ddp, groups)}


def load_trained_worker(groups, base_dir, checkpoint):
    """The adapters of ``checkpoint`` (saved under another layout) over the base; the log-probs, then one step."""
    from hpa.config.schema import CheckpointConfig
    from hpa.trainer.checkpoint import CheckpointManager

    ddp, opt = build(groups, base_dir, parallel_config(groups))
    CheckpointManager(CheckpointConfig(), os.path.dirname(checkpoint), groups).load(Path(checkpoint),
                                                                                   {"policy": (ddp, opt)})
    return {"logp": log_probs(ddp, groups)}


def fingerprint_worker(groups, base_dir, sequence_parallel=False):
    """The base fingerprint ``lora.json`` records, under this layout."""
    from hpa.models.lora import base_fingerprint

    ddp, _ = build(groups, base_dir, parallel_config(groups, sequence_parallel))
    return base_fingerprint(ddp, groups)
