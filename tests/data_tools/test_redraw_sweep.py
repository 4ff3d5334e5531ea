"""data_tools.redraw_sweep: task specs, one run's numbers, the verdict against the reference and the table."""

import json
import math

import pytest

from data_tools.redraw_sweep import parse_task, run_numbers, table, verdict
from hpa.ablate import Interval


def write_run(root, task, variant, seed, scores, model_rewards, gates=(1.0,), returncode=0, reverse=(0.5, 0.4)):
    run = root / task / "sweep" / "runs" / variant / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "ablate_run.json").write_text(json.dumps({"returncode": returncode, "wall_s": 1.0}))
    rows = [{"step": 1, "gate/gate": g} for g in gates]
    rows += [{"step": 10 * i, "eval/score": s, "eval/model_reward": m, "eval/score/reverse": rv, "eval/score/add": 0.2,
              "eval/score/copy": 0.9} for i, (s, m, rv) in enumerate(zip(scores, model_rewards, reverse))]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return run


def test_parse_task_and_its_errors():
    assert parse_task("hackable:9") == ("hackable", 9)
    for bad in ("hackable", "gold:1", "split:x"):
        with pytest.raises(ValueError, match="FAMILY:SEED"):
            parse_task(bad)


def test_run_numbers_hacked_collapsed_and_a_failed_run(tmp_path):
    hacked = run_numbers(write_run(tmp_path, "hackable_s1", "hpa", 1, [0.5, 0.35], [0.1, 0.9], gates=(1.0, 0.5)))
    assert hacked["hacked"] == 1.0 and hacked["collapsed"] == 1.0 and hacked["gate"] == pytest.approx(0.75)
    assert (hacked["reverse_start"], hacked["reverse_end"]) == (0.5, 0.4)
    fine = run_numbers(write_run(tmp_path, "hackable_s1", "hpa", 2, [0.5, 0.45], [0.9, 0.1]))
    assert fine["hacked"] == 0.0 and fine["collapsed"] == 0.0
    assert run_numbers(write_run(tmp_path, "hackable_s1", "hpa", 3, [0.5, 0.6], [0.1, 0.2], returncode=1)) is None


def test_verdict_against_the_reference_interval_and_the_start():
    ref = Interval.of([0.50, 0.52, 0.54])
    assert verdict(Interval.of([0.60, 0.61, 0.62]), 0.4, ref) == "above"
    assert verdict(Interval.of([0.50, 0.55, 0.60]), 0.4, ref) == "at"
    assert verdict(Interval.of([0.40, 0.41, 0.42]), 0.45, ref) == "below, not above start"


def test_table_counts_a_missing_run_as_collapsed(tmp_path):
    for seed in (1, 2):
        write_run(tmp_path, "hackable_s1", "dpo-rpo", seed, [0.5, 0.52 + 0.01 * seed], [0.1, 0.2])
        write_run(tmp_path, "hackable_s1", "hpa", seed, [0.5, 0.6], [0.1, 0.2])
    write_run(tmp_path, "hackable_s1", "hpa", 3, [0.5, 0.6], [0.1, 0.2], returncode=1)
    text = table(str(tmp_path), [("hackable", 1)], ["hpa", "dpo-rpo"], labels={("hackable", 1): "choose"})
    hpa_row = [line for line in text.splitlines() if "| hpa (3) |" in line][0]
    assert "| choose | 0.500 |" in hpa_row and "0.600" in hpa_row and "| 0/3 | 1/3 |" in hpa_row
    assert "above" in hpa_row and "0.500 → 0.400" in hpa_row
    assert not math.isnan(float(hpa_row.split("|")[3]))
