"""The SFT replay (``algorithm.replay``) in a real run: two DP ranks replay ``data.sft_path`` in every step,
log the term and its table row, and a run cut in two resumes to the same numbers (the replay sampler's position
is in the checkpoint)."""

import math

import pytest

from trainer_runs import launch

pytestmark = pytest.mark.e2e

STEPS = ["trainer.total_steps=4", "checkpoint.save_interval=1", "guard.kl_rollback_threshold=null"]


def _replay(demo):
    return [f"data.sft_path={demo / 'data' / 'sft.jsonl'}", "algorithm.replay.coef=0.5", "trainer.replay_batch_size=4"]


def test_a_replay_run_logs_its_term_and_resumes_exactly(demo):
    output = []
    whole = launch(demo, demo / "replay_whole", 2, STEPS + _replay(demo), output=output)
    assert "| replay | replay | w_dpo = " in output[0]  # the objective's table at the start names the term
    steps = {r["step"]: r for r in whole}
    for step in (1, 2, 3, 4):
        nll = steps[step]["replay/nll"]
        assert math.isfinite(nll) and 0 < nll < math.log(96) + 1, (step, nll)
    # the examples change from step to step (the sampler moves), so the NLL does
    assert len({round(steps[s]["replay/nll"], 6) for s in (1, 2, 3, 4)}) > 1

    run_dir = demo / "replay_cut"
    launch(demo, run_dir, 2, STEPS + _replay(demo) + ["trainer.max_steps_per_run=2"])
    resumed = {r["step"]: r for r in launch(demo, run_dir, 2, STEPS + _replay(demo))}
    for step in (3, 4):
        for key in ("replay/nll", "dpo/loss", "actor/pg_loss", "eval/score"):
            if key in steps[step]:
                assert resumed[step][key] == pytest.approx(steps[step][key], rel=1e-6, abs=1e-6), (step, key)

