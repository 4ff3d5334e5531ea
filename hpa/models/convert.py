"""Hugging Face <-> Megatron weights for the Llama family (Llama 2/3, Qwen2/2.5, Mistral) at any TP/PP.

Import (``hpa convert hf-to-megatron``) reads an HF ``config.json`` + safetensors (or a transformers
model object), derives the hpa ``ModelConfig``, builds the policy under the target layout and fills
each rank's local shards from the full HF tensors, then writes a megatron distributed checkpoint
(which later loads under any other layout). Export (``hpa convert megatron-to-hf``) gathers TP
shards and PP stages back into HF names and layouts and writes safetensors + ``config.json``.

Megatron <-> HF (``L`` is the *global* layer index; megatron numbers layers locally per pipeline
stage, so ``L = layer.layer_number - 1`` = ``pp_rank · layers_per_stage + local index``)::

    embedding.word_embeddings.weight            model.embed_tokens.weight            vocab-parallel, padded
    decoder.layers.L.input_layernorm.weight     model.layers.L.input_layernorm.weight
      (TE spec: ...self_attention.linear_qkv.layer_norm_weight)
    decoder.layers.L.self_attention.linear_qkv.weight|bias
                                                model.layers.L.self_attn.{q,k,v}_proj.weight|bias
                                                grouped per query group, split over TP by groups
    decoder.layers.L.self_attention.linear_proj.weight
                                                model.layers.L.self_attn.o_proj.weight  row-parallel
    decoder.layers.L.pre_mlp_layernorm.weight   model.layers.L.post_attention_layernorm.weight
      (TE spec: ...mlp.linear_fc1.layer_norm_weight)
    decoder.layers.L.mlp.linear_fc1.weight      model.layers.L.mlp.{gate,up}_proj.weight
                                                rank r holds [gate_r; up_r]
    decoder.layers.L.mlp.linear_fc2.weight      model.layers.L.mlp.down_proj.weight   row-parallel
    decoder.final_layernorm.weight              model.norm.weight
    output_layer.weight                         lm_head.weight  (tied: model.embed_tokens.weight)

Llama, Qwen2 and Mistral share these HF names; they differ in config only (Qwen2: q/k/v bias, often
tied embeddings; Mistral: sliding window). megatron has no o_proj/MLP biases, head_dim must equal
hidden/heads, and RoPE scaling (Llama 3.1 ``llama3``, YaRN) is not supported: such checkpoints are
refused with an error naming the config key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from hpa.config import ConfigError, build_section, load_config
from hpa.config.linears import LINEARS
from hpa.config.schema import ModelConfig, ParallelConfig
from hpa.distributed import destroy, initialize
from hpa.distributed.comm import all_gather_objects, barrier
from hpa.distributed.groups import ParallelGroups
from hpa.models.weights import load_model_weights, save_model_weights

from . import lora
from .builders import build_policy, build_reference, padded_vocab_size
from .heads import unwrap
from .layouts import gather, global_layer_of, hf_to_megatron_full, megatron_full_to_hf, shard
from .lora_io import (PEFT_BASE, base_model, export_peft_adapter, import_peft_checkpoint, is_adapter_checkpoint,
                      load_lora_checkpoint, merged_model, run_config_of)

logger = logging.getLogger(__name__)

__all__ = [
    "HF_FAMILIES", "TensorRule", "LAYER_RULES", "GLOBAL_RULES", "model_config_from_hf",
    "hf_config_from_model_config", "megatron_to_hf_names", "hf_shapes", "mapping_table",
    "HFTensorSource", "SafetensorsSource", "StateDictSource", "load_hf_into_megatron",
    "hf_tensors_from_megatron", "import_hf_checkpoint", "export_hf_checkpoint", "run_convert",
    "build_convert_parser", "add_convert_arguments",
]

# model_type -> architecture name written to config.json
HF_FAMILIES: Dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "mistral": "MistralForCausalLM"}
META_FILE = "hpa_convert.json"  # next to an imported checkpoint: ModelConfig, family, HF config
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja")
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry

# ----------------------------------------------------------------------------------------------
# Config


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _rope_theta(hf_config: Any) -> float:
    params = _get(hf_config, "rope_parameters") or {}
    scaling = _get(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"config.json rope_scaling/rope_parameters.rope_type={rope_type!r}: RoPE scaling is "
                         "not supported by the hpa Llama builder; convert a checkpoint without it "
                         "(e.g. Llama 3 8B, not 3.1) or add rope scaling to ModelConfig first")
    theta = params.get("rope_theta", _get(hf_config, "rope_theta", 10000.0))
    return float(theta)


def model_config_from_hf(hf_config: Any, *, params_dtype: str = "float32",
                         make_vocab_size_divisible_by: int = 128, transformer_impl: str = "auto",
                         max_sequence_length: Optional[int] = None) -> ModelConfig:
    """The hpa ``ModelConfig`` of an HF Llama / Qwen2 / Mistral config.

    Args:
        hf_config: a transformers ``PretrainedConfig`` or the ``config.json`` dict.
        params_dtype: dtype of the megatron model (float32 on CPU).
        make_vocab_size_divisible_by: megatron's vocab padding multiple (times TP).
        transformer_impl: auto | local | transformer_engine.
        max_sequence_length: default ``max_position_embeddings``.

    Raises:
        ValueError: naming the config key of anything megatron's Llama layer cannot represent.
    """
    model_type = _get(hf_config, "model_type")
    if model_type not in HF_FAMILIES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; "
                         f"choose one of {sorted(HF_FAMILIES)}")
    act = _get(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json hidden_act={act!r}: only SwiGLU (silu) MLPs are supported")
    hidden, heads = _get(hf_config, "hidden_size"), _get(hf_config, "num_attention_heads")
    head_dim = _get(hf_config, "head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise ValueError(f"config.json head_dim={head_dim} != hidden_size/num_attention_heads="
                         f"{hidden // heads}; megatron's kv_channels is not configurable in ModelConfig")
    if _get(hf_config, "mlp_bias", False):
        raise ValueError("config.json mlp_bias=true: megatron's Llama layer has no MLP biases")
    if model_type == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(_get(hf_config, "attention_bias", False))
        if qkv_bias:
            raise ValueError("config.json attention_bias=true also adds an o_proj bias, which megatron's "
                             "Llama layer does not have")
    if model_type == "qwen2" and _get(hf_config, "use_sliding_window", False):
        logger.warning("Qwen2 use_sliding_window=true: megatron attends to the full context; outputs "
                       "match only for sequences within the window")
    window = _get(hf_config, "sliding_window") if model_type == "mistral" else None
    if window is not None:
        logger.warning("Mistral sliding_window=%s: megatron attends to the full context; outputs match "
                       "for sequences up to %s tokens", window, window)
    kv_heads = _get(hf_config, "num_key_value_heads") or heads
    return ModelConfig(
        num_layers=_get(hf_config, "num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        ffn_hidden_size=_get(hf_config, "intermediate_size"),
        vocab_size=_get(hf_config, "vocab_size"),
        max_sequence_length=max_sequence_length or _get(hf_config, "max_position_embeddings", 4096),
        normalization="RMSNorm",
        norm_epsilon=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        activation="swiglu",
        add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not _get(hf_config, "tie_word_embeddings", False),
        rotary_base=_rope_theta(hf_config),
        params_dtype=params_dtype,
        transformer_impl=transformer_impl,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )


_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config_from_model_config(model_cfg: ModelConfig, family: str, *, dtype: Optional[str] = None,
                                base: Optional[Mapping[str, Any]] = None):
    """A transformers config (Llama / Qwen2 / Mistral) for ``model_cfg``.

    Args:
        family: llama | qwen2 | mistral.
        dtype: written as the config's dtype; default ``model_cfg.params_dtype``.
        base: an original ``config.json`` dict; its other keys (token ids, sliding window, ...) are
            kept and the shape keys are replaced.
    """
    import transformers

    if family not in HF_FAMILIES:
        raise ValueError(f"unknown HF family {family!r}; choose one of {sorted(HF_FAMILIES)}")
    if family != "qwen2" and model_cfg.add_qkv_bias:
        raise ValueError(f"{family} has no q/k/v-only bias option; export a model with qkv bias as qwen2")
    if family == "qwen2" and not model_cfg.add_qkv_bias:
        raise ValueError("Qwen2 always has q/k/v biases but model.add_qkv_bias is false; use llama")
    if model_cfg.normalization != "RMSNorm" or model_cfg.activation != "swiglu":
        raise ValueError("only RMSNorm + SwiGLU models map to Llama-family HF configs")
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[family]
    data = {k: v for k, v in dict(base or {}).items()
            if k not in ("architectures", "model_type", "transformers_version", "rope_scaling")}
    theta = float(model_cfg.rotary_base)
    data.update(
        vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size or 4 * model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers, num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.kv_heads, head_dim=model_cfg.hidden_size // model_cfg.num_attention_heads,
        max_position_embeddings=model_cfg.max_sequence_length, rms_norm_eps=model_cfg.norm_epsilon,
        hidden_act="silu", tie_word_embeddings=not model_cfg.untie_embeddings_and_output_weights,
        architectures=[HF_FAMILIES[family]],
    )
    if family == "qwen2":
        data.pop("head_dim")
        data.pop("layer_types", None)  # recomputed from num_hidden_layers
    if family == "llama":
        data.update(attention_bias=False, mlp_bias=False)
    if "rope_parameters" in cls().to_dict():  # transformers >= 5
        data["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        data.pop("rope_theta", None)
    else:
        data["rope_theta"] = theta
        data.pop("rope_parameters", None)
    config = cls(**data)
    dtype = dtype or model_cfg.params_dtype
    if "dtype" in config.to_dict():
        config.dtype = dtype
    else:
        config.torch_dtype = dtype  # transformers 4
    return config


# ----------------------------------------------------------------------------------------------
# Name / shape tables


@dataclass(frozen=True)
class TensorRule:
    """How one megatron parameter maps to HF tensors.

    Attributes:
        hf: HF name templates (``{L}`` = global layer index).
        kind: the layout transform: ``qkv`` (grouped q/k/v, split over TP by query groups), ``fc1``
            ([gate_r; up_r] per TP rank), ``row`` (split over TP on dim 1), ``vocab`` (vocab-parallel
            rows, padded), ``replicated`` (norms).
    """

    hf: Tuple[str, ...]
    kind: str


def _linear_rules(suffix: str, linears) -> Dict[str, TensorRule]:
    """The rules of the linears table's ``weight`` or ``bias`` tensors."""
    return {f"{lin.parent}.{lin.name}.{suffix}": TensorRule(tuple(f"model.layers.{{L}}.{lin.hf_parent}.{p}.{suffix}"
                                                                  for p in lin.hf_projections), lin.layout)
            for lin in linears}


_INPUT_NORM = TensorRule(("model.layers.{L}.input_layernorm.weight",), "replicated")
_MLP_NORM = TensorRule(("model.layers.{L}.post_attention_layernorm.weight",), "replicated")
# keys: megatron names below ``decoder.layers.<local>.``; the TE spec fuses each norm into the linear after it
LAYER_RULES: Dict[str, TensorRule] = {
    "input_layernorm.weight": _INPUT_NORM, "self_attention.linear_qkv.layer_norm_weight": _INPUT_NORM,
    "pre_mlp_layernorm.weight": _MLP_NORM, "mlp.linear_fc1.layer_norm_weight": _MLP_NORM,
    **_linear_rules("weight", LINEARS), **_linear_rules("bias", [lin for lin in LINEARS if lin.bias]),
}
GLOBAL_RULES: Dict[str, TensorRule] = {
    "embedding.word_embeddings.weight": TensorRule(("model.embed_tokens.weight",), "vocab"),
    "decoder.final_layernorm.weight": TensorRule(("model.norm.weight",), "replicated"),
    "output_layer.weight": TensorRule(("lm_head.weight",), "vocab"),
}
_LAYER_PREFIX = "decoder.layers."
_LINEAR_OF = {f"{lin.parent}.{lin.name}": lin for lin in LINEARS}  # "mlp.linear_fc1" -> its row


def _split_layer_name(name: str) -> Tuple[Optional[int], str]:
    """``decoder.layers.3.mlp.linear_fc1.weight`` -> (3, ``mlp.linear_fc1.weight``)."""
    if not name.startswith(_LAYER_PREFIX):
        return None, name
    index, _, rest = name[len(_LAYER_PREFIX):].partition(".")
    return int(index), rest


def _rule(name: str) -> TensorRule:
    local, rest = _split_layer_name(name)
    rule = (LAYER_RULES if local is not None else GLOBAL_RULES).get(rest)
    if rule is None:
        raise KeyError(f"megatron parameter {name!r} has no HF counterpart in hpa.models.convert "
                       f"(known: {sorted(GLOBAL_RULES)} and decoder.layers.N.{{{', '.join(LAYER_RULES)}}}); "
                       "only the Llama-family policy (no value/reward heads) converts")
    return rule


def tensor_layout(megatron_name: str) -> str:
    """The layout kind of a megatron parameter (``TensorRule.kind``: ``qkv``, ``fc1``, ``row``, ``vocab``, ...,
    ``replicated``); KeyError for a parameter with no HF counterpart."""
    return _rule(megatron_name).kind


def megatron_to_hf_names(megatron_name: str, *, global_layer: Optional[int] = None,
                         tied: bool = False) -> Tuple[str, ...]:
    """HF tensor names that one megatron parameter holds.

    Args:
        megatron_name: a parameter name of the (unwrapped) GPTModel, e.g.
            ``decoder.layers.0.self_attention.linear_qkv.weight``.
        global_layer: the global layer index; default: the index in the name (right at PP=1).
        tied: the output layer shares the embedding (its HF name is the embedding's then).
    """
    local, _ = _split_layer_name(megatron_name)
    rule = _rule(megatron_name)
    if megatron_name == "output_layer.weight" and tied:
        return ("model.embed_tokens.weight",)
    layer = global_layer if global_layer is not None else local
    return tuple(t.format(L=layer) for t in rule.hf)


def hf_shapes(megatron_name: str, model_cfg: ModelConfig) -> Tuple[Tuple[int, ...], ...]:
    """Full (unpadded, unsharded) HF shapes of the tensors ``megatron_name`` holds, in HF-name order."""
    h = model_cfg.hidden_size
    _, rest = _split_layer_name(megatron_name)
    rule = _rule(megatron_name)
    module, _, tensor = rest.rpartition(".")
    linear = _LINEAR_OF.get(module) if tensor in ("weight", "bias") else None
    if linear is not None:
        width = linear.in_features(model_cfg)
        return tuple((r, width) if tensor == "weight" else (r,) for r in linear.hf_rows(model_cfg))
    if rule.kind == "vocab":
        return ((model_cfg.vocab_size, h),)
    return ((h,),)


def mapping_table(megatron_names: Sequence[str], model_cfg: ModelConfig
                  ) -> Dict[str, List[Tuple[str, Tuple[int, ...]]]]:
    """megatron name -> [(HF name, full HF shape)] for a PP=1 model (local = global layer index).

    A tied output layer maps to the embedding's HF name (and holds no tensor of its own in HF
    safetensors).
    """
    tied = not model_cfg.untie_embeddings_and_output_weights
    return {n: list(zip(megatron_to_hf_names(n, tied=tied), hf_shapes(n, model_cfg))) for n in megatron_names}


# ----------------------------------------------------------------------------------------------
# Layout transforms (full HF tensors <-> megatron TP shards)


# ----------------------------------------------------------------------------------------------
# HF tensor sources


class HFTensorSource:
    """Full HF tensors by name (read lazily)."""

    def keys(self) -> List[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError


class StateDictSource(HFTensorSource):
    """Tensors of a ``state_dict`` (or of a transformers model: ``StateDictSource.from_model(m)``)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self._sd = dict(state_dict)

    @classmethod
    def from_model(cls, hf_model) -> "StateDictSource":
        return cls(hf_model.state_dict())

    def keys(self) -> List[str]:
        return list(self._sd)

    def get(self, name: str) -> torch.Tensor:
        return self._sd[name].detach().cpu()


class SafetensorsSource(HFTensorSource):
    """``*.safetensors`` of an HF directory (with or without ``model.safetensors.index.json``)."""

    def __init__(self, directory: Union[str, os.PathLike]):
        from safetensors import safe_open

        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.directory} has no *.safetensors files; convert .bin checkpoints "
                                    "to safetensors first (transformers: save_pretrained)")
        self._file_of: Dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    self._file_of[key] = f
        self._handles: Dict[Path, Any] = {}

    def keys(self) -> List[str]:
        return list(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)


# ----------------------------------------------------------------------------------------------
# Import


def load_hf_into_megatron(model, source: HFTensorSource, model_cfg: ModelConfig,
                          groups: ParallelGroups) -> None:
    """Fill this rank's local shards of ``model`` from full HF tensors; collective over ``groups.mp_group``.

    Raises:
        KeyError: an HF tensor a megatron parameter needs is missing (names both), a megatron
            parameter has no HF counterpart, or an HF tensor was used by no rank (names it).
        ValueError: a shape does not match (names the parameter, HF tensors and shapes).
    """
    gpt = unwrap(model)
    tied = not model_cfg.untie_embeddings_and_output_weights
    tp, tp_rank = groups.tensor_model_parallel_size, groups.tp_rank
    padded = padded_vocab_size(model_cfg.vocab_size, model_cfg.make_vocab_size_divisible_by, tp)
    layer_map = global_layer_of(gpt)
    available = set(source.keys())
    consumed = set()
    for name, param in gpt.named_parameters():
        local, _ = _split_layer_name(name)
        rule = _rule(name)
        hf_names = megatron_to_hf_names(name, global_layer=None if local is None else layer_map[local],
                                        tied=tied)
        missing = [n for n in hf_names if n not in available]
        if missing:
            raise KeyError(f"HF tensor(s) {missing} needed for megatron parameter {name!r} are not in the "
                           "HF checkpoint; is it a Llama/Qwen2/Mistral checkpoint matching config.json?")
        hf = [source.get(n) for n in hf_names]
        for n, t, shape in zip(hf_names, hf, hf_shapes(name, model_cfg)):
            if tuple(t.shape) != shape:
                raise ValueError(f"HF tensor {n!r} has shape {tuple(t.shape)}, config.json implies {shape}")
        local = shard(rule.kind, hf_to_megatron_full(rule.kind, hf, model_cfg, padded), tp, tp_rank)
        if local.shape != param.shape:
            raise ValueError(f"megatron parameter {name!r} has local shape {tuple(param.shape)} but the "
                             f"HF tensors {list(hf_names)} give {tuple(local.shape)} at TP rank {tp_rank}")
        with torch.no_grad():
            param.copy_(local.to(dtype=param.dtype))
        consumed.update(hf_names)
    used = set().union(*all_gather_objects(sorted(consumed), groups.mp_group))
    if tied and "lm_head.weight" in available:
        used.add("lm_head.weight")  # some tied checkpoints store the alias
    unused = sorted(n for n in available - used if not n.endswith(_IGNORED_HF_SUFFIXES))
    if unused:
        raise KeyError(f"HF tensor(s) not consumed by any megatron parameter: {unused[:8]}"
                       f"{' ...' if len(unused) > 8 else ''}; the checkpoint has weights this "
                       "architecture does not (check config.json: tie_word_embeddings, biases)")


def _hf_source_and_config(hf: Any) -> Tuple[HFTensorSource, Dict[str, Any]]:
    if isinstance(hf, (str, os.PathLike)):
        path = Path(hf)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json; point --hf-dir at a Hugging Face model directory")
        return SafetensorsSource(path), json.loads(cfg_file.read_text())
    return StateDictSource.from_model(hf), hf.config.to_dict()


def import_hf_checkpoint(hf: Any, out_dir: Union[str, os.PathLike], parallel_cfg: ParallelConfig,
                         groups: ParallelGroups, *, params_dtype: str = "float32",
                         make_vocab_size_divisible_by: int = 128, transformer_impl: str = "auto",
                         max_sequence_length: Optional[int] = None) -> ModelConfig:
    """HF (directory with config.json + safetensors, or a transformers model) -> megatron checkpoint.

    Writes a megatron distributed checkpoint to ``out_dir`` (loadable under any TP/PP with
    ``load_model_weights``) and ``out_dir/hpa_convert.json`` (the ``ModelConfig``, HF family and
    original config.json, read back by the export).

    Returns:
        The derived ``ModelConfig`` (put it in the ``model`` section of a training config).
    """
    source, hf_config = _hf_source_and_config(hf)
    model_cfg = model_config_from_hf(hf_config, params_dtype=params_dtype, transformer_impl=transformer_impl,
                                     make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                     max_sequence_length=max_sequence_length)
    model = build_policy(model_cfg, parallel_cfg, groups)
    load_hf_into_megatron(model, source, model_cfg, groups)
    save_model_weights(model, out_dir, groups)
    if groups.is_main:
        meta = {"family": hf_config["model_type"], "model": dataclasses.asdict(model_cfg),
                "hf_config": hf_config}
        if isinstance(hf, (str, os.PathLike)):  # what converted_from checks the directory against
            meta.update(hf_dir=str(Path(hf).resolve()), hf_files=_weight_files(hf))
        (Path(out_dir) / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    barrier()
    return model_cfg


def _weight_files(hf_dir: Union[str, os.PathLike]) -> Dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(Path(hf_dir).glob("*.safetensors"))}


def converted_from(base_dir: Union[str, os.PathLike]) -> Tuple[Optional[Path], Optional[str]]:
    """``(the HF directory, None)`` that the megatron checkpoint ``base_dir`` was imported from by ``hpa convert
    hf-to-megatron``, when its ``hpa_convert.json`` names it and it still holds what was imported (the same
    config.json and weight files of the same sizes: cheap, no weight is read); else ``(None, why not)``."""
    meta_file = Path(base_dir) / META_FILE
    if not meta_file.is_file():
        return None, f"{base_dir} was not imported from a Hugging Face directory (no {META_FILE})"
    meta = json.loads(meta_file.read_text())
    hf_dir = meta.get("hf_dir")
    if hf_dir is None:
        return None, f"{meta_file} does not name the directory it was imported from (an older hpa wrote it)"
    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        return None, f"{hf_dir}, which {base_dir} was imported from, is gone"
    if json.loads((path / "config.json").read_text()) != meta.get("hf_config"):
        return None, f"{hf_dir}/config.json is not the one {base_dir} was imported from"
    if _weight_files(path) != meta.get("hf_files"):
        return None, f"the weight files of {hf_dir} are not those {base_dir} was imported from"
    return path, None


# ----------------------------------------------------------------------------------------------
# Export


def _layer_suffixes(gpt) -> List[str]:
    """Parameter names below ``decoder.layers.<i>.``: the same on every stage (one spec); LoRA adapters
    are not HF weights (they are merged into the weights they adapt, ``_local_weight``)."""
    return [n for n, _ in gpt.decoder.layers[0].named_parameters() if not lora.is_adapter_key(n)]


def _local_weight(params: Dict[str, torch.Tensor], adapted: Dict[str, Any], name: str) -> torch.Tensor:
    """This rank's shard of parameter ``name``, with its LoRA update merged in when an enabled adapter has
    one (``W + scaling · B A``, in fp32, rounded once: ``lora.merged_weight``): an export or a vLLM sync of a LoRA
    model carries the policy, not the base."""
    tensor = params[name].detach()
    adapter = adapted.get(name)
    if adapter is not None and adapter.enabled:
        tensor = lora.merged_weight(tensor, adapter)
    return tensor


def hf_tensors_from_megatron(model, model_cfg: ModelConfig, groups: ParallelGroups
                             ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for the whole model, in HF layout without vocab padding.

    Collective: every rank of the model-parallel group (all TP × PP ranks of one replica) must
    iterate to the end, and every one of them receives every full tensor (on ``groups.device``, in
    the model's dtype), in the same order (a LoRA model's weights with its enabled adapters merged in):
    the owning stage all-gathers TP shards over
    ``groups.tp_group``, then broadcasts over ``groups.pp_group``. DP replicas work independently
    (call it on one replica only if the others do not need the tensors). Global layer index =
    ``layer.layer_number - 1`` (= pp_rank · layers_per_stage + local index). A tied output layer
    yields nothing of its own (HF stores only ``model.embed_tokens.weight``). Yielded tensors may be
    views of the model's parameters at TP=PP=1; copy them before changing them.
    """
    gpt = unwrap(model)
    tp, pp = groups.tensor_model_parallel_size, groups.pipeline_model_parallel_size
    tied = not model_cfg.untie_embeddings_and_output_weights
    params = dict(gpt.named_parameters())
    adapted = {name[:-len(lora.SUFFIX)] + ".weight": a for name, a in lora.adapters(gpt)}
    dtype = next(iter(params.values())).dtype
    local_to_global = global_layer_of(gpt)
    global_to_local = {g: l for l, g in local_to_global.items()}
    owners: Dict[int, int] = {}  # global layer -> pp rank
    for stage, layers in enumerate(all_gather_objects(sorted(global_to_local), groups.pp_group)):
        owners.update({g: stage for g in layers})
    if sorted(owners) != list(range(model_cfg.num_layers)):
        raise ValueError(f"the pipeline stages hold layers {sorted(owners)}, expected "
                         f"0..{model_cfg.num_layers - 1} (model.num_layers)")

    items: List[Tuple[int, str, str, int]] = [(0, "embedding.word_embeddings.weight",
                                               "embedding.word_embeddings.weight", -1)]
    for layer in range(model_cfg.num_layers):
        for suffix in _layer_suffixes(gpt):
            local = global_to_local.get(layer)
            local_name = f"{_LAYER_PREFIX}{local}.{suffix}" if local is not None else None
            items.append((owners[layer], local_name, f"{_LAYER_PREFIX}{layer}.{suffix}", layer))
    items.append((pp - 1, "decoder.final_layernorm.weight", "decoder.final_layernorm.weight", -1))
    if not tied:
        items.append((pp - 1, "output_layer.weight", "output_layer.weight", -1))

    for owner, local_name, global_name, layer in items:
        rule = _rule(global_name)
        hf_names = megatron_to_hf_names(global_name, global_layer=layer if layer >= 0 else None)
        shapes = hf_shapes(global_name, model_cfg)
        if groups.pp_rank == owner:
            if local_name not in params:
                raise KeyError(f"pipeline stage {owner} has no parameter {local_name!r} "
                               f"(HF {list(hf_names)})")
            full = gather(rule.kind, _local_weight(params, adapted, local_name), groups.tp_group, tp)
            tensors = megatron_full_to_hf(rule.kind, full, model_cfg)
            tensors = [t.contiguous() for t in tensors]
        else:
            tensors = [torch.empty(s, dtype=dtype, device=groups.device) for s in shapes]
        if pp > 1:
            src = dist.get_global_rank(groups.pp_group, owner)
            for t in tensors:
                dist.broadcast(t, src=src, group=groups.pp_group)
        for n, t, s in zip(hf_names, tensors, shapes):
            if tuple(t.shape) != s:
                raise ValueError(f"{global_name} gave HF {n!r} of shape {tuple(t.shape)}, expected {s}")
            yield n, t


def _write_safetensors(tensors: Iterator[Tuple[str, torch.Tensor]], out_dir: Path,
                       max_shard_bytes: int, write: bool) -> None:
    """HF-style shards (``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` + index)."""
    from safetensors.torch import save_file

    shards: List[Tuple[Path, List[str]]] = []
    pending: Dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal pending, size
        if pending and write:
            path = out_dir / f".part-{len(shards):05d}.safetensors"
            save_file(pending, str(path), metadata={"format": "pt"})
            shards.append((path, list(pending)))
        pending, size = {}, 0

    total = 0
    for name, tensor in tensors:
        if not write:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > max_shard_bytes:
            flush()
        pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += nbytes
        total += nbytes
    flush()
    if not write:
        return
    if len(shards) == 1:
        os.replace(shards[0][0], out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, (path, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(path, out_dir / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def export_hf_checkpoint(model, model_cfg: ModelConfig, groups: ParallelGroups,
                         out_dir: Union[str, os.PathLike], *, family: str = "llama",
                         hf_config_base: Optional[Mapping[str, Any]] = None,
                         tokenizer_dir: Optional[Union[str, os.PathLike]] = None,
                         dtype: Optional[str] = None, max_shard_bytes: int = 5 * 1024 ** 3) -> Path:
    """Write ``model`` (any layout) as an HF checkpoint: safetensors, config.json, tokenizer files.

    Global rank 0 writes; the ranks of DP replica 0 gather (collective), the other replicas wait.

    Args:
        family: llama | qwen2 | mistral (the config.json written).
        hf_config_base: the original config.json, whose extra keys (token ids, ...) are kept.
        tokenizer_dir: tokenizer files found there (tokenizer.json, tokenizer.model, ...) are copied.
        dtype: the dtype of the written tensors (default: the model's).
        max_shard_bytes: safetensors shard size.
    """
    out_dir = Path(out_dir)
    config = hf_config_from_model_config(model_cfg, family, base=hf_config_base, dtype=dtype)
    torch_dtype = getattr(torch, dtype) if dtype else None
    if groups.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    if groups.dp_rank == 0:
        stream = hf_tensors_from_megatron(model, model_cfg, groups)
        if torch_dtype is not None:
            stream = ((n, t.to(torch_dtype)) for n, t in stream)
        _write_safetensors(stream, out_dir, max_shard_bytes, write=groups.is_main)
    if groups.is_main:
        config.save_pretrained(str(out_dir))
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / name
                if src.is_file():
                    shutil.copy2(src, out_dir / name)
    barrier()
    return out_dir


# ----------------------------------------------------------------------------------------------
# Command line


def add_convert_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``hpa convert``'s arguments (two sub-commands) to ``parser``."""
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    imp = sub.add_parser("hf-to-megatron", help="HF config.json + safetensors -> megatron checkpoint")
    imp.add_argument("--hf-dir", required=True, help="Hugging Face model directory (local, nothing is downloaded)")
    imp.add_argument("--out", required=True, help="new directory for the megatron distributed checkpoint")
    imp.add_argument("--params-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                     help="dtype of the megatron model (float32 on CPU)")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    imp.add_argument("--max-sequence-length", type=int, default=None,
                     help="default: config.json max_position_embeddings")
    exp = sub.add_parser("megatron-to-hf", help="megatron checkpoint -> HF safetensors + config.json")
    exp.add_argument("--megatron-dir", required=True, help="checkpoint written by save_model_weights")
    exp.add_argument("--out", required=True, help="output Hugging Face directory")
    exp.add_argument("--config", default=None,
                     help="hpa YAML whose model section describes the checkpoint (default: the "
                          "hpa_convert.json written next to an imported checkpoint)")
    exp.add_argument("--family", default=None, choices=sorted(HF_FAMILIES),
                     help="config.json to write (default: from hpa_convert.json, else qwen2 when "
                          "model.add_qkv_bias else llama)")
    exp.add_argument("--tokenizer-dir", default=None, help="copy tokenizer files from this directory")
    exp.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                     help="dtype of the written tensors (default: the model's)")
    exp.add_argument("--base-dir", default=None,
                     help="a LoRA checkpoint's frozen base (megatron weights; default: the config's "
                          "model.policy_path); the merged model (base + adapters) is written")
    exp.add_argument("--peft-dir", default=None,
                     help="with a LoRA checkpoint: also write its adapters as a PEFT LoRA directory here; "
                          "adapter_config.json names the base they go on, the HF model the base was converted "
                          "from when it is still there, else the base exported to DIR/base: "
                          "AutoPeftModelForCausalLM.from_pretrained(DIR)")
    peft = sub.add_parser("peft-to-megatron", help="PEFT LoRA adapter -> hpa adapter checkpoint (to train on)")
    peft.add_argument("--peft-dir", required=True, help="PEFT adapter directory (adapter_config.json + "
                                                        "adapter_model.safetensors)")
    peft.add_argument("--config", required=True, help="hpa YAML: model (the base's architecture, model.lora: the "
                                                      "rank the import needs) and model.policy_path (the base)")
    peft.add_argument("--out", required=True, help="new directory for the adapter checkpoint "
                                                   "(then: model.lora.adapter_path=OUT)")
    for p in (imp, exp, peft):
        p.add_argument("--tensor-model-parallel-size", type=int, default=1)
        p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
        p.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
        p.add_argument("--transformer-impl", default="auto", choices=("auto", "local", "transformer_engine"))
    return parser


def build_convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpa convert", description="Convert Hugging Face <-> Megatron checkpoints (Llama, Qwen2, Mistral). "
        "Run under torchrun with TP·PP (·DP) processes, e.g. torchrun --nproc_per_node 4 -m hpa.cli convert "
        "hf-to-megatron --hf-dir llama --out ckpt --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2")
    return add_convert_arguments(parser)


def _export_config(args) -> Tuple[Optional[Path], Optional[dict]]:
    """``(the YAML whose model section describes --megatron-dir, or None, its hpa_convert.json or None)``:
    ``--config``, else the checkpoint's own ``hpa_convert.json`` (an imported checkpoint), else the ``config.yaml``
    of the run that wrote it (``<run_dir>/checkpoints/step_N/policy``, as for a LoRA checkpoint)."""
    meta_file = Path(args.megatron_dir) / META_FILE
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
    if args.config is not None or meta is not None:
        return (Path(args.config) if args.config is not None else None), meta
    return run_config_of(args.megatron_dir), None


def _model_cfg_for_export(args) -> Tuple[ModelConfig, str, Optional[dict]]:
    config, meta = _export_config(args)
    if config is not None:
        model_cfg = load_config(str(config)).model
        base_meta = Path(model_cfg.policy_path or "", META_FILE)  # the HF config a run started from
        if meta is None and model_cfg.policy_path and base_meta.is_file():
            meta = json.loads(base_meta.read_text())
    else:
        model_cfg = build_section(ModelConfig, meta["model"], "model.")  # its lora section a dataclass too
    model_cfg = dataclasses.replace(model_cfg, transformer_impl=args.transformer_impl,
                                    lora=dataclasses.replace(model_cfg.lora, rank=0, adapter_path=None))
    family = args.family or (meta or {}).get("family") or ("qwen2" if model_cfg.add_qkv_bias else "llama")
    return model_cfg, family, (meta or {}).get("hf_config")


def _convert(args, groups: ParallelGroups, parallel_cfg: ParallelConfig) -> None:
    if args.direction == "hf-to-megatron":
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"--out {out} exists and is not empty; choose a new directory")
        model_cfg = import_hf_checkpoint(args.hf_dir, out, parallel_cfg, groups, params_dtype=args.params_dtype,
                                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                         transformer_impl=args.transformer_impl,
                                         max_sequence_length=args.max_sequence_length)
        if groups.is_main:
            print(f"wrote megatron checkpoint {out}; model section:\n"
                  + json.dumps({k: v for k, v in dataclasses.asdict(model_cfg).items() if v is not None}, indent=2))
        return
    if args.direction == "peft-to-megatron":
        out = import_peft_checkpoint(args.peft_dir, args.config, args.out, parallel_cfg, groups,
                                     transformer_impl=args.transformer_impl)
        if groups.is_main:
            print(f"wrote the adapter checkpoint {out}; train on it with model.lora.adapter_path={out}")
        return
    if is_adapter_checkpoint(args.megatron_dir):
        lora_model, model_cfg, family, base = load_lora_checkpoint(args, parallel_cfg, groups)
        base_dir = args.base_dir or model_cfg.policy_path
        meta_file = Path(base_dir) / META_FILE  # a base imported from HF: its family and config.json
        if meta_file.is_file():
            meta = json.loads(meta_file.read_text())
            family, base = args.family or meta.get("family", family), meta.get("hf_config")
        plain_cfg = dataclasses.replace(model_cfg, lora=dataclasses.replace(model_cfg.lora, rank=0))
        if args.peft_dir is not None:  # the adapters name the base they go on: the HF model it came from, else
            # one exported beside them (an absolute path: PEFT reads base_model_name_or_path as given)
            hf_base, why = converted_from(base_dir)
            base_out = hf_base or Path(args.peft_dir) / PEFT_BASE
            export_peft_adapter(lora_model, model_cfg, model_cfg.lora, groups, args.peft_dir,
                                base_model_name_or_path=str(base_out.resolve()))
            if hf_base is None:
                export_hf_checkpoint(base_model(lora_model, model_cfg, parallel_cfg, groups), plain_cfg, groups,
                                     base_out, family=family, hf_config_base=base, tokenizer_dir=args.tokenizer_dir,
                                     dtype=args.dtype)
            if groups.is_main:
                print(f"wrote the PEFT adapter {args.peft_dir} over {hf_base}, the Hugging Face model its base was "
                      f"converted from" if hf_base else
                      f"wrote the PEFT adapter {args.peft_dir} and its base {base_out} ({why})")
        model = merged_model(lora_model, model_cfg, parallel_cfg, groups)
        model_cfg = plain_cfg
    else:
        if args.peft_dir is not None or args.base_dir is not None:
            raise ValueError(f"--peft-dir and --base-dir need a LoRA checkpoint; {args.megatron_dir} holds full "
                             "weights (no lora.json)")
        model_cfg, family, base = _model_cfg_for_export(args)
        model = build_reference(model_cfg, parallel_cfg, groups)
        load_model_weights(model, args.megatron_dir, groups)
    out = export_hf_checkpoint(model, model_cfg, groups, args.out, family=family, hf_config_base=base,
                               tokenizer_dir=args.tokenizer_dir, dtype=args.dtype)
    if groups.is_main:
        print(f"wrote Hugging Face {family} checkpoint {out}")


def _check_arguments(args) -> None:
    """The directories named on the command line, before any process group starts (a ConfigError: one line)."""
    flag = {"hf-to-megatron": "--hf-dir", "megatron-to-hf": "--megatron-dir", "peft-to-megatron": "--peft-dir"}[
        args.direction]
    source = getattr(args, flag[2:].replace("-", "_"))
    if not os.path.isdir(source):
        raise ConfigError(flag, f"{source!r} is not a directory", source="command line")
    config = getattr(args, "config", None)
    if config is not None and not os.path.isfile(config):
        raise ConfigError("--config", f"{config!r} is not a file", source="command line")
    for flag in ("--tokenizer-dir", "--base-dir"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and not os.path.isdir(value):
            raise ConfigError(flag, f"{value!r} is not a directory", source="command line")
    if args.direction == "megatron-to-hf" and _export_config(args) == (None, None) and \
            not (Path(source) / "lora.json").is_file() and not (Path(source) / "policy" / "lora.json").is_file():
        raise ConfigError("--config", f"{source} has no {META_FILE} (written by 'hpa convert hf-to-megatron') and no "
                                      "run's config.yaml above it; pass --config with the YAML it was trained with "
                                      "(its model section describes the architecture)", source="command line")
    out = Path(args.out)
    if args.direction != "megatron-to-hf" and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--out", f"{out} exists and is not an empty directory; choose a new directory",
                          source="command line")


def run_convert(argv_or_args: Union[Sequence[str], argparse.Namespace, None] = None, *,
                groups: Optional[ParallelGroups] = None) -> int:
    """Entry point of ``hpa convert``. Returns the exit code.

    Args:
        argv_or_args: the arguments after ``convert`` (or a Namespace parsed by a parser that
            ``add_convert_arguments`` set up).
        groups: already initialised groups (tests, embedding); their TP/PP must equal the flags. By
            default the process groups are initialised here from the torchrun / Slurm environment
            (world size = TP·PP·DP) and destroyed at the end.
    """
    args = argv_or_args if isinstance(argv_or_args, argparse.Namespace) else \
        build_convert_parser().parse_args(list(argv_or_args) if argv_or_args is not None else None)
    _check_arguments(args)
    parallel_cfg = ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                  pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                  backend=args.backend)
    owns = groups is None
    if owns:
        groups = initialize(parallel_cfg)
    elif (groups.tensor_model_parallel_size, groups.pipeline_model_parallel_size) != (
            parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size):
        raise ValueError(f"the given groups are {groups.layout} but the flags ask for TP"
                         f"{parallel_cfg.tensor_model_parallel_size} PP{parallel_cfg.pipeline_model_parallel_size}")
    try:
        _convert(args, groups, parallel_cfg)
    finally:
        if owns:
            destroy()
    return 0
