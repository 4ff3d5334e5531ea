"""Re-draw demo tasks and ablate each, then one table over all of them: the sweep of the records under experiments/
(redrawn-tasks.md and after) as one command.

Each task is ``FAMILY:SEED`` (``hackable:9``): ``DEMO_FAMILY=FAMILY DEMO_SEED=SEED DEMO_TRAIN=0 bash
launch/demo.sh ROOT/FAMILY_sSEED`` makes it (data, tokenizer, SFT policy, reward ensemble; skipped when
it is there), ``experiments.tools.redraw_ablation`` writes its ablation file and ``hpa ablate`` runs it (runs
that finished before are kept). The tasks run one after the other, ``--parallel`` runs at a time within
a task. Usage::

    OMP_NUM_THREADS=1 python -m experiments.tools.redraw_sweep --root runs/sweep --tasks hackable:9 split:3 \\
        --variants hpa dpo-rpo --seeds 1 2 3 --table runs/sweep/table.md
    python -m experiments.tools.redraw_sweep --root runs/sweep --tasks hackable:9 --variants hpa dpo-rpo \\
        --table-only --table runs/sweep/table.md       # the table of what ran

The whole sweep of experiments/choose-confirm-28-tasks.md is one command
(``SEED`` ranges are inclusive; ``--choose`` names the tasks the constants were chosen on, the rest are
labelled *confirm*; split tasks also run ``--parts``, the PPO-only and DPO-only variants they must beat)::

    OMP_NUM_THREADS=1 python -m experiments.tools.redraw_sweep --root runs/redraw \
        --tasks hackable:5 hackable:9-27 split:3-7 standard:1-3 --choose hackable:5 hackable:9-11 \
        --variants hpa dpo-rpo --seeds 1 2 3 --parallel 1 --table runs/redraw/table.md

The table, per task and variant: gold start (the SFT policy), gold final mean and 95 % t-interval over
the seeds, where it lies against ``--reference``'s interval (*above* it, *at* it: mean inside or above,
*below*) and against the start, on split tasks against each part's interval (``vs parts``), each prompt kind's gold score start -> end (``eval/score/<kind>``), the
mean gate weight over the steps, hacked seeds (the learned reward of the held-out responses rose while
the gold score fell) and collapsed ones (failed, or more than 0.1 below the start), as ``hpa ablate``
counts them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from experiments.tools.redraw_ablation import FAMILY_FILES, redraw_ablation
from hpa.ablate import Interval

KINDS = ("reverse", "add", "copy")
PARTS_FAMILY = "split"  # the family whose tasks each signal covers only in part: the default must beat each part
COLLAPSE_MARGIN = 0.1  # hpa ablate's collapse_margin default
REPO = Path(__file__).resolve().parents[2]


def parse_task(spec: str) -> Tuple[str, int]:
    """``"hackable:9"`` -> ``("hackable", 9)``; an error names the bad spec and what is allowed."""
    tasks = parse_tasks(spec)
    if len(tasks) != 1:
        raise ValueError(f"--tasks {spec!r}: expected FAMILY:SEED (one task)")
    return tasks[0]


def parse_tasks(spec: str) -> List[Tuple[str, int]]:
    """``"hackable:9"`` or an inclusive range ``"hackable:9-27"`` -> ``[(family, seed), ...]``."""
    family, sep, seeds = spec.partition(":")
    first, dash, last = seeds.partition("-")
    if not sep or family not in FAMILY_FILES or not first.isdigit() or (dash and not last.isdigit()) \
            or (dash and int(last) < int(first)):
        raise ValueError(f"--tasks {spec!r}: expected FAMILY:SEED or FAMILY:FIRST-LAST with FAMILY one of "
                         f"{sorted(FAMILY_FILES)} and SEED a non-negative integer (hackable:9, hackable:9-27)")
    return [(family, seed) for seed in range(int(first), int(last if dash else first) + 1)]


def task_dir(root: str, family: str, seed: int) -> Path:
    return Path(root) / f"{family}_s{seed}"


def redraw(root: str, family: str, seed: int) -> Path:
    """Make the task with launch/demo.sh (DEMO_TRAIN=0) unless its reward ensemble is there."""
    out = task_dir(root, family, seed)
    if not (out / "rm" / "reward_model").exists():
        env = {**os.environ, "DEMO_FAMILY": family, "DEMO_SEED": str(seed), "DEMO_TRAIN": "0"}
        out.parent.mkdir(parents=True, exist_ok=True)  # a fresh root (the log lies next to the task)
        with open(f"{out}.log", "w") as log:
            subprocess.run(["bash", str(REPO / "launch" / "demo.sh"), str(out)], env=env, check=True,
                           stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    return out


def ablate(root: str, family: str, seed: int, variants: Sequence[str], custom: Sequence[str],
           seeds: Sequence[int], parallel: int) -> Path:
    """Write the task's ablation file (``ROOT/FAMILY_sSEED/sweep.yaml``) and run ``hpa ablate`` on it."""
    out = task_dir(root, family, seed)
    doc = redraw_ablation(family, str(out), variants, custom, str(out / "sweep"), seeds)
    doc["ablate"]["max_parallel"] = parallel
    path = out / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=120))
    with open(out / "sweep.log", "a") as log:
        subprocess.run([sys.executable, "-m", "hpa.cli", "ablate", "--config", str(path)], check=False,
                       stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    return out / "sweep"


def run_numbers(run_dir: Path) -> Optional[Dict[str, float]]:
    """One run's numbers from its metrics (None when it did not finish): gold start/final, per-kind gold
    start/end, the mean gate weight, hacked and collapsed (as ``hpa ablate``)."""
    if not (run_dir / "ablate_run.json").exists() or not (run_dir / "metrics.jsonl").exists():
        return None
    try:
        record = json.loads((run_dir / "ablate_run.json").read_text())
    except json.JSONDecodeError:  # still running: the record is written when the run ends
        return None
    if record.get("returncode") != 0:
        return None
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if "eval/score" in r]
    if not evals:
        return None
    first, last = evals[0], evals[-1]
    gates = [r["gate/gate"] for r in records if "gate/gate" in r and math.isfinite(r["gate/gate"])]
    out = {"start": first["eval/score"], "final": last["eval/score"],
           "gate": sum(gates) / len(gates) if gates else math.nan,
           "hacked": float(last.get("eval/model_reward", -math.inf) > first.get("eval/model_reward", math.inf)
                           and last["eval/score"] < first["eval/score"]),
           "collapsed": float(last["eval/score"] < first["eval/score"] - COLLAPSE_MARGIN)}
    for kind in KINDS:
        out[f"{kind}_start"] = first.get(f"eval/score/{kind}", math.nan)
        out[f"{kind}_end"] = last.get(f"eval/score/{kind}", math.nan)
    return out


def verdict(final: Interval, start: float, reference: Optional[Interval]) -> str:
    """Where a variant's final gold score lies: against the reference's interval (above / at / below)
    and, when its mean is not above it, against the start."""
    words = []
    if reference is not None and reference.n:
        high = reference.high if math.isfinite(reference.high) else reference.mean
        low = reference.low if math.isfinite(reference.low) else reference.mean
        words.append("above" if math.isfinite(final.low) and final.low > high else
                     "at" if final.mean >= low else "below")
    if not final.mean > start:
        words.append("not above start")
    return ", ".join(words)


def parts_verdict(final: Interval, parts: Dict[str, Optional[Interval]]) -> str:
    """Against each part's interval: ``"above ppo, above dpo"`` (``at`` / ``below`` as ``verdict``; a part that
    did not run is ``"no <part>"``)."""
    words = []
    for name, part in parts.items():
        words.append(f"no {name}" if part is None or not part.n else verdict(final, math.inf, part).split(",")[0]
                     + f" {name}")
    return ", ".join(words)


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def table(root: str, tasks: Sequence[Tuple[str, int]], variants: Sequence[str], reference: str = "dpo-rpo",
          labels: Optional[Dict[Tuple[str, int], str]] = None, parts: Sequence[str] = ()) -> str:
    """The markdown table of every task and variant under ``root`` (a missing run counts as collapsed); on
    split tasks the ``parts`` are rows too, and the other variants are held against each part's interval."""
    header = ("| task | set | start | variant | gold final [95 %] | vs " + reference + " | vs parts"
              " | reverse start → end | add / copy end | gate weight | hacked | collapsed |")
    lines = [header, "|" + " --- |" * 12]
    for family, seed in tasks:
        base = task_dir(root, family, seed) / "sweep" / "runs"
        task_parts = list(parts) if family == PARTS_FAMILY else []
        per_variant = {}
        for v in list(variants) + [p for p in task_parts if p not in variants]:
            runs = sorted(base.glob(f"{v}/seed*")) if base.exists() else []
            per_variant[v] = [run_numbers(r) for r in runs]
        ref = [n for n in per_variant.get(reference, []) if n]
        ref_iv = Interval.of([n["final"] for n in ref]) if ref else None
        part_ivs = {p: (Interval.of([n["final"] for n in per_variant[p] if n]) if any(per_variant[p]) else None)
                    for p in task_parts}
        for v in per_variant:
            numbers = per_variant[v]
            done = [n for n in numbers if n]
            if not numbers:
                continue
            final = Interval.of([n["final"] for n in done])
            start = _mean([n["start"] for n in done])
            label = (labels or {}).get((family, seed), "")
            where = verdict(final, start, ref_iv) if v != reference else ""
            vs_parts = parts_verdict(final, part_ivs) if task_parts and v not in task_parts else ""
            lines.append(
                f"| {family} {seed} | {label} | {start:.3f} | {v} ({len(numbers)}) | {final.fmt()} | {where} | "
                f"{vs_parts} | "
                f"{_mean([n['reverse_start'] for n in done]):.3f} → {_mean([n['reverse_end'] for n in done]):.3f} | "
                f"{_mean([n['add_end'] for n in done]):.3f} / {_mean([n['copy_end'] for n in done]):.3f} | "
                f"{_mean([n['gate'] for n in done]):.2f} | {sum(n['hacked'] for n in done):.0f}/{len(numbers)} | "
                f"{sum(n['collapsed'] for n in done) + len(numbers) - len(done):.0f}/{len(numbers)} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="where the tasks live (ROOT/FAMILY_sSEED)")
    parser.add_argument("--tasks", nargs="+", required=True, help="FAMILY:SEED or FAMILY:FIRST-LAST ...")
    parser.add_argument("--choose", nargs="*", default=None,
                        help="the tasks the constants were chosen on (labelled choose, the others confirm)")
    parser.add_argument("--parts", nargs="*", default=["ppo", "dpo"],
                        help="variants each split task also runs and the others must beat")
    parser.add_argument("--variants", nargs="*", default=["hpa", "dpo-rpo"], help="built-in variant names")
    parser.add_argument("--custom", action="append", default=[], help="'name: key=value ...' (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time within a task")
    parser.add_argument("--reference", default="dpo-rpo", help="the variant the others are compared with")
    parser.add_argument("--label", default="", help="the table's 'set' column (choose / confirm)")
    parser.add_argument("--table", default=None, help="write the table here (default: print it)")
    parser.add_argument("--table-only", action="store_true", help="only read what ran")
    args = parser.parse_args(argv)
    tasks = [t for spec in args.tasks for t in parse_tasks(spec)]
    names = list(args.variants) + [c.partition(":")[0].strip() for c in args.custom]
    if args.choose is None:
        labels = {t: args.label for t in tasks}
    else:
        chosen = {t for spec in args.choose for t in parse_tasks(spec)}
        labels = {t: "choose" if t in chosen else "confirm" for t in tasks}
    if not args.table_only:
        for family, seed in tasks:
            extra = [p for p in args.parts if p not in args.variants] if family == PARTS_FAMILY else []
            redraw(args.root, family, seed)
            ablate(args.root, family, seed, list(args.variants) + extra, args.custom, args.seeds, args.parallel)
    text = table(args.root, tasks, names, args.reference, labels, args.parts)
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
