"""Load test of ``hpa serve``: requests/s, tokens/s and p50/p95 latency at several concurrencies.

```bash
bash launch/demo.sh                                    # or any run directory with data/ and a policy
python bench/serve_load.py --run-dir runs/demo         # starts hpa serve on the run's SFT policy, localhost
python bench/serve_load.py --url http://127.0.0.1:8000 --model sft   # a server that is already running
```

Each concurrency level (``--concurrency 1 4 16``) sends ``--requests`` completions (``--time-limit`` seconds
at most per level) from that many client threads, each waiting for its answer before it sends the next:
prompts from the run's held-out prompts in turn, ``--max-tokens`` tokens at ``--temperature``. A warm-up
of ``--warmup`` requests runs first. Latency is from sending a request to having its whole answer; tokens
are the ``completion_tokens`` the server reports. Only localhost URLs are accepted.

Prints one JSON object: per level ``requests``, ``seconds``, ``requests_per_s``, ``tokens_per_s``,
``p50_s``, ``p95_s``, ``errors``, and ``throughput_ratio_16_to_1`` (requests/s at the highest level over
the lowest), the load average before and after, and the server's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parent.parent


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def start_server(run_dir: Path, policy: str, reference: str, extra):
    """``hpa serve`` on the run's checkpoints on a free localhost port; returns (process, url)."""
    d = run_dir / "data"
    cmd = [sys.executable, "-m", "hpa.cli", "serve", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
           f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
           f"data.preference_path={d / 'preferences.jsonl'}", f"data.eval_prompt_path={d / 'eval_prompts.jsonl'}",
           f"model.policy_path={policy}", f"model.reference_path={reference}", "serve.host=127.0.0.1",
           "serve.port=0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = None
    for line in proc.stdout:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if m:
            url = m.group(1)
        if "ready" in line:
            break
    if url is None or proc.poll() is not None:
        raise RuntimeError("hpa serve did not start; run the command by hand to see why: " + " ".join(cmd))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, url


def run_level(url: str, model: str, prompts, concurrency: int, num_requests: int, time_limit: float,
              max_tokens: int, temperature: float):
    latencies, tokens, errors = [], [], [0]
    lock = threading.Lock()
    counter = iter(range(num_requests))
    start = time.monotonic()

    def client():
        with httpx.Client(timeout=120) as http:
            while time.monotonic() - start < time_limit:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                        "temperature": temperature}
                t = time.monotonic()
                r = http.post(url + "/v1/completions", json=body)
                elapsed = time.monotonic() - t
                with lock:
                    if r.status_code != 200:
                        errors[0] += 1
                        continue
                    latencies.append(elapsed)
                    tokens.append(r.json()["usage"]["completion_tokens"])

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    seconds = time.monotonic() - start
    return {"concurrency": concurrency, "requests": len(latencies), "seconds": round(seconds, 3),
            "requests_per_s": round(len(latencies) / seconds, 3), "tokens_per_s": round(sum(tokens) / seconds, 2),
            "p50_s": round(percentile(latencies, 0.5), 4), "p95_s": round(percentile(latencies, 0.95), 4),
            "mean_completion_tokens": round(statistics.mean(tokens), 2) if tokens else 0.0, "errors": errors[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--run-dir", default="runs/demo", help="a demo run (data/, sft/): the server is started on it")
    p.add_argument("--policy", default=None, help="policy checkpoint (default: RUN_DIR/sft)")
    p.add_argument("--reference", default=None, help="reference checkpoint (default: the policy)")
    p.add_argument("--url", default=None, help="an already running server on localhost instead")
    p.add_argument("--model", default=None, help="the served model id (with --url)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per concurrency level at most")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("overrides", nargs="*", help="extra hpa serve overrides (serve.max_batch_size=16, ...)")
    args = p.parse_args(argv)

    run_dir = Path(args.run_dir)
    proc = None
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("serve_load.py only talks to localhost")
        url, model = args.url.rstrip("/"), args.model
    else:
        policy = args.policy or str(run_dir / "sft")
        proc, url = start_server(run_dir, policy, args.reference or policy, args.overrides)
        model = None
    try:
        if model is None:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        prompt_file = run_dir / "data" / "eval_prompts.jsonl"
        prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()] \
            if prompt_file.is_file() else ["add 3 5 =", "copy a b c =", "reverse d e f ="]
        load_before = os.getloadavg()
        run_level(url, model, prompts, 1, args.warmup, args.time_limit, args.max_tokens, args.temperature)
        levels = [run_level(url, model, prompts, c, args.requests, args.time_limit, args.max_tokens,
                            args.temperature) for c in args.concurrency]
        load_after = os.getloadavg()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    ratio = levels[-1]["requests_per_s"] / levels[0]["requests_per_s"] if levels[0]["requests_per_s"] else None
    print(json.dumps({"levels": levels, f"throughput_ratio_{args.concurrency[-1]}_to_{args.concurrency[0]}":
                      round(ratio, 2) if ratio else None, "load_average_before": [round(x, 2) for x in load_before],
                      "load_average_after": [round(x, 2) for x in load_after], "max_tokens": args.max_tokens,
                      "temperature": args.temperature, "overrides": args.overrides, "url": url, "model": model},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
