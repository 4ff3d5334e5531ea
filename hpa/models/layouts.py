"""Megatron's fused tensor layouts against HF's per-projection ones, and their TP shards.

``linear_qkv``'s rows are grouped per query group (``[g0: q heads of the group · d, k d, v d][g1: ...]``) and
split over TP by whole groups; a SwiGLU ``linear_fc1``'s rows are ``[gate; up]`` in full and ``[gate_r; up_r]`` on
TP rank r; row-parallel weights split their columns. ``hpa.models.convert`` (weights) and
``hpa.models.lora_io`` (LoRA adapters, whose B rows follow the weight's) share these transforms.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from hpa.config.schema import ModelConfig
from hpa.distributed.comm import all_gather_cat

from .heads import unwrap


def qkv_groups(model_cfg: ModelConfig) -> Tuple[int, int, int]:
    d = model_cfg.hidden_size // model_cfg.num_attention_heads
    g = model_cfg.kv_heads
    return g, model_cfg.num_attention_heads // g, d


def hf_to_megatron_full(kind: str, hf: Sequence[torch.Tensor], model_cfg: ModelConfig,
                         padded_vocab: int) -> torch.Tensor:
    """Full (TP=1) megatron tensor from the full HF tensors."""
    if kind == "qkv":
        g, qpg, d = qkv_groups(model_cfg)
        q, k, v = hf
        rest = q.shape[1:]
        # [g0: q_heads_per_group·d, k d, v d][g1: ...]
        return torch.cat([q.reshape(g, qpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)],
                         dim=1).reshape(g * (qpg + 2) * d, *rest)
    if kind == "fc1":
        return torch.cat(list(hf), dim=0)  # [gate; up]
    (t,) = hf
    if kind == "vocab":
        pad = torch.zeros(padded_vocab - t.shape[0], *t.shape[1:], dtype=t.dtype)
        return torch.cat([t, pad], dim=0)  # [v_pad, h], pad rows zero
    return t


def shard(kind: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's shard of a full megatron tensor."""
    if kind in ("qkv", "vocab"):
        return full.chunk(tp, dim=0)[rank]  # qkv: whole query groups per rank
    if kind == "fc1":
        two_ffn, h = full.shape
        return full.view(2, tp, two_ffn // (2 * tp), h)[:, rank].reshape(-1, h)  # [gate_r; up_r]
    if kind == "row":
        return full.chunk(tp, dim=1)[rank]
    return full


def gather(kind: str, local: torch.Tensor, tp_group, tp: int) -> torch.Tensor:
    """Full megatron tensor from this rank's shard (all_gather over ``tp_group``)."""
    if kind == "replicated" or tp == 1:
        return local
    if kind == "row":
        return all_gather_cat(local, tp_group, dim=1)
    full = all_gather_cat(local, tp_group, dim=0)
    if kind == "fc1":
        rows, h = local.shape
        return full.view(tp, 2, rows // 2, h).transpose(0, 1).reshape(-1, h)  # [gate; up]
    return full


def megatron_full_to_hf(kind: str, full: torch.Tensor, model_cfg: ModelConfig) -> Tuple[torch.Tensor, ...]:
    if kind == "qkv":
        g, qpg, d = qkv_groups(model_cfg)
        rest = full.shape[1:]
        grouped = full.reshape(g, (qpg + 2) * d, *rest)
        q, k, v = grouped.split([qpg * d, d, d], dim=1)
        return (q.reshape(g * qpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest))
    if kind == "fc1":
        return tuple(full.chunk(2, dim=0))
    if kind == "vocab":
        return (full[:model_cfg.vocab_size],)  # strip vocab padding
    return (full,)


def global_layer_of(model) -> Dict[int, int]:
    """local layer index -> global index (``layer_number`` is 1-based and global in megatron)."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(unwrap(model).decoder.layers)}
