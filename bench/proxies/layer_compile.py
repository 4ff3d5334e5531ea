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

from _common import VOCAB, main, measure_in_child, qwen2_shaped_policy

LAYERS = 2
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

    with qwen2_shaped_policy(LAYERS, 512, compile=True) as model:
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


def measure() -> dict:
    """The counts, from a child process (``_common.measure_in_child``)."""
    return measure_in_child(__file__)


if __name__ == "__main__":
    main(measure, _measure_here)
