"""The trust gate's PI controller against scripted signal sequences."""

import math

import pytest

from hpa.algorithms.gate import TrustGate


def run(gate, nlls, rewards):
    return [gate.update(n, r) for n, r in zip(nlls, rewards)]


def test_stays_open_while_the_nll_does_not_regress():
    gate = TrustGate()
    out = run(gate, [1.0, 0.95, 0.9, 0.91, 0.88], [0.1, 0.2, 0.3, 0.4, 0.5])  # 0.91 is within the 2 % slack
    assert all(m["gate/gate"] == 1.0 for m in out)
    assert gate.best == 0.88


def test_closes_on_a_regression_while_the_learned_reward_rises_by_the_pi_law():
    gate = TrustGate(slack=0.02, kp=10.0, ki=1.0, reward_ema=0.0)
    run(gate, [1.0], [0.0])
    m = gate.update(1.12, 0.5)  # 12 % regression, 10 % beyond the slack, reward rising
    assert m["gate/regression"] == pytest.approx(0.12)
    assert m["gate/error"] == pytest.approx(0.10)
    assert m["gate/lambda"] == pytest.approx(10 * 0.10 + 1 * 0.10)
    assert m["gate/gate"] == pytest.approx(1 / 2.1)
    m = gate.update(1.12, 0.6)  # it persists: the integral keeps closing the gate
    assert m["gate/integral"] == pytest.approx(0.20)
    assert m["gate/lambda"] == pytest.approx(1.0 + 0.2)
    assert m["gate/gate"] < 1 / 2.1 + 1e-9


def test_a_regression_without_a_rising_learned_reward_does_not_close_it():
    gate = TrustGate(reward_ema=0.0)
    out = run(gate, [1.0, 1.3, 1.3], [0.5, 0.4, 0.5])  # the learned reward is not above its value at the best
    assert [m["gate/gate"] for m in out] == [1.0, 1.0, 1.0]
    assert [m["gate/rising"] for m in out] == [0.0, 0.0, 0.0]


def test_recovers_when_the_nll_comes_back():
    gate = TrustGate(slack=0.02, kp=10.0, ki=1.0, reward_ema=0.0)
    run(gate, [1.0, 1.2, 1.2, 1.2], [0.0, 1.0, 1.0, 1.0])
    closed = gate.gate
    assert closed < 0.3
    gates = [m["gate/gate"] for m in run(gate, [1.0] * 40, [1.0] * 40)]
    assert gates[0] > closed  # the proportional part goes at once
    assert all(b >= a for a, b in zip(gates, gates[1:]))  # the integral drains step by step
    assert gates[-1] == 1.0


def test_state_round_trips_and_a_non_finite_step_changes_nothing():
    gate = TrustGate(reward_ema=0.5)
    run(gate, [1.0, 1.1, 1.2], [0.0, 0.5, 1.0])
    state = gate.state_dict()
    m = gate.update(float("nan"), 1.0)
    assert gate.state_dict() == state and math.isnan(m["gate/error"])
    other = TrustGate(reward_ema=0.5)
    other.load_state_dict(state)
    assert run(other, [1.15, 1.0], [1.2, 1.3]) == run(gate, [1.15, 1.0], [1.2, 1.3])


def test_bad_constants_are_refused():
    with pytest.raises(ValueError, match="reward_ema"):
        TrustGate(reward_ema=1.0)
