"""A reward model that cannot be used as given is one ``ConfigError`` naming its key and what was found, before any
model is built: a reward model of its own size without its record, a policy checkpoint, an invalid recorded
architecture, an older record whose run used another tokenizer; and ``train-rm`` over a backbone trained with
another tokenizer (one in-process gloo rank, checkpoints of the tiny config)."""

import dataclasses
import json
import logging
import shutil

import pytest
import torch
import yaml

SMALL = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1, "ffn_hidden_size": 48}


@pytest.fixture(scope="module")
def saved(groups, tmp_path_factory):
    """Two tokenizers of one size; a policy checkpoint; a small reward model without its record; a reward model
    of the policy's size with an old record (no architecture, no tokenizer) inside a run trained with tokenizer a."""
    from data_tools.train_tokenizer import train_sentencepiece
    from hpa.config import load_config
    from hpa.models import build_policy, build_reward
    from hpa.models.weights import save_model_weights

    root = tmp_path_factory.mktemp("rm_errors")
    words = [" ".join(f"w{i % 37} v{(7 * i) % 53}" for i in range(j, j + 9)) for j in range(300)]
    train_sentencepiece(words, str(root / "a"), vocab_size=96)
    train_sentencepiece([w.replace("w", "x").replace("v", "q") for w in words], str(root / "b"), vocab_size=96)
    cfg = load_config(None, ["model.vocab_size=96"]).model
    torch.manual_seed(0)
    save_model_weights(build_policy(cfg, _parallel(), groups), root / "policy", groups)
    save_model_weights(build_reward(dataclasses.replace(cfg, **SMALL), _parallel(), groups, num_heads=2),
                       root / "small", groups)
    save_model_weights(build_reward(cfg, _parallel(), groups, num_heads=2), root / "run" / "reward_model", groups)
    (root / "run" / "reward_model" / "hpa_reward_model.json").write_text(json.dumps({"num_heads": 2,
                                                                                   "hidden_size": cfg.hidden_size}))
    (root / "run" / "config.yaml").write_text(yaml.safe_dump(
        {"data": {"tokenizer_kind": "sentencepiece", "tokenizer_path": str(root / "a.model")}}))
    return root, cfg


def _parallel():
    from hpa.config.schema import ParallelConfig

    return ParallelConfig(backend="gloo")


def _tokenizer(path):
    from hpa.data import build_tokenizer
    from hpa.reward.model import tokenizer_record

    return tokenizer_record(build_tokenizer("sentencepiece", str(path)))


def _check(groups, model, *paths, tokenizer=None):
    from hpa.config.reward import RewardConfig
    from hpa.reward.model import check_reward_models

    check_reward_models(RewardConfig(model_paths=tuple(str(p) for p in paths), num_heads=2), model, groups,
                        tokenizer=tokenizer)


def test_a_reward_model_of_its_own_size_without_its_record(saved, groups):
    root, cfg = saved
    with pytest.raises(ValueError) as err:
        _check(groups, cfg, root / "run" / "reward_model", root / "small")
    message = str(err.value)
    assert "reward.model_paths[1]" in message and "linear_qkv.weight is [1, 64, 32], [2, 128, 64] expected" in message
    assert "no hpa_reward_model.json" in message and len(message.splitlines()) == 1
    # with the record it is built at its own size and passes
    from hpa.reward.model import write_reward_model_info

    shutil.copytree(root / "small", root / "small_recorded")
    write_reward_model_info(root / "small_recorded", num_heads=2, model=dataclasses.replace(cfg, **SMALL))
    _check(groups, cfg, root / "small_recorded")


def test_a_policy_checkpoint_is_not_a_reward_model(saved, groups):
    root, cfg = saved
    with pytest.raises(ValueError, match=r"reward\.model_paths\[0\].*is not a reward model: it has an output layer "
                                         r"\[96, 64\] without a bias"):
        _check(groups, cfg, root / "policy")


def test_an_invalid_recorded_architecture_names_the_key_and_file(saved, groups, tmp_path):
    from hpa.config import ConfigError
    from hpa.reward.model import write_reward_model_info

    root, cfg = saved
    shutil.copytree(root / "small", tmp_path / "rm")
    write_reward_model_info(tmp_path / "rm", num_heads=2, model=dataclasses.replace(cfg, **SMALL))
    info = json.loads((tmp_path / "rm" / "hpa_reward_model.json").read_text())
    for bad in ({**info["architecture"], "num_attention_heads": 5}, {**info["architecture"], "hidden_size": "wide"},
                ["num_layers", 1]):
        (tmp_path / "rm" / "hpa_reward_model.json").write_text(json.dumps({**info, "architecture": bad}))
        with pytest.raises(ConfigError) as err:
            _check(groups, cfg, tmp_path / "rm")
        assert err.value.key == "reward.model_paths[0]" and "hpa_reward_model.json" in str(err.value), err.value


def test_an_old_record_is_checked_against_its_runs_tokenizer(saved, groups, tmp_path, caplog):
    from hpa.config import ConfigError

    root, cfg = saved
    old = root / "run" / "reward_model"
    _check(groups, cfg, old, tokenizer=_tokenizer(root / "a.model"))
    with pytest.raises(ConfigError, match=r"reward\.model_paths\[0\].*a\.model.*b\.model") as err:
        _check(groups, cfg, old, tokenizer=_tokenizer(root / "b.model"))
    assert str(root / "run" / "config.yaml") in str(err.value)
    shutil.copytree(old, tmp_path / "alone" / "rm")  # no run config above it: nothing to check, said
    with caplog.at_level(logging.WARNING, logger="hpa"):
        _check(groups, cfg, tmp_path / "alone" / "rm", tokenizer=_tokenizer(root / "b.model"))
    assert "records no tokenizer" in caplog.text


def test_train_rm_refuses_a_backbone_of_another_tokenizer(saved):
    from hpa.config import ConfigError, load_config
    from hpa.reward.train_rm import _check_start_tokenizer

    root, _ = saved
    (root / "run" / "sft").mkdir(exist_ok=True)
    rt = load_config(None, [f"reward.training.backbone_path={root / 'run' / 'sft'}"]).reward.training
    _check_start_tokenizer(rt, _tokenizer(root / "a.model"))
    with pytest.raises(ConfigError, match=r"reward\.training\.backbone_path.*a\.model.*b\.model"):
        _check_start_tokenizer(rt, _tokenizer(root / "b.model"))
