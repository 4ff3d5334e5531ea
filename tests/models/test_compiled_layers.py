"""``model.compile``: each transformer layer compiled (forward and backward) equals the eager layer, padded and
packed, at three lengths, without a graph break and without a recompile per length; the key's resolution and
its errors."""

import copy
import types

import pytest
import torch

from multirank import run_ranks

VOCAB = 64
# fp32 on CPU, relative to the largest value where that is above 1 (gradients reach ~50: a sum of 1e-6 there is
# under one ulp's worth of reordering); inductor reorders sums, nothing more
TOLERANCE = 1e-6


def _model_config(**changes):
    from hpa.config.schema import ModelConfig

    # Qwen2's structure (grouped-query attention, QKV biases, tied embeddings), narrow and 2 layers: inductor
    # compiles C++ on a busy CPU, one graph for both layers
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                       vocab_size=VOCAB, max_sequence_length=64, make_vocab_size_divisible_by=16,
                       add_qkv_bias=True, untie_embeddings_and_output_weights=False, **changes)


def _micro_batch(lengths, packed, seed, chunk_tokens=None):
    from hpa.engine.micro_batch import MicroBatch
    from hpa.models.specs import ChunkLayout

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=g)
    mb = MicroBatch.from_padded("rows", ids, ids, torch.tensor(lengths), packed=packed)
    if packed and chunk_tokens is not None:  # rows in several chunks: the attention's gather path
        mb.packed_seq_params().hpa_chunks = ChunkLayout(lengths, budget=chunk_tokens)
    return mb


def _forward_backward(model, mb, seed):
    from hpa.engine.step import model_inputs

    ids, positions, packed, _ = model_inputs(mb, 1)
    out = model(ids, positions, None, packed_seq_params=packed)  # [b, s, v/tp]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def compare_worker(groups, packed, batches, sequence_parallel=False):
    """Eager and compiled copies of one policy over ``batches`` (``(lengths, chunk_tokens)``), forward and
    backward: the largest differences, the graphs dynamo compiled and its graph breaks."""
    from torch._dynamo.utils import counters

    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.models.compiled_layers import compile_layers, is_compiled

    parallel = ParallelConfig(tensor_model_parallel_size=groups.tensor_model_parallel_size,
                              sequence_parallel=sequence_parallel)
    eager = build_policy(_model_config(), parallel, groups)
    compiled = build_policy(_model_config(compile=True), parallel, groups)
    assert all(is_compiled(layer) for layer in compiled.decoder.layers)
    assert not any(is_compiled(layer) for layer in eager.decoder.layers)
    compiled.load_state_dict(eager.state_dict())
    compile_layers(compiled, fullgraph=True)  # a graph break raises
    counters.clear()
    result = {"out": 0.0, "grad": 0.0, "graphs": []}
    for i, (lengths, chunk_tokens) in enumerate(batches):
        out_e, grads_e = _forward_backward(eager, _micro_batch(lengths, packed, i, chunk_tokens), i)
        out_c, grads_c = _forward_backward(compiled, _micro_batch(lengths, packed, i, chunk_tokens), i)
        result["out"] = max(result["out"], (out_c - out_e).abs().max().item())
        result["out_scale"] = max(result.get("out_scale", 0.0), out_e.abs().max().item())
        result["grad"] = max(result["grad"], *((grads_c[n] - grads_e[n]).abs().max().item() for n in grads_e))
        result["grad_scale"] = max(result.get("grad_scale", 0.0), *(g.abs().max().item() for g in grads_e.values()))
        result["graphs"].append(counters["stats"]["unique_graphs"])
    result["breaks"] = sum(counters["graph_break"].values())
    return result


def _assert_close(result):
    assert result["out"] <= TOLERANCE * max(1.0, result["out_scale"]), result
    assert result["grad"] <= TOLERANCE * max(1.0, result["grad_scale"]), result


# three lengths each; packed: rows in several chunks (the attention's gather, what long packs take)
PADDED = [([7, 5, 3], None), ([12, 9, 12], None), ([4, 2, 3], None)]
PACKED = [([7, 5, 3, 9], 10), ([12, 2, 6], 10), ([5, 11, 4, 8, 3], 12)]


@pytest.mark.multirank
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_compiled_layers_equal_eager_at_three_lengths_with_one_graph(packed):
    [result] = run_ranks(compare_worker, args=(packed, PACKED if packed else PADDED))
    _assert_close(result)
    assert result["breaks"] == 0, result
    # one graph for both layers and every length (dynamic token dimensions), compiled at the first call
    assert result["graphs"] == [1, 1, 1], result


@pytest.mark.multirank
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_tp2_compiled_equals_eager(sequence_parallel):
    """megatron's column-parallel matmul all-reduces (or, with sequence parallelism, gathers) in its backward with
    ``async_op=True``, which dynamo cannot trace: ``megatron_patches/column_parallel_comm.py``."""
    ranks = run_ranks(compare_worker, tp=2, args=(True, PACKED[:1], sequence_parallel),
                      parallel_kwargs={"sequence_parallel": sequence_parallel})
    for result in ranks:
        _assert_close(result)
        assert result["breaks"] == 0 and result["graphs"] == [1], result


def test_auto_is_on_for_local_layers_on_cuda_only():
    from hpa.models.compiled_layers import compile_wanted

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_wanted(None, cuda, use_te=False, recompute_granularity=None) is True
    assert compile_wanted(None, cpu, use_te=False, recompute_granularity=None) is False
    assert compile_wanted(None, cuda, use_te=True, recompute_granularity=None) is False
    assert compile_wanted(None, cuda, use_te=False, recompute_granularity="selective") is False
    assert compile_wanted(None, cuda, use_te=False, recompute_granularity="full") is True
    assert compile_wanted(True, cpu, use_te=False, recompute_granularity=None) is True
    assert compile_wanted(False, cuda, use_te=False, recompute_granularity=None) is False


def test_explicit_compile_names_what_it_cannot_compile():
    from hpa.config import load_config
    from hpa.config.errors import ConfigError
    from hpa.models.compiled_layers import compile_wanted

    with pytest.raises(ValueError, match="model.compile=true .*Transformer Engine.*transformer_impl=local"):
        compile_wanted(True, torch.device("cuda"), use_te=True, recompute_granularity=None)
    with pytest.raises(ConfigError, match="model.compile.*recompute_granularity=selective"):
        load_config(None, ["model.compile=true", "model.recompute_granularity=selective"])
    assert load_config(None, []).model.compile is None
    assert load_config(None, ["model.compile=false"]).model.compile is False


def test_a_call_with_an_inference_context_runs_eagerly(monkeypatch):
    """megatron's own inference path (a KV cache in ``inference_context``) and a call inside an enclosing
    compiled region go to the layer's eager forward; anything else to the compiled one."""
    from hpa.models import compiled_layers

    calls = []

    class Layer(torch.nn.Module):
        config = types.SimpleNamespace(attention_dropout=0.0)

        def forward(self, hidden_states, inference_context=None):
            return hidden_states + 1

    layer = Layer()
    gpt = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[layer]))
    assert compiled_layers.compile_layers(gpt) == 1
    monkeypatch.setattr(compiled_layers, "_compiled", lambda fullgraph: lambda *a, **k: calls.append(k) or "c")
    monkeypatch.setattr(compiled_layers, "_prepare", lambda *a: None)
    assert torch.equal(layer(torch.zeros(2), inference_context=object()), torch.ones(2))
    assert calls == []
    assert layer(hidden_states=torch.zeros(2, 1, 3)) == "c" and len(calls) == 1
    copied = copy.deepcopy(gpt).decoder.layers[0]  # a copy's layers call themselves, not the original's
    assert copied is not layer and copied.forward.__self__ is copied and compiled_layers.is_compiled(copied)


def test_the_packed_embedding_output_gets_the_layers_strides():
    """A packed ``[t, 1, h]`` from the embedding is a transposed ``[1, t, h]``: the same memory, another stride on
    the size-1 dimension, on which dynamo would guard (a second graph for the first layer)."""
    from hpa.models.compiled_layers import _canonical_strides

    embedded = torch.randn(1, 5, 4).transpose(0, 1)  # [t, 1, h]
    assert embedded.stride() == (4, 20, 1)
    same = _canonical_strides(embedded)
    assert same.stride() == (4, 4, 1) and same.data_ptr() == embedded.data_ptr() and torch.equal(same, embedded)
    padded = torch.randn(3, 5, 4).transpose(0, 1)  # [s, b, h], not contiguous: left as it is
    assert _canonical_strides(padded) is padded
