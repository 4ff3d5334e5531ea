"""CPU proxy of the policy's optimizer step: the aten operations the host issues for one step.

Usage::

    python bench/proxies/optimizer.py [--by-op]

Prints one JSON line ``{"optimizer.aten_ops_per_step": n, "optimizer.param_tensors": n}`` (``--by-op`` adds
the count of each operation).

- ``optimizer.aten_ops_per_step``: every aten operation (a ``TorchDispatchMode``, views included) of what the
  policy update does around its gradients, as ``hpa.trainer.phases`` does it: ``guarded_optimizer_step``
  (megatron's ``prepare_grads``, the gradient norm, clipping by it, Adam, the main -> model parameter copy)
  and ``zero_grad`` (the grad buffer and the optimizer's grads). Counted on the second step (the first
  creates Adam's state), with the gradients large enough for clipping to scale them.
- ``optimizer.param_tensors``: the parameter tensors the optimizer steps (170 at Qwen2-0.5B's structure).

The model is Qwen2-0.5B's structure (24 layers, QKV biases, tied embeddings: 7 tensors a layer, the
embedding and the final norm) at narrow widths, in bf16 with fp32 main parameters as on the GPU
(megatron's ``Float16OptimizerWithFloat16Params``: the main -> model copy runs every step). On a GPU the
host issues one kernel per operation (or per chunk of a multi-tensor one) whatever the widths. One
process, TP1/PP1, gloo, on the CPU, megatron-core without Transformer Engine or apex (their fallbacks).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _fill_grads(ddp, seed: int) -> None:
    """Gradients as the backward pass leaves them (in the DDP grad buffers), with a norm far above 1."""
    g = torch.Generator().manual_seed(seed)
    for buffer in ddp.buffers:
        buffer.grad_data.copy_(torch.randn(buffer.grad_data.shape, generator=g) * 10.0)
    for param in ddp.module.parameters():  # what megatron's backward hooks mark once a grad is in the buffer
        param.grad_added_to_main_grad = True


def measure(by_op: bool = False) -> dict:
    from hpa.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from hpa.distributed import LaunchEnv, destroy, initialize
    from hpa.engine.optimizer import make_trainable, use_multi_tensor_adam
    from hpa.engine.step import guarded_optimizer_step, zero_grad
    from hpa.models import build_policy

    import torch.distributed as dist

    owns_init = not dist.is_initialized()
    parallel = ParallelConfig(backend="gloo")
    groups = initialize(parallel, launch=LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                                                   master_port=0, launcher="single"))
    try:
        cfg = ModelConfig(num_layers=24, hidden_size=56, num_attention_heads=14, num_query_groups=2,
                          ffn_hidden_size=152, vocab_size=256, max_sequence_length=4096,
                          make_vocab_size_divisible_by=64, add_qkv_bias=True,
                          untie_embeddings_and_output_weights=False)
        torch.manual_seed(0)
        model = build_policy(cfg, parallel, groups).bfloat16()  # hpa builds bf16 on GPUs only
        model.config.bf16, model.config.params_dtype = True, torch.bfloat16
        policy = make_trainable(model, OptimConfig(clip_grad=1.0), parallel, groups, total_steps=10)
        num_tensors = sum(len(g["params"]) for g in policy.optimizer.param_groups)

        def count(seed):
            _fill_grads(policy.model, seed)
            counter = _OpCounter()
            with counter:
                updated, grad_norm = guarded_optimizer_step(policy.optimizer, None, lambda norm: "step", lambda: 1.0)
                zero_grad(policy.model, policy.optimizer)
            assert updated and grad_norm > 1.0, (updated, grad_norm)  # clipping scaled the gradients
            return counter.ops

        count(0)  # creates Adam's state
        host_adam = count(1)  # as built here: foreach Adam off CUDA
        use_multi_tensor_adam(policy.optimizer, fused=True)  # as built on CUDA
        cuda_adam = count(2)
    finally:
        if owns_init:
            destroy()
    result = {"optimizer.aten_ops_per_step": sum(cuda_adam.values()),
              "optimizer.aten_ops_per_step_foreach_adam": sum(host_adam.values()),
              "optimizer.param_tensors": num_tensors}
    if by_op:
        result["optimizer.by_op"] = dict(cuda_adam.most_common())
        result["optimizer.by_op_foreach_adam"] = dict(host_adam.most_common())
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--by-op", action="store_true", help="also the count of each aten operation")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(by_op=args.by_op)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
