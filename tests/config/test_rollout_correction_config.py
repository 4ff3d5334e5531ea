"""``algorithm.rollout_correction``: verl's rollout-correction keys (v0.7.0 names), their checks, and the key
they replace (``algorithm.ppo.rollout_is_threshold``)."""

import dataclasses

import pytest

from hpa.config import ConfigError, load_config
from hpa.config.schema import old_log_probs_from_update

KEY = "algorithm.rollout_correction"
ON_POLICY = ["algorithm.kl.use_kl_in_reward=false", "reward.shaping.beta=0"]  # as tests/trainer/test_old_log_probs.py


def test_off_by_default_and_on_policy_steps_stay_on_policy():
    cfg = load_config(None, [])
    c = cfg.algorithm.rollout_correction
    assert (c.rollout_is, c.rollout_rs, c.rollout_token_veto_threshold) == (None, None, None)
    assert c.rollout_is_threshold == 2.0 and not c.enabled and not c.rejects
    assert old_log_probs_from_update(load_config(None, ON_POLICY))
    # a correction reads π_old before the update: the old-policy forward runs again
    assert not old_log_probs_from_update(load_config(None, [*ON_POLICY, f"{KEY}.rollout_is=token"]))
    assert not old_log_probs_from_update(load_config(None, [*ON_POLICY, f"{KEY}.rollout_token_veto_threshold=1e-4"]))


def test_every_key_is_reachable():
    c = load_config(None, [f"{KEY}.rollout_is=sequence", f"{KEY}.rollout_is_threshold=5.0",
                           f"{KEY}.rollout_rs=geometric", f"{KEY}.rollout_rs_threshold=1.001",
                           f"{KEY}.rollout_rs_threshold_lower=0.999",
                           f"{KEY}.rollout_token_veto_threshold=1e-4"]).algorithm.rollout_correction
    assert dataclasses.asdict(c) == {"rollout_is": "sequence", "rollout_is_threshold": 5.0, "rollout_rs": "geometric",
                                     "rollout_rs_threshold": 1.001, "rollout_rs_threshold_lower": 0.999,
                                     "rollout_token_veto_threshold": 1e-4}
    assert c.enabled and c.rejects


@pytest.mark.parametrize("overrides,key,message", [
    (["rollout_is=tokens"], "rollout_is", "valid: sequence, token"),
    (["rollout_rs=geo"], "rollout_rs", "valid: geometric, sequence, token"),
    (["rollout_is=token", "rollout_is_threshold=0"], "rollout_is_threshold", "out of range"),
    (["rollout_is_threshold=-2"], "rollout_is_threshold", "out of range"),
    (["rollout_is_threshold=.inf"], "rollout_is_threshold", "finite"),
    (["rollout_is_threshold=.nan"], "rollout_is_threshold", "finite"),
    (["rollout_rs=token"], "rollout_rs_threshold", "must be set"),
    (["rollout_rs=token", "rollout_rs_threshold=-1"], "rollout_rs_threshold", "out of range"),
    (["rollout_rs=token", "rollout_rs_threshold=.inf"], "rollout_rs_threshold", "finite"),
    (["rollout_rs=token", "rollout_rs_threshold=2", "rollout_rs_threshold_lower=0"], "rollout_rs_threshold_lower",
     "out of range"),
    (["rollout_rs=token", "rollout_rs_threshold=2", "rollout_rs_threshold_lower=3"], "rollout_rs_threshold_lower",
     "exceeds rollout_rs_threshold"),
    (["rollout_token_veto_threshold=0"], "rollout_token_veto_threshold", "out of range"),
    (["rollout_token_veto_threshold=.inf"], "rollout_token_veto_threshold", "finite"),
])
def test_bad_values_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [f"{KEY}.{o}" for o in overrides])
    assert err.value.key == f"{KEY}.{key}", str(err.value)


def test_the_old_truncated_is_key_names_its_replacement():
    with pytest.raises(ConfigError, match="algorithm.rollout_correction.rollout_is=token") as err:
        load_config(None, ["algorithm.ppo.rollout_is_threshold=2.0"])
    assert err.value.key == "algorithm.ppo.rollout_is_threshold"
    assert "rollout_correction.rollout_is_threshold" in str(err.value)


def test_async_rollouts_need_a_weight_or_a_rejection():
    with pytest.raises(ConfigError, match="algorithm.rollout_correction.rollout_is") as err:
        load_config(None, ["rollout.max_staleness=1", f"{KEY}.rollout_token_veto_threshold=1e-4"])
    assert err.value.key == "rollout.max_staleness"
    for extra in ([f"{KEY}.rollout_is=sequence"], [f"{KEY}.rollout_rs=geometric", f"{KEY}.rollout_rs_threshold=1.01"]):
        assert load_config(None, ["rollout.max_staleness=1", *extra]).rollout.max_staleness == 1


def test_the_config_s_fields_are_the_algorithm_s():
    """The step builds ``RolloutCorrection(**asdict(config))``: the same names, in the same order, the same
    defaults (the config layer cannot import the algorithms, so the list is written twice)."""
    import dataclasses

    from hpa.algorithms.rollout_correction import RolloutCorrection
    from hpa.config.algorithm import RolloutCorrectionConfig

    def spec(cls):
        return [(f.name, f.default) for f in dataclasses.fields(cls)]

    assert spec(RolloutCorrectionConfig) == spec(RolloutCorrection)
