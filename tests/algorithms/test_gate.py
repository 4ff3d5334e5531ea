"""The trust gate's PI controller against scripted signal sequences (both signals)."""

import math

import pytest

from hpa.algorithms.gate import TrustGate


def run(gate, nlls, rewards):
    return [gate.update(n, r) for n, r in zip(nlls, rewards)]


def test_stays_open_while_the_nll_does_not_regress():
    gate = TrustGate(signal="heldout_nll")
    out = run(gate, [1.0, 0.95, 0.9, 0.91, 0.88], [0.1, 0.2, 0.3, 0.4, 0.5])  # 0.91 is within the 2 % slack
    assert all(m["gate/gate"] == 1.0 for m in out)
    assert gate.best == 0.88


def test_closes_on_a_regression_while_the_learned_reward_rises_by_the_pi_law():
    gate = TrustGate(signal="heldout_nll", slack=0.02, kp=10.0, ki=1.0, reward_ema=0.0)
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
    gate = TrustGate(signal="heldout_nll", reward_ema=0.0)
    out = run(gate, [1.0, 1.3, 1.3], [0.5, 0.4, 0.5])  # the learned reward is not above its value at the best
    assert [m["gate/gate"] for m in out] == [1.0, 1.0, 1.0]
    assert [m["gate/rising"] for m in out] == [0.0, 0.0, 0.0]


def test_recovers_when_the_nll_comes_back():
    gate = TrustGate(signal="heldout_nll", slack=0.02, kp=10.0, ki=1.0, reward_ema=0.0)
    run(gate, [1.0, 1.2, 1.2, 1.2], [0.0, 1.0, 1.0, 1.0])
    closed = gate.gate
    assert closed < 0.3
    gates = [m["gate/gate"] for m in run(gate, [1.0] * 40, [1.0] * 40)]
    assert gates[0] > closed  # the proportional part goes at once
    assert all(b >= a for a, b in zip(gates, gates[1:]))  # the integral drains step by step
    assert gates[-1] == 1.0


def test_state_round_trips_and_a_non_finite_step_changes_nothing():
    gate = TrustGate(signal="heldout_nll", reward_ema=0.5)
    run(gate, [1.0, 1.1, 1.2], [0.0, 0.5, 1.0])
    state = gate.state_dict()
    m = gate.update(float("nan"), 1.0)
    assert gate.state_dict() == state and math.isnan(m["gate/error"])
    other = TrustGate(signal="heldout_nll", reward_ema=0.5)
    other.load_state_dict(state)
    assert run(other, [1.15, 1.0], [1.2, 1.3]) == run(gate, [1.15, 1.0], [1.2, 1.3])


def test_bad_constants_are_refused():
    with pytest.raises(ValueError, match="reward_ema"):
        TrustGate(reward_ema=1.0)


def ceiling_gate(**kwargs):
    gate = TrustGate(signal="reward_ceiling", **{"slack": 0.02, "kp": 10.0, "ki": 1.0, "reward_ema": 0.0, **kwargs})
    gate.set_ceiling(0.5, 0.25)  # held-out chosen responses score 0.5, 0.25 above their rejected ones
    return gate


def test_ceiling_stays_open_while_the_learned_reward_is_below_what_preferred_responses_get():
    gate = ceiling_gate()
    out = [gate.update(None, r) for r in [0.1, 0.3, 0.5, 0.504]]  # 0.504: 0.016 margins above, inside the slack
    assert [m["gate/gate"] for m in out] == [1.0, 1.0, 1.0, 1.0]
    assert out[1]["gate/excess"] == pytest.approx((0.3 - 0.5) / 0.25)


def test_ceiling_closes_above_it_by_the_pi_law_and_never_reads_the_nll():
    gate = ceiling_gate()
    m = gate.update(None, 0.53)  # 0.12 margins above the ceiling, 0.10 beyond the slack
    assert m["gate/excess"] == pytest.approx(0.12)
    assert m["gate/lambda"] == pytest.approx(10 * 0.10 + 1 * 0.10)
    assert m["gate/gate"] == pytest.approx(1 / 2.1)
    m = gate.update(float("nan"), 0.53)  # the NLL is not this signal's input
    assert m["gate/integral"] == pytest.approx(0.20) and m["gate/lambda"] == pytest.approx(1.2)


def test_ceiling_reopens_when_the_learned_reward_comes_back_under_it():
    gate = ceiling_gate()
    for _ in range(5):
        gate.update(None, 0.75)  # a full margin above: closes hard
    closed = gate.gate
    assert closed < 0.1
    gates = [gate.update(None, 0.4)["gate/gate"] for _ in range(60)]
    assert gates[0] > closed and all(b >= a for a, b in zip(gates, gates[1:])) and gates[-1] == 1.0


def test_ceiling_smooths_the_learned_reward():
    gate = ceiling_gate(reward_ema=0.9)
    gate.update(None, 0.5)
    m = gate.update(None, 1.5)  # one spike moves the EMA by a tenth of it
    assert m["gate/reward_ema"] == pytest.approx(0.6)
    assert m["gate/excess"] == pytest.approx(0.4)


def test_ceiling_state_round_trips_and_needs_its_ceiling():
    gate = ceiling_gate(reward_ema=0.5)
    [gate.update(None, r) for r in [0.6, 0.7]]
    other = TrustGate(signal="reward_ceiling", reward_ema=0.5)
    other.load_state_dict(gate.state_dict())
    assert other.update(None, 0.8) == gate.update(None, 0.8)
    with pytest.raises(RuntimeError, match="set_ceiling"):
        TrustGate(signal="reward_ceiling").update(None, 0.1)
    with pytest.raises(ValueError, match="signal"):
        TrustGate(signal="gold")


def test_gate_signals_match_the_config():
    from hpa.algorithms.gate import GATE_SIGNALS
    from hpa.config.algorithm import GATE_SIGNALS as CONFIG_SIGNALS

    assert GATE_SIGNALS == CONFIG_SIGNALS


def test_sampled_ceiling_lowers_the_ceiling_by_the_offset_and_closes_where_the_plain_one_stays_open():
    """Greedy answers of the start policy score 0.2 above its sampled ones: rollouts at 0.4 are below the
    plain ceiling (0.5) but 0.1 above it on the rollouts' scale (0.3): 0.4 margins, 0.38 beyond the slack."""
    plain, sampled = ceiling_gate(), TrustGate(signal="sampled_ceiling", slack=0.02, kp=10.0, ki=1.0, reward_ema=0.0)
    sampled.set_ceiling(0.5, 0.25, offset=0.2)
    assert plain.update(None, 0.4)["gate/gate"] == 1.0
    m = sampled.update(None, 0.4)
    assert m["gate/ceiling"] == pytest.approx(0.3) and m["gate/offset"] == pytest.approx(0.2)
    assert m["gate/excess"] == pytest.approx(0.4)
    assert m["gate/lambda"] == pytest.approx(10 * 0.38 + 0.38) and m["gate/gate"] == pytest.approx(1 / 5.18)
    # the offset is saved and restored with the ceiling
    other = TrustGate(signal="sampled_ceiling", slack=0.02, kp=10.0, ki=1.0, reward_ema=0.0)
    other.load_state_dict(sampled.state_dict())
    assert other.offset == pytest.approx(0.2) and other.update(None, 0.35) == sampled.update(None, 0.35)
    with pytest.raises(ValueError, match="finite"):
        sampled.set_ceiling(0.5, 0.25, offset=float("nan"))


def start_gate(chosen=0.921, greedy=1.138, margin=0.5, steps=1, ema=0.9):
    gate = TrustGate(signal="start_rollouts", slack=0.02, kp=10.0, ki=1.0, reward_ema=ema, baseline_steps=steps)
    gate.set_headroom(chosen, greedy, margin)
    return gate


def test_start_rollouts_compares_the_rollouts_with_the_start_policys_own_rollouts_not_the_heldout_level():
    """Task A of issue 38, by its numbers: the held-out chosen responses score 0.921, the start's greedy ones
    1.138 and sampled ones 0.972 on the held-out prompts, but the start's rollouts on the training prompts
    score 0.033 and climb to 0.63. The sampled ceiling (0.755, on the held-out scale) stays open through the
    climb; the start_rollouts ceiling is the rollouts' own start (both sides on the training prompts) and
    closes by the PI law as soon as the EMA rises beyond the slack."""
    climb = [0.033, 0.10, 0.20, 0.31, 0.45, 0.63]
    sampled = TrustGate(signal="sampled_ceiling", slack=0.02, kp=10.0, ki=1.0, reward_ema=0.9)
    sampled.set_ceiling(0.921, 0.5, offset=1.138 - 0.972)
    assert all(sampled.update(None, r)["gate/gate"] == 1.0 for r in climb)
    gate = start_gate()
    m = gate.update(None, climb[0])
    assert m["gate/baseline"] == pytest.approx(0.033) and m["gate/headroom"] == 0.0  # chosen < greedy: no room
    assert m["gate/ceiling"] == pytest.approx(0.033) and m["gate/gate"] == 1.0
    m = gate.update(None, climb[1])
    ema = 0.9 * 0.033 + 0.1 * 0.10
    error = (ema - 0.033) / 0.5 - 0.02  # 0.0134 - 0.02 < 0: inside the slack
    assert m["gate/error"] == pytest.approx(error) and m["gate/gate"] == 1.0
    closed = [gate.update(None, r)["gate/gate"] for r in climb[2:]]
    assert closed[-1] < 0.5 and closed == sorted(closed, reverse=True)
    # the held-out level enters only through chosen - greedy on the same prompts: moving both by 0.9
    # (another distribution's scale) changes nothing
    a, b = start_gate(), start_gate(chosen=0.021, greedy=0.238)
    assert [a.update(None, r) for r in climb] == [b.update(None, r) for r in climb]


def test_start_rollouts_headroom_and_baseline_over_the_first_steps():
    """The headroom is chosen - greedy when the chosen responses score higher (never below 0); the baseline
    is the mean of the first ``baseline_steps`` finite rollout rewards, the gate open until it is known."""
    gate = start_gate(chosen=1.2, greedy=1.0, margin=0.25, steps=3, ema=0.0)
    assert gate.headroom == pytest.approx(0.2)
    for r in (0.1, float("nan"), 0.3):
        m = gate.update(None, r)
        assert m["gate/gate"] == 1.0 and "gate/ceiling" not in m
    m = gate.update(None, 0.5)
    assert m["gate/baseline"] == pytest.approx(0.3) and m["gate/ceiling"] == pytest.approx(0.5)
    m = gate.update(None, 0.6)  # 0.1 above the ceiling: 0.4 margins, 0.38 beyond the slack
    assert m["gate/excess"] == pytest.approx(0.4) and m["gate/lambda"] == pytest.approx(10 * 0.38 + 0.38)
    with pytest.raises(RuntimeError, match="set_headroom"):
        TrustGate(signal="start_rollouts").update(None, 0.1)
    with pytest.raises(ValueError, match="finite"):
        gate.set_headroom(float("nan"), 1.0, 0.2)
    with pytest.raises(ValueError, match="baseline_steps"):
        TrustGate(signal="start_rollouts", baseline_steps=0)


def test_start_rollouts_state_round_trips_mid_baseline_and_an_old_state_loads():
    gate = start_gate(steps=3)
    [gate.update(None, r) for r in (0.1, 0.2)]
    other = start_gate(chosen=5.0, greedy=0.0, steps=3)  # another start-up measurement: the saved one wins
    other.load_state_dict(gate.state_dict())
    assert [other.update(None, r) for r in (0.3, 0.5, 0.7)] == [gate.update(None, r) for r in (0.3, 0.5, 0.7)]
    assert other.baseline == pytest.approx(0.2)
    # a checkpoint of 2026-11-26 (no headroom/baseline keys) keeps what this start measured
    old = TrustGate(signal="sampled_ceiling")
    old.set_ceiling(0.5, 0.25, offset=0.1)
    state = old.state_dict()
    for key in ("headroom", "baseline", "baseline_sum", "baseline_count"):
        state.pop(key)
    fresh = start_gate()
    fresh.load_state_dict(state)
    assert fresh.headroom == 0.0 and fresh.baseline is None and fresh.baseline_count == 0


def test_the_default_signal_is_the_configs_default():
    from hpa.algorithms.gate import GATE_BASELINE_STEPS, GATE_HEADROOM_SCALE, GATE_KI, GATE_KP, GATE_REWARD_EMA
    from hpa.config.algorithm import TrustConfig

    assert TrustGate().signal == TrustConfig().signal == "start_rollouts"
    assert TrustGate().slack == TrustConfig().slack
    gate = TrustGate()  # the constants that were keys: the gate's own defaults
    assert (gate.kp, gate.ki, gate.reward_ema, gate.baseline_steps, gate.headroom_scale) == (
        GATE_KP, GATE_KI, GATE_REWARD_EMA, GATE_BASELINE_STEPS, GATE_HEADROOM_SCALE) == (10.0, 1.0, 0.9, 5, 1.0)


def test_start_rollouts_with_a_measured_baseline_acts_from_the_first_update():
    """``set_baseline`` (the start-up measurement, ``gate.baseline_prompts``): the ceiling is baseline +
    headroom at once, the EMA starts at the baseline, and the first update is already compared; the saved
    state restores it (a resumed run does not measure again: the saved baseline wins)."""
    gate = start_gate(chosen=1.2, greedy=1.0, margin=0.25, steps=5)
    gate.set_baseline(0.3)
    assert gate.ceiling == pytest.approx(0.5) and gate.reward == pytest.approx(0.3)
    m = gate.update(None, 1.5)  # EMA 0.9 * 0.3 + 0.1 * 1.5 = 0.42: below the ceiling
    assert m["gate/baseline"] == pytest.approx(0.3) and m["gate/excess"] == pytest.approx((0.42 - 0.5) / 0.25)
    m = gate.update(None, 2.0)  # EMA 0.578: 0.312 margins above, 0.292 beyond the slack
    assert m["gate/error"] == pytest.approx(0.292) and m["gate/gate"] < 1.0
    resumed = start_gate(chosen=1.2, greedy=1.0, margin=0.25, steps=5)
    resumed.set_baseline(9.0)  # another start-up draw
    resumed.load_state_dict(gate.state_dict())
    assert resumed.update(None, 0.7) == gate.update(None, 0.7)
    # an old run's state saved mid-way through its first batches keeps counting them
    old = start_gate(steps=3)
    old.update(None, 0.1)
    again = start_gate(steps=3)
    again.set_baseline(0.9)
    again.load_state_dict(old.state_dict())
    assert again.ceiling is None and again.update(None, 0.2)["gate/gate"] == 1.0
    assert again.update(None, 0.3)["gate/baseline"] == pytest.approx(0.2)
    with pytest.raises(RuntimeError, match="set_headroom"):
        TrustGate(signal="start_rollouts").set_baseline(0.1)
    with pytest.raises(ValueError, match="finite"):
        gate.set_baseline(float("nan"))


def test_start_rollouts_headroom_scale_scales_what_the_heldout_pairs_support():
    """``headroom_scale`` (``GATE_HEADROOM_SCALE``): the headroom is the scale times
    max(0, chosen - greedy); 0 puts the ceiling at the baseline, so a rise the held-out pairs would allow
    is already a violation; the saved headroom wins on a restore."""

    full = TrustGate(signal="start_rollouts", headroom_scale=1.0)
    full.set_headroom(1.2, 1.0, 0.25)
    half = TrustGate(signal="start_rollouts", headroom_scale=0.5)
    half.set_headroom(1.2, 1.0, 0.25)
    none = TrustGate(signal="start_rollouts", headroom_scale=0.0)
    none.set_headroom(1.2, 1.0, 0.25)
    assert (full.headroom, half.headroom, none.headroom) == pytest.approx((0.2, 0.1, 0.0))
    for gate in (full, none):
        gate.set_baseline(0.3)
    # EMA 0.9 * 0.3 + 0.1 * 0.8 = 0.35: 0.2 margins above the baseline, under the full ceiling (0.5)
    assert full.update(None, 0.8)["gate/error"] < 0
    m = none.update(None, 0.8)
    assert m["gate/ceiling"] == pytest.approx(0.3) and m["gate/error"] == pytest.approx(0.2 - 0.02)
    assert m["gate/gate"] < 1.0
    restored = TrustGate(signal="start_rollouts", headroom_scale=0.0)
    restored.set_headroom(1.2, 1.0, 0.25)
    restored.load_state_dict(full.state_dict())
    assert restored.headroom == pytest.approx(0.2)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="headroom_scale"):
            TrustGate(signal="start_rollouts", headroom_scale=bad)


def test_needs_baseline_only_while_a_start_rollouts_gate_has_none_and_counts_none():
    """The controller measures the start-up baseline while ``needs_baseline``: a fresh start_rollouts gate,
    not one with a measured or restored baseline, nor one counting the first updates' rollouts."""
    assert start_gate().needs_baseline
    measured = start_gate()
    measured.set_baseline(0.3)
    assert not measured.needs_baseline
    counting = start_gate(steps=3)
    counting.update(None, 0.1)  # baseline_prompts=0: the first updates' rollouts are being counted
    assert counting.baseline is None and not counting.needs_baseline
    restored = start_gate()
    restored.load_state_dict(measured.state_dict())
    assert not restored.needs_baseline
    assert not any(TrustGate(signal=s).needs_baseline for s in ("reward_ceiling", "sampled_ceiling", "heldout_nll"))
