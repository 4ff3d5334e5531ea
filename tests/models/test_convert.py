"""HF <-> Megatron conversion of tiny random Llama (GQA), Qwen2 (qkv bias, tied embeddings) and
Mistral models built by transformers (nothing is downloaded).

One tp2_pp2_dp1 spawn imports all three families through ``run_convert``, compares megatron's
logits with the HF model's and exports back; the name/shape tables, the error paths and the
TP2xPP2 -> TP1 reshard run in this process on a single-rank gloo group.
"""

import json

import numpy as np
import pytest
import torch

from multirank import run_ranks

VOCAB = 70  # pads to 80 at TP1 and 96 at TP2 (divisible by 16 · TP)
DIVISIBLE_BY = 16
ATOL = 1e-4
FAMILIES = ("llama", "qwen2", "mistral")


def hf_model(family: str):
    import transformers

    torch.manual_seed({"llama": 1, "qwen2": 2, "mistral": 3}[family])
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if family == "llama":
        config = transformers.LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=500000.0)
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.MistralConfig(**common, rms_norm_eps=1e-6, sliding_window=4096)
        model = transformers.MistralForCausalLM(config)
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor distinctive
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def input_ids():
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))


def tp2_pp2_worker(groups, root, families):
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.distributed.comm import all_gather_cat
    from hpa.models.builders import build_reference
    from hpa.models.convert import hf_tensors_from_megatron, run_convert
    from hpa.models.weights import load_model_weights
    from hpa.engine.step import forward_backward

    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--backend", "gloo"]
    out = {}
    for family in families:
        ckpt = f"{root}/{family}_megatron"
        assert run_convert(["hf-to-megatron", "--hf-dir", f"{root}/{family}_hf", "--out", ckpt,
                            "--make-vocab-size-divisible-by", str(DIVISIBLE_BY), *layout], groups=groups) == 0
        with open(f"{ckpt}/hpa_convert.json") as f:
            model_cfg = ModelConfig(**json.load(f)["model"])
        parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        model = build_reference(model_cfg, parallel, groups)
        load_model_weights(model, ckpt, groups)

        ids = input_ids()
        mbs = [{"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).expand_as(ids)}]

        def grab(batch, logits, hidden):  # logits [b, s, v_pad/tp]
            full = all_gather_cat(logits, groups.tp_group, dim=-1)[..., :model_cfg.vocab_size]
            return logits.sum() * 0, {"logits": full.detach()}

        with torch.no_grad():
            metrics = forward_backward(model, mbs, grab, groups, forward_only=True)
        streamed = [(n, float(t.double().sum())) for n, t in hf_tensors_from_megatron(model, model_cfg, groups)]
        assert run_convert(["megatron-to-hf", "--megatron-dir", ckpt, "--out", f"{root}/{family}_hf_out",
                            "--tokenizer-dir", f"{root}/tokenizer", *layout], groups=groups) == 0
        out[family] = {"logits": metrics[0]["logits"].numpy() if metrics else None, "streamed": streamed,
                       "vocab_padded": model.embedding.word_embeddings.weight.shape[0] * 2
                       if groups.is_first_stage else None}
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    models = {}
    for family in FAMILIES:
        models[family] = hf_model(family)
        models[family].save_pretrained(root / f"{family}_hf")
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    ranks = run_ranks(tp2_pp2_worker, tp=2, pp=2, args=(str(root), FAMILIES))
    return root, models, ranks


def read_safetensors(directory):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_tp2_pp2_dp1(converted, family):
    _, models, ranks = converted
    with torch.no_grad():
        ref = models[family](input_ids()).logits.numpy()
    got = ranks[-1][family]["logits"]  # the last global rank is on the last stage
    assert got.shape == ref.shape == (2, 12, VOCAB)
    assert ranks[0][family]["vocab_padded"] == 96
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)


@pytest.mark.multirank
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_identical_tp2_pp2_dp1(converted, family):
    root, _, _ = converted
    original = read_safetensors(root / f"{family}_hf")
    exported = read_safetensors(root / f"{family}_hf_out")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    if family == "qwen2":
        assert "lm_head.weight" not in exported and any(n.endswith("q_proj.bias") for n in exported)


@pytest.mark.multirank
@pytest.mark.parametrize("family", FAMILIES)
def test_exported_directory_loads_in_transformers(converted, family):
    import transformers

    root, models, _ = converted
    out = root / f"{family}_hf_out"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(reloaded) is type(models[family])
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"model_max_length": 64}
    for key in ("rms_norm_eps", "tie_word_embeddings", "num_key_value_heads", "intermediate_size"):
        assert getattr(reloaded.config, key) == getattr(models[family].config, key), key
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids()).logits, models[family](input_ids()).logits,
                                   atol=0, rtol=0)


@pytest.mark.multirank
def test_every_rank_streams_every_tensor_tp2_pp2_dp1(converted):
    _, models, ranks = converted
    for family in FAMILIES:
        expected = set(models[family].state_dict())
        if family == "qwen2":
            expected.discard("lm_head.weight")  # tied: HF stores only the embedding
        first = ranks[0][family]["streamed"]
        assert {n for n, _ in first} == expected
        for rank in ranks[1:]:
            assert rank[family]["streamed"] == first


@pytest.mark.parametrize("family", ("llama", "qwen2"))
def test_mapping_table_matches_transformers_names_and_shapes(groups, family):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.models.convert import mapping_table, model_config_from_hf

    hf = hf_model(family)
    model_cfg = model_config_from_hf(hf.config, make_vocab_size_divisible_by=DIVISIBLE_BY)
    megatron = build_policy(model_cfg, ParallelConfig(), groups)
    table = mapping_table([n for n, _ in megatron.named_parameters()], model_cfg)
    produced = {hf_name: shape for pairs in table.values() for hf_name, shape in pairs}
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if family == "qwen2":
        assert "output_layer.weight" not in table  # tied at PP1: the embedding is the output layer
        expected.pop("lm_head.weight")
    assert produced == expected
    for name, param in megatron.named_parameters():  # TP1 megatron shapes hold exactly the HF rows
        rows = sum(shape[0] for _, shape in table[name]) if param.dim() > 1 or "bias" in name else None
        if rows is not None and "word_embeddings" not in name and "output_layer" not in name:
            assert rows == param.shape[0], name


def test_model_config_from_hf_reads_the_details():
    from hpa.models.convert import model_config_from_hf

    llama = model_config_from_hf(hf_model("llama").config)
    assert (llama.norm_epsilon, llama.rotary_base, llama.ffn_hidden_size, llama.num_query_groups) == \
        (1e-5, 500000.0, 48, 2)
    assert llama.untie_embeddings_and_output_weights and not llama.add_qkv_bias
    qwen = model_config_from_hf(hf_model("qwen2").config)
    assert qwen.add_qkv_bias and not qwen.untie_embeddings_and_output_weights
    assert (qwen.norm_epsilon, qwen.rotary_base) == (1e-6, 1e6)
    cfg = hf_model("llama").config.to_dict()
    with pytest.raises(ValueError, match="rope_type"):
        model_config_from_hf({**cfg, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    with pytest.raises(ValueError, match="mlp_bias"):
        model_config_from_hf({**cfg, "mlp_bias": True})
    with pytest.raises(ValueError, match="model_type"):
        model_config_from_hf({**cfg, "model_type": "gpt2"})


def test_load_errors_name_the_tensor(groups):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.models.convert import StateDictSource, load_hf_into_megatron, model_config_from_hf

    hf = hf_model("llama")
    model_cfg = model_config_from_hf(hf.config, make_vocab_size_divisible_by=DIVISIBLE_BY)
    megatron = build_policy(model_cfg, ParallelConfig(), groups)
    sd = hf.state_dict()
    load_hf_into_megatron(megatron, StateDictSource(sd), model_cfg, groups)  # a model object works
    with pytest.raises(KeyError, match="model.layers.0.extra.weight"):
        load_hf_into_megatron(megatron, StateDictSource({**sd, "model.layers.0.extra.weight": torch.ones(2)}),
                              model_cfg, groups)
    missing = {k: v for k, v in sd.items() if k != "model.layers.2.mlp.up_proj.weight"}
    with pytest.raises(KeyError, match=r"model.layers.2.mlp.up_proj.weight.*decoder.layers.2.mlp.linear_fc1"):
        load_hf_into_megatron(megatron, StateDictSource(missing), model_cfg, groups)
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_hf_into_megatron(megatron, StateDictSource({**sd, "model.norm.weight": torch.ones(3)}),
                              model_cfg, groups)


@pytest.mark.multirank
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_pp2_checkpoint_exports_identically_at_tp1(converted, groups, family):
    """Resharding: the checkpoint written at TP2xPP2 loads and exports at TP1 (vocab padded to 80)."""
    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.models import build_reference
    from hpa.models.convert import hf_tensors_from_megatron
    from hpa.models.weights import load_model_weights

    root, models, _ = converted
    ckpt = root / f"{family}_megatron"
    model_cfg = ModelConfig(**json.loads((ckpt / "hpa_convert.json").read_text())["model"])
    megatron = build_reference(model_cfg, ParallelConfig(), groups)
    load_model_weights(megatron, ckpt, groups)
    assert megatron.embedding.word_embeddings.weight.shape[0] == 80
    got = dict(hf_tensors_from_megatron(megatron, model_cfg, groups))
    original = read_safetensors(root / f"{family}_hf")
    assert got.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.multirank
def test_export_writes_sharded_safetensors_that_transformers_loads(converted, groups, tmp_path):
    import transformers

    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.models import build_reference
    from hpa.models.convert import export_hf_checkpoint
    from hpa.models.weights import load_model_weights

    root, models, _ = converted
    ckpt = root / "llama_megatron"
    meta = json.loads((ckpt / "hpa_convert.json").read_text())
    model_cfg = ModelConfig(**meta["model"])
    megatron = build_reference(model_cfg, ParallelConfig(), groups)
    load_model_weights(megatron, ckpt, groups)
    out = export_hf_checkpoint(megatron, model_cfg, groups, tmp_path / "hf", family="llama",
                               hf_config_base=meta["hf_config"], max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    assert not list(out.glob(".part-*"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids()).logits, models["llama"](input_ids()).logits,
                                   atol=0, rtol=0)


def test_a_full_run_checkpoint_exports_with_its_run_config(groups, tmp_path, capsys):
    """docs/training.md's export of ``<run_dir>/checkpoints/step_N/policy`` (a full, non-LoRA run): the model
    section comes from the run's ``config.yaml`` as for a LoRA checkpoint, and the export holds the checkpoint's
    tensors; a checkpoint with neither that nor ``hpa_convert.json`` is one line naming ``--config``."""
    from hpa.cli import main
    from hpa.config import load_config, write_resolved
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_reference
    from hpa.models.convert import hf_tensors_from_megatron, run_convert
    from hpa.models.weights import save_model_weights

    cfg = load_config(None, [])
    torch.manual_seed(0)
    model = build_reference(cfg.model, ParallelConfig(), groups)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    run = tmp_path / "run"
    write_resolved(cfg, run)
    ckpt = run / "checkpoints" / "step_00000001" / "policy"
    save_model_weights(model, ckpt, groups)
    assert run_convert(["megatron-to-hf", "--megatron-dir", str(ckpt), "--out", str(tmp_path / "hf")],
                       groups=groups) == 0
    exported = read_safetensors(tmp_path / "hf")
    expected = dict(hf_tensors_from_megatron(model, cfg.model, groups))
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metadata.json").write_text("{}")
    code = main(["convert", "megatron-to-hf", "--megatron-dir", str(bare), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--config" in err and "hpa_convert.json" in err, err
