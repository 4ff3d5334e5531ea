"""The trust parts of the objective in a real run: the anchor, per-component advantages, the trust gate and
the automatic balance train under DP2, log their state, and a run resumed from a checkpoint equals the
uninterrupted one, the gate's and the balance's state included."""

import pytest
import torch

from test_fault_tolerance import assert_same_metrics
from trainer_runs import launch

TRUST = ["trainer.total_steps=4", "checkpoint.save_interval=1", "guard.kl_rollback_threshold=null",
         "algorithm.advantage.estimator=grpo", "algorithm.advantage.per_component=true", "algorithm.dpo.rpo_alpha=1.0",
         "algorithm.hpa.gate.enabled=true", "algorithm.hpa.gate.signal=heldout_nll",
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
    # the balance measures the first 3 steps (two backward passes, both norms logged), then holds its factor
    assert all("grad_norm/rollout" in r and "grad_norm/pairs" in r for r in steps[:3])
    assert not any("grad_norm/rollout" in r for r in steps[3:])
    assert steps[3]["hpa/balance_factor"] == steps[2]["hpa/balance_factor"]


def test_resumed_equals_uninterrupted_with_the_gate_and_balance_state(demo, trust_run):
    run_dir = demo / "trust_sliced"
    extra = TRUST + [f"data.heldout_preference_path={demo / 'data' / 'heldout_preferences.jsonl'}"]
    first = launch(demo, run_dir, 2, extra + ["trainer.max_steps_per_run=2"])
    # the checkpoint carries the gate's and the balance's state
    state = torch.load(run_dir / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=False)
    assert state["trust_gate"]["best"] == pytest.approx(first[-1]["gate/best_nll"], rel=1e-9)
    assert state["balance"]["measured"] == 2
    assert state["balance"]["factor"] == pytest.approx(first[-1]["hpa/balance_factor"], rel=1e-9)
    resumed = launch(demo, run_dir, 2, extra)
    assert_same_metrics(trust_run, resumed, steps=[3, 4])
