"""megatron DDP wrapping, megatron optimizer (plain or distributed) and LR schedule."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import torch

from hpa.config.schema import OptimConfig, ParallelConfig
from hpa.distributed.groups import ParallelGroups


def wrap_ddp(model: torch.nn.Module, parallel: ParallelConfig, groups: ParallelGroups):
    """Wrap a GPTModel in megatron's DistributedDataParallel and wire grad finalisation.

    The model's TransformerConfig gets ``finalize_model_grads_func`` (DP all-reduce, tied-embedding
    and layer-norm reductions across stages) and ``no_sync_func`` so the pipeline schedule can defer
    the DP reduction to the last micro-batch.
    """
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)

    config = model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                  pg_collection=groups.pg_collection)
    config.finalize_model_grads_func = functools.partial(finalize_model_grads,
                                                         pg_collection=groups.pg_collection)
    config.no_sync_func = ddp.no_sync
    return ddp


def build_optimizer(ddp_model, optim: OptimConfig, parallel: ParallelConfig, groups: ParallelGroups,
                    lr: Optional[float] = None):
    """megatron's Adam (decoupled weight decay) over one DDP-wrapped model.

    Args:
        lr: overrides ``optim.lr`` (the critic uses ``optim.critic_lr``).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import megatron_patches

    megatron_patches.apply_optimizer_patches()  # norm, clip and main -> model copy as multi-tensor ops (no TE/apex)

    config = ddp_model.config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr if lr is not None else optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    # No gloo side groups, whatever the backend: megatron refuses them next to an explicit process-group
    # collection, and hpa's checkpoints (fully_sharded_model_space) never gather optimizer state over gloo.
    optimizer = get_megatron_optimizer(opt_config, [ddp_model], use_gloo_process_groups=False,
                                       pg_collection=groups.pg_collection)
    config.grad_scale_func = optimizer.scale_loss
    use_multi_tensor_adam(optimizer)
    return optimizer


def use_multi_tensor_adam(optimizer, *, fused: Optional[bool] = None) -> None:
    """Where megatron fell back to torch's Adam (no TE or apex), step all of a group's tensors at once:
    torch's fused kernel on CUDA, its foreach operations elsewhere (on CPU bit-identical to the per-tensor loop
    torch picks there by default, 12 operations a tensor; CPU's fused kernel rounds differently). Each ``step``
    state is moved where its kernel reads it (fused: the parameter's device; foreach: the host), so this also
    runs after a checkpoint load, which restores the saved groups' choice. TE's and apex's optimizers are left alone.

    Args:
        fused: the kernel for every group; None: fused where all of a group's parameters are on CUDA (the CPU
            proxy ``bench/proxies/optimizer.py`` counts the CUDA choice with CPU's fused kernel).
    """
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):  # AdamW is one too
            continue
        for group in inner.param_groups:
            on_cuda = bool(group["params"]) and all(p.device.type == "cuda" for p in group["params"])
            group_fused = on_cuda if fused is None else fused
            group["fused"], group["foreach"] = group_fused, not group_fused
            for p in group["params"]:
                step = inner.state[p].get("step") if p in inner.state else None
                if torch.is_tensor(step):
                    inner.state[p]["step"] = step.to(device=p.device if group_fused else "cpu", dtype=torch.float32)


def build_lr_scheduler(optimizer, optim: OptimConfig, total_steps: int, lr: Optional[float] = None):
    """megatron's OptimizerParamScheduler: linear warmup over a fraction of the steps, then decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    max_lr = lr if lr is not None else optim.lr
    warmup = int(round(optim.lr_warmup_fraction * total_steps))
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else max_lr, max_lr=max_lr, min_lr=min(optim.min_lr, max_lr),
        lr_warmup_steps=warmup, lr_decay_steps=max(total_steps, warmup + 1),
        lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1), wd_incr_style="constant")


@dataclasses.dataclass
class Trainable:
    """A model being trained: the DDP-wrapped module, its megatron optimizer and its LR scheduler."""

    model: torch.nn.Module
    optimizer: object
    scheduler: object

    def state(self) -> Tuple[torch.nn.Module, object]:
        """``(model, optimizer)``, what a checkpoint saves for it."""
        return self.model, self.optimizer


def make_trainable(model: torch.nn.Module, optim: OptimConfig, parallel: ParallelConfig, groups: ParallelGroups,
                   total_steps: int, *, lr: Optional[float] = None) -> Trainable:
    """The one set-up path of the policy, the critic, the SFT policy and the reward model: wrap a built
    (and, where wanted, loaded) model in megatron's DDP, then its optimizer and LR schedule.

    Args:
        lr: overrides ``optim.lr`` (the critic uses ``optim.critic_lr``).
    """
    ddp = wrap_ddp(model, parallel, groups)
    optimizer = build_optimizer(ddp, optim, parallel, groups, lr=lr)
    return Trainable(model=ddp, optimizer=optimizer, scheduler=build_lr_scheduler(optimizer, optim, total_steps, lr=lr))


def scale_lr(scheduler, factor: float) -> None:
    """Multiply a megatron LR scheduler's bounds (and its optimizer's per-group bounds) by ``factor``."""
    scheduler.max_lr *= factor
    scheduler.min_lr *= factor
    for group in scheduler.optimizer.param_groups:  # megatron keeps per-group LR bounds too
        for key in ("max_lr", "min_lr"):
            if group.get(key) is not None:
                group[key] *= factor
    scheduler.step(increment=0)
