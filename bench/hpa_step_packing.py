"""The whole HPA step with sequence packing on against off (``trainer.sequence_packing``), on CPU, fp32.

Usage::

    python bench/hpa_step_packing.py [--steps N --warmup W --hidden H --layers L --heads A --kv-heads K
                                      --ffn F --max-new-tokens T --sft-steps S --threads 1 --work-dir DIR
                                      --control --profile --override section.key=value ...]

What runs: the trainer itself. Each side is one ``HPATrainer`` (``hpa train``'s loop: one process,
TP1/PP1/DP1, gloo) on the same config, the same initial policy, the same data and the same seed; the
only difference is ``trainer.sequence_packing`` (false: every micro-batch right-padded to its longest
row; true: its rows packed into one sequence, no pad computed). Each step is the whole HPA step:
rollout (hpa's native engine), reference and old-policy forwards, rule reward, advantages (GRPO unless
overridden), the reference log-probs of the step's preference pairs (read from the run's cache, built
at start-up, as the trainer does by default), and the mixed PPO + DPO + hierarchical-KL policy update.
Defaults: a Llama-style policy of 4 layers, hidden 256, 4 heads, 2 KV groups, ffn 704 (vocabulary
128), 16 prompts x 4 responses = 64 rollout rows and 16 preference pairs (32 rows) a step, micro-batches
of 16 rows (rollout) or 16 pairs, one PPO epoch and mini-batch; padded, each micro-batch is cut to its
longest row (no ``ppo_max_token_len_per_rank`` unless given with ``--override``). No evaluation and
no checkpoint inside the measured steps; the KL rollback guard is off
(``guard.kl_rollback_threshold=null``: a rollback would repeat a step on one side only).

The task (prepared once in ``--work-dir`` and reused while the preparation settings are unchanged):
the demo task (``data_tools.make_demo_task``, seed 0, as the tests make it) with ``copy``/``reverse``
prompts of 1 to 6 symbols (``add`` prompts are 2 numbers), a 96-token SentencePiece tokenizer, and an
initial policy from ``hpa sft`` of a random model for only ``--sft-steps`` (6) steps: it has learned
to end with EOS but not yet where, so its sampled responses (temperature 1) stop at EOS after 1 to
~30 tokens. The prompt+response lengths of every rollout row (``lengths``: min, p10, median, p90,
max, and the share that stopped at EOS rather than at ``--max-new-tokens``) and of the preference
pairs' rows are reported.

Alternation: the two sides run in their own spawned processes and take turns **one step at a time**
(off then on, the order swapped every step), so they never compete for the cores and background load
on a shared machine hits both alike. Each side's start-up is its own turn, and a step's turn also holds
the loop's work after the step (metrics, logging) and, after the last step, the teardown; so nothing of
one side overlaps the other's step. The first ``--warmup`` steps are dropped.

What is reported per side, from the trainer's own figures (``hpa.trainer.metrics.update_perf``, whose
arguments are recorded each step): ``tokens`` are the real (non-pad) tokens of the policy update's
micro-batches (rollout rows and preference-pair rows), ``computed`` the positions the update computed
(pads included; equal to ``tokens`` when packed).

- ``update_tokens_per_s`` = sum(tokens) / sum(``timing_s/update_actor``) over the measured steps (the
  trainer's ``perf/update_throughput`` per step is in ``per_step``);
- ``step_tokens_per_s`` = sum(tokens) / sum(``timing_s/step``) (the trainer's ``perf/throughput``: update
  tokens over the whole step's time, rollout included);
- ``pad_share`` = 1 - sum(tokens) / sum(computed) (``perf/pad_share``);
- median seconds of each phase (``timing_s/*``);
- ``ratio_on_off``: on / off of both throughputs, and off / on of the median update and step seconds
  (the same ratio when both sides train the same tokens, less sensitive to a step that background
  load hit).

Same tokens: both sides start from the same weights and sample with the same seeds, so their first
rollouts are identical; later ones stay so unless the rounding differences of the packed forwards
change a sampled token. Checked every step: a digest of the rollout's tokens (prompts and responses),
the update's real-token count, and the losses (``agreement``).

``--control`` runs packing off on both sides (an A/A run: how far apart two identical sides come out on
this machine, the noise floor of the ratios). ``--profile`` cProfiles each side's measured steps into
``<work-dir>/profile_<side>.pstats`` (the profiler's per-call cost slows Python-heavy code more).

Prints one JSON object (the only stdout).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from lockstep import Turn  # bench/lockstep.py (scripts run from bench/)

SIDES = ("off", "on")
PHASES = ("rollout", "reference", "old_logprob", "reward", "update_actor", "step")
COMPARED = ("actor/pg_loss", "dpo/loss", "kl/token", "kl/semantic", "actor/entropy", "actor/grad_norm",
            "reward/raw_mean", "response_length/mean")
REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=24, help="measured HPA steps per side")
    p.add_argument("--warmup", type=int, default=2, help="steps run first and not measured")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--prompts-per-step", type=int, default=16, help="trainer.global_batch_size")
    p.add_argument("--n", type=int, default=4, help="rollout.n, responses per prompt")
    p.add_argument("--micro-batch", type=int, default=16, help="trainer.micro_batch_size (rows, or pairs)")
    p.add_argument("--pairs-per-step", type=int, default=16, help="trainer.preference_batch_size")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--sft-steps", type=int, default=6, help="SFT steps of the initial policy (few: varied lengths)")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--min-symbols", type=int, default=1)
    p.add_argument("--max-symbols", type=int, default=6)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each side (the sides take turns)")
    p.add_argument("--seed", type=int, default=1234, help="trainer.seed (the SFT's too)")
    p.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hpa_bench_packing"))
    p.add_argument("--control", action="store_true",
                   help="an A/A run: packing off on both sides (the 'on' side too), for the noise floor")
    p.add_argument("--profile", action="store_true",
                   help="cProfile each side's measured steps into <work-dir>/profile_<side>.pstats (slows both)")
    p.add_argument("--override", action="append", default=[], metavar="section.key=value",
                   help="more overrides for both sides' hpa train (repeatable)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1, --warmup at least 0")
    if not 1 <= args.min_symbols <= args.max_symbols <= 6:
        p.error("need 1 <= --min-symbols <= --max-symbols <= 6 (make_demo_task enumerates 8^max prompts)")
    if args.max_new_tokens + 16 > 64 * 4:
        p.error("--max-new-tokens too large")
    return args


def model_overrides(args) -> List[str]:
    seq = 64 if args.max_new_tokens + 16 <= 64 else 1 << (args.max_new_tokens + 16 - 1).bit_length()
    return [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.num_attention_heads={args.heads}", f"model.num_query_groups={args.kv_heads}",
            f"model.ffn_hidden_size={args.ffn}", f"model.max_sequence_length={seq}"]


def data_overrides(work: Path) -> List[str]:
    d = work / "data"
    return [f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
            f"data.preference_path={d / 'preferences.jsonl'}", f"data.eval_prompt_path={d / 'eval_prompts.jsonl'}",
            f"data.sft_path={d / 'sft.jsonl'}", "logging.wandb.mode=disabled", "logging.progress_bar=false",
            "logging.console=false"]


# ---------------------------------------------------------------------------------------------- the task


def prepare(args) -> Dict:
    """The task's data, tokenizer and SFT policy under ``--work-dir`` (reused when its settings match)."""
    work = Path(args.work_dir)
    key = {"num_prompts": args.num_prompts, "min_symbols": args.min_symbols, "max_symbols": args.max_symbols,
           "sft_steps": args.sft_steps, "seed": args.seed, "model": model_overrides(args), "version": 1}
    stamp = work / "prepared.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == key and (work / "sft" / "sft").exists():
        return {"reused": True, **json.loads(stamp.read_text())}
    start = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    sys.path.insert(0, str(REPO))
    from data_tools.make_demo_task import make_demo_task

    # as tests/demo_data.make_task, with longer copy/reverse prompts
    make_demo_task(str(work / "data"), args.num_prompts, seed=0, num_eval_prompts=12, min_len=args.min_symbols,
                   max_len=args.max_symbols)
    subprocess.run([sys.executable, "-m", "data_tools.train_tokenizer", "--input", str(work / "data" / "corpus.txt"),
                    "--model-prefix", str(work / "data" / "tok"), "--vocab-size", "96"], check=True,
                   capture_output=True, env=env, cwd=REPO)
    proc = subprocess.run([sys.executable, "-m", "hpa.cli", "sft", *data_overrides(work), *model_overrides(args),
                           f"trainer.run_dir={work / 'sft'}", "model.policy_path=null", f"trainer.seed={args.seed}",
                           f"sft.total_steps={args.sft_steps}", "trainer.micro_batch_size=32"],
                          capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"hpa sft failed:\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}")
    last = json.loads((work / "sft" / "sft_logs" / "metrics.jsonl").read_text().splitlines()[-1])
    info = {"key": key, "sft_final_nll": round(last["sft/nll"], 4), "prepare_s": round(time.perf_counter() - start, 1)}
    stamp.write_text(json.dumps(info))
    return {"reused": False, **info}


def train_overrides(args, side: str) -> List[str]:
    work = Path(args.work_dir)
    return [*data_overrides(work), *model_overrides(args), f"model.policy_path={work / 'sft' / 'sft'}",
            f"trainer.run_dir={work / ('run_' + side)}", f"trainer.seed={args.seed}",
            f"trainer.total_steps={args.warmup + args.steps}", "trainer.eval_interval=0",
            "checkpoint.save_interval=0", f"trainer.global_batch_size={args.prompts_per_step}",
            f"trainer.micro_batch_size={args.micro_batch}", f"trainer.preference_batch_size={args.pairs_per_step}",
            f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
            f"rollout.temperature={args.temperature}",
            "guard.kl_rollback_threshold=null",  # a rollback would repeat a step on one side only
            *args.override,
            f"trainer.sequence_packing={'true' if side == 'on' and not args.control else 'false'}"]


# ---------------------------------------------------------------------------------------------- one side


def _digest(batch) -> str:
    """The rollout's real tokens, row by row (prompt without its left padding, response without pads)."""
    h = hashlib.sha1()
    for p, pm, r, rm in zip(batch.prompt_ids.tolist(), batch.prompt_mask.tolist(), batch.response_ids.tolist(),
                            batch.response_mask.tolist()):
        h.update(repr(([t for t, m in zip(p, pm) if m], [t for t, m in zip(r, rm) if m])).encode())
    return h.hexdigest()[:16]


def run_side(side: str, args, turn: Turn) -> Dict:
    """One ``HPATrainer`` run, its steps in turns; returns what it recorded (see the module docstring)."""
    import logging

    logging.basicConfig(level=logging.WARNING)  # before hpa's launch preamble, whose basicConfig is then a no-op
    import torch

    torch.set_num_threads(args.threads)
    from hpa.config import load_config
    from hpa.distributed import launched
    from hpa.trainer import loop, phases

    cfg = load_config(None, train_overrides(args, side))
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
    perf: List[Dict] = []
    rollouts: List[Dict] = []
    pairs: List[List[int]] = []

    real_update_perf = loop.update_perf

    def update_perf(num_params, **kw):
        perf.append({k: kw[k] for k in ("tokens", "padded_tokens", "update_seconds", "step_seconds")})
        return real_update_perf(num_params, **kw)

    loop.update_perf = update_perf
    real_update_policy = phases.update_policy

    def update_policy(batch, pair_mbs, *a, **kw):
        pairs.append([int(n) for mb in pair_mbs for n in mb.lengths.tolist()])
        return real_update_policy(batch, pair_mbs, *a, **kw)

    phases.update_policy = update_policy

    with launched(cfg) as (cfg, groups):
        trainer = loop.HPATrainer(cfg, groups)
        real_timer, real_scored = trainer.timer, trainer.rollouts.scored_rollout

        def timer(name):
            if name == "step":  # the loop times each step with timer("step"): switch turns just before
                if profile is not None:
                    profile.disable()
                turn.end()  # the previous turn (start-up, or the previous step and the loop's work after it)
                turn.begin()
                if profile is not None and trainer.state.step >= args.warmup:  # a measured step
                    profile.enable()
            return real_timer(name)

        def scored_rollout(reward, refill_round=0):
            batch, metrics = real_scored(reward, refill_round)
            rollouts.append({"step": trainer.state.step + 1, "round": refill_round, "digest": _digest(batch),
                             "prompt": batch.prompt_lengths.tolist(), "response": batch.response_lengths.tolist(),
                             "stopped": sum(r == "stop" for r in batch.finish_reasons)})
            return batch, metrics

        trainer.timer, trainer.rollouts.scored_rollout = timer, scored_rollout
        trainer.train()
        if profile is not None:
            profile.disable()
            profile.dump_stats(str(Path(args.work_dir) / f"profile_{side}.pstats"))
        records = [json.loads(line) for line in (Path(cfg.trainer.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"perf": perf, "records": records, "rollouts": rollouts, "pairs": pairs,
            "torch_threads": torch.get_num_threads(), "exit_reason": trainer.exit_reason,
            "num_params": trainer.num_params}


def _child(side: str, args, go, done, results) -> None:
    os.dup2(2, 1)  # everything of a side (megatron's prints included) to stderr: the JSON is the only stdout
    sys.stdout = sys.stderr
    turn = Turn(go, done)
    try:
        turn.begin()  # start-up is a turn of its own
        result = run_side(side, args, turn)
        results.put((side, "ok", result))
    except BaseException:
        import traceback

        results.put((side, "error", traceback.format_exc()))
    finally:
        done.set()  # the last turn: the last step, the loop's end and the teardown


# ---------------------------------------------------------------------------------------------- driver


def run_both(args) -> Dict[str, Dict]:
    """Both sides in spawned processes; turns: start-up, then one step each, off/on order swapped every step."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    events = {side: (ctx.Event(), ctx.Event()) for side in SIDES}
    for side in SIDES:  # a fresh run each time (hpa train would resume from the last run's checkpoint)
        shutil.rmtree(Path(args.work_dir) / f"run_{side}", ignore_errors=True)
    procs = {side: ctx.Process(target=_child, args=(side, args, *events[side], results), daemon=True)
             for side in SIDES}
    for p in procs.values():
        p.start()
    out: Dict[str, Dict] = {}

    def collect() -> None:
        while not results.empty():
            side, status, value = results.get(timeout=60)
            if status != "ok":
                raise RuntimeError(f"the packing-{side} side failed:\n{value}")
            out[side] = value

    try:
        for turn in range(1 + args.warmup + args.steps):  # turn 0: start-up; turn k: step k
            for side in (SIDES if turn % 2 == 0 else SIDES[::-1]):
                if side in out:
                    continue
                go, done = events[side]
                go.set()
                while not done.wait(timeout=5):
                    if not procs[side].is_alive():
                        collect()
                        raise RuntimeError(f"the packing-{side} side exited (code {procs[side].exitcode}) "
                                           f"in turn {turn}")
                done.clear()
                collect()
        deadline = time.time() + 120
        while len(out) < len(SIDES) and time.time() < deadline:
            collect()
            time.sleep(0.2)
        missing = [s for s in SIDES if s not in out]
        if missing:
            raise RuntimeError(f"no result from the packing-{missing} side(s)")
    finally:
        for p in procs.values():
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return out


# ---------------------------------------------------------------------------------------------- report


def _dist(values: List[int]) -> Dict:
    v = sorted(values)
    q = lambda f: v[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
    return {"min": v[0], "p10": q(0.1), "median": statistics.median(v), "p90": q(0.9), "max": v[-1],
            "mean": round(statistics.fmean(v), 2), "count": len(v)}


def summarize(result: Dict, warmup: int) -> Dict:
    perf = result["perf"][warmup:]
    records = [r for r in result["records"] if r.get("step", 0) > warmup]
    tokens = sum(p["tokens"] for p in perf)
    computed = sum(p["padded_tokens"] for p in perf)
    update_s = sum(p["update_seconds"] for p in perf)
    step_s = sum(p["step_seconds"] for p in perf)
    return {
        "update_tokens_per_s": round(tokens / update_s, 1),
        "step_tokens_per_s": round(tokens / step_s, 1),
        "pad_share": round(1 - tokens / computed, 4),
        "update_tokens": int(tokens),
        "update_positions_computed": int(computed),
        "median_s": {k: round(statistics.median(r.get(f"timing_s/{k}", 0.0) for r in records), 4) for k in PHASES},
        "per_step": {
            "update_throughput": [round(r["perf/update_throughput"], 1) for r in records],
            "throughput": [round(r["perf/throughput"], 1) for r in records],
            "pad_share": [round(r["perf/pad_share"], 4) for r in records],
            "update_s": [round(p["update_seconds"], 3) for p in perf],
            "step_s": [round(p["step_seconds"], 3) for p in perf],
        },
    }


def agreement(off: Dict, on: Dict) -> Dict:
    """Did the two sides train on the same tokens, and how far apart are their losses?"""
    d_off = {(r["step"], r["round"]): r["digest"] for r in off["rollouts"]}
    d_on = {(r["step"], r["round"]): r["digest"] for r in on["rollouts"]}
    steps = sorted({s for s, _ in d_off} | {s for s, _ in d_on})
    same = [s for s in steps if all(d_off.get(k) == d_on.get(k) for k in set(d_off) | set(d_on) if k[0] == s)]
    tok_off = [int(p["tokens"]) for p in off["perf"]]
    tok_on = [int(p["tokens"]) for p in on["perf"]]
    first_diff = next((s for s in steps if s not in same), None)
    diffs = {}
    rec_on = {r["step"]: r for r in on["records"]}
    for key in COMPARED:
        pairs = [(r[key], rec_on[r["step"]][key]) for r in off["records"]
                 if r["step"] in same and r["step"] in rec_on and isinstance(r.get(key), float)
                 and isinstance(rec_on[r["step"]].get(key), float)]
        if pairs:
            diffs[key] = {"abs": float(f"{max(abs(a - b) for a, b in pairs):.2e}"),
                          "rel": float(f"{max(abs(a - b) / max(abs(a), abs(b), 1e-12) for a, b in pairs):.2e}")}
    return {
        "steps": len(steps),
        "identical_rollout_steps": len(same),
        "first_step_with_different_rollout": first_diff,
        "update_tokens_equal_every_step": tok_off == tok_on,
        "update_tokens_equal_steps": sum(a == b for a, b in zip(tok_off, tok_on)),
        "update_tokens_per_step": {"off": tok_off, "on": tok_on},
        "max_diff_of_metrics_on_identical_steps": diffs,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    wall = time.perf_counter()
    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), WANDB_MODE="disabled",
                      PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    sys.path.insert(0, str(REPO))
    prepared = prepare(args)
    bench_start = time.perf_counter()
    both = run_both(args)
    off, on = both["off"], both["on"]
    total = args.warmup + args.steps
    for side in SIDES:
        if len(both[side]["perf"]) != total:
            raise RuntimeError(f"the packing-{side} side ran {len(both[side]['perf'])} steps, expected {total} "
                               f"(exit: {both[side]['exit_reason']})")
    s_off, s_on = summarize(off, args.warmup), summarize(on, args.warmup)
    rows = off["rollouts"]
    import torch

    med_off, med_on = s_off["median_s"], s_on["median_s"]
    out = {
        "off": s_off,
        "on": s_on,
        "ratio_on_off": {"update_tokens_per_s": round(s_on["update_tokens_per_s"] / s_off["update_tokens_per_s"], 3),
                         "step_tokens_per_s": round(s_on["step_tokens_per_s"] / s_off["step_tokens_per_s"], 3),
                         # the same from the median step (less sensitive to a step hit by background load)
                         "update_s_median_off_over_on": round(med_off["update_actor"] / med_on["update_actor"], 3),
                         "step_s_median_off_over_on": round(med_off["step"] / med_on["step"], 3)},
        "pad_share": {"off": s_off["pad_share"], "on": s_on["pad_share"]},
        "lengths": {
            "rollout_prompt_plus_response": _dist([p + r for x in rows for p, r in zip(x["prompt"], x["response"])]),
            "rollout_prompt": _dist([p for x in rows for p in x["prompt"]]),
            "rollout_response": _dist([r for x in rows for r in x["response"]]),
            "rollout_stopped_at_eos": round(sum(x["stopped"] for x in rows) / sum(len(x["response"]) for x in rows), 4),
            "pair_rows_prompt_plus_response": _dist([n for step in off["pairs"] for n in step]),
            "of": "every step of the packing-off side, warm-up included",
        },
        "agreement": agreement(off, on),
        "config": {"control_run_both_sides_off": args.control,
                   "alternation": "one step at a time, off/on order swapped every step, start-up and teardown "
                                  "in turns of their own",
                   "steps": args.steps, "warmup_steps": args.warmup, "threads": args.threads,
                   "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                             "kv_heads": args.kv_heads, "ffn": args.ffn, "params": off["num_params"]},
                   "rollout_rows_per_step": args.prompts_per_step * args.n, "pairs_per_step": args.pairs_per_step,
                   "micro_batch": args.micro_batch, "max_new_tokens": args.max_new_tokens,
                   "temperature": args.temperature, "sft_steps": args.sft_steps,
                   "symbols": [args.min_symbols, args.max_symbols], "overrides": args.override,
                   "device": "cpu", "dtype": "float32", "cpu_count": os.cpu_count(),
                   "torch_threads": {s: both[s]["torch_threads"] for s in SIDES}},
        "prepare": prepared,
        "bench_s": round(time.perf_counter() - bench_start, 1),
        "wall_s": round(time.perf_counter() - wall, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
