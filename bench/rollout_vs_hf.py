"""Rollout throughput: hpa's native Megatron engine against HF transformers ``generate`` (and, with
``--vllm``, hpa's vLLM engine on vLLM's CPU build), on CPU in fp32, or with ``--device cuda`` on the first GPU
(fp32 or ``--dtype bfloat16``; hpa over NCCL, each call timed until the GPU has finished and the result is
on the host).

Usage::

    python bench/rollout_vs_hf.py [--repeats N --batch B --prompt-len P --new-tokens T --hidden H
                                   --layers L --heads A --kv-heads G --ffn F --vocab V --threads N
                                   --profile --vllm --device cpu|cuda --dtype float32|bfloat16
                                   --no-cuda-graphs]

Both sides decode the same Llama-style architecture (RMSNorm, SwiGLU, RoPE, grouped-query attention,
untied embeddings, no biases; random weights, not equal across sides: a speed test) from the same
``B`` random prompts of ``P`` tokens each, greedily, for exactly ``T`` new tokens per sequence (no
early stop: EOS is ignored on both sides), with a KV cache, in one process, fp32,
``torch.set_num_threads(--threads)`` (OMP/MKL likewise).

- hpa: ``hpa.distributed.initialize`` (TP1/PP1/DP1, gloo, one process), ``build_policy`` from the
  ``ModelConfig`` (``transformer_impl="local"``, the CPU spec), ``build_rollout_engine(RolloutConfig(),
  ...)`` (the native ``megatron`` engine with its default KV cache, ``hpa.rollout.kv_cache``; on CUDA its
  decode step replayed from a CUDA graph, captured in the warm-up call, or eager with
  ``--no-cuda-graphs``: ``rollout.cuda_graphs``), and
  ``engine.generate(prompts, SamplingParams(n=1, temperature=0, max_new_tokens=T, ignore_eos=True))``
  under ``torch.no_grad``.
- HF: ``LlamaForCausalLM(LlamaConfig(same sizes))`` in eval mode,
  ``generate(input_ids, attention_mask, max_new_tokens=T, min_new_tokens=T, do_sample=False,
  use_cache=True, pad_token_id=0, eos_token_id=None)`` under ``torch.no_grad``.
- vLLM (``--vllm``): ``build_rollout_engine(RolloutConfig(engine="vllm", vllm_tensor_parallel_size=1),
  ...)`` on hpa's policy (the same weights, synced once with ``sync_weights``), the same
  ``SamplingParams``; vLLM's CPU build, ``enforce_eager``, its KV cache ``VLLM_CPU_KVCACHE_SPACE`` GiB
  (default 1 here).

Timing: one warm-up ``generate`` per side (not measured), then ``--repeats`` rounds, each timing one
``generate`` per side (the order rotated every round, so background load on a shared machine hits
every side alike). A generate is timed from the call to its return (prompt padding / tensor
building inside the call included on both sides). Generated tokens = ``B · T`` per call on both sides
(checked: every hpa response length and every HF output row is exactly ``T`` new tokens);
``tokens/s = B · T / median(call time)``.

Prints one JSON object: ``{"hpa_tokens_per_s", "hf_tokens_per_s", "ratio" (hpa / hf), "config",
"call_s", "torch", "transformers", "megatron_core", "repeats"}``, with ``--vllm`` also
``"vllm_tokens_per_s"``, ``"vllm_vs_hpa"`` (vLLM / hpa native) and ``"vllm"`` (its version). ``--profile`` also runs one hpa
``generate`` under cProfile and prints the top entries to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Dict, List

PAD, EOS = 0, 2  # token ids; prompts use ids 3..V-1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="measured generate calls per side")
    p.add_argument("--batch", type=int, default=16, help="prompts per generate call (one response each)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (all equal)")
    p.add_argument("--new-tokens", type=int, default=128, help="generated tokens per sequence")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4, help="query groups (GQA); = --heads for plain MHA")
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--profile", action="store_true", help="cProfile one hpa generate (top entries to stderr)")
    p.add_argument("--vllm", action="store_true", help="also time hpa's vLLM engine (needs vLLM's CPU build)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: both sides on the first GPU (hpa over NCCL), timed to the GPU's finish")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="native engine: eager decode on CUDA (rollout.cuda_graphs=false)")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not divisible by --kv-heads {args.kv_heads}")
    if min(args.repeats, args.batch, args.prompt_len, args.new_tokens, args.threads) < 1:
        p.error("--repeats, --batch, --prompt-len, --new-tokens and --threads must be at least 1")
    if args.vocab < 16:
        p.error("--vocab must be at least 16")
    if args.vllm and args.device != "cpu":
        p.error("--vllm times vLLM's CPU build: use it with --device cpu")
    if args.device == "cpu" and args.dtype != "float32":
        p.error("the CPU path runs in float32")
    return args


def model_sizes(args) -> Dict[str, int]:
    return {"num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.heads,
            "num_query_groups": args.kv_heads, "ffn_hidden_size": args.ffn, "vocab_size": args.vocab,
            "max_sequence_length": args.prompt_len + args.new_tokens}


def make_prompts(args) -> List[List[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]


def _synchronize(args) -> None:
    if args.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------- hpa


class HpaSide:
    """The native engine on a freshly built policy (one process, TP1/PP1/DP1, gloo)."""

    def __init__(self, args):
        from hpa.config.schema import ModelConfig, ParallelConfig, RolloutConfig
        from hpa.distributed import LaunchEnv, initialize
        from hpa.models import build_policy
        from hpa.rollout import SamplingParams, TokenizerInfo, build_rollout_engine

        self.args = args
        model_cfg = ModelConfig(**model_sizes(args), make_vocab_size_divisible_by=128, params_dtype=args.dtype,
                                transformer_impl="local")
        parallel = ParallelConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  backend="nccl" if args.device == "cuda" else "gloo")
        self.groups = initialize(parallel, seed=args.seed, launch=LaunchEnv(
            rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
            launcher="single"))
        self.model = build_policy(model_cfg, parallel, self.groups)
        self.model_cfg = model_cfg
        self.model.eval()
        self.engine = build_rollout_engine(RolloutConfig(cuda_graphs=args.cuda_graphs), self.model, self.groups,
                                           TokenizerInfo(vocab_size=args.vocab, eos_token_id=EOS, pad_token_id=PAD))
        self.params = SamplingParams(n=1, temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
        self.num_params = _num_params(self.model)

    def generate(self, prompts: List[List[int]]) -> float:
        import torch

        start = time.perf_counter()
        with torch.no_grad():
            batch = self.engine.generate(prompts, self.params)  # its batch comes back on the host
        _synchronize(self.args)
        elapsed = time.perf_counter() - start
        lengths = batch.response_lengths.tolist()
        if batch.batch_size != len(prompts) or any(n != self.args.new_tokens for n in lengths):
            raise RuntimeError(f"hpa generated {batch.batch_size} rows with response lengths {lengths}, "
                               f"expected {len(prompts)} rows of {self.args.new_tokens}")
        return elapsed

    def close(self) -> None:
        from hpa.distributed import destroy

        destroy()


class VllmSide(HpaSide):
    """hpa's vLLM engine on the hpa side's policy (same weights, synced once)."""

    def __init__(self, args, hpa: HpaSide):
        from hpa.config.schema import RolloutConfig
        from hpa.rollout import TokenizerInfo, build_rollout_engine

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.args, self.groups, self.model, self.params = args, hpa.groups, hpa.model, hpa.params
        self.engine = build_rollout_engine(RolloutConfig(engine="vllm", vllm_tensor_parallel_size=1), hpa.model,
                                           hpa.groups, TokenizerInfo(vocab_size=args.vocab, eos_token_id=EOS,
                                                                     pad_token_id=PAD),
                                           model_cfg=hpa.model_cfg)
        self.engine.sync_weights()
        self.num_params = hpa.num_params

    def close(self) -> None:
        pass  # hpa's destroy (HpaSide.close) shuts vLLM down first


# ---------------------------------------------------------------------------------------------- HF


class HfSide:
    """``LlamaForCausalLM.generate`` with its (dynamic) KV cache."""

    def __init__(self, args):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.args = args
        sizes = model_sizes(args)
        config = LlamaConfig(vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"],
                             intermediate_size=sizes["ffn_hidden_size"], num_hidden_layers=sizes["num_layers"],
                             num_attention_heads=sizes["num_attention_heads"],
                             num_key_value_heads=sizes["num_query_groups"],
                             max_position_embeddings=sizes["max_sequence_length"], rms_norm_eps=1e-5,
                             rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                             pad_token_id=PAD, eos_token_id=None, bos_token_id=None)
        self.model = LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
        self.num_params = _num_params(self.model)
        self.attn_implementation = self.model.config._attn_implementation
        self.torch = torch

    def generate(self, prompts: List[List[int]]) -> float:
        torch = self.torch
        start = time.perf_counter()
        with torch.no_grad():
            input_ids = torch.tensor(prompts, dtype=torch.long, device=self.args.device)  # [b, p] (no padding)
            attention_mask = torch.ones_like(input_ids)
            out = self.model.generate(input_ids, attention_mask=attention_mask,
                                      max_new_tokens=self.args.new_tokens, min_new_tokens=self.args.new_tokens,
                                      do_sample=False, use_cache=True, pad_token_id=PAD, eos_token_id=None)
            out = out.cpu()  # as hpa's engine hands its batch to the host
        _synchronize(self.args)
        elapsed = time.perf_counter() - start
        expected = (len(prompts), self.args.prompt_len + self.args.new_tokens)
        if tuple(out.shape) != expected:
            raise RuntimeError(f"HF generated {tuple(out.shape)}, expected {expected}")
        return elapsed


# ---------------------------------------------------------------------------------------------- driver


def profile_hpa(hpa: HpaSide, prompts: List[List[int]], top: int = 25) -> None:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    hpa.generate(prompts)
    prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        print(f"==== hpa generate, cProfile by {key} ====\n{buf.getvalue()}", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                      HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import megatron.core
    import transformers

    prompts = make_prompts(args)
    hpa = HpaSide(args)
    try:
        hf = HfSide(args)
        sides = {"hpa": hpa, "hf": hf}
        if args.vllm:
            sides["vllm"] = VllmSide(args, hpa)
        for side in sides.values():  # warm-up, not measured
            side.generate(prompts)
        times: Dict[str, List[float]] = {name: [] for name in sides}
        names = list(sides)
        for i in range(args.repeats):
            for name in names[i % len(names):] + names[:i % len(names)]:
                times[name].append(sides[name].generate(prompts))
        if args.profile:
            profile_hpa(hpa, prompts)
    finally:
        hpa.close()

    tokens = args.batch * args.new_tokens
    med = {name: statistics.median(t) for name, t in times.items()}
    hpa_tps, hf_tps = tokens / med["hpa"], tokens / med["hf"]
    out = {
        "hpa_tokens_per_s": round(hpa_tps, 1),
        "hf_tokens_per_s": round(hf_tps, 1),
        "ratio": round(hpa_tps / hf_tps, 3),
        "config": {**model_sizes(args), "batch": args.batch, "prompt_len": args.prompt_len,
                   "new_tokens": args.new_tokens, "generated_tokens_per_call": tokens,
                   "hpa_params": hpa.num_params, "hf_params": hf.num_params, "threads": torch.get_num_threads(),
                   "cpu_count": os.cpu_count(), "dtype": args.dtype, "device": args.device, "greedy": True,
                   "hf_attn_implementation": hf.attn_implementation, "hpa_decode": hpa.engine.decode},
        "call_s": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
        "call_s_median": {name: round(t, 3) for name, t in med.items()},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "unknown"),
        **({"gpu": torch.cuda.get_device_name(0)} if args.device == "cuda" else {}),
        "repeats": args.repeats,
    }
    if args.vllm:
        import vllm

        out["vllm_tokens_per_s"] = round(tokens / med["vllm"], 1)
        out["vllm_vs_hpa"] = round(med["hpa"] / med["vllm"], 3)
        out["vllm"] = vllm.__version__
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
