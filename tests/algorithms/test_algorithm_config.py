import dataclasses

import pytest

from hpa.algorithms.advantages import ADVANTAGE_ESTIMATORS
from hpa.algorithms.dpo import DPO_LOSSES
from hpa.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS, SEMANTIC_DISTANCES
from hpa.algorithms.losses import AGG_MODES
from hpa.algorithms.ppo import POLICY_LOSSES
from hpa.algorithms.schedules import SCHEDULES
from hpa.config import algorithm as A
from hpa.config.errors import ConfigError


def test_defaults_are_the_recipe():
    cfg = A.AlgorithmConfig()
    assert (cfg.advantage.estimator, cfg.advantage.gamma, cfg.advantage.lam) == ("gae", 0.99, 0.95)
    ppo = cfg.ppo
    assert (ppo.clip_ratio, ppo.clip_ratio_c, ppo.value_clip, ppo.loss_agg_mode) == (0.2, 3.0, 0.2, "token-mean")
    assert (ppo.entropy_coef.name, ppo.entropy_coef.value) == ("constant", 0.01)
    assert (cfg.dpo.loss, cfg.dpo.beta, cfg.dpo.label_smoothing) == ("sigmoid", 0.1, 0.0)
    kl = cfg.kl
    assert (kl.controller, kl.target_kl, kl.init_kl_coef, kl.horizon) == ("adaptive", 0.015, 0.001, 10000)
    assert (kl.warmup_fraction, kl.estimator, kl.use_kl_in_reward, kl.use_kl_loss) == (0.2, "low_var_kl", False, True)
    hpa = cfg.hpa
    assert [getattr(hpa, k).value for k in ("w_ppo", "w_dpo", "w_kl")] == [0.4, 0.4, 0.2]
    assert (hpa.lambda_token.name, hpa.lambda_token.start, hpa.lambda_token.end) == ("linear", 1.0, 0.2)
    assert (hpa.lambda_semantic.name, hpa.lambda_semantic.start, hpa.lambda_semantic.end) == ("linear", 0.2, 1.0)
    assert hpa.semantic_distance == "mse"


def test_frozen_and_keyword_only():
    cfg = A.PPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clip_ratio = 0.3
    with pytest.raises(TypeError):
        A.PPOConfig(0.3)


@pytest.mark.parametrize(
    "cls,kwargs,key",
    [
        (A.PPOConfig, {"clip_ratio_c": 1.0}, "clip_ratio_c"),
        (A.PPOConfig, {"clip_ratio": 0.0}, "clip_ratio"),
        (A.PPOConfig, {"loss_agg_mode": "token_mean"}, "loss_agg_mode"),
        (A.PPOConfig, {"policy_loss": "ppo"}, "policy_loss"),
        (A.PPOConfig, {"entropy_coef": A.ScheduleConfig(value=-0.1)}, "entropy_coef"),
        (A.AdvantageConfig, {"gamma": 1.5}, "gamma"),
        (A.AdvantageConfig, {"estimator": "gea"}, "estimator"),
        (A.DPOConfig, {"beta": 0.0}, "beta"),
        (A.DPOConfig, {"label_smoothing": 0.5}, "label_smoothing"),
        (A.DPOConfig, {"loss": "ipo", "label_smoothing": 0.1}, "label_smoothing"),
        (A.KLConfig, {"estimator": "k4"}, "estimator"),
        (A.KLConfig, {"horizon": 0}, "horizon"),
        (A.KLConfig, {"target_kl": 0.0}, "target_kl"),
        (A.KLConfig, {"warmup_fraction": 1.2}, "warmup_fraction"),
        (A.KLConfig, {"controller": "pid"}, "controller"),
        (A.HPAConfig, {"semantic_distance": "kl"}, "semantic_distance"),
        (A.HPAConfig, {"w_kl": A.ScheduleConfig(name="linear", start=0.2, end=-0.1)}, "w_kl"),
        (A.ScheduleConfig, {"name": "exp"}, "name"),
        (A.ScheduleConfig, {"name": "piecewise", "boundaries": (0.5,), "values": (1.0,)}, "values"),
        (A.ScheduleConfig, {"name": "piecewise", "boundaries": (0.6, 0.4), "values": (1.0, 2.0, 3.0)}, "boundaries"),
    ],
)
def test_bad_values_name_the_key(cls, kwargs, key):
    with pytest.raises(ConfigError) as err:
        cls(**kwargs)
    assert err.value.key == key
    assert key in str(err.value)


def test_unknown_name_error_lists_valid_names():
    with pytest.raises(ConfigError, match="low_var_kl"):
        A.KLConfig(estimator="low_var")


def test_name_tuples_equal_registries():
    assert A.ADVANTAGE_ESTIMATOR_NAMES == ADVANTAGE_ESTIMATORS.names()
    assert A.POLICY_LOSS_NAMES == POLICY_LOSSES.names()
    assert A.LOSS_AGG_MODE_NAMES == AGG_MODES.names()
    assert A.KL_ESTIMATOR_NAMES == KL_ESTIMATORS.names()
    assert A.KL_CONTROLLER_NAMES == KL_CONTROLLERS.names()
    assert A.DPO_LOSS_NAMES == DPO_LOSSES.names()
    assert A.SCHEDULE_NAMES == SCHEDULES.names()
    assert A.SEMANTIC_DISTANCE_NAMES == SEMANTIC_DISTANCES.names()


def test_field_types_are_loader_friendly():
    import typing

    allowed = {bool, int, float, str}

    def ok(tp):
        if tp in allowed or dataclasses.is_dataclass(tp):
            return True
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Union:
            return len(args) == 2 and type(None) in args and ok(next(a for a in args if a is not type(None)))
        if origin is tuple:
            return len(args) == 2 and args[1] is Ellipsis and ok(args[0])
        return False

    for cls in (A.AlgorithmConfig, A.AdvantageConfig, A.PPOConfig, A.DPOConfig, A.KLConfig, A.HPAConfig,
                A.ScheduleConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert ok(hints[f.name]), (cls.__name__, f.name, hints[f.name])


def test_config_does_not_import_algorithms():
    import ast
    import pathlib

    source = pathlib.Path(A.__file__).read_text()
    imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.startswith("hpa.algorithms") for m in imported)


def test_rollout_correction_level_tuples_equal_registries():
    from hpa.algorithms.rollout_correction import IS_LEVELS, RS_LEVELS

    assert A.ROLLOUT_IS_LEVEL_NAMES == IS_LEVELS.names()
    assert A.ROLLOUT_RS_LEVEL_NAMES == RS_LEVELS.names()
