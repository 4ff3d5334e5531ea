"""The decoder layer's linears: one row each, read by everything that names or sizes them.

The schema's ``model.lora.target_modules`` choices and rank check, LoRA attachment and counting
(``hpa.models.lora``), PEFT adapter I/O (``hpa.models.lora_io``), ``hpa plan`` and the HF conversion
(``hpa.models.convert``) all read ``LINEARS``; a new LoRA target is one row here plus a test (docs/lora.md).
It sits in ``hpa.config`` because the schema, the lowest layer, reads it; it imports nothing.

Sizes are whole (before tensor parallelism), as functions of ``model.*`` (a ``ModelConfig``): ``d`` the head
width (hidden / heads), ``n`` query heads, ``g`` key/value heads (GQA), ``f`` the MLP width (``ffn_hidden_size``,
default 4·hidden). A column-parallel linear splits its output rows over TP, a row-parallel one its input
columns. The HF side is the Llama family (``model.layers.L.<hf_parent>.<projection>``): megatron fuses q/k/v
into ``linear_qkv`` (rows grouped per query group) and SwiGLU's gate/up into ``linear_fc1`` (``[gate; up]``);
``layout`` names the transform of ``hpa.models.layouts`` between the fused rows and the HF projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

ModelConfig = Any  # hpa.config.schema.ModelConfig, which imports this module


def _head(m: ModelConfig) -> int:
    return m.hidden_size // m.num_attention_heads


def _ffn(m: ModelConfig) -> int:
    return m.ffn_hidden_size or 4 * m.hidden_size


def _gated(m: ModelConfig) -> int:
    return 2 if m.activation == "swiglu" else 1


@dataclass(frozen=True)
class Linear:
    """One linear of megatron's ``TransformerLayer`` (local spec).

    Attributes:
        name: megatron's attribute (and LoRA target) name.
        parent: the layer's submodule holding it (``decoder.layers.L.<parent>.<name>``).
        parallel: ``column`` (output rows split over TP) or ``row`` (input columns split).
        in_features, out_features: whole sizes from the model config.
        hf_parent: the HF layer's submodule of its projections.
        hf_projections: the HF projections it fuses, in the order of its rows.
        hf_rows: each projection's output rows (the HF weight is ``[rows, in_features]``).
        layout: ``hpa.models.layouts``'s transform between its rows and the projections' (qkv | fc1 | row).
        bias: the ``model.*`` flag that gives it a bias (its HF projections carry one each); None: never.
    """

    name: str
    parent: str
    parallel: str
    in_features: Callable[[ModelConfig], int]
    out_features: Callable[[ModelConfig], int]
    hf_parent: str
    hf_projections: Tuple[str, ...]
    hf_rows: Callable[[ModelConfig], Tuple[int, ...]]
    layout: str
    bias: Optional[str] = None

    def widths(self, m: ModelConfig) -> Tuple[int, int]:
        """``(in, out)`` features, whole."""
        return self.in_features(m), self.out_features(m)

    def has_bias(self, m: ModelConfig) -> bool:
        return self.bias is not None and bool(getattr(m, self.bias))

    def lora_shapes(self, m: ModelConfig, rank: int, tp: int = 1) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """Shapes of a rank-``rank`` adapter's ``A [r, in]`` and ``B [out, r]`` on one of ``tp`` ranks: the side
        that follows the base weight's split is divided by TP, the other is whole (replicated)."""
        i, o = self.widths(m)
        if self.parallel == "column":
            return (rank, i), (o // tp, rank)
        return (rank, i // tp), (o, rank)


LINEARS: Tuple[Linear, ...] = (
    Linear("linear_qkv", "self_attention", "column",
           in_features=lambda m: m.hidden_size,
           out_features=lambda m: (m.num_attention_heads + 2 * m.kv_heads) * _head(m),
           hf_parent="self_attn", hf_projections=("q_proj", "k_proj", "v_proj"),
           hf_rows=lambda m: (m.num_attention_heads * _head(m), m.kv_heads * _head(m), m.kv_heads * _head(m)),
           layout="qkv", bias="add_qkv_bias"),
    Linear("linear_proj", "self_attention", "row",
           in_features=lambda m: m.num_attention_heads * _head(m),
           out_features=lambda m: m.hidden_size,
           hf_parent="self_attn", hf_projections=("o_proj",), hf_rows=lambda m: (m.hidden_size,), layout="row"),
    Linear("linear_fc1", "mlp", "column",
           in_features=lambda m: m.hidden_size,
           out_features=lambda m: _gated(m) * _ffn(m),
           hf_parent="mlp", hf_projections=("gate_proj", "up_proj"), hf_rows=lambda m: (_ffn(m), _ffn(m)),
           layout="fc1"),
    Linear("linear_fc2", "mlp", "row",
           in_features=_ffn,
           out_features=lambda m: m.hidden_size,
           hf_parent="mlp", hf_projections=("down_proj",), hf_rows=lambda m: (m.hidden_size,), layout="row"),
)
BY_NAME: Dict[str, Linear] = {linear.name: linear for linear in LINEARS}
NAMES: Tuple[str, ...] = tuple(BY_NAME)


def widths(m: ModelConfig) -> Dict[str, Tuple[int, int]]:
    """``(in, out)`` features of every linear, whole (before tensor parallelism)."""
    return {linear.name: linear.widths(m) for linear in LINEARS}
