"""The GPU figures of a few bf16 HPA steps, as one JSON line (run by ``bench/gpu_check.sh``).

Makes the demo task and its tokenizer under ``--run-dir``/data, runs ``hpa train`` with ``--config`` (the
Qwen2-0.5B-shaped random model, native engine, local layer spec) in this process, and prints: the update's
MFU (real and padded tokens), the rollout's generated tokens per second, the measured peak memory against
``hpa plan``'s total (both GB = 1e9 bytes) and the bf16 gap between sampling-time and training log-probs.
Then the same run again with ``trainer.sequence_packing=true``: the update's tokens per second and pad share
with packing on against off (``packing``). The first step (CUDA warm-up, allocator growth) is left out of
the rates. After those keys: ``phases``, each phase's seconds per step (rollout, old-policy forward, reference
forward, update), the update's tokens/s and each forward-only pass's tokens/s and MFU, packing off and on; ``syncs``, the host-device syncs that
``torch.cuda.set_sync_debug_mode("warn")`` reported over each whole run (start-up included) per step; and, with
``--tokens-per-micro-batch N``, ``token_budget``: the packed run again with ``trainer.ppo_max_token_len_per_rank=N``
(micro-batches of N real tokens), with the same figures.

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
    parser.add_argument("--tokens-per-micro-batch", type=int, default=None,
                        help="also run packed with trainer.ppo_max_token_len_per_rank=N (a realistic token budget)")
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
    rc, syncs_off = _counting_syncs(lambda: cli.main(["train", "--config", args.config, *overrides]))
    if rc != 0:
        print(json.dumps({"ok": False, "error": "hpa train failed (see the log above)"}))
        return 1
    steps, timed = _steps(run / "train")
    base = [o for o in overrides if not o.startswith("trainer.run_dir=")]
    packed_overrides = base + [f"trainer.run_dir={run / 'train_packed'}", "trainer.sequence_packing=true"]
    rc, syncs_on = _counting_syncs(lambda: cli.main(["train", "--config", args.config, *packed_overrides]))
    packed_ok = rc == 0
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
        "phases": {"packing_off": phase_figures(timed), "packing_on": phase_figures(packed_timed)},
        "syncs": {"per_step_off": _per_step(syncs_off, steps),
                  "per_step_on": _per_step(syncs_on, _steps(run / "train_packed")[0] if packed_ok else [])},
    }
    if args.tokens_per_micro_batch:
        budget_dir = run / "train_budget"
        budget_overrides = base + [f"trainer.run_dir={budget_dir}", "trainer.sequence_packing=true",
                                   f"trainer.ppo_max_token_len_per_rank={args.tokens_per_micro_batch}"]
        rc, syncs_budget = _counting_syncs(lambda: cli.main(["train", "--config", args.config, *budget_overrides]))
        budget_steps, budget_timed = _steps(budget_dir) if rc == 0 else ([], [])
        figures["token_budget"] = {"ok": rc == 0, "tokens_per_micro_batch": args.tokens_per_micro_batch,
                                   "update_mfu": mean("perf/mfu", budget_timed),
                                   "phases": phase_figures(budget_timed),
                                   "syncs_per_step": _per_step(syncs_budget, budget_steps)}
    print(json.dumps(_strict(figures)))
    return 0


PHASES = {"rollout": "timing_s/rollout", "old_policy": "timing_s/old_logprob", "reference": "timing_s/reference",
          "update": "timing_s/update_actor"}


def phase_figures(records) -> dict:
    """Mean seconds per step of each phase (``PHASES``) and the update's tokens/s, over timed step records."""
    def mean(key):
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        return statistics.fmean(values) if values else float("nan")

    out = {f"{name}_s": mean(key) for name, key in PHASES.items()}
    out["update_tokens_per_s"] = mean("perf/update_throughput")
    # forward-only passes: the rollout's tokens (prompt + response, per rank) over each pass's time; their MFU
    # counts 2·N FLOPs per token against the update's 6·N, so it follows from the update's MFU and rate
    update_mfu = mean("perf/mfu")
    for name in ("old_policy", "reference"):
        rate = mean("perf/forward_tokens") / out[f"{name}_s"] if out[f"{name}_s"] > 0 else float("nan")
        out[f"{name}_tokens_per_s"] = rate
        out[f"{name}_mfu"] = update_mfu * rate / (3.0 * out["update_tokens_per_s"]) \
            if out["update_tokens_per_s"] > 0 else float("nan")
    return out


def _counting_syncs(fn):
    """``(fn(), host-device syncs during it)``: ``torch.cuda.set_sync_debug_mode("warn")`` warns once per sync;
    ``None`` for the count without CUDA."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        return fn(), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rc = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return rc, sum("synchroniz" in str(w.message) for w in caught)


def _per_step(count, steps):
    return count / len(steps) if count is not None and steps else None


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
