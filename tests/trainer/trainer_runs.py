"""Helpers of the trainer tests: launch ``hpa train`` (and ``hpa sft``) on the demo task, read its metrics."""

import json
import os
import subprocess
import sys

from demo_data import make_task  # noqa: F401  (the trainer tests import it from here)
from multirank import free_port, run_ranks

def overrides(root, run_dir, extra=()):
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
    from hpa.models.weights import save_model_weights

    cfg = load_config(None, ["model.num_layers=4"])
    torch.manual_seed(0)
    save_model_weights(build_policy(cfg.model, cfg.parallel, groups), path, groups)


def launch(root, run_dir, nproc, extra=(), env=None, expect=0, torchrun_args=(), output=None):
    """``torchrun -m hpa.train`` on the demo task; returns the metrics (and checks the exit code).

    ``torchrun_args`` go to torchrun (e.g. ``--max-restarts=1``); ``output``, a list, receives the
    combined stdout and stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", *torchrun_args, "-m", "hpa.train", *overrides(root, run_dir, extra)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if output is not None:
        output.append(proc.stdout + proc.stderr)
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sft(root, run_dir, extra=()):
    """``hpa sft`` (one process) from a random policy on ``root/data/sft.jsonl`` with the overrides of
    ``launch``; returns the directory of the saved policy, for ``model.policy_path``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hpa.cli", "sft",
           *overrides(root, run_dir, [f"data.sft_path={root / 'data' / 'sft.jsonl'}", "model.policy_path=null",
                                      *extra])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return run_dir / "sft"


def make_demo(root):
    """A small demo task, its tokenizer and one initial policy checkpoint (TP1) under ``root``."""
    make_task(root, 256, 12)
    run_ranks(save_initial_policy, args=(str(root / "init"),))
    return root
