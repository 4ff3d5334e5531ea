"""The guard's decisions on hand-made sequences of grad norms, KLs and rewards."""

import math

import pytest

from hpa.config.schema import GuardConfig
from hpa.trainer.guard import CLIP, SKIP, STEP, Guard


def test_non_finite_grad_norm_is_skipped_and_counted():
    guard = Guard(GuardConfig())
    for value in (float("nan"), float("inf")):
        assert guard.grad_norm_action(value) == SKIP
        guard.record(False)
    assert guard.metrics()["guard/skipped_steps"] == 2
    assert len(guard.grad_norms) == 0  # skipped norms do not enter the running median


@pytest.mark.parametrize("action,expected", [("skip", SKIP), ("clip", CLIP), ("none", STEP)])
def test_spike_relative_to_running_median(action, expected):
    guard = Guard(GuardConfig(grad_spike_factor=5.0, grad_spike_min_history=4, grad_spike_action=action))
    for norm in (1.0, 1.2, 0.8, 1.1):
        assert guard.grad_norm_action(norm) == STEP
    assert guard.grad_norm_action(4.9) == STEP  # below 5 x median (1.05)
    assert guard.grad_norm_action(100.0) == expected
    # the running median of 0.8, 1.0, 1.1, 1.2, 4.9 (and 100 when the spike was let through)
    assert guard.spike_clip_value() == pytest.approx(1.15 if action == "none" else 1.1)


def test_no_spike_detection_before_enough_history():
    guard = Guard(GuardConfig(grad_spike_min_history=10))
    assert guard.grad_norm_action(1.0) == STEP
    assert guard.grad_norm_action(1e6) == STEP


def test_rollback_on_kl_and_on_consecutive_skips():
    guard = Guard(GuardConfig(kl_rollback_threshold=0.05, max_consecutive_skips=3, max_rollbacks=2))
    assert guard.rollback_reason(0.04) is None
    assert "token KL" in guard.rollback_reason(0.06)
    assert guard.rollback_reason(math.nan) is not None
    for _ in range(3):
        guard.record(False)
    assert "consecutive" in guard.rollback_reason(0.0)
    guard.rolled_back()
    assert guard.lr_scale == 0.5 and guard.consecutive_skips == 0
    guard.rolled_back()
    assert guard.lr_scale == 0.25
    assert guard.rollback_reason(1.0) is None  # max_rollbacks reached: no more rollbacks


def test_early_stop_metric_and_patience():
    guard = Guard(GuardConfig(early_stop_patience=2, early_stop_window=2, early_stop_min_delta=0.01))
    assert not guard.should_stop(1, reward_mean=1.0, reward_std=0.0, kl=0.0)   # metric 1.0, best
    assert guard.early_stop_metric() == pytest.approx(1.0)
    assert not guard.should_stop(2, reward_mean=1.2, reward_std=0.1, kl=0.2)
    assert guard.early_stop_metric() == pytest.approx(1.1 - 0.5 * 0.1 - 0.3 * 0.05)  # window of two
    assert not guard.should_stop(3, reward_mean=1.2, reward_std=0.1, kl=0.2)   # 1.07: still a gain
    assert guard.best_step == 3
    assert not guard.should_stop(4, reward_mean=1.2, reward_std=0.1, kl=0.2)   # 1.07 again: no gain
    assert guard.should_stop(5, reward_mean=1.2, reward_std=0.1, kl=0.2)       # second evaluation without gain
    assert guard.best_step == 3


def test_early_stop_off_by_default():
    guard = Guard(GuardConfig())
    assert not any(guard.should_stop(i, 0.0, 0.0, 0.0) for i in range(100))


def test_state_round_trip():
    guard = Guard(GuardConfig(early_stop_patience=5))
    for norm in (1.0, 2.0, 3.0):
        guard.grad_norm_action(norm)
    guard.record(False)
    guard.rolled_back()
    guard.should_stop(1, 0.5, 0.1, 0.01)
    other = Guard(GuardConfig(early_stop_patience=5))
    other.load_state_dict(guard.state_dict())
    assert other.state_dict() == guard.state_dict()
