"""LoRA's bad input that needs no model: config combinations it refuses, the adapter key naming, and a LoRA
checkpoint given where full weights are expected (tests/models/test_lora.py has the multi-rank half)."""

import json

import pytest
import torch

from hpa.config import ConfigError, load_config
from hpa.models import lora
from hpa.models.weights import load_model_weights

ON = ["model.lora.rank=4"]


def test_lora_config_loads_with_grpo():
    cfg = load_config(overrides=ON, world_size=1)
    assert cfg.model.lora.enabled and cfg.model.lora.scaling == pytest.approx(16.0 / 4)


@pytest.mark.parametrize("overrides,key,words", [
    (ON + ["algorithm.advantage.estimator=gae", "model.critic_path=/some/critic"], "model.critic_path", "value head"),
    (ON + ["algorithm.advantage.estimator=gae", "model.recompute_granularity=full"], "model.recompute_granularity",
     "selective"),
    (ON + ["model.reference_path=/some/other/ckpt"], "model.reference_path", "frozen base"),
    (ON + ["model.transformer_impl=transformer_engine"], "model.transformer_impl", "local"),
    (["model.lora.rank=-1"], "model.lora.rank", "out of range [0"),
    (["model.lora.rank=4", "model.lora.target_modules=[linear_qkv, q_proj]"], "target_modules", "linear_fc2"),
], ids=["critic_path", "critic_full_recompute", "reference_path", "transformer_engine", "negative_rank", "unknown_target"])
def test_lora_bad_config_is_a_clear_error(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides, world_size=1)
    assert key in str(err.value) and words in str(err.value)


def test_gae_without_lora_is_still_accepted():
    """Guards the critic cases above: the error comes from LoRA, not from gae."""
    assert load_config(overrides=["algorithm.advantage.estimator=gae"], world_size=1).model.lora.rank == 0


def test_lora_with_gae_is_accepted():
    """The critic is its own adapters + value head over the policy's base (hpa.models.lora.CriticView)."""
    assert load_config(overrides=ON + ["algorithm.advantage.estimator=gae"], world_size=1).model.lora.enabled


@pytest.mark.parametrize("key,expected", [
    ("decoder.layers.0.self_attention.linear_qkv_lora.A", True),
    ("decoder.layers.3.mlp.linear_fc2_lora.B", True),
    ("decoder.layers.0.self_attention.linear_qkv.weight", False),
    ("decoder.layers.0.mlp.linear_fc1_lora.weight", False),
    ("decoder.layers.0.mlp.router_lora.A", False),
    ("A", False),
])
def test_adapter_key_naming(key, expected):
    assert lora.is_adapter_key(key) is expected


def test_lora_checkpoint_as_full_weights_is_a_clear_error(tmp_path):
    """A run checkpoint whose policy/ is adapter-only (lora.json) refuses to load as full weights, before
    megatron reads any shard (so a model is not even needed)."""
    step = tmp_path / "step_00000002"
    (step / "policy").mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    (step / "policy" / "metadata.json").write_text("{}")
    (step / "policy" / lora.MARKER).write_text(json.dumps({"adapters_only": True}))
    with pytest.raises(lora.LoRAError, match=r"is a LoRA checkpoint .*model.lora.rank > 0"):
        load_model_weights(torch.nn.Linear(2, 2), step, groups=None)


def test_check_checkpoint_kind_refuses_adapters_for_a_plain_model(tmp_path):
    (tmp_path / lora.MARKER).write_text("{}")
    with pytest.raises(lora.LoRAError, match="cannot be loaded as a full model"):
        lora.check_checkpoint_kind(tmp_path, torch.nn.Linear(2, 2))
    lora.check_checkpoint_kind(tmp_path.parent, torch.nn.Linear(2, 2))  # a full checkpoint for a plain model


def test_sft_refuses_lora():
    """hpa sft saves full weights; adapters trained there would be dropped when the output is loaded."""
    from hpa.trainer.sft import run_sft

    with pytest.raises(ConfigError, match="model.lora.rank.*pass model.lora.rank=0 to sft"):
        run_sft(load_config(overrides=ON), groups=None)


def test_train_rm_refuses_lora(capsys, tmp_path):
    """hpa train-rm trains every weight of the reward model; with model.lora on it says so before building anything."""
    from hpa.reward.train_rm import main, run_train_rm

    with pytest.raises(ConfigError, match="model.lora.rank.*pass model.lora.rank=0 to train-rm"):
        run_train_rm(load_config(overrides=ON), groups=None)
    for name in ("tok.model", "pairs.jsonl"):  # paths that exist: the check after them is the one tested
        (tmp_path / name).write_text("")
    assert main(ON + [f"data.tokenizer_path={tmp_path / 'tok.model'}",
                      f"data.preference_path={tmp_path / 'pairs.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.lora.rank" in err and "Traceback" not in err


def test_num_adapter_parameters_matches_the_tiny_model_by_hand():
    """configs/tiny_cpu.yaml (h 64, 4 heads of 16, 2 groups, ffn 128, SwiGLU, 2 layers), rank 8: qkv 8·(64+128),
    proj 8·(64+64), fc1 8·(64+256), fc2 8·(128+64) = 6,656 a layer (bench/lora_memory.py measures 13,312)."""
    cfg = load_config(overrides=["model.lora.rank=8"])
    assert lora.num_adapter_parameters(cfg.model, cfg.model.lora) == 2 * 6656
    only_qkv = load_config(overrides=["model.lora.rank=8", "model.lora.target_modules=[linear_qkv]"])
    assert lora.num_adapter_parameters(only_qkv.model, only_qkv.model.lora) == 2 * 8 * (64 + 128)
    assert lora.num_adapter_parameters(cfg.model, load_config().model.lora) == 0
