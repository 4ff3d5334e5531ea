
import pytest

from hpa.config.reward import MonitorConfig
from hpa.reward.monitor import RewardHackingMonitor


def feed(monitor, raw, length, copy=None, heldout=None):
    results = []
    for i in range(len(raw)):
        results.append(monitor.update(raw_reward_mean=raw[i], mean_response_length=length[i],
                                      copy_rate=0.0 if copy is None else copy[i],
                                      heldout_score=None if heldout is None else heldout[i]))
    return results


def test_healthy_run_has_no_alerts():
    monitor = RewardHackingMonitor.from_config(MonitorConfig(window=4))
    results = feed(monitor, [1, 2, 3, 4, 5, 6], [10] * 6, [0.1] * 6, [1, 2, 3, 4, 5, 6])
    assert all(alerts == [] for alerts, _ in results)
    _, metrics = results[-1]
    assert metrics["hacking/alert_count"] == 0.0 and metrics["hacking/length_ratio"] == 1.0
    assert metrics["hacking/raw_reward_trend"] == 2.0 and metrics["hacking/heldout_trend"] == 2.0


def test_reward_up_heldout_down_alerts_once_window_is_full():
    monitor = RewardHackingMonitor(window=4)
    results = feed(monitor, [1, 2, 3, 4], [10] * 4, heldout=[1.0, 0.9, 0.8, 0.7])
    assert [len(a) for a, _ in results] == [0, 0, 0, 1]
    alerts, metrics = results[-1]
    assert "held-out" in alerts[0] and metrics["hacking/heldout_trend"] < 0


def test_divergence_needs_heldout_on_every_step_of_the_window():
    monitor = RewardHackingMonitor(window=4)
    results = feed(monitor, [1, 2, 3, 4], [10] * 4, heldout=[1.0, None, 0.8, 0.7])
    assert results[-1][0] == [] and "hacking/heldout_trend" not in results[-1][1]


def test_length_growth_alert():
    monitor = RewardHackingMonitor(window=2, length_ratio_threshold=1.5)
    results = feed(monitor, [0] * 4, [10, 10, 20, 20])  # baseline 10; last window mean 20
    assert results[2][1]["hacking/length_ratio"] == 1.5 and results[2][0] == []
    assert results[3][1]["hacking/length_ratio"] == 2.0
    assert any("length" in a for a in results[3][0])


def test_copy_rate_alert():
    monitor = RewardHackingMonitor(window=3, copy_rate_threshold=0.5)
    results = feed(monitor, [0, 0], [10, 10], copy=[0.4, 0.8])
    assert results[0][0] == []
    assert any("copy" in a for a in results[1][0])
    assert results[1][1]["hacking/copy_rate"] == pytest.approx(0.6)


def test_monitor_state_round_trip():
    monitor = RewardHackingMonitor(window=3)
    feed(monitor, [1, 2, 3, 4], [5, 6, 7, 8], heldout=[1, 1, 1, 1])
    restored = RewardHackingMonitor(window=3)
    restored.load_state_dict(monitor.state_dict())
    step = dict(raw_reward_mean=9.0, mean_response_length=30.0, copy_rate=0.9, heldout_score=0.0)
    assert restored.update(**step) == monitor.update(**step)
