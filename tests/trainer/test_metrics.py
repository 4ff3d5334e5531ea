"""Metrics sinks: the JSONL file (one record per step, resume-safe), the progress bar, TensorBoard,
and nothing written by non-main ranks."""

import json
import math

import pytest

from hpa.config.schema import LoggingConfig, WandbConfig
from hpa.trainer.metrics import MetricsWriter, read_metrics


def cfg(**kw):
    return LoggingConfig(wandb=WandbConfig(mode="disabled"), console=False, **kw)


def test_jsonl_one_record_per_step_and_resume_drops_the_rewritten_steps(tmp_path):
    w = MetricsWriter(tmp_path, cfg(progress_bar=False), is_main=True)
    for step in range(4):
        w.write(step, {"reward/raw_mean": 0.1 * step, "kl/token": float("nan")})
    w.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2]["reward/raw_mean"] == pytest.approx(0.2) and records[2]["kl/token"] == "nan"
    resumed = MetricsWriter(tmp_path, cfg(progress_bar=False), is_main=True, resume_step=2)
    resumed.write(2, {"reward/raw_mean": 7.0})
    resumed.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[2] == {"step": 2, "reward/raw_mean": 7.0}


def test_non_main_ranks_write_nothing(tmp_path):
    w = MetricsWriter(tmp_path, cfg(tensorboard=True), is_main=False, total_steps=3)
    w.write(1, {"reward/raw_mean": 1.0})
    w.close()
    assert list(tmp_path.iterdir()) == []


def test_off_a_terminal_there_is_no_bar_and_a_console_line_every_log_interval_steps(tmp_path, caplog):
    """capsys's stderr is no terminal: no bar; the console lines come at steps 2 and 4 and the last (5)."""
    import logging

    caplog.set_level(logging.INFO, logger="hpa")
    w = MetricsWriter(tmp_path, LoggingConfig(wandb=WandbConfig(mode="disabled"), log_interval=2), is_main=True,
                      total_steps=5)
    for step in range(1, 6):
        w.write(step, {"dpo/loss": 0.5, "actor/lr": 1e-5})
    w.close()
    assert w._bar is None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2", "4", "5"]
    assert all("dpo/loss=0.5" in line and "actor/lr" not in line for line in lines)


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(tmp_path, cfg(tensorboard=True, progress_bar=False), is_main=True)
    w.write(1, {"reward/raw_mean": 0.25, "perf/mfu": "nan"})
    w.write(2, {"reward/raw_mean": 0.75})
    w.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward/raw_mean")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.25), (2, 0.75)]
    assert "perf/mfu" not in events.Tags()["scalars"]  # non-finite values stay in the JSONL only
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["perf/mfu"] == "nan"


def test_wandb_logs_against_hpa_step_so_rewritten_steps_are_kept(tmp_path, monkeypatch):
    """After a rollback or resume hpa writes earlier steps again; wandb drops any ``step=`` that does
    not grow, so hpa logs its step as a metric and plots every other metric against it."""
    import sys
    import types

    calls = []

    class Run:
        dir = str(tmp_path / "wandb")

        def define_metric(self, name, step_metric=None):
            calls.append(("define", name, step_metric))

        def log(self, data, step=None):
            calls.append(("log", dict(data), step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw["mode"], kw["settings"])) or Run(),
                                 Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    w = MetricsWriter(tmp_path, LoggingConfig(wandb=WandbConfig(mode="offline"), console=False, progress_bar=False),
                      is_main=True)
    for step in (1, 2, 3, 2, 3):  # a rollback to step 1 replays 2 and 3
        w.write(step, {"kl/token": 0.1 * step})
    w.close()
    assert calls[0] == ("init", "offline", {"quiet": True, "show_info": False})  # wandb's banner: DEBUG only
    assert ("define", "*", "trainer/step") in calls
    logs = [c for c in calls if c[0] == "log"]
    assert [c[1]["trainer/step"] for c in logs] == [1, 2, 3, 2, 3] and all(c[2] is None for c in logs)
    assert logs[-1][1]["kl/token"] == pytest.approx(0.3) and calls[-1] == ("finish",)


def test_update_mfu_uses_the_update_time_and_padded_tokens():
    from hpa.trainer.metrics import update_perf

    n, tokens, padded = 1_000_000, 3000.0, 4000.0
    perf = update_perf(n, tokens=tokens, padded_tokens=padded, update_seconds=2.0, step_seconds=10.0,
                       model_parallel_size=2, peak_tflops=1.0)
    assert perf["perf/mfu"] == pytest.approx(6 * n * (tokens / 2.0) / 2 / 1e12)  # the update's 2 s, not the step's 10
    assert perf["perf/mfu_padded"] == pytest.approx(6 * n * (padded / 2.0) / 2 / 1e12)
    assert perf["perf/pad_share"] == pytest.approx(1 - tokens / padded)
    assert perf["perf/throughput"] == 300.0 and perf["perf/update_throughput"] == 1500.0
    nan = update_perf(n, tokens=tokens, padded_tokens=padded, update_seconds=2.0, step_seconds=10.0,
                      model_parallel_size=1, peak_tflops=None)
    assert math.isnan(nan["perf/mfu"]) and math.isnan(nan["perf/mfu_padded"])


def test_peak_memory_is_in_the_plans_gb(monkeypatch):
    import torch

    from hpa import plan
    from hpa.trainer import metrics

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 7_400_000_000)
    assert metrics.peak_memory_gb(torch.device("cuda", 0)) == pytest.approx(7.4)  # not 6.89 GiB
    assert metrics.GB == plan.GB == 1e9
    assert 0 < metrics.peak_memory_gb(torch.device("cpu")) < 1e3  # the resident set, in GB


def test_device_timer_waits_for_the_gpu(monkeypatch):
    """On a fake CUDA clock: kernels launched in the block finish 5 s after Python returns; the timer counts them."""
    import torch

    from hpa.trainer.metrics import device_timer

    clock = {"now": 0.0, "pending": 0.0}

    def synchronize(device=None):
        clock["now"] += clock["pending"]
        clock["pending"] = 0.0

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    timings = []
    with device_timer(torch.device("cuda", 0), timings.append, clock=lambda: clock["now"]):
        clock["now"] += 1.0  # launching takes 1 s of Python
        clock["pending"] += 5.0  # the kernels then run 5 s on the GPU
    assert timings == [6.0]
    clock["pending"] = 3.0  # work queued before the block is not the block's
    with device_timer(torch.device("cuda", 0), timings.append, clock=lambda: clock["now"]):
        clock["now"] += 1.0
    assert timings == [6.0, 1.0]
    with device_timer(torch.device("cpu"), timings.append, clock=lambda: clock["now"]):
        clock["pending"] = 9.0  # no synchronisation off CUDA
    assert timings == [6.0, 1.0, 0.0]


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 SXM5 80GB", 989.0), ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA H100 PCIe", 756.0), ("nvidia h100 pcie", 756.0),
    # not SXM parts, so not 989: an H100 NVL (not in the table), a MIG slice, a Grace Hopper, other cards
    ("NVIDIA H100 NVL", None), ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100-SXM4-80GB", None), ("NVIDIA H800", None), ("", None), (None, None)])
def test_the_peak_is_chosen_from_the_device_name(name, peak):
    from hpa.trainer.metrics import device_peak_tflops, peak_tflops

    assert device_peak_tflops(name) == peak
    assert peak_tflops(None, name) == peak
    assert peak_tflops(500.0, name) == 500.0  # a declared peak wins (a capped clock, a card not in the table)


def test_the_loop_measures_mfu_against_the_device_peak(monkeypatch):
    """The trainer's ``perf/mfu`` uses the peak of the device it runs on when none is declared: an H200 NVL's 835,
    not the 989 the GPU-check config once declared for every card."""
    import torch

    from hpa.trainer import metrics

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200 NVL")
    assert metrics.device_name(torch.device("cuda", 0)) == "NVIDIA H200 NVL"
    assert metrics.device_name(torch.device("cpu")) is None and metrics.device_name(None) is None
    peak = metrics.peak_tflops(None, metrics.device_name(torch.device("cuda", 0)))
    perf = metrics.update_perf(1_000, tokens=835e9, padded_tokens=835e9, update_seconds=1.0, step_seconds=2.0,
                               model_parallel_size=1, peak_tflops=peak)
    assert perf["perf/mfu"] == pytest.approx(6.0 * 1_000 * 835e9 / 835e12)
