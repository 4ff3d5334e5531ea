"""``hpa train`` end to end on CPU: the full HPA step under TP1/DP2 and TP2xPP2xDP2 gives the same
metrics, the metrics file holds every documented key, and resumable pieces are in place."""

import json
import os
import subprocess
import sys

import pytest

from multirank import free_port, run_ranks

REQUIRED_KEYS = [
    "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/kl_coef",
    "actor/entropy", "actor/grad_norm", "actor/lr", "dpo/loss", "dpo/reward_acc", "dpo/margin", "kl/token",
    "kl/semantic", "hpa/w_ppo", "hpa/w_dpo", "hpa/w_kl", "hpa/lambda_token", "hpa/lambda_semantic",
    "critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "reward/raw_mean", "reward/sigma_mean",
    "reward/diversity_mean", "reward/length_penalty_mean", "reward/copy_rate", "reward/shaped_mean",
    "reward/shaped_std", "response_length/mean", "response_length/max", "response_length/clip_ratio",
    "rollout/logprob_diff_mean", "rollout/logprob_diff_max", "perf/throughput", "perf/mfu", "perf/max_memory_gb",
    "timing_s/rollout", "timing_s/reward", "timing_s/reference", "timing_s/old_logprob", "timing_s/values",
    "timing_s/update_actor", "timing_s/update_critic", "timing_s/step",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from data_tools.make_demo_task import make_demo_task

    root = tmp_path_factory.mktemp("demo")
    make_demo_task(str(root / "data"), 256, seed=0, num_eval_prompts=12)
    subprocess.run([sys.executable, "-m", "data_tools.train_tokenizer", "--input", str(root / "data" / "corpus.txt"),
                    "--model-prefix", str(root / "data" / "tok"), "--vocab-size", "96"], check=True,
                   capture_output=True)
    run_ranks(save_initial_policy, args=(str(root / "init"),))
    return root


def _overrides(root, run_dir, extra=()):
    d = root / "data"
    return [f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
            f"data.preference_path={d / 'preferences.jsonl'}", f"data.eval_prompt_path={d / 'eval_prompts.jsonl'}",
            f"trainer.run_dir={run_dir}", "logging.wandb.mode=disabled", "trainer.total_steps=2",
            "trainer.global_batch_size=4", "trainer.preference_batch_size=4", "trainer.micro_batch_size=4",
            "rollout.n=2", "rollout.max_new_tokens=6", "model.num_layers=4", f"model.policy_path={root / 'init'}",
            "algorithm.advantage.estimator=gae", "trainer.eval_interval=2", "rollout.temperature=1.0", *extra]


def save_initial_policy(groups, path):
    import torch

    from hpa.config import load_config
    from hpa.models import build_policy
    from hpa.trainer.checkpoint import save_model_weights

    cfg = load_config(None, ["model.num_layers=4"])
    torch.manual_seed(0)
    save_model_weights(build_policy(cfg.model, cfg.parallel, groups), path, groups)


def _launch(root, run_dir, nproc, extra=()):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "-m", "hpa.train", *_overrides(root, run_dir, extra)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(demo):
    dp2 = _launch(demo, demo / "tp1_pp1_dp2", 2)
    tp2pp2dp2 = _launch(demo, demo / "tp2_pp2_dp2", 8, ["parallel.tensor_model_parallel_size=2",
                                                          "parallel.pipeline_model_parallel_size=2"])
    return dp2, tp2pp2dp2


def test_metrics_file_has_every_key(runs):
    dp2, _ = runs
    assert [r["step"] for r in dp2] == [0, 1, 2]
    for key in REQUIRED_KEYS:
        assert key in dp2[-1], key
    assert "eval/score" in dp2[0]


@pytest.mark.parametrize("key", ["reward/raw_mean", "response_length/mean", "dpo/loss", "kl/token", "kl/semantic",
                                 "actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "rollout/logprob_diff_max"])
def test_tp2_pp2_matches_tp1(runs, key):
    dp2, tp2pp2 = runs
    for a, b in zip(dp2[1:], tp2pp2[1:]):
        assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), (a["step"], key)


def test_rollout_logprobs_match_training_forward(runs):
    for run in runs:
        for record in run[1:]:
            assert record["rollout/logprob_diff_max"] < 1e-4
