"""``hpa plan``: estimate the memory each GPU needs for a config and layout, and what to change.

The estimate is analytic (no GPU, no megatron import). Per GPU, the worst pipeline stage:

* **parameters**, counted exactly from ``ModelConfig`` for megatron's Llama-style GPTModel:
  embedding ``V_pad·h`` (first stage; ``V_pad = padded_vocab_size(vocab, divisible_by, TP)``),
  per layer qkv ``h·(h + 2·g·d)`` (+ bias ``h + 2·g·d`` when ``add_qkv_bias``), proj ``h·h``, fc1
  ``2·f·h`` for SwiGLU (``f·h`` for GeLU), fc2 ``f·h`` and two norms ``2·h`` (LayerNorm adds biases:
  ``4·h``), the final norm and the output layer ``V_pad·h`` (last stage, unless tied; under PP a
  tied embedding is kept on the last stage too). Linear layers are split over TP, norms are
  replicated; layers are split over PP. The critic and the reward models replace the output layer
  by a replicated ``ScalarHead`` of ``K·h + K`` parameters. A reward model has its own architecture
  (``reward_architectures``: the record at its path, else ``--reward-config``, else the policy's), laid
  out under the policy's TP/PP as ``hpa train`` loads it.
* **LoRA** (``model.lora.rank > 0``, ``hpa.models.lora``): the base weights are frozen and held once per
  stage; the policy adds ``A [r, in]`` and ``B [out, r]`` per adapted linear and layer (the side that follows
  the base weight's TP split divided by TP, ``lora_parameters``), the reference is the same base with the
  adapters off (no weights of its own) and a critic adds its own adapters and value head only (``CriticView``).
  Gradients and optimizer state are the adapters'.
* **gradients**: megatron DDP keeps fp32 main grads (``grad_reduce_in_fp32=True``): 4 bytes per
  trainable parameter, not sharded by the distributed optimizer (it shards optimizer state only).
* **optimizer state** (Adam): ``exp_avg`` + ``exp_avg_sq`` in fp32 (8 bytes), plus an fp32 master
  copy (4 bytes) when the parameters are bf16/fp16; divided by DP with the distributed optimizer.
  Torch's one-element ``step`` tensors and the distributed optimizer's alignment padding (at most
  63 elements per tensor) are left out. (megatron-core's ``optimizer_cpu_offload`` is not an hpa option:
  its ``HybridDeviceOptimizer`` needs CUDA streams, so it could not be tested here.)
* **activations**: the peak bytes one training micro-batch holds, forward and backward, on one rank, for
  the largest micro-batch of each kind the trainer runs (``training_micro_batches``): rollout rows
  (``b = trainer.micro_batch_size`` sequences of ``s = data.max_prompt_length +
  rollout.max_new_tokens`` tokens; under ``trainer.ppo_max_token_len_per_rank`` enough rows to
  cover that budget: a micro-batch holds the budget's tokens, padded or packed) and DPO rows
  (``2·micro_batch_size`` chosen + rejected sequences of ``max_prompt_length + data.max_response_length``).
  Per token and layer, in bytes, with ``e = bytes(model.params_dtype)``, ``a`` heads, ``g`` query groups,
  ``d = h/a``, ``f`` FFN size, ``t = TP``; "replicated" terms are divided by ``t`` only under sequence
  parallelism:

  - each of the two norms keeps its input and output, ``2·h·e``, replicated (torch's RMSNorm,
    which the local spec uses, also keeps ``x·rstd``: ``3·h·e``);
  - attention keeps ``(2·h + g·d + (a + 2·g)·d)·e/t + a·4/t``: q and k after RoPE, the qkv output that v
    is a view of, the context and the fused kernel's fp32 log-sum-exp. Both Transformer Engine and the
    local spec (one SDPA call per layer: flash attention on CUDA, torch's flash kernel on CPU) keep no
    ``[s, s]`` tensor; only attention dropout on the float32 (CPU) path runs torch's math kernel, which
    repeats k and v under GQA and keeps the probabilities, their dropped-out copy and the mask
    (``a·s·(2·e + mask)/t``);
  - the MLP keeps ``5·f·e/t`` with SwiGLU (fc1's output, ``x_linear + 0``, ``silu``, their product)
    or ``2·f·e/t`` with GeLU; LoRA adds ``r·e`` per adapted linear (``u = A x``);
  - with hidden dropout, two dropout masks ``2·h`` bytes, replicated (CUDA keeps a bool mask; torch
    on CPU a noise tensor of ``e`` bytes: float32 is taken as the CPU path), and one more for the
    embedding;
  - a layer's backward holds, beside what it keeps, the gradients of fc1's output and the activation and of
    the layer's input and output, ``(3·f (SwiGLU) or 2·f)·e/t + 2·h·e`` (replicated; the math kernel: two
    ``[s, s]`` gradients if larger), and under sequence parallelism ``2·h·e`` more (a column-parallel
    linear's input gathered again, a row-parallel one's gradient before its reduce-scatter).

  The LM head (``lm_head_bytes``, the fused log-prob head of ``hpa.ops.fused_head`` at the positions the loss
  reads: ``N`` response tokens) holds the logits shard ``L = T·V_pad/t·e`` and, in backward, their gradient
  ``L`` beside two fp32 chunks of ``c = min(N, CHUNK_ELEMENTS/(V_pad/t))`` rows (in 16 bits also the chunk
  read in the input dtype), then the output layer's contiguous copy of that gradient and its weight
  gradient: ``2·L + max(c·V_pad/t·(8 + e_16), V_pad/t·h·e + T·h·e)``, never an fp32 ``[T, vocab]`` tensor.
  The critic's scalar head adds only the norm. Selective recomputation (core attention) changes nothing
  outside the math kernel; there it drops the probabilities and recomputes them in backward. Full
  recomputation keeps each layer's input ``h·e`` (replicated) and, in backward, one recomputed layer
  and its gradients at a time. Peak = ``L·(per layer) + max(head, the backward's transient)``: the head's
  tensors are freed before any layer is recomputed. Under 1F1B the first stage holds ``PP``
  micro-batches of its ``L/PP`` layers, i.e. ``L`` layers' worth at any PP; the head is counted as if it
  were on that stage. Left out: ``[s, b]`` statistics, the RoPE tables, token ids, per-row loss tensors.
  Policy and critic update one after the other, so the larger of the two counts.
* **forward-only passes** (old and reference log-probs, values; ``forward_only_bytes``): micro-batches of
  ``trainer.log_prob_max_token_len_per_rank`` tokens (else ``micro_batch_size`` rows), no graph: one
  layer's tensors at a time, then the logits (``2·L`` while megatron copies them contiguous, or ``L`` and
  a forward chunk). The activation term is the larger of training's and this.

  *Measured vs formula-only*: on CPU (float32, the local spec) ``tests/test_plan.py`` runs micro-batches
  through megatron DDP, ``forward_backward`` and the trainer's fused head and tracks the bytes of every
  storage alive (a ``TorchDispatchMode``): TP1, TP2 and TP2 with sequence parallelism, no / selective / full
  recomputation, GQA and MHA, RMSNorm and LayerNorm, SwiGLU and GeLU, dropout, and the GPU-check config's
  shapes scaled down (token budgets, a chunked head, the forward-only pass); the estimate is within about
  7 % (docs/memory.md). The Transformer Engine terms (``transformer_engine_expected``: ``transformer_impl``,
  or for ``auto`` a 16-bit ``params_dtype`` where Transformer Engine is installed), the 16-bit terms and PP
  are formula only. Under sequence parallelism a micro-batch is padded to a multiple of TP positions (at
  most TP - 1 more), which the estimate leaves out.
* **rollout KV cache** (native engine, ``hpa.rollout.kv_cache.CachedDecoder``): keys and values
  ``[B, g/TP, P + R, d]`` in ``params_dtype`` for each of the stage's ``L/PP`` layers, with
  ``P = data.max_prompt_length``, ``R = rollout.max_new_tokens`` and ``B = global_batch_size/DP·n``
  rows per rank; measured exact on CPU. megatron's ``StaticInferenceContext`` fallback allocates
  the same. Rollout and training do not overlap, so the peak is ``static + max(activations, KV
  cache)``. With graph decode (``rollout.cuda_graphs`` at TP = PP = 1) the cache is the bucket's,
  ``row_bucket(B)`` rows (a power of two) by ``slot_bucket(P + R)`` slots (a multiple of 128, at most the
  context), and it stays allocated through training (a captured graph reads fixed addresses): the peak is
  ``static + that cache + max(activations, the step's [rows, V] fp32 logits)``. An evaluation's generate
  keeps a bucket of its own rows (its prompts per rank), which the plan does not count.
* **vLLM rollouts** (``rollout.engine: vllm``, colocated): while awake vLLM takes
  ``rollout.gpu_memory_utilization`` of the GPU (its weights and KV cache); it sleeps during
  training (weights to CPU, KV cache dropped), while megatron's weights, gradients and optimizer
  state stay on the GPU through the rollout. The rollout term is then that budget instead of the
  native KV cache: peak ``static + max(activations, utilization·GPU)``. When that does not fit, the
  suggestions include the largest utilization (a multiple of 0.05) that leaves 2 GB of headroom and
  still holds vLLM's weight shard plus the KV cache of one full-length sequence.

Frozen models (reference, reward) hold parameters only; their inference activations are small next
to training's and are not counted. CUDA context, NCCL buffers and allocator fragmentation (typically
2-5 GB) are not counted either: keep that much headroom. GB here is 1e9 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from hpa.config import load_config
from hpa.config.errors import ConfigError
from hpa.config.linears import BY_NAME as LINEARS
from hpa.config.schema import Config, LoRAConfig, ModelConfig, data_parallel_size, trainer_world_size, validate

GB = 1e9
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_MAX_TP = 8  # tensor parallelism stays within one node (NVLink)


def _padded_vocab(model: ModelConfig, tp: int) -> int:
    from hpa.models.builders import padded_vocab_size  # defers torch: a config error or --help answers without it

    return padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp)


def layer_parameters(model: ModelConfig, tp: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank (norms replicated)."""
    linear = 0
    for lin in LINEARS.values():
        width_in, width_out = lin.widths(model)
        linear += width_in * width_out + (width_out if lin.has_bias(model) else 0)
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


def transformer_engine_installed() -> bool:
    """Whether a Transformer Engine package is installed here (found, not imported: the planner runs on
    machines without a GPU)."""
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def transformer_engine_expected(model: ModelConfig, installed: Optional[bool] = None) -> bool:
    """Whether the run uses Transformer Engine layers, as ``hpa.models.builders`` decides.

    ``transformer_impl=auto`` resolves to TE on a CUDA machine where TE imports, else to megatron's local
    spec. The planner takes a 16-bit ``params_dtype`` as the CUDA case (bf16 is refused on CPU) and
    ``installed`` (default: ``transformer_engine_installed()``) as whether TE is there: a bf16 run without
    TE uses the local spec, and its ``[s, s]`` attention terms.
    """
    if model.transformer_impl != "auto":
        return model.transformer_impl == "transformer_engine"
    if installed is None:
        installed = transformer_engine_installed()
    return model.params_dtype != "float32" and installed


def _norm_activations(model: ModelConfig, transformer_engine: bool) -> float:
    """Bytes per token one norm saves: its input and output (torch's RMSNorm also ``x·rstd``)."""
    saved = 2 if transformer_engine or model.normalization == "LayerNorm" else 3
    return saved * model.hidden_size * _DTYPE_BYTES[model.params_dtype]


def _dropout_mask_bytes(model: ModelConfig, transformer_engine: bool) -> int:
    """CUDA's fused dropout saves a bool mask; on CPU torch saves a noise tensor of the input dtype
    (float32, taken as the CPU path for the local spec)."""
    return 1 if transformer_engine or model.params_dtype != "float32" else 4


def _math_attention(model: ModelConfig, transformer_engine: bool) -> bool:
    """Whether the core attention keeps its ``[s, s]`` probabilities: only the local spec's SDPA with attention
    dropout on the CPU (float32) path, which runs torch's math kernel. Transformer Engine, and the local spec's
    SDPA otherwise (flash attention on CUDA in 16 bits, torch's flash kernel on CPU), keep none."""
    return not transformer_engine and model.attention_dropout > 0 and model.params_dtype == "float32"


def _lora_activations(model: ModelConfig, tp: int, sequence_parallel: bool) -> float:
    """Bytes per token one layer's adapters save: ``u = A x`` (``[T, r]``, whole on every TP rank) per adapted
    linear, and with adapter dropout the dropped input and its mask."""
    lora = model.lora
    if not lora.enabled:
        return 0.0
    e = _DTYPE_BYTES[model.params_dtype]
    out = len(lora.target_modules) * lora.rank * e
    if lora.dropout > 0:  # A's input: whole for a column-parallel base, a TP shard for a row-parallel one
        inputs = sum(LINEARS[t].in_features(model) / (tp if LINEARS[t].parallel == "row" else 1)
                     for t in lora.target_modules)
        out += inputs * (e + _dropout_mask_bytes(model, False))
    return out


def _layer_activations(model: ModelConfig, *, tp: int, sequence_parallel: bool, seq_length: int,
                       transformer_engine: bool) -> dict:
    """Bytes per token that one layer saves for backward on one TP rank (module docstring, terms).

    Returns ``input`` (the layer input, all full recomputation keeps), ``none`` and ``selective``
    (the whole layer without / with core-attention recomputation), ``gradients`` (the working set of the
    layer's backward beside what it keeps) and ``attention_recompute`` (the recomputed core attention and its
    gradients in backward, or that working set if larger).
    """
    h, a, s, e = model.hidden_size, model.num_attention_heads, seq_length, _DTYPE_BYTES[model.params_dtype]
    g, d = model.kv_heads, model.hidden_size // model.num_attention_heads
    f = model.ffn_hidden_size or 4 * h
    replicated = tp if sequence_parallel else 1  # norms and dropout masks are split by TP only under SP
    norm = _norm_activations(model, transformer_engine) / replicated
    # q and k after RoPE, the qkv output v is a view of, the context, and the fused kernels' fp32
    # log-sum-exp [b, a/tp, s]
    qkv_kept = (2 * h + g * d + (a + 2 * g) * d) * e / tp + a * 4 / tp
    mlp = (5 if model.activation == "swiglu" else 2) * f * e / tp
    noise = _dropout_mask_bytes(model, transformer_engine)
    dropout_masks = 2 * h * noise / replicated if model.hidden_dropout > 0 else 0.0
    lora = _lora_activations(model, tp, sequence_parallel)
    if _math_attention(model, transformer_engine):  # SDPA's math kernel: GQA repeats k, v; the probabilities
        gqa = a != g
        probs = a * s * e / tp + a * s * (e + noise) / tp  # softmax output, the dropped-out one and the mask
        attention = (qkv_kept - a * 4 / tp) + (2 * h * e / tp if gqa else 0.0) + probs
        # recomputed in backward, plus the gradients of the dropped-out and the softmax's probabilities
        attention_recompute = probs + (2 * h * e / tp if gqa else 0.0) + 2 * a * s * e / tp
    else:  # fused attention keeps q, k, v, the output and the log-sum-exp
        attention = qkv_kept
        attention_recompute = h * e / tp + (a + 2 * g) * d * e / tp  # the output, then q, k, v's gradients
    selective_attention = qkv_kept
    rest = 2 * norm + mlp + dropout_masks + lora
    # the MLP's backward holds the gradients of fc1's output and of the activation, and of the layer's
    # input and output, beside what the layer keeps
    # (the math kernel's attention: the gradients of its two [s, s] probabilities); under sequence
    # parallelism also a column-parallel linear's input gathered again and a row-parallel one's gradient
    # before its reduce-scatter, whole-sequence [s, b, h] tensors
    gradients = max((3 if model.activation == "swiglu" else 2) * f * e / tp + 2 * h * e / replicated,
                    2 * a * s * e / tp if _math_attention(model, transformer_engine) else 0.0)
    gradients += 2 * h * e if sequence_parallel and tp > 1 else 0.0
    return {"input": h * e / replicated, "none": rest + attention, "selective": rest + selective_attention,
            "gradients": gradients, "attention_recompute": max(gradients, attention_recompute)}


def _chunk_rows(model: ModelConfig, tp: int, positions: int) -> int:
    """Rows the fused head upcasts at a time: ``min(positions, CHUNK_ELEMENTS // (V_pad/t))``."""
    from hpa.ops import fused_head  # defers torch, as _padded_vocab

    return max(1, min(positions, fused_head.CHUNK_ELEMENTS // (_padded_vocab(model, tp) // tp)))


def lm_head_bytes(model: ModelConfig, *, tp: int, tokens: int, positions: int, backward: bool = True) -> int:
    """Peak bytes of the LM head of one micro-batch of ``tokens`` tokens whose loss reads ``positions`` of them,
    on top of what the layers keep (``hpa.ops.fused_head``; module docstring).

    The logits shard ``L = tokens·V_pad/t·e`` (megatron returns ``[b, s, v/t]`` as a contiguous copy of its
    ``[s, b, v/t]`` output: ``2·L`` for a moment) is kept for the head's backward; the head upcasts
    ``c = min(positions, CHUNK_ELEMENTS / (V_pad/t))`` rows at a time (two fp32 chunks, and in 16 bits the
    chunk read in the input dtype). Backward: the logits' gradient ``L`` (the input dtype) beside the logits
    and two fp32 chunks (plus the chunk's cast back in 16 bits); then the output layer's backward makes a
    contiguous copy of that gradient (``L``) and computes its weight gradient (``V_pad/t·h·e``; none for a
    frozen output layer under LoRA) and the input gradient ``tokens·h·e``.
    """
    vocab, e, h = _padded_vocab(model, tp) // tp, _DTYPE_BYTES[model.params_dtype], model.hidden_size
    logits = tokens * vocab * e
    cast = e if e < 4 else 0  # a 16-bit chunk is read as such, then upcast
    chunk = _chunk_rows(model, tp, positions) * vocab * (8 + cast)
    if not backward:
        return max(2 * logits, logits + chunk)
    wgrad = 0 if model.lora.enabled else vocab * h * e
    return max(2 * logits + chunk, 2 * logits + wgrad + tokens * h * e)


def activation_bytes(model: ModelConfig, *, tp: int, sequence_parallel: bool, recompute: Optional[str],
                     micro_batch_size: int, seq_length: int, with_logits: bool = True,
                     transformer_engine: Optional[bool] = None, positions: Optional[int] = None) -> int:
    """Activation memory of one rank for the in-flight micro-batches of a training forward and backward
    (see the module docstring).

    Args:
        micro_batch_size, seq_length: the micro-batch ``[b, s]`` (``b·s`` tokens: padded, or packed rows).
        with_logits: the LM head (policy); False for a scalar head (critic).
        transformer_engine: which layers the run uses; None: ``transformer_engine_expected(model)``.
        positions: the tokens whose log-probs the loss reads (the fused head computes only those); None: all.
    """
    if transformer_engine is None:
        transformer_engine = transformer_engine_expected(model)
    tokens = micro_batch_size * seq_length
    layer = _layer_activations(model, tp=tp, sequence_parallel=sequence_parallel, seq_length=seq_length,
                               transformer_engine=transformer_engine)
    replicated = tp if sequence_parallel else 1
    stem = model.hidden_size * _dropout_mask_bytes(model, transformer_engine) / replicated \
        if model.hidden_dropout > 0 else 0.0  # embedding dropout
    head = tokens * _norm_activations(model, transformer_engine) / replicated  # final norm
    if with_logits:
        head += lm_head_bytes(model, tp=tp, tokens=tokens, positions=tokens if positions is None else positions)
    if recompute == "full":  # layer inputs; in backward, one recomputed layer at a time, and its gradients
        stored, transient = layer["input"], layer["none"] - layer["input"] + layer["gradients"]
    elif recompute == "selective":
        stored, transient = layer["selective"], layer["attention_recompute"]
    else:
        stored, transient = layer["none"], layer["gradients"]
    # the head's tensors are freed (its backward ran) before any layer recomputes
    return int(tokens * (model.num_layers * stored + stem) + max(head, tokens * transient))


def forward_only_bytes(model: ModelConfig, *, tp: int, sequence_parallel: bool, micro_batch_size: int,
                       seq_length: int, positions: Optional[int] = None, with_logits: bool = True,
                       transformer_engine: Optional[bool] = None) -> int:
    """Peak bytes of one forward-only micro-batch (no graph): one layer's tensors at a time, then the LM
    head's logits and chunks (``lm_head_bytes(backward=False)``)."""
    if transformer_engine is None:
        transformer_engine = transformer_engine_expected(model)
    tokens = micro_batch_size * seq_length
    layer = _layer_activations(model, tp=tp, sequence_parallel=sequence_parallel, seq_length=seq_length,
                               transformer_engine=transformer_engine)
    hidden = 2 * model.hidden_size * _DTYPE_BYTES[model.params_dtype] / (tp if sequence_parallel else 1)
    body = int(tokens * (layer["none"] + hidden))
    if not with_logits:
        return body
    head = lm_head_bytes(model, tp=tp, tokens=tokens, positions=tokens if positions is None else positions,
                         backward=False)
    return max(body, int(tokens * hidden) + head)


def training_micro_batches(cfg: Config) -> Dict[str, Tuple[int, int]]:
    """The largest ``(rows, seq_length)`` of each kind of training micro-batch, per rank.

    ``rollout`` (PPO and critic): ``trainer.micro_batch_size`` rows of prompt + response,
    ``data.max_prompt_length + rollout.max_new_tokens`` tokens, or, with
    ``trainer.ppo_max_token_len_per_rank``, enough such rows to cover the budget (rounded up: a
    micro-batch holds the budget's tokens, padded or packed, and can pass it by one row).
    ``preference`` (DPO): chosen and rejected rows of ``micro_batch_size`` pairs, or with the budget enough
    pairs to cover it (rounded up), ``data.max_prompt_length + data.max_response_length`` tokens.
    """
    t, data = cfg.trainer, cfg.data
    rollout_length = data.max_prompt_length + cfg.rollout.max_new_tokens
    pair_length = data.max_prompt_length + data.max_response_length
    rows, pairs = t.micro_batch_size, t.micro_batch_size
    if t.ppo_max_token_len_per_rank is not None:  # balancing over DP can overshoot it by one row (pair)
        rows = -(-t.ppo_max_token_len_per_rank // rollout_length)
        pairs = -(-t.ppo_max_token_len_per_rank // (2 * pair_length))
    return {"rollout": (rows, rollout_length), "preference": (2 * pairs, pair_length)}


def head_positions(cfg: Config, kind: str, rows: int) -> int:
    """The positions whose log-probs a micro-batch's loss reads: every response position of each row
    (``rollout.max_new_tokens`` for rollouts and forward-only passes, ``data.max_response_length`` for pairs)."""
    return rows * (cfg.data.max_response_length if kind == "preference" else cfg.rollout.max_new_tokens)


def forward_micro_batch(cfg: Config) -> Tuple[int, int]:
    """``(rows, seq_length)`` of the largest forward-only micro-batch (old and reference log-probs, values):
    ``trainer.micro_batch_size`` rollout rows, or enough rows to cover ``trainer.log_prob_max_token_len_per_rank``."""
    t = cfg.trainer
    length = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    rows = t.micro_batch_size
    if t.log_prob_max_token_len_per_rank is not None:
        rows = -(-t.log_prob_max_token_len_per_rank // length)
    return rows, length


def rollout_batch(cfg: Config, dp: int) -> Tuple[int, int]:
    """``(rows, positions)`` of one rank's ``generate`` call: ``global_batch_size/DP·n`` rows of
    ``data.max_prompt_length + rollout.max_new_tokens`` positions (the longest prompt + the budget)."""
    return (cfg.trainer.global_batch_size // dp * cfg.rollout.n,
            cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)


# the graph decode's buckets (``hpa.rollout.megatron_engine``: ``row_bucket``, ``slot_bucket``; restated
# here so the planner imports neither torch nor megatron; tests/test_plan.py checks the two agree)
GRAPH_SLOT_BLOCK = 128


def graph_decode(cfg: Config, tp: int, pp: int) -> bool:
    """Whether the native engine decodes from CUDA graphs (``rollout.cuda_graphs`` at TP = PP = 1; the plan is
    for GPUs): its rollout cache is then a bucket's, kept allocated through training."""
    return cfg.rollout.engine == "megatron" and cfg.rollout.cuda_graphs and tp == 1 and pp == 1


def graph_bucket(rows: int, positions: int, max_sequence_length: int) -> Tuple[int, int]:
    """``(rows, slots)`` of the graph decode's bucket: rows up to a power of two, slots up to a multiple of
    ``GRAPH_SLOT_BLOCK`` (at most the model's context)."""
    return 1 << (rows - 1).bit_length(), min(-(-positions // GRAPH_SLOT_BLOCK) * GRAPH_SLOT_BLOCK, max_sequence_length)


def rollout_cache_shape(cfg: Config, tp: int, pp: int, dp: int) -> Tuple[int, int]:
    """``(rows, positions)`` of one rank's rollout KV cache: ``rollout_batch``'s, or with graph decode
    (``graph_decode``) its bucket's rows and slots (``graph_bucket``)."""
    rows, positions = rollout_batch(cfg, dp)
    return graph_bucket(rows, positions, cfg.model.max_sequence_length) if graph_decode(cfg, tp, pp) \
        else (rows, positions)


def kv_cache_bytes(cfg: Config, tp: int, pp: int, dp: int, shape: Optional[Tuple[int, int]] = None) -> int:
    """Rollout KV cache of one rank (native engine): ``hpa.rollout.kv_cache.CachedDecoder`` keeps keys
    and values ``[b, g/tp, S, d]`` in ``params_dtype`` for each of its stage's layers, over
    ``rollout_cache_shape``'s rows and positions (``shape``, when the caller has it already)."""
    m = cfg.model
    batch, positions = shape or rollout_cache_shape(cfg, tp, pp, dp)
    per_layer = 2 * batch * (m.kv_heads // tp) * positions * (m.hidden_size // m.num_attention_heads)
    return (m.num_layers // pp) * per_layer * _DTYPE_BYTES[m.params_dtype]


@dataclasses.dataclass(frozen=True)
class _Knobs:
    tp: int
    pp: int
    distributed_optimizer: bool
    recompute: Optional[str]


def lora_parameters(model: ModelConfig, tp: int = 1, pp: int = 1) -> int:
    """Adapter parameters of one rank of a pipeline stage (``hpa.models.lora``; docs/lora.md, shapes per TP
    rank): per adapted linear of each of the stage's ``L/PP`` layers, ``A [r, in]`` and ``B [out, r]``, the
    side that follows the base weight's split divided by TP. 0 without LoRA."""
    lora = model.lora
    if not lora.enabled:
        return 0
    per_rank = 0
    for target in lora.target_modules:
        (a_rows, a_cols), (b_rows, b_cols) = LINEARS[target].lora_shapes(model, lora.rank, tp)
        per_rank += a_rows * a_cols + b_rows * b_cols
    return model.num_layers // pp * per_rank


@dataclasses.dataclass(frozen=True)
class _Model:
    """One model the run keeps: its architecture, a scalar head's K (None: the LM head), whether it trains,
    and whether its base weights are the policy's (LoRA: the reference and the critic share them)."""
    name: str
    model: ModelConfig
    scalar_heads: Optional[int]
    trainable: bool
    shares_base: bool = False


def _models(cfg: Config, reward_models: Sequence[ModelConfig]) -> List[_Model]:
    """Every model the run keeps; ``reward_models``: the architecture of each of ``reward.model_paths``."""
    lora = cfg.model.lora.enabled
    models = [_Model("policy", cfg.model, None, True)]
    if cfg.algorithm.advantage.estimator == "gae":
        models.append(_Model("critic", cfg.model, 1, True, shares_base=lora))
    models.append(_Model("reference", cfg.model, None, False, shares_base=lora))
    for i, rm in enumerate(reward_models):
        models.append(_Model(f"reward{i}" if len(reward_models) > 1 else "reward", rm, cfg.reward.num_heads, False))
    return models


def reward_architectures(cfg: Config, reward_config: Optional[Config] = None) -> Tuple[List[ModelConfig], List[str]]:
    """The architecture of each reward model, as ``hpa train`` builds it (``hpa.reward.model``), and notes.

    A path that holds a reward model's record (``hpa_reward_model.json`` with its architecture) gives its
    own; otherwise ``reward_config``'s ``model`` section (the config it is, or will be, trained with:
    ``hpa train-rm --config``, whose architecture ``train-rm`` records); otherwise the policy's architecture
    (what the loader assumes for a record without one), said in a note.
    """
    # defers torch, as _padded_vocab
    from hpa.reward.model import ARCHITECTURE_FIELDS, read_reward_model_info, reward_model_config

    out, notes = [], []
    for path in cfg.reward.model_paths:
        try:
            info = read_reward_model_info(path) if os.path.isdir(path) else None
            if info is not None:
                out.append(reward_model_config(cfg.model, path, info))
                continue
        except ValueError as exc:  # an unreadable or invalid record
            raise ConfigError("reward.model_paths", str(exc)) from None
        if reward_config is not None:
            arch = {k: getattr(reward_config.model, k) for k in ARCHITECTURE_FIELDS}
            out.append(dataclasses.replace(cfg.model, **arch, lora=LoRAConfig()))
            notes.append(f"reward model {path}: no record there; planned with the model section of --reward-config")
        else:
            out.append(dataclasses.replace(cfg.model, lora=LoRAConfig()))
            notes.append(f"reward model {path}: no record there; planned with the policy's architecture "
                         "(give --reward-config FILE, the config it is trained with, for its own size)")
    return out, notes


def vllm_budget_gb(cfg: Config, gpu_memory_gb: float) -> float:
    """What colocated vLLM takes while awake: ``rollout.gpu_memory_utilization`` of the GPU."""
    return cfg.rollout.gpu_memory_utilization * gpu_memory_gb


def vllm_minimum_gb(cfg: Config) -> float:
    """The least vLLM can run with: its weight shard (``rollout.vllm_tensor_parallel_size``, unset: the
    policy's TP) and the KV cache of one ``max_prompt_length + max_new_tokens`` sequence, in ``params_dtype``."""
    m, tp = cfg.model, cfg.rollout.vllm_tensor_parallel_size or cfg.parallel.tensor_model_parallel_size
    weights = count_parameters(m) * _DTYPE_BYTES[m.params_dtype] / tp
    positions = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    kv = 2 * m.num_layers * max(m.kv_heads // tp, 1) * (m.hidden_size // m.num_attention_heads) * positions
    return (weights + kv * _DTYPE_BYTES[m.params_dtype]) / GB


def _fitting_utilization(cfg: Config, static_gb: float, activations_gb: float, gpu_memory_gb: float,
                         headroom_gb: float = 2.0) -> Optional[float]:
    """The largest ``gpu_memory_utilization`` (a multiple of 0.05) with which a vLLM run fits."""
    if static_gb + activations_gb > gpu_memory_gb:
        return None
    util = int((gpu_memory_gb - headroom_gb - static_gb) / gpu_memory_gb * 20) / 20
    return util if util > 0 and util * gpu_memory_gb >= vllm_minimum_gb(cfg) else None


def _estimate(cfg: Config, world_size: int, k: _Knobs, gpu_memory_gb: float,
              reward_models: Sequence[ModelConfig]) -> dict:
    m = cfg.model
    disaggregated = cfg.rollout.placement == "disaggregated"
    dp = trainer_world_size(cfg.rollout, world_size) // (k.tp * k.pp)
    sp = k.tp > 1 and _sequence_parallel_possible(cfg) and (
        cfg.parallel.sequence_parallel or k.tp != cfg.parallel.tensor_model_parallel_size)
    shapes = training_micro_batches(cfg)
    adapters = lora_parameters(m, k.tp, k.pp)

    def activations(recompute: Optional[str], lm_head: bool) -> float:
        kinds = shapes if lm_head else {"rollout": shapes["rollout"]}  # the critic sees no preference pairs
        return max(activation_bytes(m, tp=k.tp, sequence_parallel=sp, recompute=recompute, micro_batch_size=b,
                                    seq_length=s, with_logits=lm_head, positions=head_positions(cfg, kind, b))
                   for kind, (b, s) in kinds.items()) / GB

    def forward_only(lm_head: bool) -> float:
        b, s = forward_micro_batch(cfg)
        return forward_only_bytes(m, tp=k.tp, sequence_parallel=sp, micro_batch_size=b, seq_length=s,
                                  positions=head_positions(cfg, "rollout", b), with_logits=lm_head) / GB

    rows = {}
    for spec in _models(cfg, reward_models):
        heads, pbytes = spec.scalar_heads, _DTYPE_BYTES[spec.model.params_dtype]
        own_head = heads * m.hidden_size + heads if heads is not None else 0
        if spec.shares_base:  # LoRA: the policy's base; a critic adds its adapters and value head
            params = trainable = (adapters + own_head) if spec.trainable else 0
        else:
            params = max(stage_parameters(spec.model, k.tp, k.pp, heads))
            params += adapters if spec.trainable else 0
            trainable = (adapters if m.lora.enabled else params) if spec.trainable else 0
        row = {"parameters": count_parameters(spec.model, heads), "parameters_per_gpu": params,
               "trainable_per_gpu": trainable, "shares_base": spec.shares_base,
               "params_gb": params * pbytes / GB, "grads_gb": 0.0, "optimizer_gb": 0.0,
               "activations_gb": 0.0, "forward_gb": 0.0}
        if spec.trainable:
            adam_bytes = 8 + (4 if spec.model.params_dtype != "float32" else 0)
            plain, dist = trainable * adam_bytes, trainable * adam_bytes / dp
            row["grads_gb"] = trainable * 4 / GB
            row["optimizer_gb"] = (dist if k.distributed_optimizer else plain) / GB
            row["optimizer_gb_plain"], row["optimizer_gb_distributed"] = plain / GB, dist / GB
            per = {r or "none": activations(r, heads is None) for r in (None, "selective", "full")}
            row["activations_gb"] = per[k.recompute or "none"]
            row["activations_gb_by_recompute"] = per
        if spec.name in ("policy", "critic", "reference"):  # old/reference log-probs, values
            row["forward_gb"] = forward_only(heads is None)
        row["static_gb"] = row["params_gb"] + row["grads_gb"] + row["optimizer_gb"]
        rows[spec.name] = row
    static = sum(r["static_gb"] for r in rows.values())
    training = max(r["activations_gb"] for r in rows.values())
    forward = max(r["forward_gb"] for r in rows.values())
    activations = max(training, forward)
    shape = rollout_cache_shape(cfg, k.tp, k.pp, dp)
    kv = kv_cache_bytes(cfg, k.tp, k.pp, dp, shape) / GB
    rollout = vllm_budget_gb(cfg, gpu_memory_gb) if cfg.rollout.engine == "vllm" else kv
    bucket = shape if graph_decode(cfg, k.tp, k.pp) else None
    held = kv if bucket else 0.0  # a graph's bucket stays allocated through training
    if bucket:  # while decoding, the captured step's logits (fp32) on top of the cache
        rollout = bucket[0] * _padded_vocab(m, k.tp) * 4 / GB
    if disaggregated:  # the rollout ranks sample (``rollout_rank_memory``); the trainer ranks hold no cache
        kv = rollout = held = 0.0
        bucket = None
    return {
        "layout": {"tensor_model_parallel_size": k.tp, "pipeline_model_parallel_size": k.pp,
                   "data_parallel_size": dp, "sequence_parallel": sp,
                   "use_distributed_optimizer": k.distributed_optimizer,
                   "recompute_granularity": k.recompute},
        "models": rows,
        "static_gb": static,
        "training_activations_gb": training,
        "forward_activations_gb": forward,
        "activations_gb": activations,
        "kv_cache_gb": kv,
        "rollout_gb": rollout,
        "rollout_engine": cfg.rollout.engine,
        "graph_cache_gb": held,
        "graph_bucket": list(bucket) if bucket else None,  # (rows, slots) of the graph decode's cache
        "total_gb": static + held + max(activations, rollout),
    }


def rollout_rank_memory(cfg: Config, world_size: int, gpu_memory_gb: float) -> dict:
    """Memory of one rollout rank of a disaggregated run (``rollout.placement: disaggregated``): the policy's
    weights whole (TP = PP = 1; with LoRA the base and the adapters), no gradients or optimizer, and the native
    engine's KV cache for one job (a trainer DP rank's ``global_batch_size/DP·n`` rows: a rollout rank samples
    its trainer ranks' jobs one at a time), with graph decode its bucket and the decode step's fp32 logits."""
    m = cfg.model
    dp = trainer_world_size(cfg.rollout, world_size) // (
        cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size)
    weights = (count_parameters(m) + lora_parameters(m, 1, 1)) * _DTYPE_BYTES[m.params_dtype] / GB
    shape = rollout_cache_shape(cfg, 1, 1, dp)
    kv = kv_cache_bytes(cfg, 1, 1, dp, shape) / GB
    logits = shape[0] * _padded_vocab(m, 1) * 4 / GB if graph_decode(cfg, 1, 1) else 0.0
    total = weights + kv + logits
    return {"num_ranks": cfg.rollout.num_ranks, "weights_gb": weights, "kv_cache_gb": kv, "logits_gb": logits,
            "cache_shape": list(shape), "total_gb": total, "fits": total <= gpu_memory_gb}


def _sequence_parallel_possible(cfg: Config) -> bool:
    """The native rollout engine decodes one position a step and refuses sequence parallelism."""
    return cfg.rollout.engine != "megatron"


def _valid_layout(cfg: Config, world_size: int, tp: int, pp: int) -> bool:
    parallel = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                   sequence_parallel=tp > 1 and _sequence_parallel_possible(cfg))
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
    if k.tp != p.tensor_model_parallel_size:
        out.append(f"parallel.tensor_model_parallel_size={k.tp}"
                   + (" parallel.sequence_parallel=true" if k.tp > 1 and _sequence_parallel_possible(cfg) else ""))
    if k.pp != p.pipeline_model_parallel_size:
        out.append(f"parallel.pipeline_model_parallel_size={k.pp}")
    return out


def _suggest(cfg: Config, world_size: int, gpu_memory_gb: float, reward_models: Sequence[ModelConfig],
             limit: int = 5) -> List[dict]:
    """Single and combined changes that make the run fit, fewest changes first, then least memory."""
    p, m = cfg.parallel, cfg.model
    trainers = trainer_world_size(cfg.rollout, world_size)
    layouts = [(tp, pp) for tp in range(1, min(_MAX_TP, trainers) + 1)
               for pp in range(1, trainers // tp + 1)
               if trainers % (tp * pp) == 0 and _valid_layout(cfg, world_size, tp, pp)]
    found = []
    for (tp, pp), dist, rec in itertools.product(
            layouts, {p.use_distributed_optimizer, True}, {m.recompute_granularity, "selective", "full"}):
        k = _Knobs(tp, pp, dist, rec)
        est = _estimate(cfg, world_size, k, gpu_memory_gb, reward_models)
        changes = _changes(cfg, k)
        if est["total_gb"] <= gpu_memory_gb:
            if changes:
                found.append({"changes": changes, "total_gb": est["total_gb"], "layout": est["layout"]})
        elif cfg.rollout.engine == "vllm":
            util = _fitting_utilization(cfg, est["static_gb"], est["activations_gb"], gpu_memory_gb)
            if util is not None and util < cfg.rollout.gpu_memory_utilization:
                total = est["static_gb"] + max(est["activations_gb"], util * gpu_memory_gb)
                found.append({"changes": changes + [f"rollout.gpu_memory_utilization={util:.2f}"],
                              "total_gb": total, "layout": est["layout"]})
    found.sort(key=lambda f: (len(f["changes"]), f["total_gb"]))
    return found[:limit]


def plan(cfg: Config, world_size: int, gpu_memory_gb: float, reward_config: Optional[Config] = None) -> dict:
    """Memory per GPU (worst pipeline stage) for ``cfg`` on ``world_size`` GPUs of ``gpu_memory_gb``.

    Returns a dict: ``layout``, ``models`` (per model: ``parameters`` (unsharded count),
    ``parameters_per_gpu``, ``params_gb``, ``grads_gb``, ``optimizer_gb`` (+ ``_plain`` /
    ``_distributed``), ``activations_gb`` (+ ``_by_recompute``), ``static_gb``), ``static_gb``,
    ``activations_gb``, ``kv_cache_gb`` (the native engine's), ``rollout_gb`` (the rollout term:
    that KV cache, or the vLLM budget), ``total_gb``, ``gpu_memory_gb``, ``fits``,
    ``suggestions`` (changes that make it fit, fewest first; empty when it fits already),
    ``training_micro_batches`` (the shapes the activations are counted for), ``transformer_engine``
    (which layers the activation terms assume) and ``notes``.

    Raises:
        ConfigError: the layout does not divide the world size or the model.
    """
    data_parallel_size(cfg.parallel, trainer_world_size(cfg.rollout, world_size))
    validate(cfg, world_size)
    p = cfg.parallel
    k = _Knobs(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.use_distributed_optimizer,
               cfg.model.recompute_granularity)
    reward_models, reward_notes = reward_architectures(cfg, reward_config)
    out = _estimate(cfg, world_size, k, gpu_memory_gb, reward_models)
    out["world_size"] = world_size
    out["gpu_memory_gb"] = gpu_memory_gb
    out["placement"] = cfg.rollout.placement
    out["rollout_ranks"] = rollout_rank_memory(cfg, world_size, gpu_memory_gb) \
        if cfg.rollout.placement == "disaggregated" else None
    out["fits"] = out["total_gb"] <= gpu_memory_gb and (out["rollout_ranks"] is None or out["rollout_ranks"]["fits"])
    out["suggestions"] = [] if out["fits"] else _suggest(cfg, world_size, gpu_memory_gb, reward_models)
    shapes = training_micro_batches(cfg)
    out["training_micro_batches"] = {kind: {"rows": b, "seq_length": s} for kind, (b, s) in shapes.items()}
    out["transformer_engine"] = transformer_engine_expected(cfg.model)
    out["notes"] = [
        "activations: largest micro-batch per rank of each kind, " + ", ".join(
            f"{kind} {b}x{s}" for kind, (b, s) in shapes.items()) + " (rows x tokens); "
        + ("Transformer Engine layers (formula only)" if out["transformer_engine"] else
           "megatron's local spec (the formula measured on CPU)"),
        "forward-only passes: {}x{} (rows x tokens) per micro-batch, no graph kept".format(*forward_micro_batch(cfg)),
        *(["LoRA: the base weights are frozen and held once (the reference is the base with the adapters off); "
           "gradients and Adam state for the adapters only"] if cfg.model.lora.enabled else []),
        *reward_notes,
        (f"rollout: vLLM takes rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization:g} of the "
         f"GPU while awake (its weights + KV cache; it sleeps during training, megatron's state stays); "
         f"the native engine's KV cache would be {out['kv_cache_gb']:.2f} GB"
         if cfg.rollout.engine == "vllm" else
         "rollout KV cache (native engine, graph decode): the bucket of {}x{} (rows x slots) for {}·{}/DP sequences "
         "of {}+{} tokens, kept through training so a rollout replays without capturing again; an evaluation's "
         "generate (its prompts per rank) keeps a bucket of its own".format(
             *out["graph_bucket"],
             cfg.trainer.global_batch_size, cfg.rollout.n, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens)
         if out["graph_bucket"] else
         f"disaggregated: {cfg.rollout.num_ranks} rollout rank(s) hold the policy's weights whole and the KV cache "
         f"of one job ({cfg.trainer.global_batch_size}·{cfg.rollout.n}/DP sequences); the trainer ranks hold the "
         f"model, its gradients and optimizer state (an evaluation's or a refill round's generate still runs on "
         f"them, its KV cache not counted)"
         if out["rollout_ranks"] else
         f"rollout KV cache: {cfg.trainer.global_batch_size}·{cfg.rollout.n}/DP sequences of "
         f"{cfg.data.max_prompt_length}+{cfg.rollout.max_new_tokens} tokens (native engine)"),
        ("peak = static + graph decode cache + max(activations, the decode step's logits)" if out["graph_cache_gb"] > 0
         else "peak (trainer ranks) = static + activations" if out["rollout_ranks"]
         else "peak = static + max(activations, rollout)") + "; keep 2-5 GB for CUDA context, NCCL, fragmentation",
    ]
    return out


def format_plan(result: dict) -> str:
    """The plan as a text table (GB = 1e9 bytes)."""
    lay = result["layout"]
    graph = result["graph_cache_gb"] > 0
    rollout_label = ("rollout (vLLM, awake)" if result["rollout_engine"] == "vllm"
                     else "rollout: the graph step's logits" if graph else "rollout KV cache (native engine)")
    rollout_ranks = result.get("rollout_ranks")
    trainers = result["world_size"] - (rollout_ranks["num_ranks"] if rollout_ranks else 0)
    lines = [f"hpa plan: {result['world_size']} GPUs x {result['gpu_memory_gb']:g} GB"
             + (f" ({trainers} trainer + {rollout_ranks['num_ranks']} rollout ranks)" if rollout_ranks else "")
             + ", "
             f"TP{lay['tensor_model_parallel_size']} x PP{lay['pipeline_model_parallel_size']} x "
             f"DP{lay['data_parallel_size']}, sequence_parallel={lay['sequence_parallel']}, "
             f"distributed_optimizer={lay['use_distributed_optimizer']}, "
             f"recompute={lay['recompute_granularity']}",
             "",
             f"{'model':<10} {'params':>9} {'params/GPU':>11} {'weights':>8} {'grads':>8} "
             f"{'optim':>8} {'train':>8} {'fwd':>8} {'static':>8}   (GB per GPU)"]
    for name, r in result["models"].items():
        lines.append(f"{name:<10} {r['parameters'] / 1e9:>8.2f}B {r['parameters_per_gpu'] / 1e9:>10.3f}B "
                     f"{r['params_gb']:>8.2f} {r['grads_gb']:>8.2f} {r['optimizer_gb']:>8.2f} "
                     f"{r['activations_gb']:>8.2f} {r['forward_gb']:>8.2f} {r['static_gb']:>8.2f}"
                     + ("   (the policy's base)" if r["shares_base"] else ""))
    lines += [f"{'static (weights + grads + optimizer)':<40} {result['static_gb']:>8.2f}",
              f"{'activations (training, forward-only)':<40} {result['activations_gb']:>8.2f}",
              *([] if rollout_ranks else [f"{rollout_label:<40} {result['rollout_gb']:>8.2f}"]),
              *([f"{'graph decode KV cache (kept)':<40} {result['graph_cache_gb']:>8.2f}"] if graph else []),
              f"{'total = static + ' + ('cache + ' if graph else '') + ('activations' if rollout_ranks else 'max(activ., rollout)'):<40} "
              f"{result['total_gb']:>8.2f}  of "
              f"{result['gpu_memory_gb']:g} GB" + (" (per trainer rank)" if rollout_ranks else "")]
    if rollout_ranks:
        r = rollout_ranks
        lines += ["",
                  f"per rollout rank ({r['num_ranks']}, TP1, native engine):",
                  f"{'  weights (the policy whole)':<40} {r['weights_gb']:>8.2f}",
                  f"{'  KV cache ({}x{} rows x positions)'.format(*r['cache_shape']):<40} {r['kv_cache_gb']:>8.2f}",
                  *([f"{'  decode step logits (fp32)':<40} {r['logits_gb']:>8.2f}"] if r["logits_gb"] else []),
                  f"{'  total':<40} {r['total_gb']:>8.2f}  of {result['gpu_memory_gb']:g} GB"
                  + ("" if r["fits"] else "  DOES NOT FIT")]
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
                     "combination of distributed optimizer, recomputation, TP/PP and vLLM memory share "
                     "fits: use more GPUs or GPUs with more memory")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``hpa plan --config X --world-size N --gpu-memory-gb M [--json] [section.key=value ...]``."""
    parser = argparse.ArgumentParser(prog="hpa plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu.yaml)")
    parser.add_argument("--world-size", type=int, required=True, help="number of GPUs")
    parser.add_argument("--gpu-memory-gb", type=float, required=True, help="memory per GPU in GB (1e9 bytes)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--reward-config", default=None, help="the config the reward models are trained with "
                        "(hpa train-rm --config): their size where reward.model_paths holds no record yet")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if not (math.isfinite(args.gpu_memory_gb) and args.gpu_memory_gb > 0):
            raise ConfigError("--gpu-memory-gb", f"must be a positive number of GB, got {args.gpu_memory_gb}",
                              source="command line")
        cfg = load_config(args.config, args.overrides, world_size=args.world_size)
        reward_cfg = _reward_config(args.reward_config) if args.reward_config else None
        result = plan(cfg, args.world_size, args.gpu_memory_gb, reward_cfg)
    except ConfigError as exc:
        print(f"hpa plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0 if result["fits"] else 1


def _reward_config(path: str):
    """``--reward-config``'s config; a missing file or a directory is said of that flag, not of ``--config``."""
    try:
        return load_config(path)
    except ConfigError as exc:
        if exc.key != "--config":
            raise
        raise ConfigError("--reward-config", exc.message, source=exc.source) from None


if __name__ == "__main__":
    sys.exit(main())
