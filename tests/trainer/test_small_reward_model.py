"""A reward model of its own size end to end: ``hpa train-rm`` trains a 1-layer, hidden-32 reward model (its
``model.*`` dimensions given on the command line), and ``hpa train`` with the demo's 4-layer, hidden-64 policy
scores its rollouts with it (the run refused any other hidden size before reward models recorded their
architecture)."""

import json
import math
import os
import subprocess
import sys

import pytest

from trainer_runs import launch

pytestmark = pytest.mark.e2e

SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
         "model.ffn_hidden_size=48"]


def train_small_rm(demo, run_dir):
    d = demo / "data"
    cmd = [sys.executable, "-m", "hpa.cli", "train-rm", f"data.tokenizer_path={d / 'tok.model'}",
           f"data.preference_path={d / 'preferences.jsonl'}", f"data.prompt_path={d / 'prompts.jsonl'}",
           f"trainer.run_dir={run_dir}", "trainer.total_steps=3", "trainer.preference_batch_size=8",
           "trainer.micro_batch_size=4", "reward.num_heads=2", "logging.wandb.mode=disabled", *SMALL]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return run_dir / "reward_model"


def test_a_smaller_reward_model_scores_a_larger_policy(demo):
    rm = train_small_rm(demo, demo / "small_rm")
    info = json.loads((rm / "hpa_reward_model.json").read_text())
    assert info["architecture"]["hidden_size"] == 32 and info["architecture"]["num_layers"] == 1
    assert info["tokenizer"]["path"] == str(demo / "data" / "tok.model") and len(info["tokenizer"]["fingerprint"]) == 64
    records = launch(demo, demo / "small_rm_policy", 1, [f"reward.model_paths=[{rm}]", "reward.num_heads=2",
                                                         "reward.shaping.beta=0.1", "trainer.total_steps=2"])
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        # the two bootstrap heads disagree: sigma comes from the reward model alone (rules add the same to each)
        assert r["reward/sigma_mean"] > 0 and math.isfinite(r["reward/raw_mean"])
        assert math.isfinite(r["reward/diversity_mean"])  # the small model's hidden-32 embeddings
    assert math.isfinite(records[0]["eval/model_reward"]) and math.isfinite(records[-1]["eval/model_reward"])


def test_a_reward_model_of_another_tokenizer_stops_the_run_naming_both_files(demo, tmp_path):
    rm = demo / "small_rm" / "reward_model"
    if not rm.exists():
        train_small_rm(demo, demo / "small_rm")
    other = tmp_path / "other_rm"
    other.mkdir()
    for f in rm.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    info = json.loads((other / "hpa_reward_model.json").read_text())
    info["tokenizer"].update(path="/elsewhere/other_tok.model", fingerprint="0" * 64)
    (other / "hpa_reward_model.json").write_text(json.dumps(info))
    output = []
    launch(demo, tmp_path / "run", 1, [f"reward.model_paths=[{other}]", "reward.num_heads=2", "trainer.total_steps=1"],
           expect=None, output=output)
    text = output[0]
    assert "/elsewhere/other_tok.model" in text and str(demo / "data" / "tok.model") in text
    # the ConfigError path of the CLI (one line, exit 2), not a traceback from inside the model loading
    assert "hpa train: " in text and "config key 'reward.model_paths[0]'" in text  # the entry named
    assert "must share the policy's tokenizer" in text and "hpa_reward_model.json" in text
