"""Fault tolerance: exact resume after a kill, SIGTERM checkpoints, corrupt shards, the guard."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from multirank import free_port, run_ranks
from trainer_runs import launch, overrides, read_metrics

VOLATILE = ("timing_s/", "perf/")


def comparable(record):
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


def assert_same_metrics(a, b, steps):
    by_step_a = {r["step"]: comparable(r) for r in a}
    by_step_b = {r["step"]: comparable(r) for r in b}
    for step in steps:
        ra, rb = by_step_a[step], by_step_b[step]
        assert ra.keys() == rb.keys()
        for k in ra:
            if isinstance(ra[k], str):  # a non-finite metric is written as "nan"/"inf"
                assert rb[k] == ra[k], (step, k)
                continue
            assert rb[k] == pytest.approx(ra[k], rel=1e-6, abs=1e-6), (step, k)


FOUR_STEPS = ["trainer.total_steps=4", "checkpoint.save_interval=1", "guard.kl_rollback_threshold=null"]


@pytest.fixture(scope="module")
def uninterrupted(demo):
    return launch(demo, demo / "ft_ref", 4, FOUR_STEPS)


@pytest.mark.e2e
def test_kill_9_one_rank_then_resume_equals_uninterrupted(demo, uninterrupted):
    run_dir = demo / "ft_killed"
    launch(demo, run_dir, 4, FOUR_STEPS, env={"HPA_INJECT_FAULT": "kill@3:1"}, expect=None)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts[-1] == "step_00000002"  # died in step 3
    resumed = launch(demo, run_dir, 4, FOUR_STEPS + ["checkpoint.resume=auto"])
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert_same_metrics(uninterrupted, resumed, steps=[1, 2, 3, 4])


@pytest.mark.e2e
def test_an_injected_fault_fires_once_per_run_not_once_per_process(tmp_path, monkeypatch):
    """A worker that torchrun restarts is a new process; it must not fault again (else it dies forever)."""
    from hpa.trainer import faults

    monkeypatch.setenv(faults.ENV, "nan_loss@2,kill@3:1")
    monkeypatch.setattr(faults, "_FIRED", set())
    monkeypatch.setattr(faults, "_MARKER_DIR", None)
    faults.record_in(tmp_path)
    assert faults.active("nan_loss", 2, 0)
    assert not faults.active("nan_loss", 2, 0)  # the same process (a rolled-back step)
    monkeypatch.setattr(faults, "_FIRED", set())  # a restarted process of the same run
    assert not faults.active("nan_loss", 2, 0)
    assert faults.active("nan_loss", 2, 1)  # every rank has its own marker
    assert not faults.active("kill", 3, 0) and not faults.active("nan_loss", 3, 0)
    assert sorted(p.name for p in (tmp_path / "faults_fired").iterdir()) == ["nan_loss@2.rank0", "nan_loss@2.rank1"]

    kill = [sys.executable, "-c", f"from hpa.trainer import faults; faults.record_in({str(tmp_path)!r}); "
            "faults.maybe_kill(3, 1); print('alive')"]
    env = dict(os.environ, **{faults.ENV: "kill@3:1"})
    first = subprocess.run(kill, env=env, capture_output=True, text=True, timeout=60)
    assert first.returncode == -signal.SIGKILL and (tmp_path / "faults_fired" / "kill@3.rank1").is_file()
    second = subprocess.run(kill, env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0 and second.stdout.strip() == "alive", second.stderr


@pytest.mark.slow
def test_kill_9_mid_step_under_max_restarts_resumes_by_itself_tp1_pp1_dp2(demo):
    """torchrun --max-restarts=1, rank 1 SIGKILLs itself mid-step 3: torchrun restarts both workers, they
    resume from step 2 (the newest checkpoint) and the run finishes with the metrics of an uninterrupted
    run, each step written once. The restart reuses torchrun's rendezvous store, so it also checks that
    the restarted workers do not connect to the dead ones' addresses."""
    reference = launch(demo, demo / "ft_restart_ref", 2, FOUR_STEPS)
    run_dir = demo / "ft_restart"
    output = []
    metrics = launch(demo, run_dir, 2, FOUR_STEPS, env={"HPA_INJECT_FAULT": "kill@3:1"},
                     torchrun_args=["--max-restarts=1"], output=output)
    log = output[0]
    assert (run_dir / "faults_fired" / "kill@3.rank1").is_file()
    assert "exitcode: -9" in log  # rank 1 did die
    assert log.count("initialised tp1_pp1_dp2") == 4  # and both workers started twice
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in log
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4]
    assert_same_metrics(reference, metrics, steps=[1, 2, 3, 4])


@pytest.mark.e2e
def test_kill_9_of_the_rollout_rank_under_max_restarts_resumes_by_itself_tp1_pp1_dp2_r1(demo):
    """Disaggregated, 2 trainer ranks at DP 2 + 1 rollout rank (global rank 2), k = 1 with partial rollouts: the
    rollout rank SIGKILLs itself as step 3's weight push arrives; torchrun --max-restarts=1 restarts the whole
    world, which resumes from step 2's checkpoint (its rows sampled ahead included) and finishes with the metrics of
    an uninterrupted run. (A push lands mid-job only when the job is slower than a training step: not here, so the
    two runs sample alike.)"""
    extra = ["trainer.total_steps=5", "checkpoint.save_interval=1", "guard.kl_rollback_threshold=null",
             "trainer.eval_interval=0", "rollout.placement=disaggregated", "rollout.num_ranks=1",
             "rollout.max_staleness=1", "rollout.partial=true", "algorithm.rollout_correction.rollout_is=token"]
    reference = launch(demo, demo / "ft_rollout_rank_ref", 3, extra)
    run_dir, output = demo / "ft_rollout_rank_killed", []
    metrics = launch(demo, run_dir, 3, extra, env={"HPA_INJECT_FAULT": "kill@3:2"},
                     torchrun_args=["--max-restarts=1"], output=output)
    log = output[0]
    assert (run_dir / "faults_fired" / "kill@3.rank2").is_file()
    assert "exitcode: -9" in log  # the rollout rank did die
    assert log.count("rollout rank 2 serves trainer ranks [0, 1]") == 2  # and was started twice
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in log
    assert [r["step"] for r in metrics] == [r["step"] for r in reference] and metrics[-1]["step"] == 5
    assert [r["async/lag_max"] for r in metrics if r["step"] >= 1] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert_same_metrics(reference, metrics, steps=[1, 2, 3, 4, 5])


def final_policy(run_dir, step):
    """The checkpoint's policy (weights and optimizer state), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / f"policy_{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:08d}" / "policy", out)
    return torch.load(out, weights_only=False)


@pytest.mark.e2e
def test_kill_9_at_max_staleness_1_then_resume_equals_uninterrupted_tp1_pp1_dp2(demo):
    """k = 1, two DP ranks: rank 1 SIGKILLs itself mid-step 3, while the worker samples step 3's prompts; the
    restart resumes from step 2's checkpoint, which holds each rank's rows sampled ahead for step 2 (by
    version 1), and ends with the uninterrupted run's metrics and final weights and optimizer state, bit for
    bit. Without the rows ahead in the checkpoint the resumed step 3 drew the prompts of step 4."""
    extra = FOUR_STEPS + ["rollout.max_staleness=1", "algorithm.rollout_correction.rollout_is=token"]
    reference = launch(demo, demo / "ft_async_ref", 2, extra)
    run_dir = demo / "ft_async_killed"
    launch(demo, run_dir, 2, extra, env={"HPA_INJECT_FAULT": "kill@3:1"}, expect=None)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))[-1] == "step_00000002"
    resumed = launch(demo, run_dir, 2, extra)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert [r["async/lag_max"] for r in resumed[1:]] == [0.0, 1.0, 1.0, 1.0]  # step 1: the first push samples it
    assert [comparable(r) for r in resumed] == [comparable(r) for r in reference]
    expected, got = final_policy(demo / "ft_async_ref", 4), final_policy(run_dir, 4)
    assert expected.keys() == got.keys()
    for key in expected:
        same = expected[key].equal(got[key]) if isinstance(expected[key], torch.Tensor) else expected[key] == got[key]
        assert same, key


@pytest.mark.e2e
def test_max_steps_per_run_exits_resumable_and_resume_is_exact(demo, uninterrupted):
    run_dir = demo / "ft_sliced"
    launch(demo, run_dir, 4, FOUR_STEPS + ["trainer.max_steps_per_run=2"])
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status == {"reason": "max_steps_per_run", "step": 2, "resumable": True, "best_step": 0}
    resumed = launch(demo, run_dir, 4, FOUR_STEPS)
    assert_same_metrics(uninterrupted, resumed, steps=[3, 4])
    # the status is the last process's: the resumed one finished the run
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status == {"reason": "done", "step": 4, "resumable": False, "best_step": 0}
    history = [json.loads(line) for line in (run_dir / "exit_history.jsonl").read_text().splitlines()]
    assert [(h["reason"], h["step"]) for h in history] == [("max_steps_per_run", 2), ("done", 4)]


@pytest.mark.e2e
def test_sigterm_saves_a_complete_checkpoint_and_exits_cleanly(demo):
    from hpa.trainer.checkpoint import verify

    run_dir = demo / "ft_sigterm"
    cmd = [sys.executable, "-m", "hpa.train", *overrides(demo, run_dir, ["trainer.total_steps=50"])]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port())),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.5)
    while time.time() < deadline and len(read_metrics(run_dir)) < 2:  # step 0 (eval) and step 1
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped at step" in err
    assert json.loads((run_dir / "exit_status.json").read_text())["reason"] == "signal"
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert saved and not list((run_dir / "checkpoints").glob("*.tmp"))
    manifest = verify(saved[-1])
    assert manifest["step"] == read_metrics(run_dir)[-1]["step"] < 50


@pytest.mark.slow
def test_usr1_through_torchrun_after_a_periodic_save_still_checkpoints(demo):
    """torchrun forwards SIGUSR1 to each worker's whole process group, and after the first save that group
    holds the checkpoint writer's helper process (megatron's multiprocessing manager). The helper must
    survive the signal, or the checkpoint the signal asks for fails (EOFError) and the preemption is lost."""
    from hpa.trainer.checkpoint import verify

    run_dir = demo / "ft_usr1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
           "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "-m", "hpa.train",
           *overrides(demo, run_dir, ["trainer.total_steps=50", "checkpoint.save_interval=1"])]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not ((run_dir / "metrics.jsonl").exists() and read_metrics(run_dir)[-1]["step"] >= 2):
            assert time.time() < deadline and proc.poll() is None, "the run never reached step 2"
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)  # to torchrun, as srun forwards it
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (run_dir / "exit_status.json").is_file(), err[-3000:]
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["reason"] == "signal" and 2 <= status["step"] < 50
    manifest = verify(run_dir / "checkpoints" / f"step_{status['step']:08d}")
    assert manifest["step"] == status["step"] == read_metrics(run_dir)[-1]["step"]


@pytest.mark.e2e
def test_truncated_shard_is_detected_and_resume_falls_back(demo, uninterrupted, caplog):
    import shutil

    from hpa.config.schema import CheckpointConfig
    from hpa.trainer.checkpoint import CheckpointError, CheckpointManager, verify

    run_dir = demo / "ft_corrupt"
    shutil.copytree(demo / "ft_ref" / "checkpoints", run_dir / "checkpoints")
    latest = run_dir / "checkpoints" / "step_00000004"
    shard = max((p for p in (latest / "policy").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard.name}.*truncated"):
        verify(latest)

    class Groups:  # one process, no torch.distributed: the manager only needs these
        is_main, rank = True, 0

    manager = CheckpointManager(CheckpointConfig(), run_dir, Groups())
    with caplog.at_level("WARNING", logger="hpa"):
        chosen = manager.find_resumable("auto")
    assert chosen.name == "step_00000003"
    assert "falling back" in caplog.text and shard.name in caplog.text


def test_top_k_retention_keeps_exactly_the_right_checkpoints(tmp_path):
    from hpa.config.schema import CheckpointConfig
    from hpa.trainer.checkpoint import CheckpointManager, write_manifest

    class Groups:
        is_main, rank = True, 0

    scores = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.7, 5: None, 6: 0.3, 7: 0.2}
    for step, score in scores.items():
        d = tmp_path / "checkpoints" / CheckpointManager.name(step)
        d.mkdir(parents=True)
        (d / "trainer_state.pt").write_bytes(b"x")
        write_manifest(d, step, score)
    manager = CheckpointManager(CheckpointConfig(keep_last=2, keep_top_k=2), tmp_path, Groups())
    manager.prune()
    left = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert left == [2, 4, 6, 7]  # the last two (6, 7) and the two best scores (2: 0.9, 4: 0.7)


def compare_weights_worker(groups, first, second):
    from hpa.config import load_config
    from hpa.models import build_policy
    from hpa.models.weights import load_model_weights

    cfg = load_config(None, ["model.num_layers=4"])
    out = []
    for path in (first, second):
        model = build_policy(cfg.model, cfg.parallel, groups)
        load_model_weights(model, path, groups)
        out.append({k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
                    and not k.endswith("_extra_state")})
    return all(torch.equal(out[0][k], out[1][k]) for k in out[0]), any(
        not torch.equal(out[0][k], out[1][k]) for k in out[0])


@pytest.mark.e2e
def test_nan_loss_skips_the_step_bit_identically_and_nan_reward_is_dropped(demo):
    run_dir = demo / "ft_nan"
    metrics = launch(demo, run_dir, 1, ["trainer.total_steps=4", "checkpoint.save_interval=1",
                                        "checkpoint.keep_last=10", "guard.kl_rollback_threshold=null"],
                     env={"HPA_INJECT_FAULT": "nan_loss@2,nan_reward@3"})
    by_step = {r["step"]: r for r in metrics}
    assert by_step[1]["guard/skipped_steps"] == 0
    assert by_step[2]["guard/skipped_steps"] == 1
    assert by_step[4]["guard/skipped_steps"] == 1  # training went on
    assert by_step[3]["reward/nonfinite_count"] > 0 and by_step[2]["reward/nonfinite_count"] == 0
    ck = run_dir / "checkpoints"
    same, _ = run_ranks(compare_weights_worker, args=(str(ck / "step_00000001"), str(ck / "step_00000002")))[0]
    assert same  # the skipped step left the policy bit-identical
    _, moved = run_ranks(compare_weights_worker, args=(str(ck / "step_00000002"), str(ck / "step_00000003")))[0]
    assert moved  # and the next step did update it


@pytest.mark.e2e
def test_kl_spike_rolls_back_lowers_the_lr_and_continues(demo):
    run_dir = demo / "ft_spike"
    metrics = launch(demo, run_dir, 1, ["trainer.total_steps=4", "checkpoint.save_interval=2",
                                        "guard.kl_rollback_threshold=10.0"],
                     env={"HPA_INJECT_FAULT": "kl_spike@3"})
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4]
    by_step = {r["step"]: r for r in metrics}
    assert by_step[2]["guard/rollbacks"] == 0
    assert by_step[3]["guard/rollbacks"] == 1 and by_step[3]["guard/lr_scale"] == 0.5
    assert by_step[3]["actor/lr"] == pytest.approx(0.5 * by_step[2]["actor/lr"])
    assert by_step[4]["guard/rollbacks"] == 1


@pytest.mark.e2e
def test_second_rollback_to_the_same_checkpoint_lowers_the_lr_again(demo):
    """Spikes after steps 3 and 4 both roll back to step 2: the LR of the replayed steps is 0.25x the
    original (the guard's cumulative scale), not 0.5x again (which would replay the same run)."""
    metrics = launch(demo, demo / "ft_spike_twice", 1, ["trainer.total_steps=5", "checkpoint.save_interval=2",
                                                        "guard.kl_rollback_threshold=10.0"],
                     env={"HPA_INJECT_FAULT": "kl_spike@3,kl_spike@4"})
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4, 5]
    by_step = {r["step"]: r for r in metrics}
    assert by_step[3]["guard/rollbacks"] == 2 and by_step[3]["guard/lr_scale"] == 0.25
    for step in (3, 4, 5):
        assert by_step[step]["actor/lr"] == pytest.approx(0.25 * by_step[2]["actor/lr"]), step


@pytest.mark.e2e
def test_run_checkpoint_saved_at_tp1_dp4_resumes_under_tp2_pp2(demo, uninterrupted):
    """A run checkpoint (models, optimizer states, run state) reshards: saved under TP1xDP4 and resumed
    under TP2xPP2 (DP1), it loads and trains on. Step 4's DPO metrics (same pairs, weights restored
    from step 3) equal the uninterrupted TP1 run's; rollout metrics differ by design, because the
    sampling seed of a rollout depends on its DP rank."""
    import shutil

    run_dir = demo / "ft_reshard"
    shutil.copytree(demo / "ft_ref", run_dir)
    (run_dir / "checkpoints" / "latest").write_text("step_00000003")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    resumed = launch(demo, run_dir, 4, FOUR_STEPS + ["parallel.tensor_model_parallel_size=2",
                                                     "parallel.pipeline_model_parallel_size=2"])
    ref = {r["step"]: r for r in uninterrupted}[4]
    got = {r["step"]: r for r in resumed}[4]
    assert [r["step"] for r in resumed][-2:] == [3, 4]
    for key in ("dpo/loss", "dpo/reward_acc", "dpo/margin", "dpo/chosen_reward"):
        assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


class OneProcess:  # no torch.distributed: the checkpoint manager only needs these
    is_main, rank = True, 0


@pytest.mark.parametrize("where", ["shard", "manifest", "pointer"])
def test_failed_save_keeps_latest_and_the_previous_checkpoint_and_removes_its_tmp(tmp_path, monkeypatch, where):
    """Out of space while writing a shard, the manifest or the ``latest`` pointer: the save raises
    CheckpointSaveError, ``latest`` still names the previous checkpoint, which verifies and stays
    the resume choice, and no ``.tmp`` directory is left."""
    import errno
    from pathlib import Path

    from hpa.config.schema import CheckpointConfig
    from hpa.trainer import checkpoint
    from hpa.trainer.checkpoint import CheckpointManager, CheckpointSaveError, verify

    manager = CheckpointManager(CheckpointConfig(keep_last=5), tmp_path, OneProcess())
    first = manager.save(1, {}, {"step": 1})
    real_save, real_write_text = torch.save, Path.write_text

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "shard":
        monkeypatch.setattr(checkpoint.torch, "save", lambda obj, f, *a, **k: (
            real_save(obj, f, *a, **k), full()) if str(f).endswith("trainer_state.pt") else real_save(obj, f, *a, **k))
    else:
        target = checkpoint.MANIFEST + ".tmp" if where == "manifest" else checkpoint.LATEST + ".tmp"
        monkeypatch.setattr(Path, "write_text", lambda self, *a, **k: full() if self.name == target
                            else real_write_text(self, *a, **k))
    with pytest.raises(CheckpointSaveError, match=r"step_00000002 failed \(rank 0: OSError: .*No space left on "
                                                  r"device\); removed step_00000002.tmp, 'latest' still names "
                                                  r"step_00000001"):
        manager.save(2, {}, {"step": 2})
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step_00000001"
    assert not list(root.glob("*.tmp"))
    assert verify(first)["step"] == 1
    assert manager.find_resumable("auto") == first
    assert manager.save(3, {}, {"step": 3}).name == "step_00000003"  # the next save works
    assert (root / "latest").read_text() == "step_00000003"


def test_a_failed_save_says_at_warning_that_the_step_has_no_checkpoint(tmp_path, monkeypatch, caplog):
    """checkpoint.on_save_failure=continue goes on training; the log must say plainly, at WARNING, that this
    step has no checkpoint (a run whose every save fails must not look like one that checkpoints)."""
    from hpa.config import load_config
    from hpa.trainer.checkpoint import CheckpointSaveError
    from hpa.trainer.state import RunState

    cfg = load_config(None, [f"trainer.run_dir={tmp_path}"])
    run = RunState(cfg, OneProcess(), trainables={}, parts={}, guard=None)
    run.step = 7

    def fails(*args, **kwargs):
        raise CheckpointSaveError("saving checkpoint step_00000007 failed (rank 1: ValueError: refused)")

    monkeypatch.setattr(run.ckpt, "save", fails)
    monkeypatch.setattr(run, "state_dict", dict)  # the save fails before the state matters
    with caplog.at_level("WARNING", logger="hpa"):
        assert run.save() is False
    (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert record.getMessage().startswith("NO CHECKPOINT for step 7: saving checkpoint step_00000007 failed")
    assert "training continues (checkpoint.on_save_failure=continue)" in record.getMessage()
    assert run.save_failures == 1 and run.last_save_ok is False


def test_tmp_directory_of_an_interrupted_save_is_ignored_and_removed_on_start(tmp_path, caplog):
    from hpa.config.schema import CheckpointConfig
    from hpa.trainer.checkpoint import CheckpointManager, write_manifest

    root = tmp_path / "checkpoints"
    good = root / "step_00000001"
    good.mkdir(parents=True)
    (good / "trainer_state.pt").write_bytes(b"x")
    write_manifest(good, 1, None)
    (root / "latest").write_text(good.name)
    partial = root / "step_00000002.tmp"
    (partial / "policy").mkdir(parents=True)
    (partial / "policy" / "shard").write_bytes(b"half")
    manager = CheckpointManager(CheckpointConfig(), tmp_path, OneProcess())
    assert manager.candidates() == [good]
    with caplog.at_level("WARNING", logger="hpa"):
        assert manager.find_resumable("auto") == good
    assert not partial.exists() and "step_00000002.tmp" in caplog.text


@pytest.mark.e2e
def test_save_failing_on_one_rank_warns_counts_and_trains_on_unchanged(demo, uninterrupted):
    """Rank 1 runs out of space while saving step 2's checkpoint (checkpoint.on_save_failure=continue,
    the default): every rank learns of it (none waits forever), step 2's checkpoint is not written,
    ``latest`` moves from step 1 straight to step 3, ``checkpoint/save_failures`` counts it, and the
    training itself is the uninterrupted run's."""
    run_dir = demo / "ft_save_fails"
    proc_env = {"HPA_INJECT_FAULT": "save_fail@2:1"}
    metrics = launch(demo, run_dir, 4, FOUR_STEPS + ["checkpoint.keep_last=10", "parallel.timeout_minutes=2"],
                     env=proc_env)
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000001", "step_00000003", "step_00000004"]
    assert (ckpts / "latest").read_text() == "step_00000004"
    by_step = {r["step"]: r for r in metrics}
    assert [by_step[s]["checkpoint/save_failures"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    for record in metrics:
        record["checkpoint/save_failures"] = 0
    assert_same_metrics(uninterrupted, metrics, steps=[1, 2, 3, 4])


@pytest.mark.slow  # two 4-rank runs; the default suite fails saves in the test above and the unit tests
def test_save_failure_with_stop_exits_74_keeps_latest_and_resume_is_exact(demo, uninterrupted):
    run_dir = demo / "ft_save_stops"
    env = dict(os.environ, OMP_NUM_THREADS="1", HPA_INJECT_FAULT="save_fail@3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", f"--master_port={free_port()}",
           "-m", "hpa.train", *overrides(demo, run_dir, FOUR_STEPS + ["checkpoint.on_save_failure=stop"])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0
    assert "exitcode  : 74" in proc.stderr, proc.stderr[-4000:]
    assert "its checkpoint could not be saved (checkpoint.on_save_failure=stop)" in proc.stderr
    assert "No space left on device" in proc.stderr
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000002"
    assert not list(ckpts.glob("*.tmp")) and not (ckpts / "step_00000003").exists()
    assert json.loads((run_dir / "exit_status.json").read_text())["reason"] == "save_failed"
    assert read_metrics(run_dir)[-1]["checkpoint/save_failures"] == 1
    resumed = launch(demo, run_dir, 4, FOUR_STEPS)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert_same_metrics(uninterrupted, resumed, steps=[1, 2, 3, 4])


def _rank_0_of_a_hung_pair(demo, run_dir, fault):
    """Two ranks of ``hpa train`` with ``HPA_INJECT_FAULT=fault`` (rank 1 hangs) and a 1-minute collective
    timeout: rank 0 must exit 75 while rank 1 is still hung; returns rank 0's stderr."""
    port = free_port()
    args = overrides(demo, run_dir, ["trainer.total_steps=3", "parallel.timeout_minutes=1"])
    procs = []
    for rank in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", HPA_INJECT_FAULT=fault, RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "hpa.train", *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        _, err = procs[0].communicate(timeout=900)
        assert procs[0].returncode == 75, err[-4000:]
        assert procs[1].poll() is None  # the hung rank is still hung; a launcher kills it
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    return err


@pytest.mark.e2e
def test_a_rank_hung_during_start_up_makes_the_others_exit_75_naming_it(demo):
    """Rank 1 stops answering while the trainer starts (before step 1: models, weights, checkpoint); rank
    0 exits 75 with the watchdog's message naming the start-up phase and rank 1, not a traceback."""
    run_dir = demo / "ft_hang_start"
    err = _rank_0_of_a_hung_pair(demo, run_dir, "hang@0:1")
    assert re.search(r"rank 0: a collective in step 0, phase 'start-up' failed after waiting up to "
                     r"parallel.timeout_minutes=1", err), err[-4000:]
    assert re.search(r"rank 1 \(last seen entering step 0, phase 'start-up', \d+ s ago\)", err), err[-4000:]
    assert "Traceback" not in err and "Exiting with status 75" in err
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["reason"] == "collective_failure" and status["step"] == 0


@pytest.mark.e2e
def test_a_hung_rank_makes_the_others_exit_75_naming_phase_and_rank(demo):
    """Rank 1 stops answering at the start of step 2; rank 0's next collective times out after
    parallel.timeout_minutes and it exits with status 75 (a launcher restarts on it), naming the step
    and phase it was in and rank 1, with rank 1's last known position."""
    run_dir = demo / "ft_hang"
    err = _rank_0_of_a_hung_pair(demo, run_dir, "hang@2:1")
    assert re.search(r"rank 0: a collective in step 2, phase 'step(/\w+)?'( \(after '\w+'\))? failed after "
                     r"waiting up to parallel.timeout_minutes=1: .*Timed out", err), err[-4000:]
    assert re.search(r"It waited for rank 1 \(last seen entering step 1, phase 'step/\w+', \d+ s ago\): it never "
                     r"reached this phase", err), err[-4000:]
    assert "Exiting with status 75" in err
    assert json.loads((run_dir / "exit_status.json").read_text())["reason"] == "collective_failure"
