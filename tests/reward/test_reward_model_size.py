"""Reward models of their own size: a reward model records its architecture and tokenizer and is built
from them, so a small one scores a larger policy; another tokenizer is a clear error; old checkpoints
(no recorded architecture) load with the policy's."""

import dataclasses
import json
import shutil

import pytest
import torch

from multirank import run_ranks

SMALL = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1, "ffn_hidden_size": 48}


def policy_config():
    from hpa.config import load_config

    return load_config(None, ["model.num_layers=2", "model.policy_path=/somewhere/policy"]).model


def test_recorded_architecture_builds_the_reward_model_with_the_runs_dtype(tmp_path):
    from hpa.config.schema import LoRAConfig
    from hpa.reward.model import reward_model_config, write_reward_model_info

    policy = dataclasses.replace(policy_config(), params_dtype="bfloat16", lora=LoRAConfig(rank=4))
    small = dataclasses.replace(policy_config(), **SMALL, params_dtype="float32")
    write_reward_model_info(tmp_path, num_heads=2, model=small)
    built = reward_model_config(policy, tmp_path)
    assert {k: getattr(built, k) for k in SMALL} == SMALL
    assert built.params_dtype == "bfloat16"  # the run's choice, not the recorded one
    assert built.lora.rank == 0 and built.policy_path is None  # a frozen reward model: no adapters, no policy weights


def test_old_record_without_architecture_has_the_policys(tmp_path):
    from hpa.reward.model import REWARD_MODEL_INFO, reward_model_config

    policy = policy_config()
    (tmp_path / REWARD_MODEL_INFO).write_text(json.dumps({"num_heads": 2, "hidden_size": policy.hidden_size}))
    built = reward_model_config(policy, tmp_path)
    assert dataclasses.replace(built, policy_path=policy.policy_path) == policy
    assert reward_model_config(policy, tmp_path / "no_info_here").hidden_size == policy.hidden_size
    (tmp_path / REWARD_MODEL_INFO).write_text(json.dumps({"num_heads": 2, "hidden_size": 32}))
    with pytest.raises(ValueError, match="records no architecture"):
        reward_model_config(policy, tmp_path)


def test_bad_recorded_architecture_is_a_clear_error(tmp_path):
    from hpa.reward.model import REWARD_MODEL_INFO, reward_model_config, write_reward_model_info

    write_reward_model_info(tmp_path, num_heads=1, model=policy_config())
    info = json.loads((tmp_path / REWARD_MODEL_INFO).read_text())
    info["architecture"]["num_attention_heads"] = 5  # 64 is not divisible by 5
    (tmp_path / REWARD_MODEL_INFO).write_text(json.dumps(info))
    with pytest.raises(ValueError, match="recorded architecture is invalid.*hidden_size"):
        reward_model_config(policy_config(), tmp_path)
    info["architecture"]["n_layers"] = 3
    (tmp_path / REWARD_MODEL_INFO).write_text(json.dumps(info))
    with pytest.raises(ValueError, match="unknown architecture keys \\['n_layers'\\]"):
        reward_model_config(policy_config(), tmp_path)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Two SentencePiece tokenizers of the same size from different corpora, and a copy of the first."""
    from data_tools.train_tokenizer import train_sentencepiece

    root = tmp_path_factory.mktemp("toks")
    words = [" ".join(f"w{i % 37} v{(7 * i) % 53}" for i in range(j, j + 9)) for j in range(300)]
    train_sentencepiece(words, str(root / "a"), vocab_size=96)
    train_sentencepiece([w.replace("w", "x").replace("v", "q") for w in words], str(root / "b"), vocab_size=96)
    shutil.copy(root / "a.model", root / "a_copy.model")
    return root


def test_tokenizer_fingerprint_follows_the_table_not_the_file(tokenizers):
    from hpa.data import build_tokenizer

    a, b, copy = (build_tokenizer("sentencepiece", str(tokenizers / f"{n}.model")) for n in ("a", "b", "a_copy"))
    assert a.vocab_size == b.vocab_size  # same size: only the table tells them apart
    assert a.fingerprint() == copy.fingerprint()
    assert a.fingerprint() != b.fingerprint()


def test_reward_model_of_another_tokenizer_names_both_files(tokenizers, tmp_path):
    from hpa.config import ConfigError
    from hpa.data import build_tokenizer
    from hpa.reward.model import check_reward_tokenizer, read_reward_model_info, tokenizer_record, \
        write_reward_model_info

    a, b, copy = (build_tokenizer("sentencepiece", str(tokenizers / f"{n}.model")) for n in ("a", "b", "a_copy"))
    write_reward_model_info(tmp_path, num_heads=1, model=policy_config(), tokenizer=tokenizer_record(a))
    info = read_reward_model_info(tmp_path)
    check_reward_tokenizer(tmp_path, info, tokenizer_record(copy))  # the same table at another path: fine
    with pytest.raises(ConfigError) as err:
        check_reward_tokenizer(tmp_path, info, tokenizer_record(b))
    message = str(err.value)
    assert str(tokenizers / "a.model") in message and str(tokenizers / "b.model") in message
    assert "reward.model_paths" in message and "hpa_reward_model.json" in message


def _score_worker(groups, root, tok_a, tok_b):
    """Scores of a small reward model (hidden 32, one layer) loaded next to a larger policy's config, against
    the same weights scored by a model built directly from the small config; the same checkpoint saved in the
    old format (no architecture) under the policy's size; the tokenizer check through ``from_config``."""
    from hpa.config.errors import ConfigError
    from hpa.config.reward import RewardConfig
    from hpa.data import build_tokenizer
    from hpa.distributed import set_seed
    from hpa.models import build_reward
    from hpa.models.weights import save_model_weights
    from hpa.engine.batching import Batching
    from hpa.reward.model import (REWARD_MODEL_INFO, ModelReward, score_sequences, tokenizer_record,
                                  write_reward_model_info)

    mb2 = Batching(micro_batch_size=2, pad_id=0)

    policy = policy_config()
    small = dataclasses.replace(policy, **SMALL, policy_path=None)
    a = tokenizer_record(build_tokenizer("sentencepiece", tok_a))
    set_seed(3)
    direct = build_reward(small, _parallel(), groups, num_heads=2).eval()
    save_model_weights(direct, f"{root}/small", groups)
    write_reward_model_info(f"{root}/small", num_heads=2, model=small, tokenizer=a)
    ids = torch.randint(0, 90, (5, 7))
    mask = torch.ones(5, 7, dtype=torch.long)
    mask[1, 4:] = 0
    expected, _ = score_sequences(direct, ids, mask, groups, num_heads=2, batching=mb2)

    mr = ModelReward.from_config(RewardConfig(model_paths=(f"{root}/small",), num_heads=2), policy, _parallel(),
                                 groups, batching=mb2, tokenizer=a)
    got, emb = score_sequences(mr.models[0], ids, mask, groups, num_heads=2, batching=mb2, pool_mask=mask,
                               hidden_size=mr.hidden_size)
    out = {"expected": expected, "got": got, "hidden": mr.hidden_size, "emb_shape": tuple(emb.shape)}

    set_seed(4)  # an old reward model: the policy's architecture, a record without it
    old = build_reward(policy, _parallel(), groups, num_heads=2).eval()
    save_model_weights(old, f"{root}/old", groups)
    with open(f"{root}/old/{REWARD_MODEL_INFO}", "w") as f:
        json.dump({"num_heads": 2, "hidden_size": policy.hidden_size}, f)
    old_expected, _ = score_sequences(old, ids, mask, groups, num_heads=2, batching=mb2)
    mr_old = ModelReward.from_config(RewardConfig(model_paths=(f"{root}/old",), num_heads=2), policy, _parallel(),
                                     groups, batching=mb2, tokenizer=a)
    out["old_expected"] = old_expected
    out["old_got"] = score_sequences(mr_old.models[0], ids, mask, groups, num_heads=2, batching=mb2)[0]
    try:
        ModelReward.from_config(RewardConfig(model_paths=(f"{root}/small",), num_heads=2), policy, _parallel(),
                                groups, tokenizer=tokenizer_record(build_tokenizer("sentencepiece", tok_b)))
        out["mismatch"] = None
    except ConfigError as exc:
        out["mismatch"] = str(exc)
    return out


def _parallel():
    from hpa.config.schema import ParallelConfig

    return ParallelConfig(backend="gloo")


@pytest.mark.multirank
def test_tp1_pp1_dp1_small_reward_model_loads_next_to_a_larger_policy(tokenizers, tmp_path):
    out = run_ranks(_score_worker, args=(str(tmp_path), str(tokenizers / "a.model"), str(tokenizers / "b.model")))[0]
    assert out["hidden"] == 32 and out["emb_shape"] == (5, 32)
    torch.testing.assert_close(out["got"], out["expected"], rtol=0, atol=0)
    torch.testing.assert_close(out["old_got"], out["old_expected"], rtol=0, atol=0)
    assert out["mismatch"] is not None and "b.model" in out["mismatch"] and "a.model" in out["mismatch"]


def test_train_rm_names_the_dimensions_of_a_smaller_starting_checkpoint(tmp_path):
    """``reward.training.backbone_path`` at the SFT model of a smaller backbone (its run's config.yaml records
    it): the reward model must be given those ``model.*`` dimensions, and the error says which."""
    import yaml

    from hpa.config import ConfigError
    from hpa.reward.train_rm import check_recorded_architecture

    (tmp_path / "sft").mkdir()
    (tmp_path / "elsewhere" / "ckpt").mkdir(parents=True)
    small = {**dataclasses.asdict(policy_config()), **SMALL}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": small}))
    with pytest.raises(ConfigError, match="reward.training.backbone_path") as err:
        check_recorded_architecture(policy_config(), str(tmp_path / "sft"), "reward.training.backbone_path")
    assert "model.hidden_size=32" in str(err.value) and "model.num_layers=1" in str(err.value)
    same = dataclasses.replace(policy_config(), **SMALL)
    check_recorded_architecture(same, str(tmp_path / "sft"), "reward.training.backbone_path")  # matches: fine
    check_recorded_architecture(policy_config(), str(tmp_path / "elsewhere" / "ckpt"), "reward.training.init_path")
