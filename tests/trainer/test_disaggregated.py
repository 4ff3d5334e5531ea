"""``rollout.placement: disaggregated``: the last ``rollout.num_ranks`` ranks sample with their own copy of the
weights, pushed by the trainer and checked; at ``max_staleness`` 0 the run equals the colocated synchronous run
bit for bit; a push that does not arrive is an error naming the tensors."""

import pytest

from multirank import run_ranks
from trainer_runs import overrides, read_metrics

VOLATILE = ("timing_s/", "perf/")
DISAGGREGATED = ["rollout.placement=disaggregated", "rollout.num_ranks=1"]
BASE = ["trainer.eval_interval=0", "rollout.max_new_tokens=4"]


def _run(groups, root, run_dir, extra, lose_pushes=False):
    from hpa.config import load_config
    from hpa.rollout.worker import WeightPushError

    cfg = load_config(None, overrides(root, run_dir, [*BASE, *extra]))
    if groups.placement is not None and groups.placement.role == "rollout":
        from hpa.rollout import remote
        from hpa.trainer.rollout_server import serve_rollouts

        if lose_pushes:  # the broadcast completes, into copies: the rollout rank's weights never change
            original = remote.receive_weights
            remote.receive_weights = lambda placement, params, names: original(
                placement, {n: params[n].clone() for n in names}, names)
        return ("rollout", groups.rank, serve_rollouts(cfg, groups))
    from hpa.trainer.loop import HPATrainer

    trainer = HPATrainer(cfg, groups)
    try:
        trainer.train()
    except WeightPushError as exc:
        return ("error", str(exc), trainer.rollouts.worker.watched)
    return ("trainer", groups.dp_rank,
            {name: p.detach().clone() for name, p in trainer.parts.policy.model.named_parameters()})


@pytest.mark.multirank
def test_tp1_pp1_dp2_r1_five_steps_at_k1_lag_at_most_one(demo, tmp_path):
    extra = [*DISAGGREGATED, "rollout.max_staleness=1", "algorithm.rollout_correction.rollout_is=token",
             "trainer.total_steps=5"]
    results = run_ranks(_run, dp=2, rollout_ranks=1, args=(demo, tmp_path, extra))
    assert [r[0] for r in results] == ["trainer", "trainer", "rollout"]
    # one job per step and trainer rank (none re-sampled: no row is older than k = 1), one push per step
    assert results[2][2] == {"jobs": 2 * 5, "pushes": 5}
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5]
    # step 0 samples at version 0 (lag 0); every later step trains rows sampled during the previous update
    assert [r["async/lag_max"] for r in metrics] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(r["async/dropped_rows"] == 0.0 for r in metrics)
    first, second = results[0][2], results[1][2]
    for name in first:
        assert first[name].equal(second[name]), name  # DP replicas
        assert bool(first[name].isfinite().all()), name


@pytest.mark.multirank
def test_tp1_pp1_dp2_r1_at_k0_equals_the_colocated_synchronous_run(demo, tmp_path):
    extra = ["trainer.total_steps=4"]
    colocated = run_ranks(_run, dp=2, args=(demo, tmp_path / "colocated", extra))
    disaggregated = run_ranks(_run, dp=2, rollout_ranks=1, args=(demo, tmp_path / "disaggregated",
                                                                  [*extra, *DISAGGREGATED]))
    assert disaggregated[2][2] == {"jobs": 2 * 4, "pushes": 4}
    for (_, _, a), (_, _, b) in zip(colocated, disaggregated[:2]):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].equal(b[name]), name
    a_metrics, b_metrics = read_metrics(tmp_path / "colocated"), read_metrics(tmp_path / "disaggregated")
    assert [r["step"] for r in b_metrics] == [1, 2, 3, 4]
    for a, b in zip(a_metrics, b_metrics):
        assert b["async/lag_max"] == 0.0
        assert {k: v for k, v in a.items() if not k.startswith(VOLATILE)} == \
            {k: v for k, v in b.items() if not k.startswith(VOLATILE)}


@pytest.mark.multirank
def test_tp1_pp1_dp2_r1_a_push_that_changes_nothing_stops_the_run_naming_the_tensors(demo, tmp_path):
    extra = [*DISAGGREGATED, "rollout.max_staleness=1", "algorithm.rollout_correction.rollout_is=token",
             "trainer.total_steps=3"]
    results = run_ranks(_run, dp=2, rollout_ranks=1, args=(demo, tmp_path, extra, True))
    # step 0's push finds the rollout rank's copy equal to the trainer's (the same initial policy); step 1's,
    # after an update, does not arrive
    for kind, error, watched in results[:2]:
        assert kind == "error" and "policy version 1" in error, error
        assert len(watched) == 3 and all(name in error for name in watched), (watched, error)
    assert results[2][0] == "rollout"
    assert len(read_metrics(tmp_path)) == 1


@pytest.mark.multirank
def test_tp1_pp1_dp1_r1_a_run_that_stops_with_a_job_in_flight_ends_both_sides(demo, tmp_path):
    """``trainer.max_steps_per_run`` 2 of 4 at k = 1: the trainer stops after step 2 (index 1) with step 3's job
    sampled ahead and never taken; the rollout rank's answer to it must not keep it (or the launch) waiting."""
    extra = [*DISAGGREGATED, "rollout.max_staleness=1", "algorithm.rollout_correction.rollout_is=token",
             "trainer.total_steps=4", "trainer.max_steps_per_run=2"]
    results = run_ranks(_run, dp=1, rollout_ranks=1, args=(demo, tmp_path, extra),
                        parallel_kwargs={"timeout_minutes": 1.0})
    assert [r[0] for r in results] == ["trainer", "rollout"]
    assert results[1][2] == {"jobs": 3, "pushes": 2}
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def _run_with_a_rollback(groups, root, run_dir, extra):
    import os

    os.environ["HPA_INJECT_FAULT"] = "kl_spike@3"
    try:
        return _run(groups, root, run_dir, extra)
    finally:
        del os.environ["HPA_INJECT_FAULT"]


@pytest.mark.multirank
def test_tp1_pp1_dp1_r1_at_k1_with_a_rollback_equals_the_colocated_worker(demo, tmp_path):
    """k = 1 with a guard rollback after the third step (to the checkpoint of version 2): the rollout rank samples
    what the colocated worker thread samples, so the two runs agree bit for bit (metrics, final weights), and
    what was sampled ahead by the lost policies is discarded on both."""
    extra = ["rollout.max_staleness=1", "algorithm.rollout_correction.rollout_is=token", "trainer.total_steps=5",
             "checkpoint.save_interval=2", "guard.kl_rollback_threshold=10.0"]
    [colocated] = run_ranks(_run_with_a_rollback, args=(demo, tmp_path / "colocated", extra))
    disaggregated = run_ranks(_run_with_a_rollback, rollout_ranks=1,
                              args=(demo, tmp_path / "disaggregated", [*extra, *DISAGGREGATED]))
    # a job per step and one more for step 3 (sampled ahead, then discarded); step 2 again trains the rows its
    # checkpoint holds (no job); a push per step taken
    assert disaggregated[1][2] == {"jobs": 6, "pushes": 6}
    for name in colocated[2]:
        assert colocated[2][name].equal(disaggregated[0][2][name]), name
    a_metrics, b_metrics = read_metrics(tmp_path / "colocated"), read_metrics(tmp_path / "disaggregated")
    assert b_metrics[2]["guard/rollbacks"] == 1 and b_metrics[-1]["async/discarded_rows"] == 8.0
    assert len(a_metrics) == len(b_metrics) == 5
    for a, b in zip(a_metrics, b_metrics):
        assert {k: v for k, v in a.items() if not k.startswith(VOLATILE)} == \
            {k: v for k, v in b.items() if not k.startswith(VOLATILE)}


CUT = 2  # the forward of decode step 1: a cut job has tokens of steps 0 and 1 by the old version


def _run_partial(groups, root, run_dir, extra):
    """``_run``, with the rollout rank's worker holding every second job (trainer rank 1's: the rollout rank takes
    its trainer ranks' messages in turn, so their jobs alternate) in its CUT-th forward until the next push (3 s at
    most: step 0's job gets none), so each push lands in the middle of trainer rank 1's job; the trainer ranks
    record the token versions of the rows they train."""
    from hpa.rollout import remote
    from hpa.trainer import rollout_step

    original_worker, original_take = getattr(remote, "RolloutWorker", None), rollout_step.RolloutStep.take
    trained = []  # (step, versions of the first CUT tokens, versions of the rest, lag of the entry)

    class HeldWorker(rollout_step.RolloutWorker):
        def __init__(self, engine, module, **kwargs):
            super().__init__(engine, module, **kwargs)
            forward, resume, stop, jobs, count = engine._forward, engine.resume, self._jobs.stop, [0], [0]

            def held_resume(partial, *, stop=None):
                if partial.steps == 0:
                    jobs[0], count[0] = jobs[0] + 1, 0
                return resume(partial, stop=stop)

            def held_forward(*args, **kwargs):
                count[0] += 1
                if count[0] == CUT and jobs[0] % 2 == 0:
                    stop.wait(timeout=3.0)
                return forward(*args, **kwargs)

            engine._forward, engine.resume = held_forward, held_resume

    def take(self, step):
        taken = original_take(self, step)
        for entry in taken:
            versions = entry.versions
            trained.append((step, versions[:, :CUT].unique().tolist(), versions[:, CUT:].unique().tolist()))
        return taken

    remote.RolloutWorker, rollout_step.RolloutStep.take = HeldWorker, take
    try:
        result = _run(groups, root, run_dir, extra)
    finally:
        rollout_step.RolloutStep.take = original_take
        if original_worker is not None:
            remote.RolloutWorker = original_worker
    return (*result, trained)


@pytest.mark.multirank
def test_tp1_pp1_dp2_r1_partial_rollouts_continue_across_a_push_that_lands_mid_job(demo, tmp_path):
    steps = 5
    extra = [*DISAGGREGATED, "rollout.max_staleness=1", "rollout.partial=true",
             "algorithm.rollout_correction.rollout_is=token", f"trainer.total_steps={steps}"]
    results = run_ranks(_run_partial, dp=2, rollout_ranks=1, args=(demo, tmp_path, extra))
    assert [r[0] for r in results] == ["trainer", "trainer", "rollout"]
    assert results[2][2] == {"jobs": 2 * steps, "pushes": steps}
    for rank in (0, 1):
        trained = results[rank][3]
        assert [step for step, _, _ in trained] == list(range(steps)), (rank, trained)
        assert trained[0][1:] == ([0], [0])  # sampled by version 0 before any update
        for step, before, after in trained[1:]:
            if rank == 1:  # the push of version `step` stopped the job (sampled ahead by step - 1) after CUT steps
                assert before == [step - 1] and after == [step], (step, before, after)
            else:  # trainer rank 0's job ran unheld: done before the push, or cut by it
                assert before == [step - 1] and set(after) <= {step - 1, step}, (step, before, after)
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    assert [r["async/lag_max"] for r in metrics] == [0.0] + [1.0] * (steps - 1)
    assert all(r["async/dropped_rows"] == 0.0 for r in metrics)
    assert all("rollout_corr/rollout_is_mean" in r for r in metrics)
    first, second = results[0][2], results[1][2]
    for name in first:
        assert first[name].equal(second[name]), name  # DP replicas
        assert bool(first[name].isfinite().all()), name
