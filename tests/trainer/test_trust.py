"""The trust parts of the objective in a real run: the anchor, per-component advantages, the trust gate (both
signals) and the automatic balance train under DP2, log their state, and a run resumed from a checkpoint equals
the uninterrupted one, the gate's and the balance's state included."""

import math

import pytest
import torch

from multirank import run_ranks
from test_fault_tolerance import assert_same_metrics
from trainer_runs import launch

pytestmark = pytest.mark.e2e

RM_HEADS = 2


def save_random_reward_model(groups, path):
    from hpa.config import load_config
    from hpa.models.builders import build_reward
    from hpa.models.weights import save_model_weights
    from hpa.reward.model import write_reward_model_info

    cfg = load_config(None, ["model.num_layers=4"])
    torch.manual_seed(1)
    save_model_weights(build_reward(cfg.model, cfg.parallel, groups, num_heads=RM_HEADS), path, groups)
    if groups.rank == 0:
        write_reward_model_info(path, num_heads=RM_HEADS, model=cfg.model)

TRUST = ["trainer.total_steps=4", "checkpoint.save_interval=1", "guard.kl_rollback_threshold=null",
         "algorithm.advantage.estimator=grpo", "algorithm.advantage.per_component=true", "algorithm.dpo.rpo_alpha=1.0",
         "algorithm.hpa.trust.regime=gate", "algorithm.hpa.trust.signal=heldout_nll",
         "algorithm.hpa.balance.enabled=true",
         "algorithm.hpa.balance.measure_steps=3"]


@pytest.fixture(scope="module")
def trust_run(demo):
    return launch(demo, demo / "trust_ref", 2, TRUST + [f"data.heldout_preference_path={demo / 'data' / 'heldout_preferences.jsonl'}"])


def test_the_trust_parts_log_their_state_every_step(trust_run):
    steps = [r for r in trust_run if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["gate/nll"] > 0 and 0 < r["gate/gate"] <= 1 and r["dpo/anchor_nll"] > 0
        assert r["hpa/balance_factor"] > 0
        # the factor the step's updates scaled the pair stream by: the balance's (no coverage trust here)
        assert r["hpa/pairs_factor"] == r["hpa/balance_factor"]
    # the balance measures the first 3 steps (two backward passes, both norms logged), then holds its factor
    assert all("grad_norm/rollout" in r and "grad_norm/pairs" in r for r in steps[:3])
    assert not any("grad_norm/rollout" in r for r in steps[3:])
    assert steps[3]["hpa/balance_factor"] == steps[2]["hpa/balance_factor"]


@pytest.fixture(scope="module")
def ceiling_extra(demo):
    """The reward_ceiling gate on a reward model (random weights: the gate only needs its scores)."""
    rm = demo / "random_rm"
    if not rm.exists():
        run_ranks(save_random_reward_model, args=(str(rm),))
    # regime auto: the gate, and the coverage trust (reward models and held-out pairs are given)
    return [*[o for o in TRUST if not o.startswith(("algorithm.hpa.trust.signal", "algorithm.hpa.trust.regime"))],
            "algorithm.hpa.trust.signal=reward_ceiling",
            f"reward.model_paths=[{rm}]",
            f"reward.num_heads={RM_HEADS}", f"data.heldout_preference_path={demo / 'data' / 'heldout_preferences.jsonl'}"]


@pytest.fixture(scope="module")
def ceiling_run(demo, ceiling_extra):
    return launch(demo, demo / "trust_ceiling_ref", 2, ceiling_extra)


def test_the_reward_ceiling_gate_follows_its_law_in_a_run(ceiling_run):
    steps = [r for r in ceiling_run if r["step"] > 0]
    assert len(steps) == 4 and "gate/nll" not in steps[0]  # no held-out forward pass with this signal
    ceiling, margin = steps[0]["gate/ceiling"], steps[0]["gate/margin"]
    assert math.isfinite(ceiling) and math.isfinite(margin)
    for r in steps:
        assert (r["gate/ceiling"], r["gate/margin"]) == (ceiling, margin)  # scored once, at start-up
        assert r["gate/excess"] == pytest.approx((r["gate/reward_ema"] - ceiling) / max(margin, 1e-3), rel=1e-9)
        assert r["gate/gate"] == pytest.approx(1 / (1 + r["gate/lambda"]), rel=1e-12)
        # the demo's rule (weight 1) and one reward model share the advantage equally; the gate scales the latter
        assert r["hpa/learned_share"] == pytest.approx(0.5 * r["gate/gate"], rel=1e-9)
        # the coverage trust is on (a reward model) and holds (no start skill measured: no data.sft_path), so
        # the pair stream's factor is the balance's (released, it would be released_pairs times that)
        assert "coverage/start_skill" not in r and r["coverage/kl_boost"] > 0
        assert r["hpa/pairs_factor"] == r["hpa/balance_factor"]
    # the smoothed learned reward is the EMA (0.9) of the rollouts' learned reward
    ema = steps[0]["reward/learned_mean"]
    for r in steps[1:]:
        ema = 0.9 * ema + 0.1 * r["reward/learned_mean"]
        assert r["gate/reward_ema"] == pytest.approx(ema, rel=1e-9)


def test_resumed_equals_uninterrupted_with_the_gate_and_balance_state(demo, ceiling_extra, ceiling_run):
    run_dir = demo / "trust_sliced"
    first = launch(demo, run_dir, 2, ceiling_extra + ["trainer.max_steps_per_run=2"])
    # the checkpoint carries the gate's and the balance's state
    state = torch.load(run_dir / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=False)
    assert state["trust_gate"]["ceiling"] == pytest.approx(first[-1]["gate/ceiling"], rel=1e-9)
    assert state["trust_gate"]["lam"] == pytest.approx(first[-1]["gate/lambda"], rel=1e-9)
    assert state["balance"]["measured"] == 2
    assert state["balance"]["factor"] == pytest.approx(first[-1]["hpa/balance_factor"], rel=1e-9)
    resumed = launch(demo, run_dir, 2, ceiling_extra)
    assert_same_metrics(ceiling_run, resumed, steps=[3, 4])


def test_the_coverage_trust_runs_and_logs_its_distribution_every_step(demo, ceiling_extra):
    """The coverage trust (``algorithm.hpa.trust.regime: auto``) on the reward-model run under DP2: calibrated once at start-up,
    the trust distribution of the step's rollouts (gathered over DP) logged every step, the held-out
    responses' trust per category at every evaluation, and the calibration constants saved in the checkpoint."""
    run_dir = demo / "trust_coverage"
    records = launch(demo, run_dir, 2, ceiling_extra + ["trainer.total_steps=3"])
    evals = [r for r in records if "eval/score" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]
    for r in evals:  # 12 held-out prompts, 4 of each category, over 2 DP ranks
        per_category = [r[f"eval/trust/{c}"] for c in ("add", "copy", "reverse")]
        assert all(0 <= v <= 1 for v in per_category)
        assert r["eval/trust"] == pytest.approx(sum(per_category) / 3, abs=1e-6)
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    low, high = steps[0]["coverage/low"], steps[0]["coverage/high"]
    assert 0 <= low < high
    for r in steps:
        assert (r["coverage/low"], r["coverage/high"]) == (low, high)
        assert 0 <= r["coverage/trust_p10"] <= r["coverage/trust_mean"] <= 1
        assert r["coverage/trust_p10"] <= r["coverage/trust_p90"] <= 1 and 0 <= r["coverage/far_share"] <= 1
    # the gate (on: ceiling_extra) reads every row's learned reward; the covered rows' is logged apart
    ema = steps[0]["reward/learned_mean"]
    assert steps[0]["gate/reward_ema"] == pytest.approx(ema, rel=1e-9)
    for r in steps[1:]:
        ema = 0.9 * ema + 0.1 * r["reward/learned_mean"]
        assert r["gate/reward_ema"] == pytest.approx(ema, rel=1e-9)
        assert math.isfinite(r["coverage/learned_reward"]) or r["coverage/trust_mean"] == 0
    state = torch.load(run_dir / "checkpoints" / "step_00000003" / "trainer_state.pt", weights_only=False)
    assert state["coverage"] == {"low": low, "high": high}


def test_the_sampled_ceiling_gate_moves_the_ceiling_by_the_start_policys_greedy_minus_sampled_reward(
        demo, ceiling_extra, ceiling_run):
    """``gate.signal=sampled_ceiling`` (the default of 2026-11-26) under DP2: the same held-out ceiling as
    ``reward_ceiling`` lowered by the offset measured once at start-up (every rank the same: one gate), the offset
    in the checkpoint."""
    run_dir = demo / "trust_sampled_ceiling"
    sampled = [o for o in ceiling_extra if not o.startswith("algorithm.hpa.trust.signal")] + [
        "algorithm.hpa.trust.signal=sampled_ceiling"]
    steps = [r for r in launch(demo, run_dir, 2, sampled + ["trainer.total_steps=2"]) if r["step"] > 0]
    offset, plain = steps[0]["gate/offset"], ceiling_run[1]["gate/ceiling"]
    assert math.isfinite(offset) and offset != 0
    for r in steps:
        assert r["gate/offset"] == offset and r["gate/margin"] == ceiling_run[1]["gate/margin"]
        assert r["gate/ceiling"] == pytest.approx(plain - offset, rel=1e-9, abs=1e-12)
        assert r["gate/excess"] == pytest.approx((r["gate/reward_ema"] - r["gate/ceiling"]) / max(r["gate/margin"], 1e-3))
    state = torch.load(run_dir / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=False)
    assert state["trust_gate"]["offset"] == pytest.approx(offset, rel=1e-12)


def test_the_start_rollouts_gate_measures_its_baseline_before_the_first_update(demo, ceiling_extra):
    """The default signal and baseline (``GATE_BASELINE_PROMPTS``: all 256 prompts of the demo task) under DP2: at start-up the start
    policy's sampled rollouts on training prompts give the baseline, so the gate compares from the first
    update: the ceiling is baseline + headroom at step 1 and the EMA moves from the baseline by the first
    batch's learned reward; every step the same baseline; the baseline in the checkpoint."""
    run_dir = demo / "trust_start_baseline"
    default = [o for o in ceiling_extra if not o.startswith("algorithm.hpa.trust.signal")]  # the default signal
    steps = [r for r in launch(demo, run_dir, 2, default + ["trainer.total_steps=2"]) if r["step"] > 0]
    baseline, headroom = steps[0]["gate/baseline"], steps[0]["gate/headroom"]
    assert math.isfinite(baseline) and headroom >= 0
    assert steps[0]["gate/ceiling"] == pytest.approx(baseline + headroom, rel=1e-9)
    assert steps[0]["gate/reward_ema"] == pytest.approx(0.9 * baseline + 0.1 * steps[0]["reward/learned_mean"])
    assert math.isfinite(steps[0]["gate/error"])  # compared at the first update, not open by default
    assert all(r["gate/baseline"] == baseline for r in steps)
    state = torch.load(run_dir / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=False)
    assert state["trust_gate"]["baseline"] == pytest.approx(baseline, rel=1e-12)


