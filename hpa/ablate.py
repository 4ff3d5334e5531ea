"""``hpa ablate``: named variants of one training config, over several seeds, compared on held-out numbers.

Every variant trains from the same config (same data, SFT start and reward models) plus its own
overrides; every seed sets ``trainer.seed`` and ``rollout.seed``. Each (variant, seed) is one
``hpa train`` run in ``<out_dir>/runs/<variant>/seed<S>``, started as a subprocess (one process, or
``torchrun`` with ``nproc_per_node`` processes), ``max_parallel`` at a time. A run that finished is
recorded in its ``ablate_run.json`` and never rerun; an interrupted one resumes from its own
checkpoint. When every run is done the summary is written: ``<out_dir>/ablation.md`` (mean and 95%
t-interval over seeds per variant, and the per-seed numbers) and ``<out_dir>/curves_*.png``.

Stopping (Ctrl-C or SIGTERM): no further run starts; every running one gets SIGTERM, which ``hpa train``
answers by checkpointing at the end of its step; one still running ``stop_timeout_s`` later, or at a
second signal, is killed (it resumes from its last periodic checkpoint). Runs are started in sessions of
their own, so a terminal's Ctrl-C reaches them only through this forwarding.

The ablation file has one section, ``ablate`` (``AblateConfig``); dotted overrides on the command
line (``ablate.seeds=[1,2,3]``) are checked against it like any config key::

    ablate:
      config: tiny_cpu.yaml          # the training config (relative to this file)
      overrides: [trainer.total_steps=300]
      variants: [hpa, ppo, dpo]      # built-in names (BUILTIN_VARIANTS)
      custom:                        # more variants: a name and its overrides
        - {name: hpa-beta-0.3, overrides: [algorithm.dpo.beta=0.3]}
      seeds: [1, 2, 3, 4, 5]
      out_dir: runs/ablate
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from hpa.config import load_config
from hpa.config.errors import ConfigError, check_choice, check_range, check_seed, closest
from hpa.config.load import _build_dataclass, _set_dotted, _yaml_with_lines, parse_overrides
from hpa.config.presets import PRESETS

logger = logging.getLogger("hpa.ablate")

RECIPE = PRESETS["recipe"]

# the built-in variants: overrides on top of the training config. The single-component baselines
# (ppo, dpo) and each trust part alone start from the recipe as published (``--preset recipe``), so
# they mean the same whatever the defaults.
BUILTIN_VARIANTS: Dict[str, Tuple[str, ...]] = {
    "hpa": (),
    # no DPO term (the recipe's PPO: no per-component advantages, no gate)
    "ppo": (*RECIPE, "algorithm.hpa.w_dpo.name=constant", "algorithm.hpa.w_dpo.value=0.0"),
    # no PPO term; with w_ppo 0 for the whole run the trainer spends no rollouts (nor their KL and entropy terms)
    "dpo": (*RECIPE, "algorithm.hpa.w_ppo.name=constant", "algorithm.hpa.w_ppo.value=0.0"),
    # the hierarchical KL without its semantic level: the token KL alone
    "hpa-token-kl": ("algorithm.hpa.lambda_semantic.name=constant", "algorithm.hpa.lambda_semantic.value=0.0"),
    # the reward without the ensemble-disagreement penalty
    "hpa-no-uncertainty": ("reward.shaping.alpha=0.0",),
    # no schedules: the recipe's mixing weights and the hierarchical-KL weights held at their starting values
    "hpa-fixed-weights": ("algorithm.hpa.w_ppo={name: constant, value: 0.4}",
                          "algorithm.hpa.w_dpo={name: constant, value: 0.4}",
                          "algorithm.hpa.w_kl={name: constant, value: 0.2}",
                          "algorithm.hpa.lambda_token={name: constant, value: 1.0}",
                          "algorithm.hpa.lambda_semantic={name: constant, value: 0.2}"),
    # the recipe as published: 0.4 / 0.4 / 0.2, none of the trust parts below
    "hpa-recipe": RECIPE,
    # DPO alone with the preference anchor (RPO), the fair baseline for the anchor's gain
    "dpo-rpo": (*RECIPE, "algorithm.hpa.w_ppo.name=constant", "algorithm.hpa.w_ppo.value=0.0",
                "algorithm.dpo.rpo_alpha=1.0"),
    # each trust part alone, on top of the recipe
    "hpa-anchor": (*RECIPE, "algorithm.dpo.rpo_alpha=1.0"),
    # per-component advantages with the coverage trust on their learned part (which rode along with them once
    # it was on by default, experiments/start-rollouts-and-coverage.md; needs reward models and held-out pairs)
    "hpa-components": (*RECIPE, "algorithm.advantage.per_component=true", "algorithm.hpa.trust.regime=coverage"),
    # the trust regime back at auto: the gate, and the coverage trust as above where its inputs are given
    "hpa-gate": (*RECIPE, "algorithm.advantage.per_component=true", "algorithm.hpa.trust.regime=auto"),
    "hpa-balance": (*RECIPE, "algorithm.hpa.balance.enabled=true"),
    # all of them (the defaults, spelled out): anchor, per-component advantages, trust gate, balance
    "hpa-trust": ("algorithm.dpo.rpo_alpha=1.0", "algorithm.advantage.per_component=true",
                  "algorithm.hpa.trust.regime=auto", "algorithm.hpa.balance.enabled=true"),
}
LAUNCHER_NAMES = ("sequential", "torchrun")
# the held-out numbers an evaluation logs (hpa.trainer.evaluate: eval/<name>, and eval/score/<category>,
# eval/trust/<category> per category of the eval prompts); tests/trainer/test_train_e2e.py checks every eval/*
# number a real run logs against it
EVAL_METRIC_NAMES = ("score", "reward", "model_reward", "copy_rate", "response_length", "kl", "trust")
PER_CATEGORY_METRICS = ("score", "trust")
RUN_RECORD = "ablate_run.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CustomVariant:
    """A user-named variant: ``name`` and the dotted overrides that make it."""

    name: str
    overrides: Tuple[str, ...] = ()

    def __post_init__(self):
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError("name", f"a variant name must be a plain directory name, got {self.name!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AblateConfig:
    """The ``ablate`` section.

    Attributes:
        config: the training config file (relative paths resolve against the ablation file); None is the
            embedded default.
        overrides: dotted overrides of the training config, applied to every variant (data, SFT start,
            reward models, number of steps).
        variants: built-in variant names (``BUILTIN_VARIANTS``).
        custom: further variants, each a name and its overrides (applied after ``overrides``).
        seeds: the seeds; each run sets ``trainer.seed`` and ``rollout.seed`` to one of them.
        out_dir: where the runs and the summary go.
        launcher: sequential (one process per run) | torchrun (``nproc_per_node`` processes per run).
        nproc_per_node: processes per run with torchrun.
        max_parallel: runs at a time (on a CPU host, with ``OMP_NUM_THREADS`` set so they share the cores).
        metric: the held-out gold score (a key of the run's metrics).
        collapse_margin: a seed has collapsed when its run failed, its final gold score is not finite, or it
            ends more than this below the starting policy's gold score.
        stop_timeout_s: after Ctrl-C or SIGTERM, how long the running runs have to checkpoint and exit
            before they are killed.
    """

    config: Optional[str] = None
    overrides: Tuple[str, ...] = ()
    variants: Tuple[str, ...] = ("hpa", "ppo", "dpo")
    custom: Tuple[CustomVariant, ...] = ()
    seeds: Tuple[int, ...] = (1, 2, 3)
    out_dir: str = "runs/ablate"
    launcher: str = "sequential"
    nproc_per_node: int = 1
    max_parallel: int = 1
    metric: str = "eval/score"
    collapse_margin: float = 0.1
    stop_timeout_s: float = 300.0

    def __post_init__(self):
        for name in self.variants:
            if name not in BUILTIN_VARIANTS:
                raise ConfigError("variants", f"unknown variant {name!r}; built-in variants: "
                                              f"{', '.join(BUILTIN_VARIANTS)} (closest: "
                                              f"{', '.join(closest(name, BUILTIN_VARIANTS))}); name your own "
                                              "in ablate.custom")
        names = list(self.variants) + [c.name for c in self.custom]
        if not names:
            raise ConfigError("variants", "no variants to run; name built-in ones or add ablate.custom entries")
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ConfigError("custom", f"variant names must be unique, repeated: {duplicated}")
        if not self.seeds:
            raise ConfigError("seeds", "needs at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError("seeds", f"seeds must be distinct, got {list(self.seeds)}")
        check_choice("launcher", self.launcher, LAUNCHER_NAMES)
        if self.nproc_per_node < 1 or self.max_parallel < 1:
            raise ConfigError("max_parallel", "nproc_per_node and max_parallel must be >= 1")
        if self.launcher == "sequential" and self.nproc_per_node != 1:
            raise ConfigError("nproc_per_node", "the sequential launcher runs one process per run; use "
                                                "launcher=torchrun for more")
        for seed in self.seeds:
            check_seed("seeds", seed)
        check_metric(self.metric)
        check_range("collapse_margin", self.collapse_margin, low=0.0)
        check_range("stop_timeout_s", self.stop_timeout_s, low=0.0)

    def variant_overrides(self) -> Dict[str, Tuple[str, ...]]:
        """Every variant's own overrides, in order (built-in first)."""
        out = {name: BUILTIN_VARIANTS[name] for name in self.variants}
        out.update({c.name: c.overrides for c in self.custom})
        return out


def check_metric(metric: str) -> None:
    """``metric`` must be a number an evaluation logs, else every seed would read NaN and count as collapsed."""
    parts = metric.split("/")
    valid = [f"eval/{n}" for n in EVAL_METRIC_NAMES] + [f"eval/{n}/<category>" for n in PER_CATEGORY_METRICS]
    ok = (len(parts) == 2 and parts[0] == "eval" and parts[1] in EVAL_METRIC_NAMES) or \
         (len(parts) == 3 and parts[0] == "eval" and parts[1] in PER_CATEGORY_METRICS and parts[2])
    if not ok:
        raise ConfigError("metric", f"{metric!r} is not a number the evaluation logs; valid: {', '.join(valid)} "
                                    f"(closest: {', '.join(closest(metric, valid))})")


def load_ablate_config(path: Optional[str], overrides: Sequence[str] = ()) -> AblateConfig:
    """The ``ablate`` section of the file at ``path`` with dotted ``ablate.*`` overrides."""
    if path is not None and not Path(path).is_file():
        what = "is a directory" if Path(path).is_dir() else "is not a file" if Path(path).exists() else "does not exist"
        raise ConfigError("--config", f"the ablation file {path} {what}; give an ablation YAML file (one "
                                      "section, 'ablate')", source="command line")
    data, sources = _yaml_with_lines(Path(path)) if path else ({}, {})
    unknown = [k for k in data if k != "ablate"]
    if unknown:
        raise ConfigError(unknown[0], "an ablation file has one section, 'ablate'", source=sources.get(unknown[0]))
    for key, value in parse_overrides(overrides):
        if not key.startswith("ablate."):
            raise ConfigError(key, "hpa ablate takes ablate.* overrides; put training overrides in "
                                   "ablate.overrides or a variant's overrides", source="command line")
        _set_dotted(data, key, value)
        sources[key] = "command line"
    section = data.get("ablate") or {}
    if not isinstance(section, dict):
        raise ConfigError("ablate", "must be a mapping", source=sources.get("ablate"))
    cfg = _build_dataclass(AblateConfig, section, "ablate.", sources)
    base = Path(path).resolve().parent if path else Path.cwd()
    if cfg.config is not None and not Path(cfg.config).is_absolute():
        cfg = dataclasses.replace(cfg, config=str(_existing(base / cfg.config, Path(cfg.config))))
    if cfg.config is not None and not Path(cfg.config).is_file():
        what = "is a directory" if Path(cfg.config).is_dir() else "does not exist"
        raise ConfigError("ablate.config", f"the training config {cfg.config} {what} (relative paths: to the "
                                           "ablation file's directory); give a training YAML file",
                          source=sources.get("ablate.config"))
    return cfg


def _existing(*candidates: Path) -> Path:
    return next((p for p in candidates if p.exists()), candidates[0])


# ------------------------------------------------------------------------------------------- runs


@dataclasses.dataclass(frozen=True)
class Run:
    variant: str
    seed: int
    run_dir: Path
    overrides: Tuple[str, ...]  # all training overrides of this run, in order


def plan_runs(cfg: AblateConfig) -> List[Run]:
    """Every (variant, seed) run, variant-major."""
    runs = []
    for variant, own in cfg.variant_overrides().items():
        for seed in cfg.seeds:
            run_dir = Path(cfg.out_dir) / "runs" / variant / f"seed{seed}"
            overrides = (*cfg.overrides, *own, f"trainer.seed={seed}", f"rollout.seed={seed}",
                         f"trainer.run_dir={run_dir}")
            runs.append(Run(variant, seed, run_dir, overrides))
    return runs


def run_command(cfg: AblateConfig, run: Run) -> List[str]:
    config = ["--config", cfg.config] if cfg.config else []
    if cfg.launcher == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.nproc_per_node}",
                "-m", "hpa.cli"]
    else:
        head = [sys.executable, "-m", "hpa.cli"]
    return [*head, "train", *config, *run.overrides]


def read_record(run: Run) -> Optional[dict]:
    path = run.run_dir / RUN_RECORD
    return json.loads(path.read_text()) if path.exists() else None


def is_done(run: Run) -> bool:
    """True when the run finished before; an error when it finished with other overrides."""
    record = read_record(run)
    if record is None:
        return False
    if tuple(record["overrides"]) != run.overrides:
        raise ConfigError("ablate.out_dir", f"{run.run_dir} finished with other overrides ({record['overrides']}) "
                                            f"than this ablation gives it ({list(run.overrides)}); use a new "
                                            "out_dir or delete that run directory")
    return True


class AblationStopped(Exception):
    """``hpa ablate`` was stopped by a signal; every run it started has ended.

    Attributes:
        signum: the (first) signal received.
        states: every run of the plan with what became of it, in plan order.
    """

    def __init__(self, signum: int, states: List[Tuple[Run, str]]):
        self.signum, self.states = signum, states
        super().__init__(f"hpa ablate stopped by {signal.Signals(signum).name}")


class _StopSignals:
    """Records SIGINT/SIGTERM instead of dying of them (main thread only; restored on exit)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: Optional[int] = None
        self.count = 0
        self._previous: Dict[int, object] = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        self.signum = self.signum or signum
        self.count += 1


def read_exit_status(run: Run) -> dict:
    """The run's ``exit_status.json`` (written by ``hpa train`` when it stops), or ``{}``."""
    path = run.run_dir / "exit_status.json"
    return json.loads(path.read_text()) if path.exists() else {}


def execute(cfg: AblateConfig, runs: Sequence[Run], env: Optional[Dict[str, str]] = None) -> Dict[str, int]:
    """Run every run that is not done, ``max_parallel`` at a time; returns ``{"ran", "skipped", "failed",
    "stopped"}``.

    A run's stdout and stderr go to ``<run_dir>/train.log``. A finished run writes ``ablate_run.json``
    (its overrides, return code and wall time); a failed one does not, so the next call retries it
    (resuming from its last checkpoint), nor does one that exited early but resumable (a signal,
    ``trainer.max_steps_per_run``: ``stopped``).

    Raises:
        AblationStopped: on SIGINT/SIGTERM, once every run it started has ended (see the module docstring).
    """
    env = dict(os.environ if env is None else env)
    pending = [r for r in runs if not is_done(r)]
    states: Dict[Run, str] = {r: "done before" for r in runs if r not in pending}
    counts = {"ran": 0, "skipped": len(runs) - len(pending), "failed": 0, "stopped": 0}
    active: List[Tuple[Run, subprocess.Popen, float, object]] = []
    deadline, killed = math.inf, False
    with _StopSignals() as stop:
        while active or (pending and stop.signum is None):
            while stop.signum is None and pending and len(active) < cfg.max_parallel:
                run = pending.pop(0)
                run.run_dir.mkdir(parents=True, exist_ok=True)
                log = open(run.run_dir / "train.log", "a")
                logger.info("ablate: starting %s seed %d -> %s", run.variant, run.seed, run.run_dir)
                # a session of its own: a terminal's Ctrl-C reaches the run only as the SIGTERM forwarded below
                proc = subprocess.Popen(run_command(cfg, run), stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
                active.append((run, proc, time.time(), log))
            if stop.signum is not None and deadline == math.inf:
                logger.warning("ablate: %s received: stopping %d running run(s) (SIGTERM: each checkpoints at the "
                               "end of its step; killed after %.0f s or at a second signal)",
                               signal.Signals(stop.signum).name, len(active), cfg.stop_timeout_s)
                for _, proc, _, _ in active:
                    proc.send_signal(signal.SIGTERM)
                deadline = time.time() + cfg.stop_timeout_s
            if not killed and (time.time() > deadline or stop.count > 1):
                killed = True
                why = "a second signal" if stop.count > 1 else f"still running after {cfg.stop_timeout_s:.0f} s"
                for run, proc, _, _ in active:
                    logger.warning("ablate: killing %s seed %d (%s)", run.variant, run.seed, why)
                    with contextlib.suppress(ProcessLookupError):  # (it may have exited meanwhile)
                        os.killpg(proc.pid, signal.SIGKILL)  # the run's whole session: torchrun's workers too
            time.sleep(0.2)
            for item in list(active):
                run, proc, start, log = item
                if proc.poll() is None:
                    continue
                active.remove(item)
                log.close()
                states[run] = _finish(run, proc.returncode, time.time() - start, counts,
                                      stopping=stop.signum is not None)
        if stop.signum is not None:
            states.update({r: "not started" for r in pending})
            raise AblationStopped(stop.signum, [(r, states[r]) for r in runs])
    return counts


def _finish(run: Run, returncode: int, wall: float, counts: Dict[str, int], *, stopping: bool) -> str:
    """Records a run that exited, counts it, and says what became of it."""
    counts["ran"] += 1
    status = read_exit_status(run) if returncode == 0 else {}
    if returncode == 0 and not status.get("resumable", False):
        (run.run_dir / RUN_RECORD).write_text(json.dumps(
            {"variant": run.variant, "seed": run.seed, "overrides": list(run.overrides),
             "returncode": returncode, "wall_s": wall}))
        logger.info("ablate: %s seed %d finished in %.0f s", run.variant, run.seed, wall)
        return f"finished in {wall:.0f} s"
    if returncode == 0:
        counts["stopped"] += 1
        state = f"stopped at step {status.get('step')} ({status.get('reason')}); the next hpa ablate resumes it"
    elif stopping:
        counts["stopped"] += 1
        state = f"ended by the stop (exit {returncode}); the next hpa ablate resumes it from its last checkpoint"
    else:
        counts["failed"] += 1
        logger.error("ablate: %s seed %d failed (exit %d) after %.0f s; see %s", run.variant, run.seed,
                     returncode, wall, run.run_dir / "train.log")
        return f"failed (exit {returncode})"
    logger.warning("ablate: %s seed %d %s", run.variant, run.seed, state)
    return state


# ------------------------------------------------------------------------------------- statistics


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (bisection on the CDF)."""
    if not 0.5 <= q < 1.0:
        raise ValueError(f"q must be in [0.5, 1), got {q}")
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < q else (lo, mid)
    return 0.5 * (lo + hi)


@dataclasses.dataclass(frozen=True)
class Interval:
    """Mean and the 95% t-interval ``mean ± t(0.975, n-1)·s/√n`` over the finite values (nan when n < 2)."""

    mean: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float], confidence: float = 0.95) -> "Interval":
        xs = [float(v) for v in values if v is not None and math.isfinite(v)]
        n = len(xs)
        if n == 0:
            return cls(math.nan, math.nan, math.nan, 0)
        mean = sum(xs) / n
        if n < 2:
            return cls(mean, math.nan, math.nan, n)
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        half = student_t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
        return cls(mean, mean - half, mean + half, n)

    def fmt(self, digits: int = 3) -> str:
        if self.n == 0:
            return "–"
        if math.isnan(self.low):
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def read_metrics(run_dir: Path) -> List[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_summary(run: Run, metric: str, collapse_margin: float) -> Dict[str, float]:
    """The numbers of one run, read from its metrics and its ablate record (all NaN for a failed run, which
    counts as collapsed).

    ``gold_final``/``gold_best``: the held-out gold score at the last evaluation / the best one after the
    start; ``learned_reward``: the reward models' score of the held-out responses at the last
    evaluation (``eval/model_reward``); ``token_kl``: the held-out per-token KL to the reference at the
    last evaluation (``eval/kl``); ``gap_growth``: the hacking monitor's gap growth at the last
    evaluation of the adversarial set; ``hacked``: 1 when the learned reward rose from the start while
    the gold score fell.
    """
    record = read_record(run)
    records = read_metrics(run.run_dir) if record is not None else []  # a failed run has no numbers
    evals = [r for r in records if metric in r]
    nan = math.nan
    out = {"gold_start": nan, "gold_final": nan, "gold_best": nan, "learned_reward": nan, "token_kl": nan,
           "gap_growth": nan, "rollbacks": nan, "skipped_steps": nan, "hacked": nan,
           "wall_s": record["wall_s"] if record else nan, "finished": float(record is not None)}
    if evals:
        first, last = evals[0], evals[-1]
        out.update(gold_start=first[metric], gold_final=last[metric],
                   gold_best=max(r[metric] for r in evals[1:]) if len(evals) > 1 else first[metric],
                   learned_reward=last.get("eval/model_reward", nan), token_kl=last.get("eval/kl", nan),
                   gap_growth=last.get("hacking/gap_growth", nan))
        if "eval/model_reward" in first and "eval/model_reward" in last:
            out["hacked"] = float(last["eval/model_reward"] > first["eval/model_reward"]
                                  and last[metric] < first[metric])
    if records:
        out.update(rollbacks=records[-1].get("guard/rollbacks", nan),
                   skipped_steps=records[-1].get("guard/skipped_steps", nan))
    final = out["gold_final"]
    out["collapsed"] = float(record is None or not math.isfinite(final)
                             or final < out["gold_start"] - collapse_margin)
    return out


def curve(run: Run, key: str) -> Dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run.run_dir) if key in r and math.isfinite(r[key])}


# ----------------------------------------------------------------------------------------- report

COLUMNS = (  # (summary key, header, how the seeds combine)
    ("gold_final", "gold final", "ci"), ("gold_best", "gold best", "ci"),
    ("learned_reward", "learned reward", "ci"), ("token_kl", "token KL", "ci"),
    ("gap_growth", "gap growth", "ci"), ("rollbacks", "rollbacks", "sum"),
    ("skipped_steps", "skipped steps", "sum"), ("hacked", "hacked seeds", "count"),
    ("collapsed", "collapsed seeds", "count"), ("wall_s", "wall s", "ci"),
)


def summarise(cfg: AblateConfig, runs: Sequence[Run]) -> Dict[str, Dict[str, object]]:
    """Per variant: the per-seed summaries and, per column, an ``Interval`` or a total."""
    out: Dict[str, Dict[str, object]] = {}
    for variant in cfg.variant_overrides():
        seeds = {r.seed: run_summary(r, cfg.metric, cfg.collapse_margin) for r in runs if r.variant == variant}
        stats: Dict[str, object] = {}
        for key, _, how in COLUMNS:
            values = [s[key] for s in seeds.values()]
            finite = [v for v in values if math.isfinite(v)]
            if how == "ci":
                stats[key] = Interval.of(values)
            else:
                stats[key] = (sum(finite), len(finite)) if how == "count" else sum(finite)
        out[variant] = {"seeds": seeds, "stats": stats}
    return out


def _cell(value, how: str, digits: int = 3) -> str:
    if how == "ci":
        return value.fmt(digits)
    if how == "count":
        total, n = value
        return f"{total:.0f}/{n}"
    return f"{value:.0f}"


def write_report(cfg: AblateConfig, runs: Sequence[Run], command: str = "") -> Path:
    """``<out_dir>/ablation.md`` and the learning-curve PNGs; returns the markdown path."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarise(cfg, runs)
    lines = ["# Ablation", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [f"Training config: `{cfg.config or '(embedded default)'}`; common overrides: "
              f"`{' '.join(cfg.overrides) or '(none)'}`; seeds: {list(cfg.seeds)}.", "",
              f"Mean and 95% t-interval over seeds of the held-out gold score (`{cfg.metric}`: final, and best "
              "after the start), the learned reward (`eval/model_reward`) and the token KL to the reference "
              "(`eval/kl`) at the last evaluation, and the reward-hacking monitor's gap growth "
              "(`hacking/gap_growth`); totals of rollbacks and skipped steps; hacked seeds: the learned reward "
              "rose while the gold score fell; collapsed seeds: failed, or ended more than "
              f"{cfg.collapse_margin} below the starting gold score.", "",
              "| variant | finished runs | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
              "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |"]
    for variant, v in summary.items():
        stats = v["stats"]
        finished = sum(s["finished"] for s in v["seeds"].values())
        lines.append(f"| {variant} | {finished:.0f}/{len(v['seeds'])} | " +
                     " | ".join(_cell(stats[k], how, 0 if k == "wall_s" else 3) for k, _, how in COLUMNS) + " |")
    lines += ["", "Start (the SFT policy): " + ", ".join(
        f"{variant} {Interval.of([s['gold_start'] for s in v['seeds'].values()]).fmt()}"
        for variant, v in summary.items()), ""]
    lines += _comparisons(summary)
    lines += ["", "## Per seed", "", "| variant | seed | gold start | gold final | gold best | learned reward | "
              "token KL | gap growth | hacked | collapsed | wall s |", "| --- |" + " --- |" * 10]
    for variant, v in summary.items():
        for seed, s in sorted(v["seeds"].items()):
            lines.append(f"| {variant} | {seed} | " + " | ".join(
                f"{s[k]:.3f}" for k in ("gold_start", "gold_final", "gold_best", "learned_reward", "token_kl",
                                        "gap_growth")) +
                f" | {s['hacked']:.0f} | {s['collapsed']:.0f} | {s['wall_s']:.0f} |")
    lines += ["", "## Overrides", ""] + [f"- `{name}`: `{' '.join(o) or '(none)'}`"
                                         for name, o in cfg.variant_overrides().items()]
    pngs = _plots(cfg, runs, out_dir)
    if pngs:
        lines += ["", "## Learning curves", ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    path = out_dir / "ablation.md"
    path.write_text("\n".join(lines) + "\n")
    (out_dir / "ablation.json").write_text(json.dumps(
        {variant: {"seeds": {str(k): s for k, s in v["seeds"].items()},
                   "stats": {k: (dataclasses.asdict(s) if isinstance(s, Interval) else s)
                             for k, s in v["stats"].items()}}
         for variant, v in summary.items()}, indent=1, default=float))
    return path


def _comparisons(summary) -> List[str]:
    """Whether each variant's final gold score beats or loses to each other's beyond the intervals."""
    names = list(summary)
    if len(names) < 2:
        return []
    lines = ["Final gold score, pairwise (non-overlapping 95% intervals):", ""]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            x, y = summary[a]["stats"]["gold_final"], summary[b]["stats"]["gold_final"]
            if any(math.isnan(v) for v in (x.low, y.low)):
                verdict = "not comparable (fewer than 2 seeds)"
            elif x.low > y.high:
                verdict = f"**{a} beats {b}**"
            elif y.low > x.high:
                verdict = f"**{b} beats {a}**"
            else:
                verdict = "overlap (no difference shown)"
            lines.append(f"- {a} vs {b}: {verdict}")
    return lines


def _plots(cfg: AblateConfig, runs: Sequence[Run], out_dir: Path) -> List[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the summary table does not need the plots
        logger.warning("matplotlib is not installed: no learning-curve PNGs")
        return []
    paths = []
    for key, label in ((cfg.metric, "held-out gold score"), ("eval/model_reward", "learned reward (held-out)"),
                       ("eval/kl", "token KL to the reference (held-out)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        drawn = False
        for variant in cfg.variant_overrides():
            curves = [curve(r, key) for r in runs if r.variant == variant]
            steps = sorted(set.intersection(*[set(c) for c in curves])) if curves and all(curves) else []
            if not steps:
                continue
            bands = [Interval.of([c[s] for c in curves]) for s in steps]
            means = [b.mean for b in bands]
            line, = ax.plot(steps, means, label=f"{variant} (n={len(curves)})")
            if len(curves) > 1:
                ax.fill_between(steps, [b.low for b in bands], [b.high for b in bands], alpha=0.2,
                                color=line.get_color())
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(f"{label}: mean and 95% interval over seeds")
        ax.legend(fontsize=8)
        path = out_dir / f"curves_{key.replace('/', '_')}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def precheck(cfg: AblateConfig, runs: Sequence[Run]) -> None:
    """Every run's training config as ``hpa train`` will check it (every check, its paths, the world size of
    the launcher), before any run starts: a bad variant fails here, not in each of its runs' ``train.log``.

    Raises:
        ConfigError: naming the variant, the seed, the key and its source.
    """
    world_size = cfg.nproc_per_node if cfg.launcher == "torchrun" else 1
    warned, unevaluated = set(), []
    for run in runs:
        try:  # each variant's warnings once, not once per seed
            train_cfg = load_config(cfg.config, run.overrides, world_size=world_size, command="train",
                                    warn=run.variant not in warned)
            warned.add(run.variant)
        except ConfigError as exc:  # the runs' overrides are the ablation file's, not a command line's
            source = f"the overrides of variant {run.variant!r} (ablate.overrides, then its own, then the seed's)" \
                if exc.source == "command line" else exc.source
            raise ConfigError(exc.key, f"variant {run.variant!r} (seed {run.seed}) cannot start: {exc.message}",
                              source=source) from None
        if (train_cfg.data.eval_prompt_path is None or train_cfg.trainer.eval_interval <= 0) \
                and run.variant not in unevaluated:
            unevaluated.append(run.variant)
    if unevaluated:  # valid (a smoke test of the runs), but every seed will read NaN and count as collapsed
        print(f"hpa ablate: warning: config key 'ablate.metric': {cfg.metric!r} is logged by the evaluation, which "
              f"variant(s) {', '.join(unevaluated)} never run (data.eval_prompt_path unset or trainer.eval_interval "
              "0): their summary will be NaN and every seed counted as collapsed", file=sys.stderr, flush=True)


def run_ablation(cfg: AblateConfig, command: str = "") -> Tuple[Dict[str, int], Path]:
    """Run what is not done, then write the report; returns the run counts and the report path.

    Raises:
        AblationStopped: on SIGINT/SIGTERM (no report is written then).
    """
    runs = plan_runs(cfg)
    precheck(cfg, runs)
    counts = execute(cfg, runs)
    return counts, write_report(cfg, runs, command)
