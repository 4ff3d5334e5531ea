"""experiments.tools.redraw_sweep: task specs, one run's numbers, the verdict against the reference and the table."""

import json
import math
from pathlib import Path

import pytest

from experiments.tools import redraw_sweep
from experiments.tools.redraw_sweep import main, parse_task, parse_tasks, parts_verdict, run_numbers, table, verdict
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


def test_parse_tasks_ranges_and_their_errors():
    assert parse_tasks("hackable:9-11") == [("hackable", 9), ("hackable", 10), ("hackable", 11)]
    assert parse_tasks("split:3") == [("split", 3)]
    for bad in ("hackable:9-", "hackable:11-9", "hackable:a-3", "gold:1-2"):
        with pytest.raises(ValueError, match="FIRST-LAST"):
            parse_tasks(bad)
    with pytest.raises(ValueError, match="one task"):
        parse_task("hackable:1-2")


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


def test_split_tasks_are_held_against_each_part_and_choose_labels_the_rest_confirm(tmp_path, capsys):
    """On a split task the default must beat the PPO-only and the DPO-only part: a ``vs parts`` verdict per
    part (a part that did not run says so); other families have no parts."""
    for seed in (1, 2, 3):
        write_run(tmp_path, "split_s3", "hpa", seed, [0.3, 0.60 + 0.01 * seed], [0.1, 0.2])
        write_run(tmp_path, "split_s3", "dpo-rpo", seed, [0.3, 0.50 + 0.01 * seed], [0.1, 0.2])
        write_run(tmp_path, "split_s3", "ppo", seed, [0.3, 0.40 + 0.01 * seed], [0.1, 0.2])
        write_run(tmp_path, "split_s3", "dpo", seed, [0.3, 0.59 + 0.02 * seed], [0.1, 0.2])
        write_run(tmp_path, "hackable_s9", "hpa", seed, [0.5, 0.6], [0.1, 0.2])
    main(["--root", str(tmp_path), "--tasks", "split:3", "hackable:9", "--choose", "hackable:9", "--table-only"])
    rows = {tuple(c.strip() for c in line.split("|")[1:5:3]): line.split("|") for line in
            capsys.readouterr().out.splitlines() if line.startswith("| split") or line.startswith("| hackable")}
    hpa = rows[("split 3", "hpa (3)")]
    assert hpa[2].strip() == "confirm" and hpa[7].strip() == "above ppo, at dpo"
    assert rows[("split 3", "ppo (3)")][7].strip() == "" and rows[("split 3", "dpo-rpo (3)")][7].strip()
    assert rows[("hackable 9", "hpa (3)")][2].strip() == "choose" and rows[("hackable 9", "hpa (3)")][7].strip() == ""
    assert parts_verdict(Interval.of([0.5, 0.6, 0.7]), {"ppo": None}) == "no ppo"


def test_redraw_makes_a_root_that_is_not_there(tmp_path, monkeypatch):
    """The documented command's ``--root runs/redraw`` on a fresh clone: the task's log and directory go under
    a root that does not exist yet (it was a FileNotFoundError before any task was made)."""
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs["env"]["DEMO_FAMILY"], kwargs["env"]["DEMO_SEED"]))
        # the script is the repository's launch/demo.sh, run from the repository root (the tool lives two levels down)
        assert Path(cmd[1]).is_file() and Path(cmd[1]) == Path(kwargs["cwd"]) / "launch" / "demo.sh"
        kwargs["stdout"].write("made\n")

    monkeypatch.setattr(redraw_sweep.subprocess, "run", run)
    root = tmp_path / "runs" / "redraw"
    out = redraw_sweep.redraw(str(root), "hackable", 9)
    assert out == root / "hackable_s9" and calls[0][1:] == ("hackable", "9")
    assert calls[0][0][-1] == str(out) and (root / "hackable_s9.log").read_text() == "made\n"
