"""LoRA interop against the real ``peft`` library on a tiny model (one in-process gloo rank):

* a LoRA model's adapters exported as a PEFT directory load with ``PeftModel.from_pretrained`` on the exported
  HF base and give megatron's logits (fp32, 1e-5); the merged export gives them too;
* a PEFT adapter imports back: our own export at its rank (A shared by q/k/v and by gate/up), one trained by
  PEFT (its own A per projection) exactly in block form at 3·r, and at a wrong rank a clear error giving it.
"""

import dataclasses

import pytest
import torch


peft = pytest.importorskip("peft")

VOCAB = 70
ATOL = 1e-5


def model_config():
    from hpa.config.schema import LoRAConfig, ModelConfig

    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                       vocab_size=VOCAB, max_sequence_length=32, make_vocab_size_divisible_by=16,
                       lora=LoRAConfig(rank=4, alpha=8.0))


def ids():
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))


def megatron_logits(model, groups):
    from hpa.engine.step import forward_backward

    x = ids()
    mbs = [{"input_ids": x, "position_ids": torch.arange(x.shape[1]).expand_as(x)}]

    def grab(batch, logits, hidden):  # [b, s, v_pad]
        return logits.sum() * 0, {"logits": logits[..., :VOCAB].detach()}

    with torch.no_grad():
        return forward_backward(model, mbs, grab, groups, forward_only=True)[0]["logits"]


def hf_logits(model):
    with torch.no_grad():
        return model(ids()).logits.float()


def lora_model(groups, base_dir, cfg=None):
    from hpa.config.schema import ParallelConfig
    from hpa.models.lora_io import build_lora_model

    return build_lora_model(cfg or model_config(), ParallelConfig(), groups, str(base_dir)).eval()


@pytest.fixture(scope="module")
def exported(groups, tmp_path_factory):
    """A random base (megatron and HF), a LoRA model over it with random A and B, its PEFT and merged exports."""
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.models.convert import export_hf_checkpoint
    from hpa.models.lora import adapters
    from hpa.models.lora_io import export_peft_adapter, merged_model, save_adapters
    from hpa.models.weights import save_model_weights

    root = tmp_path_factory.mktemp("lora_peft")
    cfg = model_config()
    torch.manual_seed(0)
    base = build_policy(cfg, ParallelConfig(), groups)
    with torch.no_grad():  # norms at 1 would hide a wrong norm mapping
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_model_weights(base, root / "base_megatron", groups)
    export_hf_checkpoint(base, cfg, groups, root / "base_hf")
    model = lora_model(groups, root / "base_megatron")
    torch.manual_seed(1)
    with torch.no_grad():  # B = 0 at the start would make any mapping of B pass
        for _, a in adapters(model):
            a.B.normal_(0, 0.2)
    export_peft_adapter(model, cfg, cfg.lora, groups, root / "peft")
    save_adapters(model, root / "adapters", groups)
    export_hf_checkpoint(merged_model(model, cfg, ParallelConfig(), groups), cfg, groups, root / "merged_hf")
    return root, model, megatron_logits(model, groups)


def test_peft_loads_the_export_on_the_hf_base_with_the_same_logits(exported):
    import transformers

    root, _, expected = exported
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base_hf", torch_dtype=torch.float32)
    without = hf_logits(base)
    model = peft.PeftModel.from_pretrained(base, str(root / "peft")).eval()
    torch.testing.assert_close(hf_logits(model), expected, atol=ATOL, rtol=0)
    assert (without - expected).abs().max() > 1e-2  # the adapters matter: the bare base is far off
    modules = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n.endswith("_proj")}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_merged_export_has_the_same_logits(exported):
    import transformers

    root, _, expected = exported
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged_hf", torch_dtype=torch.float32)
    torch.testing.assert_close(hf_logits(merged), expected, atol=ATOL, rtol=0)


def test_our_export_imports_back_at_its_rank(exported, groups):
    from hpa.models.lora import adapters
    from hpa.models.lora_io import import_peft_adapter

    root, model, expected = exported
    fresh = lora_model(groups, root / "base_megatron")
    import_peft_adapter(fresh, root / "peft", model_config(), model_config().lora, groups)
    for (name, a), (_, b) in zip(adapters(model), adapters(fresh)):
        assert torch.equal(a.A, b.A), name
        torch.testing.assert_close(a.B, b.B, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(megatron_logits(fresh, groups), expected, atol=ATOL, rtol=0)


def test_a_peft_trained_adapter_imports_exactly_in_block_form(exported, groups, tmp_path):
    import transformers

    from hpa.config.schema import LoRAConfig
    from hpa.models.lora_io import AdapterImportError, import_peft_adapter

    root, _, _ = exported
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base_hf", torch_dtype=torch.float32)
    torch.manual_seed(2)
    config = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, config).eval()  # random A and B: every projection its own A
    model.save_pretrained(tmp_path / "trained")
    expected = hf_logits(model)

    cfg = model_config()
    with pytest.raises(AdapterImportError, match="set model.lora.rank: 6"):
        import_peft_adapter(lora_model(groups, root / "base_megatron"), tmp_path / "trained", cfg, cfg.lora, groups)
    block = dataclasses.replace(cfg, lora=LoRAConfig(rank=6, alpha=6.0))
    imported = lora_model(groups, root / "base_megatron", block)
    import_peft_adapter(imported, tmp_path / "trained", block, block.lora, groups)
    torch.testing.assert_close(megatron_logits(imported, groups), expected, atol=ATOL, rtol=0)


def test_the_convert_peft_export_names_its_base_and_loads_the_usual_ways(exported, groups, tmp_path):
    """``hpa convert megatron-to-hf --peft-dir``: ``adapter_config.json`` names the base the adapters go on (not the
    merged export), so ``AutoPeftModelForCausalLM.from_pretrained(PEFT)`` and ``PeftModel.from_pretrained(base,
    PEFT)`` both give the merged export's logits (fp32, 1e-5), which are megatron's."""
    import json

    import transformers

    from hpa.models.convert import run_convert

    import yaml

    from hpa.config.load import default_config_path

    root, _, expected = exported
    config = yaml.safe_load(default_config_path().read_text())  # the run's config: the embedded one with this model
    config["model"] = {**json.loads(json.dumps(dataclasses.asdict(model_config()))),
                       "policy_path": str(root / "base_megatron")}
    config["data"].update(max_prompt_length=16, max_response_length=8)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    run_convert(["megatron-to-hf", "--megatron-dir", str(root / "adapters"), "--out", str(tmp_path / "merged"),
                 "--peft-dir", str(tmp_path / "peft"), "--config", str(tmp_path / "config.yaml")], groups=groups)
    merged = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                                         torch_dtype=torch.float32))
    torch.testing.assert_close(merged, expected, atol=ATOL, rtol=0)
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "peft"), torch_dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(auto), merged, atol=ATOL, rtol=0)
    named = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = transformers.AutoModelForCausalLM.from_pretrained(named, torch_dtype=torch.float32)
    assert (hf_logits(base) - merged).abs().max() > 1e-2  # the named base is not the merged model
    on_base = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    torch.testing.assert_close(hf_logits(on_base), merged, atol=ATOL, rtol=0)


def _run_config(path, model_cfg, base_dir):
    """A run's YAML (the embedded default's) with this model section over ``base_dir``."""
    import json

    import yaml

    from hpa.config.load import default_config_path

    config = yaml.safe_load(default_config_path().read_text())
    config["model"] = {**json.loads(json.dumps(dataclasses.asdict(model_cfg))), "policy_path": str(base_dir)}
    config["data"].update(max_prompt_length=16, max_response_length=8)
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_the_convert_peft_export_names_the_hf_base_the_run_was_converted_from(exported, groups, tmp_path):
    """A base imported with ``hpa convert hf-to-megatron``: ``adapter_config.json`` names that HF directory (absolute:
    PEFT reads ``base_model_name_or_path`` as given), no copy of the base is written, and both PEFT loaders give
    the merged export's logits, which are megatron's (fp32, 1e-5). Moved away, the base is exported beside the
    adapters as before; changed (its config.json), too."""
    import json
    import shutil

    import transformers

    from hpa.config.schema import LoRAConfig, ParallelConfig
    from hpa.models.convert import converted_from, import_hf_checkpoint, run_convert
    from hpa.models.lora import adapters
    from hpa.models.lora_io import save_adapters

    hf = tmp_path / "hf"
    shutil.copytree(exported[0] / "base_hf", hf)
    imported = import_hf_checkpoint(str(hf), tmp_path / "imported", ParallelConfig(), groups,
                                    make_vocab_size_divisible_by=16)
    cfg = dataclasses.replace(imported, lora=LoRAConfig(rank=4, alpha=8.0))
    model = lora_model(groups, tmp_path / "imported", cfg)
    torch.manual_seed(2)
    with torch.no_grad():
        for _, a in adapters(model):
            a.B.normal_(0, 0.2)
    save_adapters(model, tmp_path / "adapters", groups)
    expected = megatron_logits(model, groups)
    config = _run_config(tmp_path / "config.yaml", cfg, tmp_path / "imported")

    def convert(name):
        run_convert(["megatron-to-hf", "--megatron-dir", str(tmp_path / "adapters"), "--out",
                     str(tmp_path / f"merged_{name}"), "--peft-dir", str(tmp_path / name), "--config", config],
                    groups=groups)
        merged = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"merged_{name}",
                                                                             torch_dtype=torch.float32))
        torch.testing.assert_close(merged, expected, atol=ATOL, rtol=0)
        auto = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / name), torch_dtype=torch.float32).eval()
        torch.testing.assert_close(hf_logits(auto), merged, atol=ATOL, rtol=0)
        named = json.loads((tmp_path / name / "adapter_config.json").read_text())["base_model_name_or_path"]
        base = transformers.AutoModelForCausalLM.from_pretrained(named, torch_dtype=torch.float32)
        on_base = peft.PeftModel.from_pretrained(base, str(tmp_path / name)).eval()
        torch.testing.assert_close(hf_logits(on_base), merged, atol=ATOL, rtol=0)
        return named

    assert converted_from(tmp_path / "imported") == (hf.resolve(), None)
    assert convert("peft") == str(hf.resolve()) and not (tmp_path / "peft" / "base").exists()
    hf.rename(tmp_path / "hf_moved")
    assert convert("peft_moved") == str((tmp_path / "peft_moved" / "base").resolve())
    shutil.copytree(tmp_path / "hf_moved", hf)
    hf_config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**hf_config, "rms_norm_eps": 0.5}))
    found, why = converted_from(tmp_path / "imported")
    assert found is None and "config.json" in why


def _tp2_pp2_export(groups, root):
    from hpa.config.schema import ParallelConfig
    from hpa.models.lora_io import build_lora_model, export_peft_adapter, load_adapters

    cfg = model_config()
    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model = build_lora_model(cfg, parallel, groups, f"{root}/base_megatron")
    load_adapters(model, f"{root}/adapters", groups)  # saved at TP1: megatron reshards
    export_peft_adapter(model, cfg, cfg.lora, groups, f"{root}/peft_tp2_pp2")


@pytest.mark.multirank
def test_tp2_pp2_exports_the_same_peft_adapter(exported):
    """The adapters saved at TP1, loaded under TP2×PP2 (q/k/v groups and [gate_r; up_r] split over TP, layers over
    PP) and exported again: the same PEFT tensors, bit for bit."""
    from safetensors.torch import load_file

    from multirank import run_ranks

    root = exported[0]
    run_ranks(_tp2_pp2_export, tp=2, pp=2, args=(str(root),))
    ours, theirs = load_file(str(root / "peft" / "adapter_model.safetensors")), \
        load_file(str(root / "peft_tp2_pp2" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs) and len(ours) == 2 * 2 * 7  # layers x projections x (A, B)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
