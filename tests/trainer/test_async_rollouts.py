"""``rollout.max_staleness`` k >= 1: the rollout worker samples ahead of the update; no row trained lags more
than k versions, ``async/lag_max`` <= k every step, stale rows are dropped and counted; a failed weight push is
an error naming what did not arrive; with ``rollout.partial`` a push stops the job in flight and its rows continue
with the new weights (tokens of two versions, the lag of the oldest)."""

import pytest

from multirank import run_ranks
from trainer_runs import overrides, read_metrics

ASYNC = ["rollout.max_staleness=2", "algorithm.rollout_correction.rollout_is=token", "trainer.eval_interval=0",
         "rollout.max_new_tokens=4"]


def _run(groups, root, run_dir, steps, pattern):
    import torch

    from hpa.config import load_config
    from hpa.trainer import rollout_step
    from hpa.trainer.loop import HPATrainer

    cfg = load_config(None, overrides(root, run_dir, [*ASYNC, f"trainer.total_steps={steps}"]))
    trained = []  # (step, lag of each valid token trained)
    original_take, original_ahead = rollout_step.RolloutStep.take, rollout_step.RolloutStep.steps_ahead

    def take(self, step):
        taken = original_take(self, step)
        for entry in taken:
            trained.append((step, (step - entry.versions[entry.mask.bool()]).tolist()))
        return taken

    rollout_step.RolloutStep.take = take
    if pattern:  # 1, 2, 3 steps ahead in turn: lags 0..3, the lag-3 rows stale at k = 2
        rollout_step.RolloutStep.steps_ahead = lambda self, step: 1 + step % 3
    try:
        HPATrainer(cfg, groups).train()
    finally:
        rollout_step.RolloutStep.take, rollout_step.RolloutStep.steps_ahead = original_take, original_ahead
    return trained


@pytest.mark.multirank
def test_fifty_steps_at_k2_never_train_a_row_older_than_k(demo, tmp_path):
    [trained] = run_ranks(_run, args=(demo, tmp_path, 50, True))
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == list(range(1, 51))
    assert {step for step, _ in trained} == set(range(50))
    assert all(max(lags) <= 2 for _, lags in trained if lags)
    assert {max(lags) for _, lags in trained if lags} == {0, 1, 2}  # the bound is reached, not only respected
    # steps 2, 5, 8, ... (after the first) got rows sampled three versions back: dropped, sampled again
    stale_steps = [s for s in range(5, 50, 3)]
    rows = 4 * 2  # global batch 4 prompts x n 2
    for record in metrics:
        assert record["async/lag_max"] <= 2.0
    dropped = [r["async/dropped_rows"] for r in metrics]
    assert dropped[-1] == rows * len(stale_steps)
    assert all(b >= a for a, b in zip(dropped, dropped[1:]))
    for s in stale_steps:  # the step's own rows are the re-sampled ones, by the current policy
        assert dropped[s] - dropped[s - 1] == rows
        assert metrics[s]["async/lag_max"] == 0.0
    lag_of = {step: max(lags) for step, lags in trained}
    assert [r["async/lag_max"] for r in metrics] == [float(lag_of[s]) for s in range(50)]
    # π_old (the trainer's forward at consume time) and π_behaviour differ on rows sampled by older weights,
    # and the PPO term's token IS weight is computed every step
    assert all("rollout_corr/rollout_is_mean" in r for r in metrics)
    diff = {lag: [r["rollout/logprob_diff_mean"] for s, r in enumerate(metrics) if lag_of[s] == lag] for lag in (0, 2)}
    assert min(diff[2]) > 10 * max(diff[0]), diff
    # the staleness histogram: each step's tokens by lag, the step's own lag among them; the weights' ESS is
    # below 1 where the rows are stale
    for s, record in enumerate(metrics):
        assert sum(record[f"async/lag_frac_{i}"] for i in range(3)) == pytest.approx(1.0)
        assert record[f"async/lag_frac_{lag_of[s]}"] > 0
        assert 0 < record["rollout_corr/rollout_is_eff_sample_size"] <= 1.0 + 1e-6
    ess = {lag: [r["rollout_corr/rollout_is_eff_sample_size"] for s, r in enumerate(metrics) if lag_of[s] == lag]
           for lag in (0, 2)}
    assert max(ess[2]) < min(ess[0]), ess


def _run_with_a_lost_push(groups, root, run_dir):
    from hpa.config import load_config
    from hpa.rollout.worker import RolloutWorker, WeightPushError
    from hpa.trainer.loop import HPATrainer

    cfg = load_config(None, overrides(root, run_dir, [*ASYNC, "trainer.total_steps=3"]))
    original = RolloutWorker._copy_in
    RolloutWorker._copy_in = lambda self, named_tensors: None  # the push reaches nothing
    trainer = HPATrainer(cfg, groups)
    try:
        trainer.train()
    except WeightPushError as exc:
        return str(exc), trainer.rollouts.worker.watched
    finally:
        RolloutWorker._copy_in = original
    return None, trainer.rollouts.worker.watched


@pytest.mark.multirank
def test_a_weight_push_that_never_arrives_stops_the_run_naming_the_tensors(demo, tmp_path):
    [(error, watched)] = run_ranks(_run_with_a_lost_push, args=(demo, tmp_path))
    # step 0's push finds the worker's copy equal to the trainer's (a copy of it); step 1's, after an update, not
    assert error is not None and "policy version 1" in error, error
    assert len(watched) == 3 and watched[0].startswith("embedding")
    assert all(name in error for name in watched), (watched, error)
    assert len(read_metrics(tmp_path)) == 1


def _run_with_a_rollback(groups, root, run_dir):
    import os

    from hpa.config import load_config
    from hpa.trainer import rollout_step
    from hpa.trainer.loop import HPATrainer

    cfg = load_config(None, overrides(root, run_dir, [*ASYNC, "rollout.max_staleness=1", "trainer.total_steps=5",
                                                      "checkpoint.save_interval=2", "guard.kl_rollback_threshold=10.0"]))
    trained, rows, original = [], [], rollout_step.RolloutStep.take

    def take(self, step):
        taken = original(self, step)
        trained.append((step, self.queue.version, [int(e.versions.min()) for e in taken]))
        rows.append([e.rows["response_ids"].clone() for e in taken])
        return taken

    rollout_step.RolloutStep.take = take
    os.environ["HPA_INJECT_FAULT"] = "kl_spike@3"
    try:
        trainer = HPATrainer(cfg, groups)
        trainer.train()
    finally:
        rollout_step.RolloutStep.take = original
        del os.environ["HPA_INJECT_FAULT"]
    return trained, rows, trainer.rollouts.queue.metrics()["async/discarded_rows"]


@pytest.mark.multirank
def test_a_rollback_discards_what_was_sampled_ahead_by_the_lost_policies(demo, tmp_path):
    trained, rows, discarded = run_ranks(_run_with_a_rollback, args=(demo, tmp_path))[0]
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5] and metrics[2]["guard/rollbacks"] == 1
    # the spike after the third step (index 2) rolls back to the checkpoint of version 2: steps 2..4 again
    assert [step for step, _, _ in trained] == [0, 1, 2, 2, 3, 4]
    # the replayed step 2 trains the rows the checkpoint holds, sampled ahead by version 1 (as a resume from it
    # does); step 3's job, sampled ahead by version 2 before the spike, was discarded with the prompts drawn for it
    # (counted as discarded, not as stale) and sampled again by the restored version 2
    assert trained[3] == (2, 2, [1]) and trained[4] == (3, 3, [2])
    assert all(a.equal(b) for a, b in zip(rows[2], rows[3], strict=True))
    assert all(0 <= version - v <= 1 for _, version, vs in trained for v in vs)
    assert all(r["async/lag_max"] <= 1.0 for r in metrics)
    assert discarded == 4 * 2 and metrics[-1]["async/discarded_rows"] == 8.0


CUT = 2  # the forward of decode step 1: a cut job has tokens of steps 0 and 1 by the old version


def _run_partial(groups, root, run_dir, steps):
    from hpa.config import load_config
    from hpa.trainer import rollout_step
    from hpa.trainer.loop import HPATrainer

    class HeldWorker(rollout_step.RolloutWorker):
        """Each job waits in its CUT-th forward for the next push (3 s at most: step 0's job gets none), so every
        push lands mid-job, at the same step."""

        def __init__(self, engine, module, **kwargs):
            super().__init__(engine, module, **kwargs)
            forward, resume, stop, count = engine._forward, engine.resume, self._jobs.stop, [0]

            def held_resume(partial, *, stop=None):
                if partial.steps == 0:
                    count[0] = 0
                return resume(partial, stop=stop)

            def held_forward(*args, **kwargs):
                count[0] += 1
                if count[0] == CUT:
                    stop.wait(timeout=3.0)
                return forward(*args, **kwargs)

            engine._forward, engine.resume = held_forward, held_resume

    cfg = load_config(None, overrides(root, run_dir, [*ASYNC, "rollout.max_staleness=1", "rollout.partial=true",
                                                      f"trainer.total_steps={steps}"]))
    trained, original_take, original_worker = [], rollout_step.RolloutStep.take, rollout_step.RolloutWorker

    def take(self, step):
        taken = original_take(self, step)
        for entry in taken:
            versions = entry.versions
            trained.append((step, versions[entry.mask.bool()].tolist(), versions[:, :CUT].unique().tolist(),
                            versions[:, CUT:].unique().tolist()))
        return taken

    rollout_step.RolloutStep.take, rollout_step.RolloutWorker = take, HeldWorker
    try:
        HPATrainer(cfg, groups).train()
    finally:
        rollout_step.RolloutStep.take, rollout_step.RolloutWorker = original_take, original_worker
    return trained


@pytest.mark.multirank
def test_k1_with_partial_rollouts_trains_rows_whose_tokens_span_two_versions(demo, tmp_path):
    steps = 4
    [trained] = run_ranks(_run_partial, args=(demo, tmp_path, steps))
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    assert [step for step, _, _, _ in trained] == list(range(steps))
    assert set(trained[0][1]) == {0}  # sampled by version 0 before any update
    for step, versions, before, after in trained[1:]:
        # the push of version `step` stopped the job (sampled ahead by step - 1) after CUT steps
        assert before == [step - 1] and after == [step], (step, before, after)
        assert set(versions) == {step - 1, step}, (step, versions)
    assert [r["async/lag_max"] for r in metrics] == [0.0] + [1.0] * (steps - 1)
    assert all(r["async/dropped_rows"] == 0.0 for r in metrics)
    assert all("rollout_corr/rollout_is_mean" in r for r in metrics)
