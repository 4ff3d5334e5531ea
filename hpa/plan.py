"""``hpa plan``: estimate the memory each GPU needs for a config and layout, and what to change.

The estimate is analytic (no GPU, no megatron import). Per GPU, the worst pipeline stage:

* **parameters**, counted exactly from ``ModelConfig`` for megatron's Llama-style GPTModel:
  embedding ``V_pad·h`` (first stage; ``V_pad = padded_vocab_size(vocab, divisible_by, TP)``),
  per layer qkv ``h·(h + 2·g·d)`` (+ bias ``h + 2·g·d`` when ``add_qkv_bias``), proj ``h·h``, fc1
  ``2·f·h`` for SwiGLU (``f·h`` for GeLU), fc2 ``f·h`` and two norms ``2·h`` (LayerNorm adds biases:
  ``4·h``), the final norm and the output layer ``V_pad·h`` (last stage, unless tied; under PP a
  tied embedding is kept on the last stage too). Linear layers are split over TP, norms are
  replicated; layers are split over PP. The critic and the reward models replace the output layer
  by a replicated ``ScalarHead`` of ``K·h + K`` parameters.
* **gradients**: megatron DDP keeps fp32 main grads (``grad_reduce_in_fp32=True``): 4 bytes per
  trainable parameter, not sharded by the distributed optimizer (it shards optimizer state only).
* **optimizer state** (Adam): ``exp_avg`` + ``exp_avg_sq`` in fp32 (8 bytes), plus an fp32 master
  copy (4 bytes) when the parameters are bf16/fp16; divided by DP with the distributed optimizer.
  Torch's one-element ``step`` tensors and the distributed optimizer's alignment padding (at most
  63 elements per tensor) are left out.
* **activations** for one micro-batch of ``b = trainer.micro_batch_size`` sequences of
  ``s = model.max_sequence_length`` tokens, per layer (Korthikanti et al. 2022, bf16 bytes):
  ``s·b·h·(34 + 5·a·s/h)`` without recomputation, ``s·b·h·34`` with selective recomputation, and
  ``2·s·b·h`` (the layer input) with full recomputation (plus one layer's working set without
  recomputation, for the layer being recomputed); divided by TP with sequence parallelism
  (without it only ``24 + 5·a·s/h`` of the terms are split: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``).
  Under 1F1B the first stage holds ``PP`` micro-batches of its ``L/PP`` layers, i.e. ``L`` layers'
  worth at any PP. The fp32 vocab-parallel logits ``s·b·V_pad/TP·4`` are added (conservatively, as
  if on the same stage). fp32 models (the CPU path) double the bytes. Policy and critic update one
  after the other, so the larger of the two counts.
* **rollout KV cache** (megatron engine): ``2·(L/PP)·(g/TP)·d·(P + R)·B·bytes`` with
  ``P = data.max_prompt_length``, ``R = rollout.max_new_tokens`` and ``B = global_batch_size·n/DP``
  sequences per rank. Rollout and training do not overlap, so the peak is
  ``static + max(activations, KV cache)``.

Frozen models (reference, reward) hold parameters only; their inference activations are small next
to training's and are not counted. CUDA context, NCCL buffers and allocator fragmentation (typically
2-5 GB) are not counted either: keep that much headroom. GB here is 1e9 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from typing import List, Optional, Sequence

from hpa.config.errors import ConfigError
from hpa.config.schema import Config, ModelConfig, data_parallel_size, validate

GB = 1e9
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_MAX_TP = 8  # tensor parallelism stays within one node (NVLink)


def _padded_vocab(model: ModelConfig, tp: int) -> int:
    from hpa.models.builders import padded_vocab_size

    return padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp)


def layer_parameters(model: ModelConfig, tp: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank (norms replicated)."""
    h, f = model.hidden_size, model.ffn_hidden_size or 4 * model.hidden_size
    d = h // model.num_attention_heads
    qkv_out = h + 2 * model.kv_heads * d
    linear = qkv_out * h + h * h + (2 if model.activation == "swiglu" else 1) * f * h + f * h
    linear += qkv_out if model.add_qkv_bias else 0
    norms = 2 * _norm_parameters(model)
    return linear // tp + norms


def _norm_parameters(model: ModelConfig) -> int:
    return model.hidden_size * (2 if model.normalization == "LayerNorm" else 1)


def stage_parameters(model: ModelConfig, tp: int = 1, pp: int = 1,
                     scalar_heads: Optional[int] = None) -> List[int]:
    """Parameters per rank of each pipeline stage.

    Args:
        scalar_heads: K for a critic/reward model (ScalarHead instead of the LM output layer).
    """
    h = model.hidden_size
    vocab_rows = _padded_vocab(model, tp) // tp
    layers = model.num_layers // pp
    stages = []
    for stage in range(pp):
        n = layers * layer_parameters(model, tp)
        if stage == 0:
            n += vocab_rows * h
        if stage == pp - 1:
            n += _norm_parameters(model)
            if scalar_heads is not None:
                n += scalar_heads * h + scalar_heads
            elif model.untie_embeddings_and_output_weights or pp > 1:
                n += vocab_rows * h
        stages.append(n)
    return stages


def count_parameters(model: ModelConfig, scalar_heads: Optional[int] = None) -> int:
    """All parameters of the unsharded model (vocab padded for TP=1)."""
    return stage_parameters(model, 1, 1, scalar_heads)[0]


def activation_bytes(model: ModelConfig, *, tp: int, sequence_parallel: bool, recompute: Optional[str],
                     micro_batch_size: int, seq_length: int, with_logits: bool = True) -> int:
    """Activation memory of one rank for the in-flight micro-batches (see the module docstring)."""
    s, b, h, a = seq_length, micro_batch_size, model.hidden_size, model.num_attention_heads

    def per_layer(attention: float) -> float:  # bf16 bytes of one layer
        if sequence_parallel:
            return s * b * h * (34 + attention) / tp
        return s * b * h * (10 + (24 + attention) / tp)

    full_layer = per_layer(5 * a * s / h)
    if recompute == "full":  # stored layer inputs, plus the working set of the layer being recomputed
        total = model.num_layers * 2 * s * b * h / (tp if sequence_parallel else 1) + full_layer
    elif recompute == "selective":
        total = model.num_layers * per_layer(0.0)
    else:
        total = model.num_layers * full_layer
    total *= _DTYPE_BYTES[model.params_dtype] / 2
    if with_logits:
        total += s * b * _padded_vocab(model, tp) / tp * 4
    return int(total)


def kv_cache_bytes(cfg: Config, tp: int, pp: int, dp: int) -> int:
    """Rollout KV cache of one rank for its share of the rollout batch (megatron engine)."""
    m = cfg.model
    head_dim = m.hidden_size // m.num_attention_heads
    tokens = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    batch = cfg.trainer.global_batch_size * cfg.rollout.n / dp
    return int(2 * (m.num_layers // pp) * (m.kv_heads / tp) * head_dim * tokens * batch
               * _DTYPE_BYTES[m.params_dtype])


@dataclasses.dataclass(frozen=True)
class _Knobs:
    tp: int
    pp: int
    distributed_optimizer: bool
    recompute: Optional[str]
    offload_reference: bool


def _models(cfg: Config) -> List[tuple]:
    """(name, scalar_heads or None, trainable) for every model the run keeps."""
    models = [("policy", None, True)]
    if cfg.algorithm.advantage.estimator == "gae":
        models.append(("critic", 1, True))
    models.append(("reference", None, False))
    for i, _ in enumerate(cfg.reward.model_paths):
        models.append((f"reward{i}" if len(cfg.reward.model_paths) > 1 else "reward",
                       cfg.reward.num_heads, False))
    return models


def _estimate(cfg: Config, world_size: int, k: _Knobs) -> dict:
    m = cfg.model
    dp = world_size // (k.tp * k.pp)
    sp = k.tp > 1 and (cfg.parallel.sequence_parallel or k.tp != cfg.parallel.tensor_model_parallel_size)
    pbytes = _DTYPE_BYTES[m.params_dtype]
    adam_bytes = 8 + (4 if m.params_dtype != "float32" else 0)
    act = {r or "none": activation_bytes(m, tp=k.tp, sequence_parallel=sp, recompute=r,
                                         micro_batch_size=cfg.trainer.micro_batch_size,
                                         seq_length=m.max_sequence_length)
           for r in (None, "selective", "full")}
    rows = {}
    for name, heads, trainable in _models(cfg):
        params = max(stage_parameters(m, k.tp, k.pp, heads))
        row = {"parameters": count_parameters(m, heads), "parameters_per_gpu": params,
               "params_gb": params * pbytes / GB, "grads_gb": 0.0, "optimizer_gb": 0.0,
               "activations_gb": 0.0}
        if name == "reference" and k.offload_reference:
            row["params_gb"] = 0.0
            row["offloaded"] = True
        if trainable:
            plain, dist = params * adam_bytes, params * adam_bytes / dp
            row["grads_gb"] = params * 4 / GB
            row["optimizer_gb"] = (dist if k.distributed_optimizer else plain) / GB
            row["optimizer_gb_plain"], row["optimizer_gb_distributed"] = plain / GB, dist / GB
            key = k.recompute or "none"
            per = {r: (v if heads is None else activation_bytes(
                m, tp=k.tp, sequence_parallel=sp, recompute=None if r == "none" else r,
                micro_batch_size=cfg.trainer.micro_batch_size, seq_length=m.max_sequence_length,
                with_logits=False)) / GB for r, v in act.items()}
            row["activations_gb"] = per[key]
            row["activations_gb_by_recompute"] = per
        row["static_gb"] = row["params_gb"] + row["grads_gb"] + row["optimizer_gb"]
        rows[name] = row
    static = sum(r["static_gb"] for r in rows.values())
    activations = max(r["activations_gb"] for r in rows.values())
    kv = kv_cache_bytes(cfg, k.tp, k.pp, dp) / GB
    return {
        "layout": {"tensor_model_parallel_size": k.tp, "pipeline_model_parallel_size": k.pp,
                   "data_parallel_size": dp, "sequence_parallel": sp,
                   "use_distributed_optimizer": k.distributed_optimizer,
                   "recompute_granularity": k.recompute, "offload_reference": k.offload_reference},
        "models": rows,
        "static_gb": static,
        "activations_gb": activations,
        "kv_cache_gb": kv,
        "total_gb": static + max(activations, kv),
    }


def _valid_layout(cfg: Config, world_size: int, tp: int, pp: int) -> bool:
    parallel = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=tp,
                                   pipeline_model_parallel_size=pp, sequence_parallel=tp > 1)
    try:
        validate(dataclasses.replace(cfg, parallel=parallel), world_size)
    except ConfigError:
        return False
    return True


def _changes(cfg: Config, k: _Knobs) -> List[str]:
    p, out = cfg.parallel, []
    if k.distributed_optimizer != p.use_distributed_optimizer:
        out.append("parallel.use_distributed_optimizer=true")
    if k.recompute != cfg.model.recompute_granularity:
        out.append(f"model.recompute_granularity={k.recompute}")
    if k.offload_reference:
        out.append("offload the reference model to CPU")
    if k.tp != p.tensor_model_parallel_size:
        out.append(f"parallel.tensor_model_parallel_size={k.tp}"
                   + (" parallel.sequence_parallel=true" if k.tp > 1 else ""))
    if k.pp != p.pipeline_model_parallel_size:
        out.append(f"parallel.pipeline_model_parallel_size={k.pp}")
    return out


def _suggest(cfg: Config, world_size: int, gpu_memory_gb: float, limit: int = 5) -> List[dict]:
    """Single and combined changes that make the run fit, fewest changes first, then least memory."""
    p, m = cfg.parallel, cfg.model
    layouts = [(tp, pp) for tp in range(1, min(_MAX_TP, world_size) + 1)
               for pp in range(1, world_size // tp + 1)
               if world_size % (tp * pp) == 0 and _valid_layout(cfg, world_size, tp, pp)]
    found = []
    for (tp, pp), dist, rec, off in itertools.product(
            layouts, {p.use_distributed_optimizer, True}, {m.recompute_granularity, "selective", "full"},
            (False, True)):
        k = _Knobs(tp, pp, dist, rec, off)
        est = _estimate(cfg, world_size, k)
        if est["total_gb"] <= gpu_memory_gb:
            changes = _changes(cfg, k)
            if changes:
                found.append({"changes": changes, "total_gb": est["total_gb"], "layout": est["layout"]})
    found.sort(key=lambda f: (len(f["changes"]), f["total_gb"]))
    return found[:limit]


def plan(cfg: Config, world_size: int, gpu_memory_gb: float) -> dict:
    """Memory per GPU (worst pipeline stage) for ``cfg`` on ``world_size`` GPUs of ``gpu_memory_gb``.

    Returns a dict: ``layout``, ``models`` (per model: ``parameters`` (unsharded count),
    ``parameters_per_gpu``, ``params_gb``, ``grads_gb``, ``optimizer_gb`` (+ ``_plain`` /
    ``_distributed``), ``activations_gb`` (+ ``_by_recompute``), ``static_gb``), ``static_gb``,
    ``activations_gb``, ``kv_cache_gb``, ``total_gb``, ``gpu_memory_gb``, ``fits`` and
    ``suggestions`` (changes that make it fit, fewest first; empty when it fits already).

    Raises:
        ConfigError: the layout does not divide the world size or the model.
    """
    data_parallel_size(cfg.parallel, world_size)
    validate(cfg, world_size)
    p = cfg.parallel
    k = _Knobs(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.use_distributed_optimizer,
               cfg.model.recompute_granularity, False)
    out = _estimate(cfg, world_size, k)
    out["world_size"] = world_size
    out["gpu_memory_gb"] = gpu_memory_gb
    out["fits"] = out["total_gb"] <= gpu_memory_gb
    out["suggestions"] = [] if out["fits"] else _suggest(cfg, world_size, gpu_memory_gb)
    out["notes"] = [
        f"activations: micro_batch_size={cfg.trainer.micro_batch_size}, "
        f"seq_length=model.max_sequence_length={cfg.model.max_sequence_length}",
        f"KV cache: {cfg.trainer.global_batch_size}·{cfg.rollout.n}/DP sequences of "
        f"{cfg.data.max_prompt_length}+{cfg.rollout.max_new_tokens} tokens (megatron-engine estimate"
        + ("; vLLM instead reserves rollout.gpu_memory_utilization of the GPU while awake" if
           cfg.rollout.engine == "vllm" else "") + ")",
        "peak = static + max(activations, KV cache); keep 2-5 GB for CUDA context, NCCL, fragmentation",
    ]
    return out


def format_plan(result: dict) -> str:
    """The plan as a text table (GB = 1e9 bytes)."""
    lay = result["layout"]
    lines = [f"hpa plan: {result['world_size']} GPUs x {result['gpu_memory_gb']:g} GB, "
             f"TP{lay['tensor_model_parallel_size']} x PP{lay['pipeline_model_parallel_size']} x "
             f"DP{lay['data_parallel_size']}, sequence_parallel={lay['sequence_parallel']}, "
             f"distributed_optimizer={lay['use_distributed_optimizer']}, "
             f"recompute={lay['recompute_granularity']}",
             "",
             f"{'model':<10} {'params':>9} {'params/GPU':>11} {'weights':>8} {'grads':>8} "
             f"{'optim':>8} {'activ.':>8} {'static':>8}   (GB per GPU)"]
    for name, r in result["models"].items():
        lines.append(f"{name:<10} {r['parameters'] / 1e9:>8.2f}B {r['parameters_per_gpu'] / 1e9:>10.3f}B "
                     f"{r['params_gb']:>8.2f} {r['grads_gb']:>8.2f} {r['optimizer_gb']:>8.2f} "
                     f"{r['activations_gb']:>8.2f} {r['static_gb']:>8.2f}")
    lines += [f"{'static (weights + grads + optimizer)':<40} {result['static_gb']:>8.2f}",
              f"{'activations (training peak)':<40} {result['activations_gb']:>8.2f}",
              f"{'rollout KV cache':<40} {result['kv_cache_gb']:>8.2f}",
              f"{'total = static + max(activ., KV)':<40} {result['total_gb']:>8.2f}  of "
              f"{result['gpu_memory_gb']:g} GB"]
    policy = result["models"]["policy"]
    lines += ["",
              f"policy optimizer state: {policy['optimizer_gb_plain']:.2f} GB plain, "
              f"{policy['optimizer_gb_distributed']:.2f} GB distributed over DP{lay['data_parallel_size']}",
              "policy activations by recompute: " + ", ".join(
                  f"{k} {v:.2f} GB" for k, v in policy["activations_gb_by_recompute"].items())]
    lines += [f"note: {n}" for n in result["notes"]]
    lines.append("")
    if result["fits"]:
        lines.append(f"FITS: {result['total_gb']:.2f} GB of {result['gpu_memory_gb']:g} GB "
                     f"({result['gpu_memory_gb'] - result['total_gb']:.2f} GB headroom)")
    elif result["suggestions"]:
        lines.append(f"DOES NOT FIT: {result['total_gb']:.2f} GB > {result['gpu_memory_gb']:g} GB. "
                     "Changes that fit (fewest first):")
        for s in result["suggestions"]:
            lines.append(f"  {s['total_gb']:8.2f} GB  " + " + ".join(s["changes"]))
    else:
        lines.append(f"DOES NOT FIT: {result['total_gb']:.2f} GB > {result['gpu_memory_gb']:g} GB, and no "
                     "combination of distributed optimizer, recomputation, reference offload and TP/PP "
                     "fits: use more GPUs or GPUs with more memory")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``hpa plan --config X --world-size N --gpu-memory-gb M [--json] [section.key=value ...]``."""
    from hpa.config import load_config

    parser = argparse.ArgumentParser(prog="hpa plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu.yaml)")
    parser.add_argument("--world-size", type=int, required=True, help="number of GPUs")
    parser.add_argument("--gpu-memory-gb", type=float, required=True, help="memory per GPU in GB (1e9 bytes)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = load_config(args.config, args.overrides, world_size=args.world_size)
        result = plan(cfg, args.world_size, args.gpu_memory_gb)
    except ConfigError as exc:
        print(f"hpa plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
