"""Parameter + gradient + optimizer-state bytes of the tiny policy with and without LoRA, and the size of its
run checkpoint (docs/lora.md, "Measured"). One process, CPU, gloo, fp32, megatron DDP + optimizer.

    python bench/lora_memory.py [--config configs/tiny_cpu.yaml] [--rank 8] [--alpha 16] [--distributed-optimizer]

Prints one JSON object: for "full" and "lora", the bytes of the policy's parameters (base + adapters), of its
gradient buffers (megatron DDP holds them for trainable parameters only), of its Adam state (read from the
optimizer after one step, so it is allocated), of the reference (a second full copy without LoRA; none with
it: the reference is the base with the adapters off), their total, and the run checkpoint's ``policy/`` bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_state_bytes(optimizer) -> int:
    """Every tensor in the torch optimizer state megatron's optimizer wraps (Adam: exp_avg, exp_avg_sq; with
    bf16, also the fp32 main parameters, which megatron keeps outside ``state``)."""
    inner = optimizer.optimizer
    state = _bytes(v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    main = [p for g in getattr(optimizer, "fp32_from_float16_groups", []) for p in g]
    return state + _bytes(main)


def _one_step(trainable, groups, vocab_size: int):
    from hpa.engine.step import forward_backward, optimizer_step, zero_grad
    from hpa.ops.vocab_parallel import vocab_parallel_log_probs

    ids = torch.randint(0, vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    mbs = [{"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(16).expand(4, 16)}]

    def nll(batch, logits, hidden):
        return -vocab_parallel_log_probs(logits, batch["labels"], groups.tp_group).mean(), {}

    zero_grad(trainable.model, trainable.optimizer)
    forward_backward(trainable.model, mbs, nll, groups)
    optimizer_step(trainable.optimizer)


def measure(cfg, groups, lora_cfg, root: Path) -> dict:
    from hpa.engine.optimizer import make_trainable
    from hpa.models import build_policy, unwrap
    from hpa.models.lora import attach_lora
    from hpa.trainer.checkpoint import CheckpointManager

    torch.manual_seed(0)
    model = build_policy(cfg.model, cfg.parallel, groups)
    if lora_cfg.enabled:
        attach_lora(model, lora_cfg, groups, seed=cfg.trainer.seed)
    trainable = make_trainable(model, cfg.optim, cfg.parallel, groups, total_steps=10)
    _one_step(trainable, groups, cfg.model.vocab_size)
    gpt = unwrap(trainable.model)
    params = _bytes(gpt.parameters())
    out = {
        "parameters": sum(p.numel() for p in gpt.parameters()),
        "trainable_parameters": sum(p.numel() for p in gpt.parameters() if p.requires_grad),
        "parameter_bytes": params,
        "gradient_bytes": _bytes(b.grad_data for b in trainable.model.buffers),
        "optimizer_state_bytes": _optimizer_state_bytes(trainable.optimizer),
        "reference_bytes": 0 if lora_cfg.enabled else params,
    }
    out["total_bytes"] = sum(out[k] for k in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes",
                                              "reference_bytes"))
    manager = CheckpointManager(cfg.checkpoint, root, groups)
    path = manager.save(1, {"policy": trainable.state()}, {"step": 1, "layout": groups.layout})
    out["checkpoint_policy_bytes"] = sum(p.stat().st_size for p in (path / "policy").rglob("*") if p.is_file())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from hpa.config import load_config
    from hpa.config.schema import LoRAConfig
    from hpa.distributed import initialize

    overrides = ["parallel.backend=gloo", f"parallel.use_distributed_optimizer={str(args.distributed_optimizer).lower()}"]
    cfg = load_config(args.config, overrides)
    groups = initialize(cfg.parallel, seed=cfg.trainer.seed)
    lora_cfg = dataclasses.replace(cfg.model.lora, rank=args.rank, alpha=args.alpha)
    with tempfile.TemporaryDirectory() as tmp:
        full = measure(cfg, groups, LoRAConfig(), Path(tmp) / "full")
        lora = measure(cfg, groups, lora_cfg, Path(tmp) / "lora")
    result = {"config": args.config, "lora": {"rank": lora_cfg.rank, "alpha": lora_cfg.alpha,
                                               "target_modules": list(lora_cfg.target_modules)},
              "distributed_optimizer": args.distributed_optimizer, "dtype": cfg.model.params_dtype,
              "full": full, "with_lora": lora,
              "ratio_total": lora["total_bytes"] / full["total_bytes"],
              "ratio_checkpoint": lora["checkpoint_policy_bytes"] / full["checkpoint_policy_bytes"],
              "torch": torch.__version__}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
