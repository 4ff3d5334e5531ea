"""Builders for the four models of an HPA run: policy, reference, value (critic) and reward.

Each takes its own config sections and the ``ParallelGroups``; none holds training logic
(docs/design.md, rule 8). Heads exist only on the last pipeline stage (``post_process``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hpa.config.schema import ModelConfig, ParallelConfig
from hpa.distributed.groups import ParallelGroups
from hpa.distributed.init import TEST_MODEL_DEVICE_ENV

from . import device_boundary
from .compiled_layers import compile_layers, compile_wanted
from .heads import ScalarHead
from .specs import gpt_layer_spec, use_transformer_engine

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron pads the embedding so every TP shard has the same, aligned number of rows."""
    multiple = divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups):
    """megatron ``TransformerConfig`` for a Llama-style decoder under this layout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = _DTYPES[model.params_dtype]
    on_cpu = compute_device(groups).type == "cpu"
    if on_cpu and dtype != torch.float32:
        raise ValueError("model.params_dtype must be float32 on CPU (gloo); bf16 is for GPUs")
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.kv_heads,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.activation == "swiglu",
        activation_func=F.silu if model.activation == "swiglu" else F.gelu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=groups.tensor_model_parallel_size,
        pipeline_model_parallel_size=groups.pipeline_model_parallel_size,
        context_parallel_size=groups.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        use_cpu_initialization=on_cpu,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # megatron requires it with variable_seq_lengths
        deallocate_pipeline_outputs=not on_cpu,
        recompute_granularity=model.recompute_granularity,
        recompute_method="uniform" if model.recompute_granularity == "full" else None,
        recompute_num_layers=1 if model.recompute_granularity == "full" else None,
        cuda_graph_scope=[],  # megatron's default "full", spelled as it now wants (else it warns per config)
    )


def compute_device(groups: ParallelGroups) -> torch.device:
    """Where a model's parameters live: ``groups.device``, except in the lazy-device test mode
    (``hpa/distributed/device_mode.py``), where the model computes on the CPU behind test-device edges."""
    return torch.device("cpu") if groups.device.type == "lazy" else groups.device


def _edges(gpt, groups: ParallelGroups):
    if groups.device.type != "lazy":
        return gpt
    if groups.pipeline_model_parallel_size > 1:
        raise ValueError(f"{TEST_MODEL_DEVICE_ENV}: the test device mode runs one pipeline stage "
                         f"(parallel.pipeline_model_parallel_size=1)")
    return device_boundary.install(gpt, groups.device)


def _gpt(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups):
    """The GPTModel with every weight in ``params_dtype``. megatron's local spec builds its torch norms without
    a dtype (fp32) and leaves the cast to ``Float16Module`` (``module.bfloat16()``), which hpa does not wrap
    models in; cast as it does, or every norm of a bf16 run takes torch's unfused path (bf16 input, fp32
    weight) and megatron's plain mixed-precision optimizer cannot map the fp32 ones' state in a checkpoint."""
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(model, parallel, groups)
    use_te = use_transformer_engine(model.transformer_impl) and groups.device.type == "cuda"
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(use_te=use_te, normalization=model.normalization),
        vocab_size=padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by,
                                     groups.tensor_model_parallel_size),
        max_sequence_length=model.max_sequence_length,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=int(model.rotary_base),
        pg_collection=groups.pg_collection,
    ).to(device=compute_device(groups), dtype=config.params_dtype)
    if compile_wanted(model.compile, compute_device(groups), use_te=use_te,
                      recompute_granularity=model.recompute_granularity):
        compile_layers(gpt)
    return gpt


def build_policy(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups):
    """The trainable policy: a GPTModel whose last stage returns vocab-parallel logits ``[b, s, v/tp]``."""
    return _edges(_gpt(model, parallel, groups), groups)


def build_reference(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups):
    """A frozen copy of the policy architecture (weights are loaded from ``model.reference_path``)."""
    ref = _edges(_gpt(model, parallel, groups), groups)
    ref.requires_grad_(False)
    return ref.eval()


def value_head(model: ModelConfig, groups: ParallelGroups, num_heads: int = 1, *,
               sequence_parallel: bool = False) -> ScalarHead:
    """A fresh scalar head (the last stage's output layer of a critic or reward model)."""
    return ScalarHead(model.hidden_size, num_heads, init_std=model.init_method_std,
                      sequence_parallel=sequence_parallel, tp_group=groups.tp_group).to(
        device=compute_device(groups), dtype=_DTYPES[model.params_dtype])


def _with_scalar_head(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups, num_heads: int):
    gpt = _gpt(model, parallel, groups)
    if groups.is_last_stage:
        gpt.output_layer = value_head(model, groups, num_heads, sequence_parallel=gpt.config.sequence_parallel)
    return _edges(gpt, groups)


def build_value(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups):
    """The critic: the policy backbone with one scalar head; the last stage returns ``[b, s, 1]``."""
    if not model.untie_embeddings_and_output_weights:
        raise ValueError("a value model needs untied embeddings (its head is not the embedding)")
    return _with_scalar_head(model, parallel, groups, 1)


def build_reward(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups, num_heads: int = 1):
    """The reward model: backbone + ``num_heads`` scalar heads (an ensemble); last stage ``[b, s, K]``."""
    if not model.untie_embeddings_and_output_weights:
        raise ValueError("a reward model needs untied embeddings (its heads are not the embedding)")
    return _with_scalar_head(model, parallel, groups, num_heads)
