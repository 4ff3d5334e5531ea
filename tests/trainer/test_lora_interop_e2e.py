"""LoRA end to end through the commands: ``hpa train`` with adapters (the native engine samples through them:
its log-probs equal the training forward's), ``hpa convert megatron-to-hf`` of the adapter checkpoint (the merged
model, and with ``--peft-dir`` a PEFT adapter that ``PeftModel.from_pretrained`` loads on the exported base with the
merged model's logits), ``hpa convert peft-to-megatron`` back, and a run continuing from it
(``model.lora.adapter_path``) whose policy starts where the first one ended."""

import os
import subprocess
import sys

import pytest
import torch

from trainer_runs import launch

pytestmark = pytest.mark.e2e

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.advantage.estimator=grpo", "optim.lr=2e-3",
        "checkpoint.save_interval=2", "trainer.total_steps=2"]


def convert(*args):
    cmd = [sys.executable, "-m", "hpa.cli", "convert", *args, "--backend", "gloo"]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.fixture(scope="module")
def lora_run(demo):
    run_dir = demo / "lora_interop"
    return run_dir, launch(demo, run_dir, 1, LORA)


def test_the_native_engine_samples_through_the_adapters(lora_run):
    _, records = lora_run
    step2 = [r for r in records if r["step"] == 2][0]
    assert step2["kl/token"] > 0  # the adapters moved after step 1
    assert step2["rollout/logprob_diff_max"] < 1e-4  # the sampler's log-probs are the trained policy's


def test_export_merged_and_peft_and_back(demo, lora_run, tmp_path):
    import peft
    import transformers

    run_dir, first_run = lora_run
    ckpt = run_dir / "checkpoints" / "step_00000002"
    convert("megatron-to-hf", "--megatron-dir", str(ckpt), "--out", str(tmp_path / "merged"),
            "--peft-dir", str(tmp_path / "peft"))
    convert("megatron-to-hf", "--megatron-dir", str(demo / "init"), "--config", str(run_dir / "config.yaml"),
            "--out", str(tmp_path / "base"))
    ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        merged = load(tmp_path / "merged", torch_dtype=torch.float32).eval()(ids).logits
        base = load(tmp_path / "base", torch_dtype=torch.float32).eval()
        bare = base(ids).logits
        with_adapter = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()(ids).logits
    torch.testing.assert_close(with_adapter, merged, atol=1e-5, rtol=0)
    assert (bare - merged).abs().max() > 1e-4  # two LoRA steps changed the model

    out = convert("peft-to-megatron", "--peft-dir", str(tmp_path / "peft"), "--config", str(run_dir / "config.yaml"),
                  "--out", str(tmp_path / "imported"))
    assert "model.lora.adapter_path=" in out
    records = launch(demo, tmp_path / "continued", 1, [*LORA, "trainer.total_steps=1",
                                                        f"model.lora.adapter_path={tmp_path / 'imported'}"])
    first = records[0]
    # the continued run starts from the imported adapters: away from the base, which is its reference, and where
    # the first run ended (its evaluation after step 2 is greedy, of the same prompts, against the same base)
    ended = [r for r in first_run if r["step"] == 2][0]
    assert first["step"] == 0 and first["eval/kl"] > 0
    for key in ("eval/kl", "eval/score", "eval/response_length"):
        assert first[key] == pytest.approx(ended[key], rel=1e-5, abs=1e-6), key
