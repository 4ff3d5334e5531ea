import pytest

from hpa.config.reward import MonitorConfig
from hpa.reward.monitor import RewardHackingMonitor


def test_healthy_evaluations_have_no_alerts_and_the_first_is_the_baseline():
    monitor = RewardHackingMonitor.from_config(MonitorConfig())
    alerts, m = monitor.update(model_reward=0.8, gold_score=0.5, copy_rate=0.1, mean_response_length=10)
    assert alerts == [] and m["hacking/gap"] == pytest.approx(0.3) and m["hacking/gap_growth"] == 0.0
    assert m["hacking/length_ratio"] == 1.0 and m["hacking/alert_count"] == 0.0
    # reward and gold score rise together: the gap stays, nothing fires
    alerts, m = monitor.update(model_reward=1.3, gold_score=0.9, copy_rate=0.2, mean_response_length=12)
    assert alerts == [] and m["hacking/gap_growth"] == pytest.approx(0.1) and m["hacking/length_ratio"] == 1.2


def test_model_reward_up_gold_flat_alerts_on_gap_growth():
    monitor = RewardHackingMonitor(gap_threshold=0.5)
    monitor.update(model_reward=0.0, gold_score=0.4, copy_rate=0.0, mean_response_length=10)
    alerts, m = monitor.update(model_reward=0.5, gold_score=0.4, copy_rate=0.0, mean_response_length=10)
    assert alerts == [] and m["hacking/gap_growth"] == pytest.approx(0.5)  # at the threshold: not above
    alerts, m = monitor.update(model_reward=1.2, gold_score=0.3, copy_rate=0.0, mean_response_length=10)
    assert len(alerts) == 1 and "exploited" in alerts[0] and m["hacking/gap_growth"] == pytest.approx(1.3)
    assert m["hacking/alert_count"] == 1.0


def test_length_growth_and_copy_alerts():
    monitor = RewardHackingMonitor(length_ratio_threshold=1.5, copy_rate_threshold=0.5)
    monitor.update(model_reward=0.0, gold_score=0.0, copy_rate=0.1, mean_response_length=10)
    alerts, m = monitor.update(model_reward=0.0, gold_score=0.0, copy_rate=0.8, mean_response_length=20)
    assert m["hacking/length_ratio"] == 2.0 and m["hacking/copy_rate"] == 0.8
    assert len(alerts) == 2 and any("padding" in a for a in alerts) and any("copy" in a for a in alerts)


def test_state_round_trip_keeps_the_baseline():
    a = RewardHackingMonitor()
    a.update(model_reward=0.2, gold_score=0.1, copy_rate=0.0, mean_response_length=8)
    b = RewardHackingMonitor()
    b.load_state_dict(a.state_dict())
    args = dict(model_reward=1.0, gold_score=0.1, copy_rate=0.0, mean_response_length=16)
    assert a.update(**args) == b.update(**args)


@pytest.mark.parametrize("kwargs", [dict(gap_threshold=0.0), dict(length_ratio_threshold=1.0)])
def test_bad_thresholds(kwargs):
    with pytest.raises(ValueError):
        RewardHackingMonitor(**kwargs)
