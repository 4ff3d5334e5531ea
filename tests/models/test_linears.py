"""The linears table (``hpa.config.linears``) against what it describes: megatron's built decoder layer (every
parallel linear of a layer is a row, its class, weight and bias shapes; the adapters ``attach_lora`` puts on it),
at TP1 in this process and at TP2 (the shards) on two gloo ranks, and transformers' Llama/Qwen2 projections.
"""

import dataclasses

import pytest
import torch

from multirank import run_ranks

RANK = 4


def model_configs():
    from hpa.config.schema import LoRAConfig, ModelConfig

    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16,
                  make_vocab_size_divisible_by=16, lora=LoRAConfig(rank=RANK, alpha=8.0))
    return {"swiglu_gqa": ModelConfig(**common, num_query_groups=2, ffn_hidden_size=48),
            "gelu_bias_default_ffn": ModelConfig(**common, activation="gelu", add_qkv_bias=True)}


def layer_linears(groups, model_cfg, tp):
    """Every parallel linear of layer 0 of a built policy with LoRA attached: ``{parent.name: (class kind,
    weight shape, bias shape or None, A shape, B shape)}`` on this rank."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy, unwrap
    from hpa.models.lora import SUFFIX, attach_lora

    gpt = unwrap(build_policy(model_cfg, ParallelConfig(tensor_model_parallel_size=tp), groups))
    attach_lora(gpt, model_cfg.lora, groups, seed=0)
    layer = gpt.decoder.layers[0]
    out = {}
    for name, module in layer.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            parent, _, attr = name.rpartition(".")
            adapter = layer.get_submodule(f"{parent}.{attr}{SUFFIX}")
            bias = getattr(module, "bias", None)
            out[name] = ("column" if isinstance(module, ColumnParallelLinear) else "row",
                         tuple(module.weight.shape), None if bias is None else tuple(bias.shape),
                         tuple(adapter.A.shape), tuple(adapter.B.shape))
    return out


def expected(model_cfg, tp):
    from hpa.config.linears import LINEARS

    out = {}
    for lin in LINEARS:
        i, o = lin.widths(model_cfg)
        weight = (o // tp, i) if lin.parallel == "column" else (o, i // tp)
        a, b = lin.lora_shapes(model_cfg, RANK, tp)
        out[f"{lin.parent}.{lin.name}"] = (lin.parallel, weight, (o // tp,) if lin.has_bias(model_cfg) else None, a, b)
    return out


@pytest.mark.parametrize("name", ["swiglu_gqa", "gelu_bias_default_ffn"])
def test_the_table_is_megatrons_layer_at_tp1(groups, name):
    model_cfg = model_configs()[name]
    got = layer_linears(groups, model_cfg, 1)
    assert got == expected(model_cfg, 1)
    # the hand-derived widths of the GQA SwiGLU model: q 4·8 + k, v 2·8 each; [gate; up] 2·48
    if name == "swiglu_gqa":
        assert got["self_attention.linear_qkv"][1] == (64, 32) and got["mlp.linear_fc1"][1] == (96, 32)


def tp2_worker(groups):
    return {name: layer_linears(groups, cfg, 2) for name, cfg in model_configs().items()}


@pytest.mark.multirank
def test_the_table_gives_megatrons_tp2_shards():
    ranks = run_ranks(tp2_worker, tp=2)
    for name, model_cfg in model_configs().items():
        for rank in ranks:
            assert rank[name] == expected(model_cfg, 2), name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_table_names_transformers_projections(family):
    import transformers

    from hpa.config.linears import LINEARS
    from hpa.models.convert import model_config_from_hf

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    hf = cls[1](cls[0](**common))
    model_cfg = model_config_from_hf(hf.config)
    linears = {n for n, m in hf.model.layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears == {f"{lin.hf_parent}.{p}" for lin in LINEARS for p in lin.hf_projections}
    for lin in LINEARS:
        for proj, rows in zip(lin.hf_projections, lin.hf_rows(model_cfg), strict=True):
            module = hf.model.layers[0].get_submodule(f"{lin.hf_parent}.{proj}")
            assert tuple(module.weight.shape) == (rows, lin.in_features(model_cfg)), (lin.name, proj)
            assert (module.bias is not None) == lin.has_bias(model_cfg), (lin.name, proj)
        if lin.layout != "row":  # the fused rows are the projections' rows stacked
            assert sum(lin.hf_rows(model_cfg)) == lin.out_features(model_cfg)


def test_the_schema_choices_are_the_tables():
    from hpa.config.errors import ConfigError
    from hpa.config.linears import NAMES
    from hpa.config.schema import LoRAConfig

    assert LoRAConfig(rank=2).target_modules == NAMES == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    with pytest.raises(ConfigError, match="target_modules"):
        LoRAConfig(rank=2, target_modules=("q_proj",))
    described = LoRAConfig.__doc__.split("target_modules:")[1].split("rslora:")[0]
    assert all(name in described for name in NAMES)  # docs/configuration.md lists the choices


def test_counts_read_the_table():
    from hpa.models.lora import num_adapter_parameters
    from hpa.plan import lora_parameters

    cfg = model_configs()["swiglu_gqa"]
    # r·(in + out) per layer: qkv 4·(32 + 64), proj 4·(32 + 32), fc1 4·(32 + 96), fc2 4·(48 + 32); 2 layers
    assert num_adapter_parameters(cfg, cfg.lora) == 2 * (384 + 256 + 512 + 320)
    # at TP2: column A whole, B rows halved; row A columns halved, B whole
    assert lora_parameters(cfg, tp=2) == 2 * ((128 + 128) + (64 + 128) + (128 + 192) + (96 + 128))
    two = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, target_modules=("linear_fc2", "linear_qkv")))
    assert num_adapter_parameters(two, two.lora) == 2 * (320 + 384)
