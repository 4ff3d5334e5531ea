"""CPU proxy of the compiled transformer layers (``model.compile``): graph breaks and recompiles.

Usage::

    python bench/proxies/layer_compile.py   # ~1-2 min on one CPU core (two inductor compilations); one JSON line

A policy of Qwen2-0.5B's structure (14 query heads / 2 KV heads, RoPE, SwiGLU, RMSNorm, QKV biases, tied
embeddings) at narrow widths and 2 layers (every layer runs the same compiled graph) has its layers compiled as
the trainer compiles them (``hpa.models.compiled_layers``, graph breaks allowed, so they are counted rather than
raised), then runs forward and backward over three packed micro-batches of different token counts (rows of 30
to 300 tokens, packed into chunks as long packs are) and three padded ones of different widths:

- ``layer_compile.graph_breaks``: dynamo's graph breaks over the six passes (target 0);
- ``layer_compile.recompiles``: graphs compiled beyond the first of each layout over the three lengths
  (target <= 2; 0 when the token dimensions are dynamic from the first call).

``layer_compile.graphs`` is the number of graphs compiled in all (one per layout when nothing recompiles).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 2, 56, 14, 2, 152, 256
PACKED_LENGTHS = ([120, 300, 45, 210, 80, 260], [30, 190, 240, 150, 95], [280, 60, 175, 225, 130, 40, 300])
PADDED_LENGTHS = ([48, 20, 33, 48], [90, 64, 12, 75], [130, 100, 27, 66])


def _pass(model, lengths, packed: bool, seed: int) -> None:
    import torch

    from hpa.engine.micro_batch import MicroBatch
    from hpa.engine.step import model_inputs

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=g)
    batch = MicroBatch.from_padded("rows", ids, ids, torch.tensor(lengths), packed=packed)
    ids, positions, packed_seq_params, _ = model_inputs(batch, 1)
    out = model(ids, positions, None, packed_seq_params=packed_seq_params)  # [b, s, v]
    model.zero_grad(set_to_none=True)
    out.float().square().mean().backward()


def _measure_here() -> dict:
    """The counts, in this process (plain CPU tensors: inductor does not trace hpa's test device mode)."""
    import torch
    from torch._dynamo.utils import counters

    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.distributed import LaunchEnv, destroy, initialize
    from hpa.models import build_policy

    torch.set_num_threads(1)
    groups = initialize(ParallelConfig(backend="gloo"),
                        launch=LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                                         master_port=0, launcher="single"))
    try:
        torch.manual_seed(0)
        cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
                          ffn_hidden_size=FFN, vocab_size=VOCAB, max_sequence_length=512,
                          make_vocab_size_divisible_by=64, add_qkv_bias=True, untie_embeddings_and_output_weights=False,
                          compile=True)
        model = build_policy(cfg, ParallelConfig(), groups)
        torch._dynamo.reset()
        counters.clear()
        recompiles, graphs = 0, 0
        for packed, all_lengths in ((True, PACKED_LENGTHS), (False, PADDED_LENGTHS)):
            for seed, lengths in enumerate(all_lengths):
                _pass(model, lengths, packed, seed)
            layout_graphs = counters["stats"]["unique_graphs"] - graphs
            recompiles += max(layout_graphs - 1, 0)
            graphs += layout_graphs
        return {"layer_compile.graph_breaks": sum(counters["graph_break"].values()),
                "layer_compile.recompiles": recompiles,
                "layer_compile.graphs": graphs}
    finally:
        destroy()


def measure() -> dict:
    """The counts, from a child process: a clean dynamo and process group state, and no test device mode."""
    env = {k: v for k, v in os.environ.items() if k != "HPA_TEST_MODEL_DEVICE"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--here"], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"bench/proxies/layer_compile.py failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if "--here" in sys.argv:
        sys.path.insert(0, ROOT)
        print(json.dumps(_measure_here()))
    else:
        print(json.dumps(measure()))
