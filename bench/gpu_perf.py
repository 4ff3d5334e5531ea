"""The update's and the rollout's pace on one GPU, as one JSON line (run by ``bench/gpu_perf.sh``).

Makes the demo task and its tokenizer under ``--run-dir``/data (``bench/gpu_check.py``'s), then in this process:

1. ``perf``: ``hpa train`` with ``configs/qwen2_0.5b_gpu_perf.yaml`` (64 x 4 = 256 rows of up to 256 new tokens,
   64 pairs, token budgets) for ``--steps`` steps and one more, the **profiler pass**: that step runs under
   ``torch.profiler`` with each phase of the step (``HPATrainer.timer``: rollout, old_logprob, reference,
   update_actor, ...) marked by a ``record_function``; its record is not in the rates;
2. ``rollout``: the perf config's model and native engine on its own, one ``generate`` of ``R`` random prompts
   for each ``R`` of ``--rollout-rows`` (64 and 256), ``--rollout-tokens`` new tokens each (EOS ignored,
   sampled at temperature 1), timed after a warm-up call of the same rows (which captures the decode graph);
3. ``base``: ``hpa train`` with ``configs/qwen2_0.5b_gpu_check.yaml`` (16 prompts x 4 responses, 64 rows) for
   ``--steps`` steps, the comparison.

After each part the figures so far are written to ``--run-dir``/``figures.partial.json`` (``gpu_perf.sh`` prints
them if the time limit ends the run); the device's memory is freed and its peak counter reset between parts.

No run is sync-instrumented (``bench/gpu_check.py`` keeps the sync census). Per run (``base``, ``perf``): the rates
over ``timed_steps`` (step ``--timed-from`` to ``--steps``, less any step the automatic balance measured:
``gpu_check.timed_steps``): ``update_mfu`` (6·N per trained token over the update's time, against
``peak_tflops``), ``update_tokens_per_s``, ``rollout_tokens_per_s`` (generated tokens over the rollout phase),
``phases`` (``gpu_check.phase_figures``), ``peak_memory_gb`` against ``hpa plan``'s ``plan_total_gb`` on this
device's memory. ``profile``: per phase of the profiled step (and ``train_step``, the whole of it), ``wall_s``,
``device_s`` (the device's kernel, copy and memset time inside the phase's windows) and ``device_busy_share``
(their ratio; null off CUDA).
``peak_tflops``: ``hpa.trainer.metrics.peak_tflops`` (the device's, unless the config declares one).

``--device cpu --tiny`` runs every part at narrow widths in float32 over gloo in a few seconds a run (the
test's smoke mode: ``tests/bench/test_gpu_perf.py``); its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import gpu_check  # noqa: E402  (bench/ is not a package)

CONFIGS = {"base": ROOT / "configs" / "qwen2_0.5b_gpu_check.yaml",
           "perf": ROOT / "configs" / "qwen2_0.5b_gpu_perf.yaml"}
PHASE_PREFIX = "hpa_phase/"

# --tiny: both configs at narrow widths, float32, gloo; small batches and budgets (the perf config's proportions:
# 4x the rows of the base config, token budgets)
TINY = ["parallel.backend=gloo", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.vocab_size=256",
        "model.make_vocab_size_divisible_by=64", "model.max_sequence_length=96", "model.params_dtype=float32",
        "data.max_response_length=16", "rollout.max_new_tokens=8", "trainer.micro_batch_size=4",
        "trainer.preference_batch_size=4", "trainer.ppo_max_token_len_per_rank=512",
        "trainer.log_prob_max_token_len_per_rank=512", "data.cache_reference_log_probs=false"]
TINY_ROWS = {"base": ["trainer.global_batch_size=2"], "perf": ["trainer.global_batch_size=4"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="narrow widths, float32, gloo: a CPU smoke run")
    p.add_argument("--run-dir", default="runs/gpu_perf")
    p.add_argument("--steps", type=int, default=None, help="timed runs' steps (default 5; --tiny 3)")
    p.add_argument("--timed-from", type=int, default=None, help="first timed step (default 3; --tiny 2)")
    p.add_argument("--rollout-rows", type=int, nargs="+", default=None, help="default 64 256; --tiny 4 8")
    p.add_argument("--rollout-tokens", type=int, default=None, help="default 256; --tiny 8")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.steps = args.steps or (3 if tiny else 5)
    args.timed_from = args.timed_from or (2 if tiny else 3)
    args.rollout_rows = args.rollout_rows or ([4, 8] if tiny else [64, 256])
    args.rollout_tokens = args.rollout_tokens or (8 if tiny else 256)
    if args.device == "cpu" and not tiny:
        p.error("--device cpu runs only with --tiny (the configs are bf16 over NCCL)")
    if not 1 <= args.timed_from <= args.steps:
        p.error(f"--timed-from {args.timed_from} must be a step of the run (1 to --steps {args.steps})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "failed": ["no CUDA device (--device cpu --tiny runs without one)"]}))
        return 1
    start = time.perf_counter()
    run = Path(args.run_dir)
    data = [o for o in gpu_check._demo_task(run, args.steps)
            if not o.startswith(("trainer.run_dir=", "trainer.total_steps="))]
    cuda = args.device == "cuda"
    name = torch.cuda.get_device_name(0) if cuda else None
    out = {"device": name or "cpu", "tiny": args.tiny, "steps": args.steps, "timed_from": args.timed_from}
    failed = []
    partial = run / PARTIAL

    def save():  # what a part adds is kept should a later one run past the time limit (gpu_perf.sh prints it)
        partial.write_text(json.dumps(gpu_check._strict(dict(out, failed=failed, wall_s=time.perf_counter() - start))))

    # the perf config first, then the rollout alone, then the base config: the figures before the comparison
    for key in ("perf", "rollout", "base"):
        fresh_device(cuda)
        overrides = data + (TINY + TINY_ROWS["base" if key == "base" else "perf"] if args.tiny else [])
        try:  # a part that fails (out of memory, a kernel error) is named; the others still run
            if key == "rollout":
                out["rollout"] = rollout_figures(str(CONFIGS["perf"]), overrides, args.rollout_rows,
                                                 args.rollout_tokens)
            else:
                failed.extend(run_part(key, overrides, args, run, name, cuda, out))
        except Exception as err:  # noqa: BLE001 -- reported in the JSON
            failed.append(f"{key}: {type(err).__name__}: {err}")
        save()
    out["peak_tflops"] = out.get("perf", out.get("base", {})).get("peak_tflops")
    out["failed"], out["ok"] = failed, not failed
    out["wall_s"] = time.perf_counter() - start
    print(json.dumps(gpu_check._strict(out)))
    return 0 if out["ok"] else 1


def run_part(key: str, overrides, args, run: Path, device_name, cuda: bool, out: dict) -> list:
    """One config's run (``perf`` with its profiled step) into ``out``; what failed."""
    config, profiled = CONFIGS[key], key == "perf"
    overrides = overrides + [f"trainer.run_dir={run / key}"]
    steps = args.steps + 1 if profiled else args.steps
    rc, prof = train(str(config), overrides + [f"trainer.total_steps={steps}"],
                     profile_step=steps if profiled else None, cuda=cuda)
    if rc != 0:
        return [f"hpa train ({key}, {config.name}) exited {rc}"]
    records = [r for r in gpu_check._steps(run / key)[0] if r["step"] <= args.steps]
    out[key] = run_figures(str(config), overrides, records, args.timed_from, device_name, cuda)
    if profiled:
        out["profile"] = dict(profile_figures(*phase_intervals(prof), cuda=cuda), step=steps)
    return [] if out[key]["timed_steps"] else [f"{key}: no timed step (warm-up or balance-measured steps only)"]


# the figures so far, under --run-dir: bench/gpu_perf.sh prints them when the run passes its time limit
PARTIAL = "figures.partial.json"


def fresh_device(cuda: bool) -> None:
    """Between parts: what the last part left is freed and the peak-memory counter starts again (each run's
    ``perf/max_memory_gb`` is its own, not the process's so far)."""
    import gc

    import torch

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def train(config: str, overrides, *, profile_step=None, cuda: bool):
    """``hpa train`` in this process; with ``profile_step``, that step runs under ``torch.profiler`` and each
    phase of every step is a ``record_function`` (``PHASE_PREFIX`` + the phase's ``timing_s/`` name). Returns
    the exit status and the profiler (None without ``profile_step``)."""
    import torch

    from hpa import cli
    from hpa.trainer.loop import HPATrainer

    holder = {}
    timer, train_step = HPATrainer.timer, HPATrainer.train_step

    @contextlib.contextmanager
    def marked_timer(self, name):
        # outside the trainer's timer, which waits for the device at both ends: the window holds the phase's kernels
        with torch.profiler.record_function(PHASE_PREFIX + name), timer(self, name):
            yield

    def profiled_step(self):
        if self.state.step + 1 != profile_step:
            return train_step(self)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            with torch.profiler.record_function(PHASE_PREFIX + "train_step"):  # the whole step, as one more phase
                metrics = train_step(self)
        holder["prof"] = prof
        return metrics

    if profile_step is not None:
        HPATrainer.timer, HPATrainer.train_step = marked_timer, profiled_step
    try:
        rc = cli.main(["train", "--config", config, *overrides])
    finally:
        HPATrainer.timer, HPATrainer.train_step = timer, train_step
    return rc, holder.get("prof")


def run_figures(config: str, overrides, records, timed_from: int, device_name, cuda: bool) -> dict:
    """A run's rates over its timed steps (``gpu_check.timed_steps``), its peak memory against the plan."""
    import torch

    from hpa.config import load_config
    from hpa.plan import count_parameters, plan
    from hpa.trainer.metrics import mfu, peak_tflops

    cfg = load_config(config, overrides)
    timed = gpu_check.timed_steps(records, timed_from)
    peak = peak_tflops(cfg.trainer.peak_tflops_per_device, device_name)
    rows = cfg.trainer.global_batch_size * cfg.rollout.n
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else 80.0
    rates = step_rates(timed, rows)
    return {"rows": rows, "steps": len(records), "timed_steps": [r["step"] for r in timed],
            "measured_steps": [r["step"] for r in records if gpu_check.measured_step(r)],
            "peak_tflops": peak,
            "update_mfu": mfu(count_parameters(cfg.model), rates["update_tokens_per_s"], 1, peak),
            **rates, "phases": gpu_check.phase_figures(timed),
            "peak_memory_gb": max((r["perf/max_memory_gb"] for r in records), default=float("nan")),
            "plan_total_gb": plan(cfg, world_size=1, gpu_memory_gb=gpu_gb)["total_gb"], "plan_gpu_gb": gpu_gb}


def step_rates(timed, rows: int) -> dict:
    """Rates over the timed step records, totals over totals (a slow step weighs by its time): the update's
    trained tokens (``perf/update_throughput`` x ``timing_s/update_actor``) over its seconds, the rollout's
    generated tokens (``response_length/mean`` x rows) over the rollout phase's seconds."""
    update_s = sum(r["timing_s/update_actor"] for r in timed)
    tokens = sum(r["perf/update_throughput"] * r["timing_s/update_actor"] for r in timed)
    rollout_s = sum(r["timing_s/rollout"] for r in timed)
    generated = sum(r["response_length/mean"] * rows for r in timed)
    nan = float("nan")
    return {"update_tokens_per_s": tokens / update_s if update_s > 0 else nan,
            "update_tokens_per_step": tokens / len(timed) if timed else nan,
            "update_s_per_step": update_s / len(timed) if timed else nan,
            "rollout_tokens_per_s": generated / rollout_s if rollout_s > 0 else nan,
            "step_s": statistics.fmean(r["timing_s/step"] for r in timed) if timed else nan}


def phase_intervals(prof):
    """``(windows, device)`` from a profiler's events: each phase's host windows (the ``PHASE_PREFIX`` ranges,
    CPU side) and the device's activity intervals (kernels, copies, memsets; µs on the profiler's clock)."""
    if prof is None:
        return {}, []
    from torch.autograd import DeviceType

    windows, device = {}, []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end)
        if e.name.startswith(PHASE_PREFIX):
            if e.device_type == DeviceType.CPU:  # the GPU side's copy of the annotation is not activity
                windows.setdefault(e.name[len(PHASE_PREFIX):], []).append(span)
        elif e.device_type == DeviceType.CUDA:
            device.append(span)
    return windows, device


def merge(intervals):
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def profile_figures(windows, device, *, cuda: bool) -> dict:
    """Per phase: ``wall_s`` (its windows' union), ``device_s`` (the device's activity inside them, each
    interval clipped to the windows; intervals on several streams that overlap count each) and
    ``device_busy_share`` = ``device_s / wall_s`` (null without CUDA: no device activity is recorded there)."""
    out = {}
    for name, spans in sorted(windows.items()):
        spans = merge(spans)
        wall = sum(end - start for start, end in spans)
        busy = sum(max(0.0, min(end, d_end) - max(start, d_start)) for start, end in spans for d_start, d_end in device)
        out[name] = {"wall_s": wall / 1e6, "device_s": busy / 1e6 if cuda else None,
                     "device_busy_share": busy / wall if cuda and wall > 0 else None}
    return out


def rollout_figures(config: str, overrides, rows_list, new_tokens: int) -> dict:
    """The native engine on the config's model (random weights, its dtype): per row count, one warm-up
    ``generate`` (captures the graph of its bucket) and one timed, ``new_tokens`` each, EOS ignored."""
    import random

    import torch

    from hpa.config import load_config
    from hpa.distributed import LaunchEnv, destroy, initialize
    from hpa.models import build_policy
    from hpa.rollout import SamplingParams, build_rollout_engine
    from hpa.rollout.base import TokenizerInfo

    cfg = load_config(config, overrides)
    groups = initialize(cfg.parallel, launch=LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                                                       master_port=0, launcher="single"))
    try:
        torch.manual_seed(0)
        model = build_policy(cfg.model, cfg.parallel, groups)
        model.eval()
        engine = build_rollout_engine(cfg.rollout, model, groups,
                                      TokenizerInfo(vocab_size=cfg.model.vocab_size, eos_token_id=2, pad_token_id=0),
                                      model_cfg=cfg.model)
        rng = random.Random(0)
        prompt_length = min(32, cfg.data.max_prompt_length)
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
        out = {}
        for rows in rows_list:
            prompts = [[rng.randrange(3, cfg.model.vocab_size) for _ in range(prompt_length)] for _ in range(rows)]
            with torch.no_grad():
                engine.generate(prompts, params)  # warm-up: the bucket's capture
                _synchronize(groups.device)
                start = time.perf_counter()
                batch = engine.generate(prompts, params)
                _synchronize(groups.device)
                seconds = time.perf_counter() - start
            generated = int(batch.response_lengths.sum())
            out[f"rows{rows}"] = {"rows": rows, "new_tokens": new_tokens, "generated": generated, "call_s": seconds,
                                  "tokens_per_s": generated / seconds, "decode": getattr(engine, "decoded", None)}
        return out
    finally:
        destroy()


def _synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
