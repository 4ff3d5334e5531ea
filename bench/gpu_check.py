"""The GPU figures of a few bf16 HPA steps, as one JSON line (run by ``bench/gpu_check.sh``).

Makes the demo task and its tokenizer under ``--run-dir``/data, runs ``hpa train`` with ``--config`` (the
Qwen2-0.5B-shaped random model, native engine, local layer spec) in this process, and prints: the update's
MFU (real and padded tokens), the rollout's generated tokens per second, the measured peak memory against
``hpa plan``'s total (both GB = 1e9 bytes) and the bf16 gap between sampling-time and training log-probs.
Then the same run again with ``trainer.sequence_packing=true``: the update's tokens per second and pad share
with packing on against off (``packing``). The first step (CUDA warm-up, allocator growth) is left out of
the rates.

Ran on one H100 (docs/gpu.md, "GPU check", gives the figures) before the packing run was added; the packing
run has not yet run on a GPU.
"""

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "qwen2_0.5b_gpu_check.yaml"))
    parser.add_argument("--run-dir", default="runs/gpu_check")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)

    import torch

    from hpa import cli
    from hpa.config import load_config
    from hpa.plan import plan

    sys.path.insert(0, str(ROOT))
    from data_tools.make_demo_task import make_demo_task

    run = Path(args.run_dir)
    data = run / "data"
    make_demo_task(str(data), 256, seed=0, num_eval_prompts=16)
    subprocess.run([sys.executable, "-m", "data_tools.train_tokenizer", "--input", str(data / "corpus.txt"),
                    "--model-prefix", str(data / "tok"), "--vocab-size", "96"], check=True, capture_output=True,
                   cwd=ROOT)
    overrides = [f"data.tokenizer_path={data / 'tok.model'}", f"data.prompt_path={data / 'prompts.jsonl'}",
                 f"data.preference_path={data / 'preferences.jsonl'}",
                 f"data.eval_prompt_path={data / 'eval_prompts.jsonl'}", f"trainer.run_dir={run / 'train'}",
                 f"trainer.total_steps={args.steps}", "checkpoint.resume=never"]
    if cli.main(["train", "--config", args.config, *overrides]) != 0:
        print(json.dumps({"ok": False, "error": "hpa train failed (see the log above)"}))
        return 1
    steps, timed = _steps(run / "train")
    packed_overrides = [o for o in overrides if not o.startswith("trainer.run_dir=")] + \
        [f"trainer.run_dir={run / 'train_packed'}", "trainer.sequence_packing=true"]
    packed_ok = cli.main(["train", "--config", args.config, *packed_overrides]) == 0
    packed_timed = _steps(run / "train_packed")[1] if packed_ok else []
    cfg = load_config(args.config, overrides)
    cuda = torch.cuda.is_available()  # False only when the script itself is tried on a CPU machine
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else 80.0
    planned = plan(cfg, world_size=1, gpu_memory_gb=gpu_gb)
    rows = cfg.trainer.global_batch_size * cfg.rollout.n

    def mean(key, records=timed):
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        return statistics.fmean(values) if values else float("nan")

    rollout_tps = statistics.fmean(r["response_length/mean"] * rows / r["timing_s/rollout"] for r in timed)
    figures = {
        "ok": True, "device": torch.cuda.get_device_name(0) if cuda else "cpu", "steps": len(steps),
        "update_mfu": mean("perf/mfu"), "update_mfu_padded": mean("perf/mfu_padded"),
        "update_tokens_per_s": mean("perf/update_throughput"), "rollout_tokens_per_s": rollout_tps,
        "peak_memory_gb": max(r["perf/max_memory_gb"] for r in steps), "plan_total_gb": planned["total_gb"],
        "memory_unit": "GB (1e9 bytes)", "bf16_logprob_gap_mean": mean("rollout/logprob_diff_mean"),
        "bf16_logprob_gap_max": max(r["rollout/logprob_diff_max"] for r in steps),
        "packing": {"ok": packed_ok, "update_tokens_per_s_off": mean("perf/update_throughput"),
                    "update_tokens_per_s_on": mean("perf/update_throughput", packed_timed),
                    "pad_share_off": mean("perf/pad_share"), "pad_share_on": mean("perf/pad_share", packed_timed)},
    }
    print(json.dumps(_strict(figures)))
    return 0


def _steps(run_dir: Path):
    """The training steps' metric records of a run, and those timed (the first step warms up CUDA)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) >= 1]
    return steps, steps[1:] or steps


def _strict(value):
    """Strict JSON: a figure that could not be computed (MFU without a declared peak) is null, not NaN."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


if __name__ == "__main__":
    sys.exit(main())
