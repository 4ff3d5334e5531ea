import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpa.algorithms.schedules import SCHEDULES, make_schedule, progress
from hpa.config.algorithm import HPAConfig, PPOConfig, ScheduleConfig

finite = st.floats(-10, 10)


@settings(max_examples=100, deadline=None)
@given(finite, finite, st.sampled_from(["linear", "cosine"]))
def test_schedules_hit_their_endpoints(start, end, name):
    f = make_schedule(name, start=start, end=end)
    assert f(0.0) == start
    assert f(1.0) == end
    assert f(-3.0) == start and f(7.0) == end  # progress is clamped
    lo, hi = min(start, end), max(start, end)
    assert lo - 1e-9 <= f(0.37) <= hi + 1e-9


def test_hand_values():
    assert make_schedule("constant", value=0.4)(0.7) == 0.4
    assert make_schedule("linear", start=1.0, end=0.2)(0.5) == pytest.approx(0.6)
    assert make_schedule("linear", start=0.2, end=1.0)(0.25) == pytest.approx(0.4)
    assert make_schedule("cosine", start=1.0, end=0.0)(0.5) == pytest.approx(0.5)
    assert make_schedule("cosine", start=1.0, end=0.0)(0.25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    warm = make_schedule("warmup_constant", value=0.01, start=0.0, warmup_fraction=0.2)
    assert (warm(0.0), warm(0.1999), warm(0.2), warm(1.0)) == (0.0, 0.0, 0.01, 0.01)


def test_piecewise():
    f = make_schedule("piecewise", boundaries=(0.25, 0.5), values=(1.0, 2.0, 3.0))
    assert [f(p) for p in (0.0, 0.2499, 0.25, 0.49, 0.5, 1.0)] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="len"):
        make_schedule("piecewise", boundaries=(0.5,), values=(1.0,))
    with pytest.raises(ValueError, match="increasing"):
        make_schedule("piecewise", boundaries=(0.5, 0.5), values=(1.0, 2.0, 3.0))


def test_make_schedule_from_config_dict_and_errors():
    cfg = HPAConfig()
    lam_tok = make_schedule(**dataclasses.asdict(cfg.lambda_token))
    lam_sem = make_schedule(**dataclasses.asdict(cfg.lambda_semantic))
    for p in (0.0, 0.3, 1.0):  # the recipe: 1 - 0.8p and 0.2 + 0.8p
        assert lam_tok(p) == pytest.approx(1.0 - 0.8 * p)
        assert lam_sem(p) == pytest.approx(0.2 + 0.8 * p)
    assert make_schedule(**dataclasses.asdict(PPOConfig().entropy_coef))(0.5) == 0.01
    pw = ScheduleConfig(name="piecewise", boundaries=(0.5,), values=(1.0, 0.0))
    assert make_schedule(**dataclasses.asdict(pw))(0.75) == 0.0
    with pytest.raises(TypeError, match="stop"):
        make_schedule("linear", stop=1.0)
    with pytest.raises(ValueError, match="linear"):
        make_schedule("lineal")


def test_progress():
    assert progress(50, 200) == 0.25
    assert progress(300, 200) == 1.0
    with pytest.raises(ValueError):
        progress(1, 0)


def test_registry_names():
    assert SCHEDULES.names() == ("constant", "cosine", "linear", "piecewise", "warmup_constant")
