"""The fused decode step: the attention mask built once a step, RoPE without a concatenation, the static step
compiled, rollouts of 256 rows in one call.

- ``apply_rope`` (query and key rotated together in the fused projection's layout) equals megatron's unfused
  RoPE bit for bit, rotate-half and interleaved, full and partial rotary; the additive mask gives SDPA's
  boolean-mask result exactly.
- The decoder equals the path it replaced (query and key rotated apart with megatron's RoPE, a boolean mask
  that SDPA converts in every layer) within 1e-6 in fp32, for left-padded prompts of mixed lengths (a row
  finished in the middle) and for prompts of one length (no mask), through the prefill, the eager decode
  step and the static one.
- Compiled on CPU (``compile_decode``, off by default there), the static step equals the eager one and the
  engine draws the same tokens; a compilation that fails warns and decodes uncompiled.
- 256 rows (64 prompts x 4) decode in one call, one bucket of 256 rows, equal to eager decode.

CUDA-graph capture of the compiled step runs only on a GPU (``tests/gpu/test_graph_decode.py``).
"""

import numpy as np
import pytest
import torch

from multirank import run_ranks

VOCAB = 64
PAD = 0


def tiny_model_config(**overrides):
    from hpa.config.schema import ModelConfig

    kwargs = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                  vocab_size=VOCAB, max_sequence_length=64, make_vocab_size_divisible_by=16, init_method_std=0.1,
                  add_qkv_bias=True)
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


# ------------------------------------------------------------------------------------------------ unit level
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("rot", [8, 6], ids=["full", "partial"])
def test_rope_equals_megatron_bit_for_bit(interleaved, rot):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from hpa.rollout.kv_cache import apply_rope, rope_tables

    g = torch.Generator().manual_seed(0)
    s, d = 5, 8
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)  # [s, rot/2]
    table = (torch.stack((freqs, freqs), dim=-1).reshape(s, rot) if interleaved
             else torch.cat((freqs, freqs), dim=-1))[:, None, None, :]  # megatron's [s, 1, 1, rot]
    cos, sin = rope_tables(table, interleaved, torch.float32)
    t = torch.randn(s, 3, 4, d, generator=g)  # [s, b, heads, d]
    want = _apply_rotary_pos_emb_bshd(t, table, rotary_interleaved=interleaved)
    assert torch.equal(apply_rope(t, cos, sin, interleaved=interleaved), want)
    # a [s, b, groups, heads/groups + 1, d] view (queries and key of each group), rotated at once
    grouped = torch.randn(s, 3, 2, 5, d, generator=g)[:, :, :, :3]
    got = apply_rope(grouped, cos, sin, interleaved=interleaved)
    want = _apply_rotary_pos_emb_bshd(grouped.reshape(s, 3, 6, d), table, rotary_interleaved=interleaved)
    assert torch.equal(got.reshape(s, 3, 6, d), want)


def test_additive_mask_gives_the_boolean_masks_attention():
    import torch.nn.functional as F

    from hpa.rollout.kv_cache import attention_bias

    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 4, 8, generator=g)  # [b, heads, s_q, d]
    k, v = (torch.randn(3, 2, 8, 8, generator=g) for _ in range(2))  # [b, heads, s_k, d]
    allowed = torch.rand(3, 1, 4, 8, generator=g) > 0.4
    allowed[..., 0] = True
    bias = attention_bias(allowed, torch.float32)
    assert bias.dtype == torch.float32 and set(bias.unique().tolist()) == {0.0, float("-inf")}
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))


# ------------------------------------------------------------------------------------------ the decoder, old path
def _old_path_decoder():
    """The decoder as it was before: query and key split, reshaped and rotated apart by megatron's unfused RoPE
    (negation, concatenation); the boolean mask handed to SDPA in every layer (``attention_bias`` patched)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from hpa.rollout import kv_cache

    class OldPathDecoder(kv_cache.CachedDecoder):
        def _rope_slice(self, start, end):
            return self.rotary[start:end]

        def _rope_at(self, position):
            return self.rotary.index_select(0, position)

        def _qkv(self, i, attn, normed, rope):
            mixed, _ = kv_cache._linear(attn.linear_qkv, normed)
            groups, d = attn.num_query_groups_per_partition, attn.hidden_size_per_attention_head
            per_group = attn.num_attention_heads_per_partition // groups
            mixed = mixed.view(*mixed.shape[:2], groups, (per_group + 2) * d)
            query, key, value = torch.split(mixed, [per_group * d, d, d], dim=3)
            query = query.reshape(query.shape[0], query.shape[1], -1, d)
            interleaved = self.config.rotary_interleaved
            query = _apply_rotary_pos_emb_bshd(query, rope, rotary_interleaved=interleaved)
            key = _apply_rotary_pos_emb_bshd(key, rope, rotary_interleaved=interleaved)
            return query.unflatten(2, (groups, per_group)), key, value

    return OldPathDecoder


def _decode_logits(decoder_cls, model, prompts, continuation, finished_row):
    """Prefill, two eager decode steps and two static ones on fixed tokens: the logits of each ``[b, v]``."""
    b, p, slots = len(prompts), max(len(x) for x in prompts), 32
    tokens = torch.full((b, slots), PAD, dtype=torch.long)
    key_valid = torch.zeros((b, slots), dtype=torch.bool)
    for i, seq in enumerate(prompts):
        tokens[i, p - len(seq):p] = torch.tensor(seq)
        key_valid[i, p - len(seq):p] = True
    decoder = decoder_cls(model, b, slots)
    logits = [decoder.forward(tokens[:, :p], None, 0, p, key_valid)]
    for step, new in enumerate(continuation.unbind(1)):
        end = p + step + 1
        tokens[:, end - 1] = new
        key_valid[:, end - 1] = True
        if finished_row is not None and step >= 1:
            key_valid[finished_row, end - 1] = False  # a stopped row: padding from here on
        if step < 2:
            logits.append(decoder.forward(tokens[:, end - 1:end], None, end - 1, end, key_valid))
        else:
            logits.append(decoder.decode_step(tokens[:, end - 1:end], torch.tensor([end - 1]), key_valid))
    return torch.stack(logits)


def old_path_worker(groups):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import kv_cache

    out = {}
    torch.manual_seed(0)
    model = build_policy(tiny_model_config(), ParallelConfig(), groups).eval()  # hpa's models: rotate-half RoPE
    g = torch.Generator().manual_seed(3)
    mixed = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 3, 8)]
    equal = [torch.randint(2, VOCAB, (6,), generator=g).tolist() for _ in range(3)]
    for name, prompts, finished in (("mixed", mixed, 2), ("equal", equal, None)):
        continuation = torch.randint(2, VOCAB, (len(prompts), 4), generator=g)
        with torch.no_grad():
            new = _decode_logits(kv_cache.CachedDecoder, model, prompts, continuation, finished)
            original = kv_cache.attention_bias
            kv_cache.attention_bias = lambda allowed, dtype: allowed  # SDPA gets the boolean mask
            try:
                old = _decode_logits(_old_path_decoder(), model, prompts, continuation, finished)
            finally:
                kv_cache.attention_bias = original
        out[name] = (new.numpy(), old.numpy())
    return out


@pytest.mark.multirank
def test_decoder_equals_the_old_mask_and_rope_path():
    out = run_ranks(old_path_worker)[0]
    assert set(out) == {"mixed", "equal"}
    for key, (new, old) in out.items():
        assert np.isfinite(new).all(), key
        np.testing.assert_allclose(new, old, atol=1e-6, rtol=0, err_msg=str(key))


# ------------------------------------------------------------------------------------------- compiled, 256 rows
def compiled_worker(groups):
    import logging

    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.rollout import SamplingParams, TokenizerInfo, kv_cache
    from hpa.rollout import megatron_engine as me

    torch.manual_seed(0)
    model = build_policy(tiny_model_config(num_layers=2), ParallelConfig(), groups).eval()
    info = TokenizerInfo(vocab_size=VOCAB, eos_token_id=1, pad_token_id=PAD)
    out = {}
    # the step itself, compiled against eager, at the same inputs
    steps = [kv_cache.StaticDecodeStep(model, 4, 16, capture=False, compile=c) for c in (False, True)]
    for step in steps:
        step.input_ids.copy_(torch.tensor([[5], [7], [9], [11]]))
        step.position.fill_(3)
        step.key_valid[:, :3] = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)
    out["step"] = [s().clone().numpy() for s in steps]
    out["step_compiled"] = steps[1].compiled

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(3)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=7)
    eager = me.MegatronRolloutEngine(model, groups, info, decode="eager")
    out["eager"] = eager.generate(prompts, params)
    compiled = me.MegatronRolloutEngine(model, groups, info, decode="static", compile_decode=True)
    out["compiled"] = compiled.generate(prompts, params)
    out["compiled_metrics"] = compiled.decode_metrics()
    out["cpu_default"] = me.MegatronRolloutEngine(model, groups, info, decode="static").compile_decode

    def broken(fn):
        def fail():
            raise RuntimeError("no C++ compiler")
        return fail

    kv_cache.compile_step, original = broken, kv_cache.compile_step
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    kv_cache.logger.addHandler(handler)
    try:
        fallback = me.MegatronRolloutEngine(model, groups, info, decode="static", compile_decode=True)
        out["fallback"] = fallback.generate(prompts, params)
        out["fallback_metrics"] = fallback.decode_metrics()
    finally:
        kv_cache.compile_step = original
        kv_cache.logger.removeHandler(handler)
    out["warnings"] = [r.getMessage() for r in records]

    # 256 rows: 64 prompts x 4 responses, one call, one bucket
    many = [torch.randint(2, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(64)]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=3)
    static = me.MegatronRolloutEngine(model, groups, info, decode="static")
    out["rows256"] = static.generate(many, params)
    out["rows256_eager"] = eager.generate(many, params)
    out["rows256_buckets"] = list(static._steps)
    out["rows256_cache_rows"] = [k.shape[0] for k in next(iter(static._steps.values())).decoder.keys]
    return out


@pytest.fixture(scope="module")
def compiled():
    return run_ranks(compiled_worker)[0]


def _same_rollout(a, b, atol):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=atol, rtol=0)


@pytest.mark.multirank
def test_compiled_step_equals_the_eager_step(compiled):
    assert compiled["step_compiled"] is True
    eager, fused = compiled["step"]
    assert np.isfinite(fused).all()
    np.testing.assert_allclose(fused, eager, atol=1e-5, rtol=0)  # inductor reorders fp32 reductions


@pytest.mark.multirank
def test_compiled_decode_draws_the_eager_tokens(compiled):
    _same_rollout(compiled["compiled"], compiled["eager"], atol=1e-5)
    assert compiled["compiled_metrics"]["rollout/decode_compiled"] == 1.0
    assert compiled["cpu_default"] is False  # on CPU only when asked for


@pytest.mark.multirank
def test_failed_compilation_warns_and_decodes_uncompiled(compiled):
    _same_rollout(compiled["fallback"], compiled["eager"], atol=1e-6)
    assert compiled["fallback_metrics"]["rollout/decode_compiled"] == 0.0
    assert len(compiled["warnings"]) == 1
    assert "compiling the decode step failed (RuntimeError: no C++ compiler)" in compiled["warnings"][0]
    assert "rollout.compile_decode=false" in compiled["warnings"][0]


@pytest.mark.multirank
def test_256_rows_decode_in_one_call(compiled):
    batch = compiled["rows256"]
    assert batch.response_ids.shape[0] == 256 and batch.group_ids.tolist() == [i // 4 for i in range(256)]
    assert [rows for rows, _ in compiled["rows256_buckets"]] == [256]
    assert set(compiled["rows256_cache_rows"]) == {256}
    _same_rollout(batch, compiled["rows256_eager"], atol=1e-6)
