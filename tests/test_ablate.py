"""``hpa ablate``: config checks, the run plan, resumption, the report's statistics (by hand), and a tiny real run."""

import json
import math
import re
import sys

import pytest

from hpa import ablate
from hpa.ablate import AblateConfig, CustomVariant, Interval, load_ablate_config, plan_runs, student_t_quantile
from hpa.config import ConfigError, load_config


def test_t_quantiles_match_the_tables():
    # two-sided 95% critical values of Student's t, as printed in statistics tables
    for df, table in ((1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)):
        assert student_t_quantile(0.975, df) == pytest.approx(table, abs=5e-4)


def test_interval_by_hand():
    iv = Interval.of([0.6, 0.7, 0.8, 0.65, 0.75])
    # mean 0.7; s = sqrt(0.025 / 4) = 0.0790569; half-width = 2.776445 * s / sqrt(5) = 0.0981627
    assert iv.mean == pytest.approx(0.7)
    assert iv.high - iv.mean == pytest.approx(0.0981627, abs=1e-6)
    assert iv.mean - iv.low == pytest.approx(0.0981627, abs=1e-6)
    assert iv.n == 5
    one = Interval.of([0.3, float("nan")])  # non-finite values are left out; one value has no interval
    assert one.mean == 0.3 and one.n == 1 and math.isnan(one.low)


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown variant 'ppo-only'"):
        AblateConfig(variants=("ppo-only",))
    with pytest.raises(ConfigError, match="unique"):
        AblateConfig(variants=("hpa",), custom=(CustomVariant(name="hpa"),))
    with pytest.raises(ConfigError, match="distinct"):
        AblateConfig(seeds=(1, 1))
    path = tmp_path / "a.yaml"
    path.write_text("ablate:\n  seeds: [1, 2]\n  varaints: [hpa]\n")
    with pytest.raises(ConfigError, match=r"a\.yaml:3.*ablate\.varaints.*closest valid keys: ablate\.variants"):
        load_ablate_config(str(path))
    path.write_text("ablate:\n  seeds: [1, 2]\n")
    with pytest.raises(ConfigError, match="ablate.overrides"):
        load_ablate_config(str(path), ["trainer.total_steps=3"])
    cfg = load_ablate_config(str(path), ["ablate.seeds=[4, 5, 6]",
                                         "ablate.custom=[{name: beta, overrides: [algorithm.dpo.beta=0.3]}]"])
    assert cfg.seeds == (4, 5, 6) and cfg.custom[0].overrides == ("algorithm.dpo.beta=0.3",)


def test_every_builtin_variant_is_a_valid_training_config(tmp_path):
    # the gate's variants need held-out pairs and reward models (the sampled ceiling reads them): without
    # them every check, the cross-section ones too, refuses hpa-gate and hpa-trust (test_ablate_precheck_*)
    cfg = AblateConfig(variants=tuple(ablate.BUILTIN_VARIANTS), seeds=(7,), out_dir=str(tmp_path),
                       overrides=("trainer.total_steps=9", "data.heldout_preference_path=heldout.jsonl",
                                  "reward.model_paths=[rm]"),
                       custom=(CustomVariant(name="mine", overrides=("algorithm.dpo.beta=0.3",)),))
    runs = {r.variant: r for r in plan_runs(cfg)}
    assert list(runs) == [*ablate.BUILTIN_VARIANTS, "mine"]
    resolved = {name: load_config(None, r.overrides) for name, r in runs.items()}
    for name, c in resolved.items():
        assert c.trainer.seed == 7 and c.rollout.seed == 7 and c.trainer.total_steps == 9
        assert c.trainer.run_dir == str(tmp_path / "runs" / name / "seed7")
    hpa = resolved["hpa"].algorithm.hpa
    assert resolved["ppo"].algorithm.hpa.w_dpo.used_values() == (0.0,)
    assert resolved["ppo"].algorithm.hpa.w_ppo == hpa.w_ppo
    assert resolved["dpo"].algorithm.hpa.w_ppo.used_values() == (0.0,)
    assert resolved["hpa-token-kl"].algorithm.hpa.lambda_semantic.used_values() == (0.0,)
    assert resolved["hpa-no-uncertainty"].reward.shaping.alpha == 0.0
    assert resolved["hpa"].reward.shaping.alpha > 0
    fixed = resolved["hpa-fixed-weights"].algorithm.hpa
    assert all(getattr(fixed, k).name == "constant" for k in ("w_ppo", "w_dpo", "w_kl", "lambda_token",
                                                               "lambda_semantic"))
    assert resolved["mine"].algorithm.dpo.beta == 0.3


# a stand-in for ``hpa train``: writes the metrics a run would, from a table keyed by (variant, seed)
FAKE = r"""
import json, sys
from pathlib import Path
run_dir, variant, seed = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
table = json.loads(sys.argv[4])
with open(run_dir / "calls", "a") as f:
    f.write("1\n")
if variant == "broken" and seed == 2:
    sys.exit(3)
final, best, reward = table[variant][str(seed)]
rows = [{"step": 0, "eval/score": 0.5, "eval/model_reward": 0.0, "eval/kl": 0.0, "hacking/gap_growth": 0.0},
        {"step": 1, "guard/rollbacks": 0.0, "guard/skipped_steps": 0.0},
        {"step": 2, "eval/score": best, "eval/model_reward": reward / 2, "eval/kl": 0.01},
        {"step": 4, "eval/score": final, "eval/model_reward": reward, "eval/kl": 0.02 * seed,
         "hacking/gap_growth": reward - final + 0.5, "guard/rollbacks": float(seed == 3),
         "guard/skipped_steps": 2.0}]
with open(run_dir / "metrics.jsonl", "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
"""

TABLE = {  # (final, best, learned reward) per seed
    "hpa": {"1": (0.7, 0.75, 0.2), "2": (0.8, 0.8, 0.1), "3": (0.75, 0.9, 0.3)},
    "ppo": {"1": (0.2, 0.6, 0.9), "2": (0.3, 0.55, 0.8), "3": (0.5, 0.5, 0.2)},
    "broken": {"1": (0.6, 0.6, 0.0), "2": (0.0, 0.0, 0.0), "3": (0.6, 0.6, 0.0)},
}


@pytest.fixture
def fake_train(monkeypatch):
    def command(cfg, run):
        return [sys.executable, "-c", FAKE, str(run.run_dir), run.variant, str(run.seed), json.dumps(TABLE)]

    monkeypatch.setattr(ablate, "run_command", command)


def _table_rows(md):
    rows = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 12 and cells[0] in TABLE:
            rows[cells[0]] = cells
    return rows


def test_runs_resume_and_report_by_hand(tmp_path, fake_train):
    cfg = AblateConfig(variants=("hpa", "ppo"), custom=(CustomVariant(name="broken"),), seeds=(1, 2, 3),
                       out_dir=str(tmp_path), max_parallel=2)
    runs = plan_runs(cfg)
    assert ablate.execute(cfg, runs) == {"ran": 9, "skipped": 0, "failed": 1, "stopped": 0}
    # resumption: finished runs are not rerun, the failed one is retried
    assert ablate.execute(cfg, runs) == {"ran": 1, "skipped": 8, "failed": 1, "stopped": 0}
    calls = {(r.variant, r.seed): len((r.run_dir / "calls").read_text().split()) for r in runs}
    assert calls[("hpa", 1)] == 1 and calls[("broken", 2)] == 2
    (tmp_path / "runs" / "ppo" / "seed2" / ablate.RUN_RECORD).unlink()
    (tmp_path / "runs" / "ppo" / "seed2" / "metrics.jsonl").unlink()
    assert ablate.execute(cfg, runs) == {"ran": 2, "skipped": 7, "failed": 1, "stopped": 0}

    md = ablate.write_report(cfg, runs).read_text()
    rows = _table_rows(md)
    # hpa final 0.7, 0.8, 0.75: mean 0.75, s = 0.05, half-width t(0.975, 2) * 0.05 / sqrt(3) = 0.124206
    assert rows["hpa"][2] == "0.750 [0.626, 0.874]"
    # best after the start: 0.75, 0.8, 0.9 -> mean 0.816667, s = 0.076376, half-width 0.189730
    assert rows["hpa"][3] == "0.817 [0.627, 1.006]"
    assert rows["hpa"][4].startswith("0.200 ")  # learned reward at the end
    assert rows["hpa"][5].startswith("0.040 ")  # token KL at the end: 0.02, 0.04, 0.06
    assert rows["hpa"][7] == "1" and rows["hpa"][8] == "6"  # rollbacks, skipped steps (totals)
    # ppo: learned reward up and gold down in seeds 1 and 2 (hacked); seed 1 and 2 end > 0.1 below 0.5
    assert rows["ppo"][9] == "2/3" and rows["ppo"][10] == "2/3"  # hacked seeds, collapsed seeds
    assert rows["hpa"][9] == "0/3" and rows["hpa"][10] == "0/3"
    # the failed seed counts as collapsed and is left out of the means
    assert rows["broken"][1] == "2/3" and rows["broken"][10] == "1/3" and rows["broken"][2] == "0.600 [0.600, 0.600]"
    assert "hpa vs ppo: overlap" in md and "**hpa beats broken**" in md
    assert re.search(r"\| ppo \| 2 \| 0\.500 \| 0\.300 \| 0\.550 \| 0\.800 \|", md)  # a per-seed row
    assert (tmp_path / "curves_eval_score.png").stat().st_size > 0
    stats = json.loads((tmp_path / "ablation.json").read_text())
    assert stats["hpa"]["stats"]["gold_final"]["mean"] == pytest.approx(0.75)


def test_a_finished_run_with_other_overrides_is_an_error(tmp_path, fake_train):
    cfg = AblateConfig(variants=("hpa",), seeds=(1,), out_dir=str(tmp_path))
    ablate.execute(cfg, plan_runs(cfg))
    other = AblateConfig(variants=("hpa",), seeds=(1,), out_dir=str(tmp_path), overrides=("optim.lr=1e-3",))
    with pytest.raises(ConfigError, match="other overrides"):
        ablate.execute(other, plan_runs(other))


@pytest.mark.slow
def test_tiny_real_ablation(tmp_path):
    """``hpa ablate`` end to end on the small demo task: hpa and dpo, one seed, 2 steps; the dpo run spends
    no rollouts; a second call reruns nothing."""
    import subprocess

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "trainer"))
    from multirank import run_ranks
    from trainer_runs import make_task, overrides, save_initial_policy

    make_task(tmp_path, 64, 6)
    run_ranks(save_initial_policy, args=(str(tmp_path / "init"),))
    train = [o for o in overrides(tmp_path, tmp_path / "unused") if not o.startswith("trainer.run_dir")]
    spec = tmp_path / "ablate.yaml"
    spec.write_text(json.dumps({"ablate": {"overrides": train, "variants": ["hpa", "dpo"], "seeds": [1],
                                           "out_dir": str(tmp_path / "out")}}))
    cmd = [sys.executable, "-m", "hpa.cli", "ablate", "--config", str(spec)]
    for expected in ("2 runs ran", "0 runs ran"):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0 and expected in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = {}
    for variant in ("hpa", "dpo"):
        lines = (tmp_path / "out" / "runs" / variant / "seed1" / "metrics.jsonl").read_text().splitlines()
        records[variant] = [json.loads(line) for line in lines]
    assert any("timing_s/rollout" in r for r in records["hpa"])
    assert not any("timing_s/rollout" in r or "reward/raw_mean" in r for r in records["dpo"])
    assert any("dpo/loss" in r for r in records["dpo"])
    assert "| dpo | 1 |" in (tmp_path / "out" / "ablation.md").read_text()


def test_cli_reports_a_bad_ablation_file(tmp_path, capsys):
    from hpa.cli import main

    path = tmp_path / "a.yaml"
    path.write_text("ablate:\n  variants: [hpa, ppo-only]\n")
    assert main(["ablate", "--config", str(path)]) == 2
    assert "unknown variant 'ppo-only'" in capsys.readouterr().err


def test_training_config_resolves_against_the_ablation_file(tmp_path):
    (tmp_path / "train.yaml").write_text("trainer:\n  total_steps: 3\n")
    path = tmp_path / "a.yaml"
    path.write_text("ablate:\n  config: train.yaml\n")
    assert load_ablate_config(str(path)).config == str(tmp_path / "train.yaml")


@pytest.mark.parametrize("name", ["ablate_demo.yaml", "ablate_hackable.yaml", "ablate_split.yaml",
                                  "ablate_freetext.yaml"])
def test_shipped_ablation_files_resolve(name):
    from pathlib import Path

    cfg = load_ablate_config(str(Path(__file__).parents[1] / "configs" / name))
    runs = plan_runs(cfg)
    assert len(runs) == len(cfg.variant_overrides()) * len(cfg.seeds) and len(cfg.seeds) >= 5
    for run in runs[::len(cfg.seeds)]:
        load_config(cfg.config, run.overrides)


def test_single_component_baselines_start_from_the_recipe():
    """ppo, dpo and each trust part alone are defined on the recipe preset, so they keep their meaning
    whatever the defaults; hpa is the defaults."""
    from hpa.ablate import BUILTIN_VARIANTS
    from hpa.config.presets import PRESETS

    recipe = PRESETS["recipe"]
    for name in ("ppo", "dpo", "dpo-rpo", "hpa-recipe", "hpa-anchor", "hpa-components", "hpa-gate", "hpa-balance"):
        assert BUILTIN_VARIANTS[name][:len(recipe)] == recipe, name
    assert BUILTIN_VARIANTS["hpa"] == ()


def test_the_trust_variants_run_the_controllers_they_ran_before_the_regime():
    """With reward models and held-out pairs (the shipped ablation files), each built-in variant runs the trust
    controllers it ran when they were ``gate.enabled`` / ``coverage.enabled`` (the coverage trust rode along
    wherever per-component advantages were on): the regimes change no run of those files."""
    from hpa.config.schema import coverage_enabled, trust_gate_enabled

    given = ["data.heldout_preference_path=h.jsonl", "reward.model_paths=[rm]", "algorithm.advantage.estimator=grpo"]
    expected = {"hpa": (True, True), "hpa-trust": (True, True), "hpa-gate": (True, True),
                "hpa-components": (False, True), "hpa-recipe": (False, False), "hpa-anchor": (False, False),
                "hpa-balance": (False, False), "dpo-rpo": (False, False)}
    for name, (gate, coverage) in expected.items():
        cfg = load_config(None, [*given, *ablate.BUILTIN_VARIANTS[name]])
        assert (trust_gate_enabled(cfg), coverage_enabled(cfg)) == (gate, coverage), name


# a stand-in for ``hpa train`` that answers SIGTERM as it does (exit_status.json, exit 0) or ignores it
STOPPABLE = r"""
import json, signal, sys, time
from pathlib import Path
run_dir, ignore = Path(sys.argv[1]), sys.argv[2] == "ignore"
def on_term(signum, frame):
    if not ignore:
        (run_dir / "exit_status.json").write_text(json.dumps({"reason": "signal", "step": 3, "resumable": True}))
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
(run_dir / "ready").write_text("1")
while True:
    time.sleep(0.05)
"""


def test_a_stopped_ablation_ends_every_run_it_started(tmp_path, monkeypatch):
    """SIGTERM to the ablation: the run that checkpoints on SIGTERM exits by itself, the one that ignores it is
    killed at the stop timeout, the third never starts; nothing is recorded as finished, so all three rerun."""
    import os
    import signal
    import threading
    import time

    pids = []

    def command(cfg, run):
        return [sys.executable, "-c", STOPPABLE, str(run.run_dir), "ignore" if run.variant == "ppo" else "checkpoint"]

    real_popen = ablate.subprocess.Popen

    def popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        pids.append(proc.pid)
        return proc

    monkeypatch.setattr(ablate, "run_command", command)
    monkeypatch.setattr(ablate.subprocess, "Popen", popen)
    cfg = AblateConfig(variants=("hpa", "ppo", "dpo"), seeds=(1,), out_dir=str(tmp_path), max_parallel=2,
                       stop_timeout_s=2.0)
    runs = plan_runs(cfg)

    def stop_when_ready():
        deadline = time.time() + 30
        while not all((r.run_dir / "ready").exists() for r in runs[:2]) and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    handler_before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_when_ready, daemon=True).start()
    start = time.time()
    with pytest.raises(ablate.AblationStopped) as stopped:
        ablate.execute(cfg, runs)
    assert time.time() - start < 20
    assert stopped.value.signum == signal.SIGTERM
    states = {run.variant: state for run, state in stopped.value.states}
    assert states["hpa"].startswith("stopped at step 3 (signal)")
    assert states["ppo"].startswith("ended by the stop (exit -9)")
    assert states["dpo"] == "not started"
    assert len(pids) == 2
    for pid in pids:  # both reaped: no process left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not any((r.run_dir / ablate.RUN_RECORD).exists() for r in runs)
    assert signal.getsignal(signal.SIGTERM) is handler_before  # restored


@pytest.mark.e2e
def test_sigterm_to_a_real_ablation_checkpoints_its_runs_and_a_rerun_resumes_them(tmp_path):
    """``hpa ablate`` with two runs in flight on the tiny config gets SIGTERM: both runs checkpoint and end
    (no process of the ablation is left), it says so and exits 128 + 15; the same command then resumes both
    from their checkpoints and finishes them."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "trainer"))
    from multirank import run_ranks
    from trainer_runs import make_task, overrides, save_initial_policy

    make_task(tmp_path, 64, 6)
    run_ranks(save_initial_policy, args=(str(tmp_path / "init"),))
    train = [o for o in overrides(tmp_path, tmp_path / "unused", ["trainer.total_steps=16", "trainer.eval_interval=0",
                                                                  "checkpoint.save_interval=100"])
             if not o.startswith("trainer.run_dir")]
    spec = tmp_path / "ablate.yaml"
    spec.write_text(json.dumps({"ablate": {"overrides": train, "variants": ["hpa", "hpa-no-uncertainty"],
                                           "seeds": [1], "max_parallel": 2, "out_dir": str(tmp_path / "out")}}))
    run_dirs = [tmp_path / "out" / "runs" / v / "seed1" for v in ("hpa", "hpa-no-uncertainty")]
    cmd = [sys.executable, "-m", "hpa.cli", "ablate", "--config", str(spec)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # each run is paused (SIGSTOP) once it has trained a step, until the other has too: then both are in
    # their training loops when the ablation gets SIGTERM, whichever started faster
    paused, deadline = {}, time.time() + 240
    while len(paused) < len(run_dirs):
        assert proc.poll() is None and time.time() < deadline, "the runs did not reach their first step"
        for d in run_dirs:
            if d not in paused and (d / "metrics.jsonl").exists():
                train, = [p for p in psutil.Process(proc.pid).children() if f"trainer.run_dir={d}" in p.cmdline()]
                train.suspend()
                paused[d] = train
        time.sleep(0.1)
    family = psutil.Process(proc.pid).children(recursive=True)
    for train in paused.values():
        train.resume()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:] + err[-4000:]
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    steps = {}
    for d in run_dirs:
        status = json.loads((d / "exit_status.json").read_text())
        assert status["reason"] == "signal" and 1 <= status["step"] < 16
        steps[d] = status["step"]
        assert (d / "checkpoints" / "latest").read_text().strip() == f"step_{status['step']:08d}"
        assert not (d / ablate.RUN_RECORD).exists()
        assert f"{d.parent.name} seed 1: stopped at step {status['step']} (signal)" in out
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert rerun.returncode == 0 and "2 runs ran (0 failed" in rerun.stdout, rerun.stdout[-2000:] + rerun.stderr[-4000:]
    for d in run_dirs:
        history = [json.loads(line) for line in (d / "exit_history.jsonl").read_text().splitlines()]
        assert [(h["reason"], h["step"]) for h in history] == [("signal", steps[d]), ("done", 16)]
        logged = [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()]
        assert logged == list(range(1, 17))  # resumed after the checkpoint's step: nothing trained twice
        assert (d / ablate.RUN_RECORD).exists()
