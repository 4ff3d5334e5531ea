"""Exact resume at ``rollout.max_staleness`` k >= 1: a run stopped at a checkpoint and resumed equals the
uninterrupted run, metrics and final weights bit for bit (fp32, CPU). The rows the worker sampled ahead of the
checkpoint (by the policy before it) travel with the checkpoint, with the prompts drawn for them."""

import pytest

from multirank import run_ranks
from trainer_runs import overrides, read_metrics

VOLATILE = ("timing_s/", "perf/")
ASYNC = ["algorithm.rollout_correction.rollout_is=token", "trainer.eval_interval=0", "rollout.max_new_tokens=4",
         "trainer.total_steps=4", "guard.kl_rollback_threshold=null"]


def _run(groups, root, run_dir, k, ahead, extra):
    from hpa.config import load_config
    from hpa.trainer import rollout_step
    from hpa.trainer.loop import HPATrainer

    cfg = load_config(None, overrides(root, run_dir, [*ASYNC, f"rollout.max_staleness={k}", *extra]))
    original = rollout_step.RolloutStep.steps_ahead
    rollout_step.RolloutStep.steps_ahead = lambda self, step: ahead
    try:
        trainer = HPATrainer(cfg, groups)
        trainer.train()
    finally:
        rollout_step.RolloutStep.steps_ahead = original
    weights = {name: p.detach().clone() for name, p in trainer.parts.policy.model.named_parameters()}
    return weights, trainer.exit_reason


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.mark.multirank
@pytest.mark.parametrize("k, ahead", [(1, 1), (2, 2)], ids=["k1_ahead1", "k2_ahead2"])
def test_resumed_equals_uninterrupted_at_max_staleness(demo, tmp_path, k, ahead):
    """Stopped after step 2 (``trainer.max_steps_per_run``, a checkpoint), resumed to step 4: the same
    metrics.jsonl and final weights as the run that never stopped. At k = 2, two steps ahead, the checkpoint
    holds the rows of two steps, sampled by two versions. A resumed run once drew the next step's prompts
    again from the sampler (which had already given them to the worker): one batch skipped, every later
    step different."""
    [(straight, reason)] = run_ranks(_run, args=(demo, tmp_path / "straight", k, ahead, []))
    assert reason == "done"
    [(_, reason)] = run_ranks(_run, args=(demo, tmp_path / "sliced", k, ahead, ["trainer.max_steps_per_run=2"]))
    assert reason == "max_steps_per_run"
    [(resumed, reason)] = run_ranks(_run, args=(demo, tmp_path / "sliced", k, ahead, []))
    assert reason == "done"
    expected, got = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "sliced")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert max(r["async/lag_max"] for r in expected) == float(ahead)  # rows ahead were trained (and resumed)
    assert _comparable(got) == _comparable(expected)
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert straight[name].equal(resumed[name]), name
