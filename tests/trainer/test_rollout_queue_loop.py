"""The colocated loop through the rollout queue at ``rollout.max_staleness: 0`` equals the loop without it, bit
for bit (metrics and final weights, fp32 CPU), and logs ``async/lag_max`` every step."""

import pytest

from multirank import run_ranks
from trainer_runs import overrides, read_metrics

VOLATILE = ("timing_s/", "perf/")


def _run(groups, root, run_dir, bypass):
    import torch

    from hpa.config import load_config
    from hpa.trainer.loop import HPATrainer
    from hpa.trainer.rollout_step import RolloutStep

    cfg = load_config(None, overrides(root, run_dir, ["trainer.eval_interval=0", "trainer.total_steps=3"]))
    original = RolloutStep.through_queue
    if bypass:  # the synchronous loop as it was before the queue
        RolloutStep.through_queue = lambda self, batch: batch
    try:
        trainer = HPATrainer(cfg, groups)
        trainer.train()
    finally:
        RolloutStep.through_queue = original
    return {name: p.detach().clone() for name, p in trainer.parts.policy.model.named_parameters()}


@pytest.mark.multirank
def test_staleness_zero_through_the_queue_equals_the_synchronous_loop(demo, tmp_path):
    [direct] = run_ranks(_run, args=(demo, tmp_path / "direct", True))
    [queued] = run_ranks(_run, args=(demo, tmp_path / "queued", False))
    assert direct.keys() == queued.keys()
    for name in direct:
        assert direct[name].equal(queued[name]), name
    direct_metrics, queued_metrics = read_metrics(tmp_path / "direct"), read_metrics(tmp_path / "queued")
    assert [r["step"] for r in queued_metrics] == [1, 2, 3]
    for a, b in zip(direct_metrics, queued_metrics):
        assert b["async/lag_max"] == 0.0 and b["async/dropped_rows"] == 0.0
        a = {k: v for k, v in a.items() if not k.startswith(VOLATILE)}
        b = {k: v for k, v in b.items() if not k.startswith(VOLATILE)}
        assert a == b


def _run_worker(groups, root, run_dir, k):
    from hpa.config import load_config
    from hpa.trainer.loop import HPATrainer
    from hpa.trainer.rollout_step import RolloutStep

    cfg = load_config(None, overrides(root, run_dir, ["trainer.eval_interval=0", "trainer.total_steps=4",
                                                      f"rollout.max_staleness={k}",
                                                      "algorithm.rollout_correction.rollout_is=token"]))
    original = RolloutStep.steps_ahead
    RolloutStep.steps_ahead = lambda self, step: 0  # the worker samples each step's prompts by that step's policy
    try:
        trainer = HPATrainer(cfg, groups)
        trainer.train()
    finally:
        RolloutStep.steps_ahead = original
    return ({name: p.detach().clone() for name, p in trainer.parts.policy.model.named_parameters()},
            trainer.rollouts.worker is not None)


@pytest.mark.multirank
def test_the_rollout_worker_at_lag_zero_equals_the_synchronous_loop(demo, tmp_path):
    """The asynchronous path with nothing sampled ahead (k = 1, the worker sampling each step by its own policy
    after the weight push) reproduces the synchronous run (k = 0) bit for bit, metrics.jsonl and final weights,
    4 steps, fp32 CPU: the worker's copy of the weights, the push, the thread and the queue change no bit; what
    an async run changes is the staleness alone."""
    [(sync, sync_worker)] = run_ranks(_run_worker, args=(demo, tmp_path / "sync", 0))
    [(worker, used_worker)] = run_ranks(_run_worker, args=(demo, tmp_path / "worker", 1))
    assert not sync_worker and used_worker
    assert sync.keys() == worker.keys()
    for name in sync:
        assert sync[name].equal(worker[name]), name
    sync_metrics, worker_metrics = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "worker")
    assert [r["step"] for r in worker_metrics] == [1, 2, 3, 4]
    for a, b in zip(sync_metrics, worker_metrics, strict=True):
        assert b.pop("async/discarded_rows") == 0.0 and b["async/lag_max"] == 0.0  # the worker's count only
        # the staleness histogram, logged at k >= 1 only: every trained token is of the current version
        assert (b.pop("async/lag_frac_0"), b.pop("async/lag_frac_1"), b.pop("async/lag_mean")) == (1.0, 0.0, 0.0)
        a = {k: v for k, v in a.items() if not k.startswith(VOLATILE)}
        b = {k: v for k, v in b.items() if not k.startswith(VOLATILE)}
        assert a == b
