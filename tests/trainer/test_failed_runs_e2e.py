"""Runs that cannot do what they were asked end with a nonzero status and one line, not "done" or a traceback:
a LoRA alpha so large that every gradient norm is NaN (every update skipped), and a malformed record in the SFT
examples that ``hpa sft`` trains on and ``hpa train`` replays."""

import json
import os
import subprocess
import sys

import pytest

from trainer_runs import overrides

pytestmark = pytest.mark.e2e


def _hpa(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hpa.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=900)


def _one_line(proc):
    err = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return err[-1]


def test_a_run_that_skips_every_update_fails(demo):
    run_dir = demo / "all_skipped"
    proc = _hpa("train", *overrides(demo, run_dir, ["model.lora.rank=4", "model.lora.alpha=1e30",
                                                    "algorithm.advantage.estimator=grpo", "trainer.eval_interval=0"]))
    assert proc.returncode == 65, proc.stderr[-4000:]
    last = _one_line(proc)
    assert "every optimizer step" in last and "model.lora.alpha" in last, last
    assert json.loads((run_dir / "exit_status.json").read_text())["reason"] == "all_skipped"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["guard/skipped_steps"] >= 2


def test_a_malformed_sft_record_is_one_line(demo, tmp_path):
    bad = tmp_path / "sft.jsonl"
    bad.write_text((demo / "data" / "sft.jsonl").read_text().splitlines()[0] + '\n{"prompt": "2+2="}\n')
    for command, extra in (("sft", ["model.policy_path=null"]), ("train", ["algorithm.replay.coef=0.5"])):
        proc = _hpa(command, *overrides(demo, tmp_path / command, [f"data.sft_path={bad}", *extra]))
        last = _one_line(proc)
        assert last.startswith(f"hpa {command}: ") and "sft.jsonl:2: key 'response': is missing" in last, last


def test_a_policy_given_as_a_reward_model_is_one_line(demo, tmp_path):
    proc = _hpa("train", *overrides(demo, tmp_path / "run", [f"reward.model_paths=[{demo / 'init'}]",
                                                             "reward.num_heads=2"]))
    last = _one_line(proc)
    assert last.startswith("hpa train: ") and "reward.model_paths[0]" in last and "is not a reward model" in last, last
