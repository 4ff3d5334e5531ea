"""Overlap of generation and training at ``rollout.max_staleness: 1`` against the synchronous loop (k = 0).

Usage::

    python bench/async_overlap.py [--sleep 2.0 --steps 6 --out FILE]

Prints one JSON line::

    {"sync_step_s", "async_step_s", "speedup", "generate_s", "train_s", "bound_s", "within_bound", "config"}

Both runs are ``hpa train`` on the demo task (one process, gloo, fp32 CPU, a 2-layer policy, 4 prompts x 2
responses of at most 6 tokens), with generation and training each made to take about ``--sleep`` seconds by a
``time.sleep`` (which frees the CPU) injected by this script, not by a config key: at the start of every
``MegatronRolloutEngine.generate`` (the trainer's engine at k = 0, the rollout worker's copy at k = 1) and of
every ``phases.update_policy``. Times are medians over the steps after the first (step 1 samples synchronously
in both runs) of ``timing_s/step``. ``generate_s`` is the synchronous run's ``timing_s/rollout``, ``train_s``
the rest of its step; ``within_bound``: ``async_step_s <= 1.25 * max(generate_s, train_s)`` (``bound_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _data(root: Path) -> list:
    from data_tools.make_demo_task import make_demo_task

    data = root / "data"
    make_demo_task(str(data), 256, seed=0, num_eval_prompts=16)
    subprocess.run([sys.executable, "-m", "data_tools.train_tokenizer", "--input", str(data / "corpus.txt"),
                    "--model-prefix", str(data / "tok"), "--vocab-size", "96"], check=True, capture_output=True,
                   cwd=ROOT)
    return [f"data.tokenizer_path={data / 'tok.model'}", f"data.prompt_path={data / 'prompts.jsonl'}",
            f"data.preference_path={data / 'preferences.jsonl'}",
            f"data.eval_prompt_path={data / 'eval_prompts.jsonl'}"]


def _inject_sleeps(seconds: float) -> None:
    from hpa.rollout.megatron_engine import MegatronRolloutEngine
    from hpa.trainer import phases

    generate, update = MegatronRolloutEngine.generate, phases.update_policy

    def slow_generate(self, prompts, params):
        time.sleep(seconds)
        return generate(self, prompts, params)

    def slow_update(*args, **kwargs):
        time.sleep(seconds)
        return update(*args, **kwargs)

    MegatronRolloutEngine.generate, phases.update_policy = slow_generate, slow_update


def _run(base: list, run_dir: Path, k: int, steps: int) -> list:
    from hpa.config import load_config
    from hpa.trainer.loop import HPATrainer

    extra = [f"rollout.max_staleness={k}", "algorithm.rollout_correction.rollout_is=token"]
    cfg = load_config(None, [*base, *extra, f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}"])
    HPATrainer(cfg, _run.groups).train()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sleep", type=float, default=2.0, help="seconds injected into generate and the update")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first step is not timed)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from hpa.config.schema import ParallelConfig
    from hpa.distributed import LaunchEnv, destroy, initialize

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _run.groups = initialize(ParallelConfig(backend="gloo"), launch=LaunchEnv(
        rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=port, launcher="torchrun"))
    overrides = ["logging.wandb.mode=disabled", "trainer.global_batch_size=4", "trainer.preference_batch_size=4",
                 "trainer.micro_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=6", "model.num_layers=2",
                 "model.policy_path=null", "trainer.eval_interval=0", "rollout.temperature=1.0",
                 "checkpoint.resume=never"]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = [*_data(Path(tmp)), *overrides]
            _inject_sleeps(args.sleep)
            sync = _run(base, Path(tmp) / "sync", 0, args.steps)[1:]
            overlapped = _run(base, Path(tmp) / "async", 1, args.steps)[1:]
    finally:
        destroy()
    sync_step = statistics.median(r["timing_s/step"] for r in sync)
    async_step = statistics.median(r["timing_s/step"] for r in overlapped)
    generate = statistics.median(r["timing_s/rollout"] for r in sync)
    train = statistics.median(r["timing_s/step"] - r["timing_s/rollout"] for r in sync)
    bound = 1.25 * max(generate, train)
    result = {"sync_step_s": round(sync_step, 3), "async_step_s": round(async_step, 3),
              "speedup": round(sync_step / async_step, 3), "generate_s": round(generate, 3),
              "train_s": round(train, 3), "bound_s": round(bound, 3), "within_bound": async_step <= bound,
              "async_lag_max": max(r["async/lag_max"] for r in overlapped),
              "config": {"sleep_s": args.sleep, "steps": args.steps, "timed_steps": len(sync),
                         "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                         "torch_threads": torch.get_num_threads()}}
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0 if result["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
