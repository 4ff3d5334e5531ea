import dataclasses
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

import pytest

from hpa.config import reward as rc
from hpa.config.errors import ConfigError
from hpa.reward import shaping, rules
from hpa.reward.monitor import RewardHackingMonitor


def test_defaults_are_the_recipe():
    cfg = rc.RewardConfig()
    assert cfg.shaping.alpha == 0.5 and cfg.shaping.beta == 0.2
    assert cfg.num_heads == 1 and not cfg.allow_custom_code and cfg.custom_function is None


def test_name_tuples_equal_registries():
    assert rc.RULE_REWARD_NAMES == rules.RULE_REWARDS.names()
    assert rc.TARGET_LENGTH_MODES == shaping.TARGET_LENGTH_MODES.names()
    assert rc.COPY_PENALTY_MODES == shaping.COPY_PENALTY_MODES.names()
    assert rc.DIVERSITY_SOURCES == shaping.EMBEDDING_SOURCES


def test_config_does_not_import_reward():
    code = "import sys, hpa.config.reward; assert 'hpa.reward' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_frozen_and_keyword_only():
    cfg = rc.ShapingConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.alpha = 1.0
    with pytest.raises(TypeError):
        rc.MonitorConfig(0.5)


def test_components_accept_every_config_field():
    shaper = shaping.UncertaintyAwareReward.from_config(rc.ShapingConfig(normalize=True, clip=5.0))
    assert shaper.alpha == 0.5 and shaper.clip == 5.0 and shaper.normalizer is not None
    assert RewardHackingMonitor.from_config(rc.MonitorConfig(gap_threshold=0.7)).gap_threshold == 0.7


@pytest.mark.parametrize("cls, kwargs, key", [
    (rc.ShapingConfig, dict(alpha=-0.1), "alpha"),
    (rc.ShapingConfig, dict(beta=-1.0), "beta"),
    (rc.ShapingConfig, dict(diversity_bank_size=0), "diversity_bank_size"),
    (rc.ShapingConfig, dict(diversity_source="critic"), "diversity_source"),
    (rc.ShapingConfig, dict(overlong_buffer_len=-1), "overlong_buffer_len"),
    (rc.ShapingConfig, dict(overlong_buffer_len=64), "max_response_length"),
    (rc.ShapingConfig, dict(overlong_buffer_len=64, max_response_length=32), "overlong_buffer_len"),
    (rc.ShapingConfig, dict(target_length=0), "target_length"),
    (rc.ShapingConfig, dict(target_length_mode="below"), "target_length_mode"),
    (rc.ShapingConfig, dict(copy_ngram=0), "copy_ngram"),
    (rc.ShapingConfig, dict(copy_threshold=1.5), "copy_threshold"),
    (rc.ShapingConfig, dict(copy_mode="cubic"), "copy_mode"),
    (rc.ShapingConfig, dict(clip=0.0), "clip"),
    (rc.MonitorConfig, dict(gap_threshold=0.0), "gap_threshold"),
    (rc.RewardModelTrainingConfig, dict(init_path="rm", backbone_path="sft"), "backbone_path"),
    (rc.MonitorConfig, dict(length_ratio_threshold=1.0), "length_ratio_threshold"),
    (rc.RewardConfig, dict(num_heads=0), "num_heads"),
    (rc.RewardConfig, dict(rules=("gsm9k",)), "rules[0]"),
    (rc.RewardConfig, dict(rules=("gsm8k", "gsm8k")), "rules"),
    (rc.RewardConfig, dict(model_paths=("",)), "model_paths[0]"),
    (rc.RewardConfig, dict(custom_function="pkg.mod:fn"), "custom_function"),
    (rc.RewardConfig, dict(custom_function="pkg.mod.fn", allow_custom_code=True), "custom_function"),
])
def test_bad_values_name_the_key(cls, kwargs, key):
    with pytest.raises(ConfigError) as err:
        cls(**kwargs)
    assert err.value.key == key
    assert f"'{key}'" in str(err.value)


def test_unknown_choice_lists_valid_names():
    with pytest.raises(ConfigError, match="gsm8k_flexible"):
        rc.RewardConfig(rules=("gsm8k_flex",))


def test_valid_custom_function_config():
    cfg = rc.RewardConfig(custom_function="pkg.mod:fn", allow_custom_code=True)
    assert cfg.custom_function == "pkg.mod:fn"
