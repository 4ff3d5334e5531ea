"""``bench/async_overlap.py``: one JSON line; with generation and the update each held 1 s by an injected sleep,
the k = 1 step stays within 1.25 x max(generate, train) and beats the synchronous step."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.e2e
def test_k1_overlaps_generation_and_training():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "async_overlap.py"), "--sleep", "1",
                           "--steps", "4"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout + proc.stderr[-3000:]
    result = json.loads(lines[0])
    assert result["within_bound"] and result["async_step_s"] <= result["bound_s"]
    assert result["generate_s"] >= 1.0 and result["train_s"] >= 1.0  # the sleeps were injected on both sides
    assert result["speedup"] >= 1.6 and result["async_lag_max"] == 1.0, result
