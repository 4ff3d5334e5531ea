"""What the proxies that build a policy share (a helper, not a proxy: its name starts with ``_``; a proxy imports it
by name, its folder on the import path as when it runs as a script or ``bench/step_proxies.py`` loads it).

The policy is Qwen2-0.5B's structure (14 query heads / 2 KV heads, RoPE, SwiGLU, RMSNorm, QKV biases, tied
embeddings) at narrow widths (``bench/host_overhead.py``'s: the counts the proxies take do not depend on them), in a
one-process gloo group; a proxy measures in a child process of its own (``measure_in_child``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 56, 14, 2, 152, 256


@contextlib.contextmanager
def qwen2_shaped_policy(num_layers: int, max_sequence_length: int, **model_keys) -> Iterator:
    """The policy (``model_keys``: more ``ModelConfig`` keys), built after ``torch.manual_seed(0)`` on one CPU thread;
    the process group is destroyed on the way out."""
    import torch

    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.distributed import LaunchEnv, destroy, initialize
    from hpa.models import build_policy

    torch.set_num_threads(1)
    groups = initialize(ParallelConfig(backend="gloo"),
                        launch=LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                                         master_port=0, launcher="single"))
    try:
        torch.manual_seed(0)
        cfg = ModelConfig(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                          num_query_groups=KV_HEADS, ffn_hidden_size=FFN, vocab_size=VOCAB,
                          max_sequence_length=max_sequence_length, make_vocab_size_divisible_by=64, add_qkv_bias=True,
                          untie_embeddings_and_output_weights=False, **model_keys)
        yield build_policy(cfg, ParallelConfig(), groups)
    finally:
        destroy()


def measure_in_child(script: str) -> dict:
    """``python script --here``'s JSON line: a clean inductor, dynamo and process group state, and no test device
    mode (inductor does not trace it)."""
    env = {k: v for k, v in os.environ.items() if k != "HPA_TEST_MODEL_DEVICE"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, os.path.abspath(script), "--here"], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{os.path.relpath(script, ROOT)} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(measure: Callable[[], dict], measure_here: Callable[[], dict]) -> None:
    """A proxy run as a script: one JSON line, measured here with ``--here`` (the child), else in a child."""
    if "--here" in sys.argv:
        sys.path.insert(0, ROOT)
        print(json.dumps(measure_here()))
    else:
        print(json.dumps(measure()))
