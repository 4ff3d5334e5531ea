"""hpa's own KV-cache decode over a megatron ``GPTModel``'s modules (the native engine's default).

megatron-core 0.16's ``StaticInferenceContext`` path stores keys *before* RoPE and re-applies the
rotary embedding to the whole cached prefix at every decode step, then runs the local spec's
unfused attention with a ``repeat_interleave`` of the GQA groups over the whole cache: per-step cost
grows with the sequence, and on CPU it made the engine 4x slower than HF ``generate``. This decoder
walks the same modules the training forward uses (embedding, each ``TransformerLayer``'s norms,
``linear_qkv``, ``linear_proj``, bias-dropout-adds and MLP, the final norm and the output layer,
with their parameters as they are) and changes how they are driven:

- keys are rotated once, when they are written, and cached rotated: ``[b, g/tp, S, d]`` per layer;
- attention is ``torch.nn.functional.scaled_dot_product_attention`` over the cached prefix, with the
  GQA groups shared (``enable_gqa``) instead of copied;
- only the last position goes through the final norm and the output layer;
- megatron's plain (local-spec) column/row-parallel linears run as ``F.linear`` plus the same TP
  all-reduce, without the autograd function megatron wraps them in for backward overlap, and RoPE
  uses cos/sin tables computed once (the same formula as megatron's unfused RoPE); Transformer
  Engine modules are called as they are;
- the attention mask is built once per forward or step, additive, for every layer, and the queries and key of
  each group are rotated together without a concatenation (``apply_rope``): fewer kernels a step.

The numerics are those of the training forward up to fp32 rounding: RoPE rotates by the position in
the padded row (as megatron does when it ignores ``position_ids``), padded keys get zero weight, and
the softmax scale is the core attention's. Left-padding rows (all of whose keys are padding) attend
to themselves only, which keeps them finite; nothing attends to them.

``CachedDecoder.decode_step`` is the same layer walk for one token with static shapes (every cache
slot attended under a mask, the position a device tensor): ``StaticDecodeStep`` captures it in a CUDA
graph; the engine's ``decode`` modes say when.

``unsupported_reason(module)`` names what this decoder does not implement (sliding windows, output
gates, MLA, ...); the engine then falls back to megatron's inference context.
"""

from __future__ import annotations

from typing import List, Optional

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .cuda_graph import CUDAGraphWrapper


logger = logging.getLogger(__name__)


def unsupported_reason(module) -> Optional[str]:
    """Why ``CachedDecoder`` cannot run this GPTModel, or None when it can."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp

    config = module.config
    checks = [
        (getattr(module, "position_embedding_type", None) != "rope", "position embedding is not plain RoPE"),
        (bool(getattr(config, "multi_latent_attention", False)), "multi-latent attention"),
        (getattr(config, "window_size", None) is not None, "sliding-window attention"),
        (bool(getattr(config, "attention_output_gate", False)), "attention output gate"),
        (bool(getattr(config, "no_rope_freq", None)), "layers without RoPE"),
        (getattr(config, "softmax_type", "vanilla") != "vanilla", "non-vanilla softmax"),
        (getattr(config, "num_moe_experts", None) is not None, "mixture of experts"),
        (getattr(module, "mtp_process", False), "multi-token prediction"),
        (config.context_parallel_size > 1, "context parallelism"),
        (config.sequence_parallel, "sequence parallelism"),
    ]
    for bad, what in checks:
        if bad:
            return what
    for layer in module.decoder.layers:
        if not isinstance(layer.self_attention, SelfAttention):
            return f"attention module {type(layer.self_attention).__name__}"
        if not isinstance(layer.cross_attention, IdentityOp):
            return "cross attention"
    return None


class CachedDecoder:
    """Incremental forward of one pipeline stage of a GPTModel with a rotated-key KV cache.

    Args:
        module: the unwrapped GPTModel (this stage's layers), in eval mode while decoding.
        batch_size: rows ``b`` of the generate call.
        max_sequence_length: prompt + response positions ``S`` to allocate.
    """

    def __init__(self, module, batch_size: int, max_sequence_length: int):
        config = module.config
        self.module = module
        self.config = config
        layers = list(module.decoder.layers)
        attn = layers[0].self_attention if layers else None
        dtype, device = config.params_dtype, next(module.parameters()).device
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []
        for layer in layers:
            a = layer.self_attention
            shape = (batch_size, a.num_query_groups_per_partition, max_sequence_length, a.hidden_size_per_attention_head)
            # zeros, not empty: the static decode step reads every slot (masked), and 0 * NaN is NaN
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))  # [b, g/tp, S, d]
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))  # [b, g/tp, S, d]
        # [S, 1, 1, d_rot]; megatron computes the same table for a training forward of length S
        self.rotary = module.rotary_pos_emb(max_sequence_length) if layers else None
        self.rope_tables = None
        if self.rotary is not None:
            self.rope_tables = rope_tables(self.rotary, config.rotary_interleaved, dtype)  # [S, d_rot] each
        self.plain = [_plain_layer(layer, config) for layer in layers]
        head_dim = attn.hidden_size_per_attention_head if attn is not None else 1
        # megatron's net scale: config.softmax_scale or 1/sqrt(d) (query-key layer scaling divides the
        # scores by the layer number and its softmax multiplies them back)
        self.scale = config.softmax_scale or head_dim ** -0.5

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, hidden: Optional[torch.Tensor], start: int, end: int,
                key_valid: torch.Tensor) -> torch.Tensor:
        """Run positions ``[start, end)`` through this stage.

        Args:
            input_ids: ``[b, end - start]`` tokens (first stage only; ignored elsewhere).
            hidden: ``[end - start, b, h]`` activations from the previous stage, or None on the first.
            start, end: the positions; every position before ``start`` is already cached.
            key_valid: ``[b, >= end]`` bool, True where a position holds a real token.

        Returns:
            ``[end - start, b, h]`` activations for the next stage, or, on the last stage,
            ``[b, v_padded]`` logits of position ``end - 1`` gathered over TP.
        """
        module = self.module
        if hidden is None:
            hidden = module.embedding(input_ids=input_ids, position_ids=None)  # [s_q, b, h]
        allowed = self._allowed(key_valid, start, end)  # [b, 1, s_q, end], or None: plain causal
        bias = None if allowed is None else attention_bias(allowed, self.keys[0].dtype)  # once for every layer
        rope = self._rope_slice(start, end)

        def attend(i, query, key, value):
            self.keys[i][:, :, start:end] = key.permute(1, 2, 0, 3)
            self.values[i][:, :, start:end] = value.permute(1, 2, 0, 3)
            query = query.flatten(2, 3).permute(1, 2, 0, 3)  # [b, heads/tp, s_q, d]
            return F.scaled_dot_product_attention(
                query, self.keys[i][:, :, :end], self.values[i][:, :, :end],  # [b, g/tp, end, d]
                attn_mask=bias, is_causal=bias is None and end - start > 1, scale=self.scale,
                enable_gqa=True)  # [b, heads/tp, s_q, d]

        for i, layer in enumerate(module.decoder.layers):
            hidden = self._layer(i, layer, hidden, rope, attend)
        return self._head(hidden)

    @torch.no_grad()
    def decode_step(self, input_ids: torch.Tensor, position: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """One decode step with static shapes: what the native engine captures in a CUDA graph.

        Every shape is the cache's (``b`` rows, ``S`` slots) whatever the step; the step's position is a
        device tensor, its keys and values go into the cache with ``index_copy_``, and attention reads all
        ``S`` slots under a mask, so nothing depends on a host value and the same call replays at every step.

        Args:
            input_ids: ``[b, 1]`` the tokens at ``position`` (first stage only).
            position: ``[1]`` int64, the step's position in the padded rows.
            key_valid: ``[b, S]`` bool, True where a slot holds a real token; False beyond ``position``.

        Returns:
            ``[b, v_padded]`` logits of ``position`` (this is the last stage: the engine runs it at PP 1).
        """
        module = self.module
        hidden = module.embedding(input_ids=input_ids, position_ids=None)  # [1, b, h]
        # real keys, and always the query itself (rows of padding only attend to themselves, as in forward);
        # additive, built once for every layer (SDPA converts a boolean mask in each call)
        bias = attention_bias(key_valid.index_fill(1, position, True)[:, None, None, :], self.keys[0].dtype)
        rope = self._rope_at(position)  # [1, d_rot] each, once for every layer

        def attend(i, query, key, value):
            self.keys[i].index_copy_(2, position, key.permute(1, 2, 0, 3))
            self.values[i].index_copy_(2, position, value.permute(1, 2, 0, 3))
            b, groups, per_group, d = query.shape[1:]
            # one query per row: a group's heads (consecutive, as megatron splits them) become the query
            # positions of that group, so each key and value is read once, without SDPA's GQA support
            context = F.scaled_dot_product_attention(
                query[0], self.keys[i], self.values[i], attn_mask=bias, scale=self.scale)  # [b, g/tp, heads/g, d]
            return context.reshape(b, groups * per_group, 1, d)  # [b, heads/tp, 1, d]

        for i, layer in enumerate(module.decoder.layers):
            hidden = self._layer(i, layer, hidden, rope, attend)
        return self._head(hidden)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s_q, b, h]`` -> ``[b, v_padded]`` logits of the last position (gathered over TP) on the last
        stage; the activations unchanged on the others."""
        module = self.module
        if not module.post_process:
            return hidden
        last = hidden[-1:]  # [1, b, h]
        if module.decoder.final_layernorm is not None:
            last = module.decoder.final_layernorm(last)
        weight = module.shared_embedding_or_output_weight() if module.share_embeddings_and_output_weights else None
        logits, _ = module.output_layer(last, weight=weight, runtime_gather_output=True)  # [1, b, v_padded]
        return logits[0]

    @staticmethod
    def _allowed(key_valid: torch.Tensor, start: int, end: int) -> Optional[torch.Tensor]:
        """SDPA's boolean mask (True = attend): causal, real keys only, and always the query itself.
        None when no key is padding and the queries see every key or the causal prefix (a decode
        step, or a prefill from position 0): SDPA then runs without a mask, which is faster."""
        if (end - start == 1 or start == 0) and bool(key_valid[:, :end].all()):
            return None
        q = torch.arange(start, end, device=key_valid.device).unsqueeze(1)  # [s_q, 1]
        k = torch.arange(end, device=key_valid.device).unsqueeze(0)  # [1, end]
        allowed = (k <= q).unsqueeze(0) & key_valid[:, None, :end]  # [b, s_q, end]
        allowed |= (k == q).unsqueeze(0)
        return allowed.unsqueeze(1)

    def _rope_slice(self, start: int, end: int):
        """The rotation of positions ``[start, end)``: ``(cos, signed sin)`` ``[s_q, d_rot]`` each (``rope_tables``),
        or None without RoPE."""
        if self.rope_tables is None:
            return None
        return self.rope_tables[0][start:end], self.rope_tables[1][start:end]

    def _rope_at(self, position: torch.Tensor):
        """``_rope_slice`` of the one position in the device tensor ``position`` ``[1]`` (no host read)."""
        if self.rope_tables is None:
            return None
        return self.rope_tables[0].index_select(0, position), self.rope_tables[1].index_select(0, position)

    def _rope(self, t: torch.Tensor, rope) -> torch.Tensor:
        """Rotate ``[s_q, b, ..., d]`` by ``rope`` (``_rope_slice``) as megatron's unfused RoPE does."""
        return apply_rope(t, *rope, interleaved=self.config.rotary_interleaved)

    def _qkv(self, i: int, attn, normed: torch.Tensor, rope):
        """Query ``[s_q, b, groups/tp, heads/groups, d]``, key and value ``[s_q, b, groups/tp, d]``, the query and
        the key rotated by ``rope`` (None: no RoPE). With megatron's plain linear and no query/key norm, the
        query and key of a group are rotated together in place in the fused projection's layout: one rotation
        per layer."""
        groups, d = attn.num_query_groups_per_partition, attn.hidden_size_per_attention_head
        per_group = attn.num_attention_heads_per_partition // groups
        if not self.plain[i]:
            query, key, value = attn.get_query_key_value_tensors(normed, None)  # [s_q, b, heads/tp, d], ...
            query = query.unflatten(2, (groups, per_group))
            if rope is not None:
                query, key = self._rope(query, rope), self._rope(key, rope)
            return query, key, value
        mixed, _ = _linear(attn.linear_qkv, normed)  # [s_q, b, g/tp * (heads/g + 2) * d]
        mixed = mixed.view(*mixed.shape[:2], groups, per_group + 2, d)  # megatron's q.. k v interleave
        value = mixed[:, :, :, per_group + 1]
        q_norm, k_norm = _norm_or_none(attn.q_layernorm), _norm_or_none(attn.k_layernorm)
        if q_norm is None and k_norm is None:
            query_key = mixed[:, :, :, :per_group + 1]  # [s_q, b, g/tp, heads/g + 1, d]
            if rope is not None:
                query_key = self._rope(query_key, rope)
            return query_key[:, :, :, :per_group], query_key[:, :, :, per_group], value
        query, key = mixed[:, :, :, :per_group], mixed[:, :, :, per_group]
        if q_norm is not None:  # megatron normalises [s_q, b, heads/tp, d]
            query = q_norm(query.flatten(2, 3)).unflatten(2, (groups, per_group))
        if k_norm is not None:
            key = k_norm(key)
        if rope is not None:
            query, key = self._rope(query, rope), self._rope(key, rope)
        return query, key, value

    def _mlp(self, i: int, layer, hidden: torch.Tensor) -> torch.Tensor:
        """megatron's ``_forward_mlp`` (pre-MLP norm, MLP, bias-dropout-add) with plain linears."""
        if not self.plain[i]:
            return layer._forward_mlp(hidden)
        mlp, config = layer.mlp, self.config
        inter, bias = _linear(mlp.linear_fc1, layer.pre_mlp_layernorm(hidden))  # [s_q, b, ffn/tp (x2)]
        if bias is not None:
            inter = inter + bias
        if config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(inter, 2, dim=-1)
            if config.activation_func_clamp_value is not None:
                x_glu = x_glu.clamp(min=None, max=config.activation_func_clamp_value)
                x_linear = x_linear.clamp(min=-config.activation_func_clamp_value,
                                          max=config.activation_func_clamp_value)
            inter = config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)
        else:
            inter = mlp.activation_func(inter)
        out_with_bias = _linear(mlp.linear_fc2, inter)
        return layer.mlp_bda(False, config.bias_dropout_fusion)(out_with_bias, hidden, layer.hidden_dropout)

    def _layer(self, i: int, layer, hidden: torch.Tensor, rope, attend):
        """One ``TransformerLayer``: megatron's modules, with the attention core over the cache.

        ``rope``: ``_rope_slice`` of the queries' positions; ``attend(i, query, key, value)``: writes the
        rotated ``[s_q, b, groups/tp, d]`` keys and values into layer ``i``'s cache and returns the
        attention ``[b, heads/tp, s_q, d]`` of the ``[s_q, b, groups/tp, heads/groups, d]`` queries over it."""
        attn = layer.self_attention
        residual = hidden
        normed = layer.input_layernorm(hidden)  # [s_q, b, h]
        query, key, value = self._qkv(i, attn, normed, rope)  # [s_q, b, g/tp, heads/g, d], [s_q, b, g/tp, d]
        context = attend(i, query, key, value)  # [b, heads/tp, s_q, d]
        s_q, b = hidden.shape[0], hidden.shape[1]
        context = context.permute(2, 0, 1, 3).reshape(s_q, b, -1)  # [s_q, b, heads/tp * d]
        out_with_bias = _linear(attn.linear_proj, context) if self.plain[i] else attn.linear_proj(context)
        hidden = layer.self_attn_bda(False, self.config.bias_dropout_fusion)(out_with_bias, residual,
                                                                            layer.hidden_dropout)
        return self._mlp(i, layer, hidden)


def rope_tables(rotary: torch.Tensor, interleaved: bool, dtype: torch.dtype):
    """``(cos, signed sin)`` ``[S, d_rot]`` of megatron's rotary table ``[S, 1, 1, d_rot]``: the sine negated where
    megatron's rotate-half negates (the first half, or the even entries when interleaved), so ``apply_rope``
    needs no negation and no concatenation. Computed once, as megatron's ``_apply_rotary_pos_emb_bshd`` does
    on every call (``mscale`` 1)."""
    freqs = rotary.reshape(rotary.shape[0], rotary.shape[-1])  # [S, d_rot]
    sign = torch.ones(freqs.shape[-1], dtype=freqs.dtype, device=freqs.device)
    if interleaved:
        sign[0::2] = -1
    else:
        sign[:freqs.shape[-1] // 2] = -1
    return torch.cos(freqs).to(dtype), (torch.sin(freqs).to(dtype) * sign.to(dtype))


def apply_rope(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Megatron's unfused RoPE of ``t`` ``[s, ..., d]`` at the positions of ``cos`` and ``signed_sin``
    ``[s, d_rot]`` (``rope_tables``): ``t * cos + rotate_half(t) * sin``, with the halves (or pairs) swapped by
    one ``flip`` instead of a negation and a concatenation. Bit-identical to megatron's: ``-x * s == x * -s``."""
    shape = (cos.shape[0],) + (1,) * (t.dim() - 2) + (cos.shape[-1],)
    cos, signed_sin = cos.view(shape), signed_sin.view(shape)
    rot = cos.shape[-1]
    x = t[..., :rot] if rot < t.shape[-1] else t
    if interleaved:
        swapped = x.unflatten(-1, (rot // 2, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
    else:
        swapped = x.unflatten(-1, (2, rot // 2)).flip(-2).flatten(-2)  # (x2, x1)
    out = x * cos + swapped * signed_sin
    return out if rot == t.shape[-1] else torch.cat((out, t[..., rot:]), dim=-1)  # partial rotary only


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's additive mask (0 attend, -inf not) of a boolean one (True = attend): what SDPA computes from a
    boolean mask inside every call, built once a step for all layers."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _norm_or_none(norm):
    """A query or key norm, None where megatron's spec has none (None or its ``IdentityOp``)."""
    from megatron.core.transformer.identity_op import IdentityOp

    return None if norm is None or isinstance(norm, IdentityOp) else norm


def _plain_layer(layer, config) -> bool:
    """Whether a layer's linears are megatron's plain column/row-parallel ones and its MLP the plain
    unfused one, so ``_linear`` and ``CachedDecoder._mlp`` reproduce them."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP

    attn, mlp = layer.self_attention, layer.mlp
    return (type(attn.linear_qkv) is ColumnParallelLinear and type(attn.linear_proj) is RowParallelLinear
            and type(mlp) is MLP and type(mlp.linear_fc1) is ColumnParallelLinear
            and type(mlp.linear_fc2) is RowParallelLinear and not config.use_te_activation_func
            and not config.bias_activation_fusion and config.num_query_groups >= attn.world_size
            and not attn.linear_qkv.sequence_parallel and not attn.linear_qkv.gather_output
            and attn.linear_proj.input_is_parallel)


def _linear(module, x: torch.Tensor):
    """Forward of megatron's plain ``ColumnParallelLinear`` (no gather) or ``RowParallelLinear`` (input
    already split) without its autograd wrapper: ``x @ W.T`` (+ the TP all-reduce of a row-parallel
    layer), then the bias as megatron adds it. Returns ``(output, bias)``, bias when ``skip_bias_add``."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    out = F.linear(x, module.weight)
    if isinstance(module, RowParallelLinear) and dist.is_initialized() and dist.get_world_size(module.tp_group) > 1:
        dist.all_reduce(out, group=module.tp_group)
    if module.bias is None or module.skip_bias_add:
        return out, module.bias
    return out + module.bias, None


class StaticDecodeStep:
    """The native engine's decode step for one bucket of ``b`` rows and ``S`` cache slots: the cache, the step's
    input buffers, and the step behind a ``CUDAGraphWrapper`` (captured once, replayed per token; eager when
    ``capture`` is off, on CPU and to check the graph).

    The engine writes the step's tokens, position and valid keys into ``input_ids`` ``[b, 1]``,
    ``position`` ``[1]`` and ``key_valid`` ``[b, S]`` and calls the object. A captured step reads the
    parameters through their storage: in-place updates (the optimizer's) are seen; a parameter given new
    storage is not, so the wrapper captures again when a parameter's address changes.

    With ``compile``, the step is ``torch.compile``d (one graph, static shapes, inductor's default mode: no
    CUDA graphs of its own, so the compiled step is what the wrapper captures) at its first call, the capture's
    warm-up on CUDA: the layers' elementwise work fuses into a few kernels each around the matmuls and the
    attention (``bench/proxies/decode.py`` counts them). A compilation that fails logs a warning and the
    step runs uncompiled.

    Args:
        module: the unwrapped GPTModel (one stage holding every layer), in eval mode when captured.
        batch_size: rows ``b`` (the bucket).
        max_sequence_length: slots ``S``.
        capture: capture a CUDA graph (``hpa.rollout.cuda_graph.GRAPHS`` must be available on the device).
        compile: compile the step before it runs (and before it is captured).
    """

    def __init__(self, module, batch_size: int, max_sequence_length: int, *, capture: bool, compile: bool = False):
        self.decoder = CachedDecoder(module, batch_size, max_sequence_length)
        device = next(module.parameters()).device
        self.input_ids = torch.zeros((batch_size, 1), dtype=torch.long, device=device)  # [b, 1]
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.key_valid = torch.zeros((batch_size, max_sequence_length), dtype=torch.bool, device=device)  # [b, S]
        self.compiled = None if compile else False  # None: compiles at the first call; then True, or False if it failed
        self._compiled_step = compile_step(self._eager_step) if compile else None
        # warm-up and capture write position 0 of the cache: every prefill overwrites it
        self.step = CUDAGraphWrapper(self._run, lambda: tuple(p.data_ptr() for p in module.parameters()),
                                     enabled=capture)

    def _eager_step(self) -> torch.Tensor:
        return self.decoder.decode_step(self.input_ids, self.position, self.key_valid)

    def _run(self) -> torch.Tensor:
        if self.compiled is False:
            return self._eager_step()
        if self.compiled:
            return self._compiled_step()
        try:  # the first call compiles
            out = self._compiled_step()
        except Exception as err:  # noqa: BLE001 - any compiler failure: the step still runs, uncompiled
            logger.warning("native rollout engine: compiling the decode step failed (%s: %s); it runs uncompiled "
                           "(rollout.compile_decode=false skips the attempt)", type(err).__name__, err)
            self._compiled_step, self.compiled = None, False
            return self._eager_step()
        self.compiled = True
        return out

    @property
    def captures(self) -> int:
        return self.step.captures

    def __call__(self) -> torch.Tensor:
        """``[b, v_padded]`` logits of the step; from a graph, one buffer overwritten by the next replay."""
        return self.step()


def compile_step(fn):
    """``torch.compile`` of a decode step: one graph (``fullgraph``), static shapes (a bucket's step keeps its
    shapes), inductor's default mode (``"reduce-overhead"`` would capture CUDA graphs of its own, inside the
    engine's capture)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)
