"""``hpa report RUN_DIR``: plots and a Markdown summary of a run's ``metrics.jsonl``.

Writes one PNG per panel group into ``<run_dir>/report/`` and ``<run_dir>/report/summary.md``
(steps, first / last / best values of the key metrics, the plots written and the panels skipped).
A panel whose keys are all absent is skipped and listed as such; a key of a part the run does not have
(a critic, the trust gate, the balance) is not listed as lacking; non-finite values (``"nan"``,
``"inf"`` strings, as :class:`~hpa.trainer.metrics.MetricsWriter` writes them) are left out of the
lines and of first / last / best, and counted in the summary. matplotlib is imported lazily, with
the Agg backend, so nothing else in hpa needs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

METRICS_FILE = "metrics.jsonl"
REPORT_DIR = "report"


@dataclasses.dataclass(frozen=True)
class Panel:
    """One PNG: the series of ``keys`` (``(key, label)``) against the step.

    ``parts``: ``(key, prefix)`` for keys that only a part some runs lack logs (a critic, the trust gate);
    such a key is expected only when the log has a key starting with ``prefix`` (the part ran).
    """

    name: str
    title: str
    keys: Tuple[Tuple[str, str], ...]
    ylabel: str = ""
    parts: Tuple[Tuple[str, str], ...] = ()

    def expected(self, series: "Series") -> List[str]:
        """The keys this run should have logged."""
        part = dict(self.parts)
        return [k for k, _ in self.keys if k not in part or any(name.startswith(part[k]) for name in series)]


PANELS: Tuple[Panel, ...] = (
    Panel("reward", "Reward", (("reward/raw_mean", "raw"), ("reward/shaped_mean", "shaped")), "reward"),
    Panel("kl", "KL to the reference", (("kl/token", "token KL"), ("kl/semantic", "semantic distance")), "KL"),
    Panel("entropy", "Policy entropy", (("actor/entropy", "entropy"),), "nats / token"),
    Panel("grad_norm", "Policy gradient norm", (("actor/grad_norm", "grad norm"),), "L2 norm"),
    Panel("clip_fractions", "Clip fractions",
          (("actor/pg_clipfrac", "policy (upper)"), ("actor/pg_clipfrac_lower", "policy (lower, dual-clip)"),
           ("critic/vf_clipfrac", "value")), "fraction", parts=(("critic/vf_clipfrac", "critic/"),)),
    Panel("response_length", "Response length",
          (("response_length/mean", "mean"), ("response/length_mean", "mean")), "tokens"),
    Panel("dpo_accuracy", "DPO reward accuracy", (("dpo/reward_acc", "accuracy"),), "fraction"),
    Panel("weights", "HPA weights: schedules, trust gate, balance",
          (("hpa/w_ppo", "w_ppo"), ("hpa/w_dpo", "w_dpo"), ("hpa/w_kl", "w_kl"),
           ("hpa/lambda_token", "lambda_token"), ("hpa/lambda_semantic", "lambda_semantic"),
           ("gate/gate", "trust gate (learned-reward weight)"), ("hpa/balance_factor", "balance (pair-term factor)")),
          # (the balance logs nothing else: its factor is expected only where it is logged)
          "weight", parts=(("gate/gate", "gate/"), ("hpa/balance_factor", "hpa/balance_factor"))),
    Panel("eval_score", "Evaluation score", (("eval/score", "eval score"),), "score"),
)

# the summary table: (key, which way is better: "max" or "min")
SUMMARY_KEYS: Tuple[Tuple[str, str], ...] = (
    ("eval/score", "max"),
    ("reward/raw_mean", "max"),
    ("reward/shaped_mean", "max"),
    ("kl/token", "min"),
    ("kl/semantic", "min"),
    ("dpo/reward_acc", "max"),
)

Series = Dict[str, List[Tuple[int, float]]]  # key -> [(step, value)] in step order, non-finite kept


def _number(value) -> Optional[float]:
    """A metric value as a float (``"nan"``/``"inf"`` strings included); None when it is not a number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # accepts "nan", "inf", "-inf", "Infinity"
        except ValueError:
            return None
    return None


def load_series(path: Path) -> Series:
    """``metrics.jsonl`` -> every numeric key's ``[(step, value)]``, sorted by step.

    A step logged twice (a resumed run that was not truncated) keeps its last record.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is empty, or a line is not a JSON object with an integer ``step``
            (the message names the file and line).
    """
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}; pass the run directory that holds {METRICS_FILE} "
                                f"(trainer.run_dir of the run)")
    records: Dict[int, dict] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg}); fix or delete that line") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with an integer 'step'")
        records[record["step"]] = record
    if not records:
        raise ValueError(f"the metrics file {path} is empty: the run has not logged a step yet")
    series: Series = {}
    for step in sorted(records):
        for key, value in records[step].items():
            number = _number(value)
            if key != "step" and number is not None:
                series.setdefault(key, []).append((step, number))
    return series


def _finite(points: Sequence[Tuple[int, float]]) -> List[Tuple[int, float]]:
    return [(s, v) for s, v in points if math.isfinite(v)]


def _plot(panel: Panel, series: Series, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        for key, label in panel.keys:
            if key not in series:
                continue
            # non-finite values become gaps in the line
            steps = [s for s, _ in series[key]]
            values = [v if math.isfinite(v) else math.nan for _, v in series[key]]
            marker = "o" if len(_finite(series[key])) < 20 else None
            ax.plot(steps, values, label=f"{label} ({key})", marker=marker, markersize=3)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{panel.name}.png"
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


# figures that need the device's peak FLOP/s (``trainer.peak_tflops_per_device``, unknown on CPU): NaN by
# design there, so a run where they are never finite shows them as "n/a on CPU", not as non-finite values
NEED_PEAK = ("perf/mfu", "perf/mfu_padded")


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _summary_rows(series: Series) -> List[str]:
    rows = ["| metric | first (step) | last (step) | best (step) | non-finite |",
            "|---|---|---|---|---|"]
    for key, better in SUMMARY_KEYS:
        if key not in series:
            continue
        finite = _finite(series[key])
        bad = len(series[key]) - len(finite)
        if not finite:
            rows.append(f"| `{key}` | – | – | – | {bad} |")
            continue
        pick = max if better == "max" else min
        best = pick(finite, key=lambda p: p[1])
        (s0, v0), (s1, v1) = finite[0], finite[-1]
        rows.append(f"| `{key}` | {_fmt(v0)} ({s0}) | {_fmt(v1)} ({s1}) | {_fmt(best[1])} ({best[0]}, {better}) "
                    f"| {bad} |")
    return rows


def write_summary(series: Series, run_dir: Path, plots: Sequence[Path], skipped: Sequence[Panel],
                  partial: Dict[str, List[str]]) -> Path:
    steps = sorted({s for points in series.values() for s, _ in points})
    lines = [f"# Run report: {run_dir}", "",
             f"- steps logged: {len(steps)} (step {steps[0]} to {steps[-1]})" if steps else "- steps logged: 0"]
    eval_points = _finite(series.get("eval/score", []))
    if eval_points:
        lines.append(f"- eval score: {_fmt(eval_points[0][1])} at step {eval_points[0][0]} (before) -> "
                     f"{_fmt(eval_points[-1][1])} at step {eval_points[-1][0]} (after)")
    else:
        lines.append("- eval score: not logged")
    skill = _finite(series.get("coverage/start_skill", []))
    if skill:  # the trust regime the start chose (algorithm.hpa.trust.hold_min_skill)
        boost = _finite(series.get("coverage/kl_boost", []))
        lines.append(f"- trust regime: the start's skill where no pair covers {_fmt(skill[0][1])}; the far rows "
                     + (f"held (KL boost {_fmt(boost[0][1])})" if boost and boost[0][1] > 0 else
                        "released (no KL boost; the released KL and pair weights)"))
    unknown_peak = sorted(k for k in NEED_PEAK if k in series and not _finite(series[k]))
    if unknown_peak:
        lines.append("- n/a on CPU (no peak FLOP/s known; set trainer.peak_tflops_per_device on a GPU): "
                     + ", ".join(f"`{k}`" for k in unknown_peak))
    nonfinite = {k: len(v) - len(_finite(v)) for k, v in series.items() if k not in unknown_peak}
    nonfinite = {k: n for k, n in nonfinite.items() if n}
    if nonfinite:
        listed = ", ".join(f"`{k}` ({n})" for k, n in sorted(nonfinite.items()))
        lines.append(f"- non-finite values (left out of plots and of first/last/best): {listed}")
    lines += ["", "## Key metrics", ""]
    rows = _summary_rows(series)
    lines += rows if len(rows) > 2 else ["None of the key metrics were logged."]
    lines += ["", "## Plots", ""]
    lines += [f"- [{p.name}]({p.name})" for p in plots] or ["None (no panel had any of its metrics)."]
    for name, keys in sorted(partial.items()):
        lines.append(f"  - `{name}.png` lacks " + ", ".join(f"`{k}`" for k in keys))
    if skipped:
        lines += ["", "## Skipped panels (none of their metrics in the log)", ""]
        lines += [f"- {p.name}: " + ", ".join(f"`{k}`" for k, _ in p.keys) for p in skipped]
    path = run_dir / REPORT_DIR / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_report(run_dir) -> Path:
    """Plots and ``summary.md`` for ``<run_dir>/metrics.jsonl``, written into ``<run_dir>/report/``.

    Args:
        run_dir: a run directory (``trainer.run_dir``) holding ``metrics.jsonl``.

    Returns:
        The path of ``summary.md``.

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
        ValueError: the file is empty or has a malformed line (file and line named).
    """
    run_dir = Path(run_dir)
    series = load_series(run_dir / METRICS_FILE)
    out_dir = run_dir / REPORT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    plots, skipped, partial = [], [], {}
    for panel in PANELS:
        present = [k for k, _ in panel.keys if k in series]
        if not present:
            skipped.append(panel)
            continue
        lacking = [k for k in panel.expected(series) if k not in series]
        if panel.name != "response_length" and lacking:
            partial[panel.name] = lacking
        plots.append(_plot(panel, series, out_dir))
    return write_summary(series, run_dir, plots, skipped, partial)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``hpa report RUN_DIR``; returns the exit status (2 on a missing or bad metrics file)."""
    parser = argparse.ArgumentParser(prog="hpa report", description="plots and a summary of a run's metrics.jsonl")
    parser.add_argument("run_dir", help="the run directory (trainer.run_dir) holding metrics.jsonl")
    args = parser.parse_args(argv)
    try:
        summary = run_report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"hpa report: {exc}", file=sys.stderr)
        return 2
    print(summary.read_text(), end="")
    print(f"wrote {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
