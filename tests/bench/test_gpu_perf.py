"""``bench/gpu_perf.py`` and the GPU check's timing (``bench/gpu_check.py``): the parts that run without a GPU."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timed_steps_leave_out_the_warm_up_and_the_balance_measured_steps():
    """The automatic balance logs ``grad_norm/rollout`` only on a measured step (two backward passes and a copy
    of the gradients): such a step is not the update's pace, nor is a warm-up step."""
    gpu_check = _load("gpu_check")
    measured = {"grad_norm/rollout": 1.0, "grad_norm/pairs": 2.0}
    steps = [dict(step=1, **measured), dict(step=2, **measured), {"step": 3}, {"step": 4}, {"step": 5}]
    assert [r["step"] for r in gpu_check.timed_steps(steps, 3)] == [3, 4, 5]
    assert [r["step"] for r in gpu_check.timed_steps(steps, 2)] == [3, 4, 5]
    assert [r["step"] for r in gpu_check.timed_steps(steps)] == [3, 4, 5]
    # the check's old set-up (measure_steps 10, 4 steps): nothing is left to time, and the rates say so
    every = [dict(step=k, **measured) for k in range(1, 5)]
    assert gpu_check.timed_steps(every) == []
    gpu_perf = _load("gpu_perf")
    rates = gpu_perf.step_rates([], rows=64)
    assert all(v != v for v in rates.values()), rates  # NaN (null in the JSON), not a made-up pace


def test_rates_are_totals_over_totals():
    gpu_perf = _load("gpu_perf")
    timed = [{"perf/update_throughput": 1000.0, "timing_s/update_actor": 1.0, "timing_s/rollout": 2.0,
              "response_length/mean": 10.0, "timing_s/step": 4.0},
             {"perf/update_throughput": 500.0, "timing_s/update_actor": 3.0, "timing_s/rollout": 6.0,
              "response_length/mean": 30.0, "timing_s/step": 10.0}]
    rates = gpu_perf.step_rates(timed, rows=4)
    # update: 1000 + 1500 tokens in 4 s; rollout: (10 + 30) x 4 rows in 8 s
    assert rates == pytest.approx({"update_tokens_per_s": 625.0, "update_tokens_per_step": 1250.0,
                                   "update_s_per_step": 2.0, "rollout_tokens_per_s": 20.0, "step_s": 7.0})


def test_device_busy_share_of_each_phase():
    """Kernel time inside a phase's windows over the windows' wall time; a window nested in another of the
    same phase counts once; kernels outside every window count nowhere."""
    gpu_perf = _load("gpu_perf")
    windows = {"update_actor": [(0.0, 100.0), (20.0, 40.0), (200.0, 300.0)], "reference": [(100.0, 150.0)]}
    kernels = [(10.0, 30.0), (90.0, 110.0), (250.0, 400.0), (160.0, 190.0)]
    out = gpu_perf.profile_figures(windows, kernels, cuda=True)
    # update_actor: wall 100 + 100 µs; busy 20 + 10 + 50; reference: wall 50, busy 10
    assert out["update_actor"] == pytest.approx({"wall_s": 200e-6, "device_s": 80e-6, "device_busy_share": 0.4})
    assert out["reference"] == pytest.approx({"wall_s": 50e-6, "device_s": 10e-6, "device_busy_share": 0.2})
    cpu = gpu_perf.profile_figures(windows, [], cuda=False)
    assert cpu["reference"] == {"wall_s": pytest.approx(50e-6), "device_s": None, "device_busy_share": None}
    assert gpu_perf.merge([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]


def test_phase_intervals_read_the_profiler_events():
    """Windows from the CPU side of each phase's ``record_function`` (a real CPU profile), device intervals
    from the events on the CUDA device; the GPU-side copy of an annotation is neither."""
    from torch.autograd import DeviceType

    gpu_perf = _load("gpu_perf")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for name in ("update_actor", "reference", "update_actor"):
            with torch.profiler.record_function(gpu_perf.PHASE_PREFIX + name):
                torch.ones(64, 64) @ torch.ones(64, 64)
    windows, device = gpu_perf.phase_intervals(prof)
    assert sorted(windows) == ["reference", "update_actor"] and len(windows["update_actor"]) == 2
    assert all(end > start for spans in windows.values() for start, end in spans) and device == []
    event = lambda name, kind, start, end: types.SimpleNamespace(  # noqa: E731
        name=name, device_type=kind, time_range=types.SimpleNamespace(start=start, end=end))
    fake = types.SimpleNamespace(events=lambda: [
        event(gpu_perf.PHASE_PREFIX + "update_actor", DeviceType.CPU, 0, 10),
        event(gpu_perf.PHASE_PREFIX + "update_actor", DeviceType.CUDA, 1, 9),  # gpu_user_annotation
        event("ampere_bf16_gemm", DeviceType.CUDA, 2, 5), event("aten::mm", DeviceType.CPU, 1, 2)])
    assert gpu_perf.phase_intervals(fake) == ({"update_actor": [(0, 10)]}, [(2, 5)])
    assert gpu_perf.phase_intervals(None) == ({}, [])


def test_cpu_needs_tiny_and_the_timed_window_is_inside_the_run(capsys):
    gpu_perf = _load("gpu_perf")
    for argv, message in ((["--device", "cpu"], "--tiny"), (["--steps", "5", "--timed-from", "6"], "--timed-from")):
        with pytest.raises(SystemExit):
            gpu_perf.parse_args(argv)
        assert message in capsys.readouterr().err
    args = gpu_perf.parse_args([])
    assert (args.steps, args.timed_from, args.rollout_rows, args.rollout_tokens) == (5, 3, [64, 256], 256)


@pytest.mark.e2e
def test_gpu_perf_runs_on_cpu_tiny(tmp_path):
    """Every part of ``bench/gpu_perf.py`` at narrow widths on CPU: both configs' runs timed over steps 2-3
    (step 1, the balance's measured step, left out), the profiled step's phases, the rollout at two row
    counts; one JSON line, no MFU without a peak."""
    proc = subprocess.run([sys.executable, "bench/gpu_perf.py", "--device", "cpu", "--tiny", "--run-dir",
                           str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["ok"] and out["failed"] == [] and out["device"] == "cpu" and out["peak_tflops"] is None
    for key, rows in (("base", 8), ("perf", 16)):
        run = out[key]
        assert run["rows"] == rows and run["timed_steps"] == [2, 3] and run["measured_steps"] == [1], run
        assert run["update_tokens_per_s"] > 0 and run["rollout_tokens_per_s"] > 0 and run["update_mfu"] is None
    profile = out["profile"]
    assert profile["step"] == 4 and profile["train_step"]["wall_s"] > profile["update_actor"]["wall_s"]
    for phase in ("rollout", "old_logprob", "reference", "update_actor", "train_step"):
        assert profile[phase]["wall_s"] > 0 and profile[phase]["device_busy_share"] is None, profile
    assert {k: (v["rows"], v["generated"]) for k, v in out["rollout"].items()} == {"rows4": (4, 32), "rows8": (8, 64)}
    partial = json.loads((tmp_path / "run" / "figures.partial.json").read_text())  # written after each part
    assert partial["base"] == out["base"] and partial["rollout"] == out["rollout"]


@pytest.mark.parametrize("script", ["gpu_perf.sh", "gpu_check.sh"])
def test_the_gpu_scripts_share_the_set_up_and_stop_without_cuda(script, tmp_path):
    """Both scripts source ``bench/gpu_setup.sh`` (from any working directory), which runs from the repository
    root and stops the script at its CUDA check, before installing or running anything (a stand-in ``python``
    that fails as the check does on a machine without CUDA, and logs where it ran)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text('#!/bin/sh\necho "$PWD" >> "%s"\necho "AssertionError: no CUDA device" >&2\nexit 1\n'
                                 % (tmp_path / "calls"))
    (fake / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "GPU_PERF_LOG_DIR": str(tmp_path / "perf"),
           "GPU_CHECK_LOG_DIR": str(tmp_path / "check")}
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", script), "no_wheels"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "calls").read_text().splitlines() == [ROOT]  # one call, the check, from the root
    assert not (tmp_path / "perf").exists() and not (tmp_path / "check").exists()


def test_gpu_check_fails_when_its_sync_census_run_failed():
    gpu_check = _load("gpu_check")
    probe = {"varlen_calls": 48, "causality_leak_max": 0.0, "changed_after_max": 0.3, "logprob_gap_mean": 0.01}
    steps = [{"rollout/decode_graph": 1.0, "rollout/graph_captures": 1.0, "rollout/decode_buckets": 1.0}] * 4
    good = {"device": "NVIDIA H100", "sequence_packing": True, "packing": {"padded_run_ok": True},
            "decode": gpu_check.decode_figures(steps), "packing_probe": probe,
            "syncs": {"ok": True, "steps": 3, "per_step": 12.0, "startup": 300, "sites": {}}}
    assert gpu_check.failed_checks(good) == []
    assert gpu_check.failed_checks(dict(good, syncs=dict(good["syncs"], ok=False))) == ["the sync census run failed"]


def test_gpu_perf_sh_prints_the_finished_parts_when_the_time_limit_ends_the_run(tmp_path):
    """A run past ``GPU_PERF_TIMEOUT_S`` prints nothing itself: the script prints the figures it had written so
    far (``figures.partial.json``), not ok, saying why, and exits with timeout's status."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(f"""#!/bin/sh
case "$1" in
  -c) exit 0 ;;
  bench/gpu_perf.py) echo '{{"perf": {{"update_mfu": 0.31}}, "failed": []}}' > "$3/figures.partial.json"; exec sleep 30 ;;
  *) exec {sys.executable} "$@" ;;
esac
""")
    (fake / "python").chmod(0o755)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "GPU_PERF_LOG_DIR": str(log),
           "GPU_PERF_TIMEOUT_S": "1"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_perf.sh"), "no_wheels"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 124, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["perf"] == {"update_mfu": 0.31} and out["ok"] is False
    assert out["failed"] == ["bench/gpu_perf.py printed nothing (past the time limit): the parts that finished"]
