"""Host cost of a micro-batch, measured on CPU: the operations the host issues and its host-device syncs.

Usage::

    python bench/host_overhead.py [--layers 24 --hidden 56 --ffn 152 --vocab 256 --out FILE]

Prints one JSON line::

    {"forward": {L: {R: {"aten_ops": n, "kernel_ops": n, "syncs": n, "sync_ops": n, "sync_sites": {...}}}},
     "update": {...},
     "syncs_per_step": {"padded": n, "packed": n}, "config": {...}}

per micro-batch, with L the layout (``padded``: rows right-padded to the longest; ``packed``: the rows'
tokens in one sequence) and R the rows of the micro-batch (``rows8``, ``rows32``; rows of 12 to 60
tokens, seeded). The model is Qwen2-0.5B's structure (24 layers, grouped-query attention with 14 query
heads and 2 KV heads, RoPE, SwiGLU, RMSNorm, QKV biases, tied embeddings) at narrow widths (hidden 56,
head dim 4), so it runs in seconds on a CPU and the counts are those of the real shape: on a GPU the host
issues one kernel per operation whatever the widths, and the small model's operations are the same.

- ``forward``: the micro-batch's copy to the model's device, its model inputs, one forward pass without
  gradients and hpa's heads on the logits (what the old-policy and reference forwards do per micro-batch).
- ``update``: the same, with gradients and the entropy, and the backward pass of the heads' loss.
- ``aten_ops``: every aten operation the pass dispatches (a ``TorchDispatchMode``), views included.
- ``kernel_ops``: the aten operations that would launch a kernel on a GPU: all of them except views
  (operations whose output aliases their input: ``view``, ``transpose``, ``expand``, ``slice``...),
  ``detach``/``alias``/``lift_fresh`` and allocations without initialisation (``empty*``).
- ``sync_ops``: operations that make the host wait for a CUDA device, forward and backward
  (``hpa/distributed/sync_ops.py``, ``SyncOps``): the reads ``syncs`` counts and those inside operations
  (``nonzero``, boolean masks, ``index_put_`` with accumulate, ``unique``, ``repeat_interleave`` without
  ``output_size``, ``unravel_index``...) and blocking host-to-device copies; ``sync_sites`` gives each one's
  ``file:line``. The pass includes hpa's two heads (``hpa.engine.head``: response log-probs and entropy,
  label log-probs) as the losses call them.
- ``syncs``: host-device syncs, counted in hpa's test device mode (``hpa/distributed/device_mode.py``,
  ``SyncCounter``): reads of device values (``.item()``, ``.tolist()``, tensor ``bool``, device-to-host
  copies) in hpa's code and inside the model's forward; backward passes are not seen (``sync_ops`` sees them).
- ``syncs_per_step``: the syncs of one step's worth of model passes through hpa's engine
  (``hpa.engine.step.forward_backward``, megatron's schedule): 4 micro-batches of 8 rows forward-only
  (old policy), the same for the reference, and 4 with the backward pass (the update), with a
  log-prob loss whose metric stays on the device. The test device mode's one
  device-to-host copy per micro-batch of the engine's loss (``loss.to(parameters' device)``, the CPU
  there) is counted too: a real device makes no copy there.

One process, TP1/PP1, gloo, fp32, ``HPA_TEST_MODEL_DEVICE=lazy``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HPA_TEST_MODEL_DEVICE", "lazy")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

_NO_KERNEL = {"detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided", "_local_scalar_dense"}


class OpCounter(TorchDispatchMode):
    """Counts aten operations; ``kernel_ops`` leaves out views and ops that launch no kernel."""

    def __init__(self):
        super().__init__()
        self.aten_ops = 0
        self.kernel_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.aten_ops += 1
        if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
            self.kernel_ops += 1
        return func(*args, **(kwargs or {}))


def _micro_batch(rows: int, packed: bool, vocab: int, seed: int):
    """Rows of 12 to 60 tokens, the first 8 the prompt: the response positions (``response_index``, ``mask``
    ``[n, r]``) and the label positions (``label_mask`` ``[n, s]``) that hpa's two heads read."""
    from hpa.engine.collate import TokenRows, collate

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, 61, (rows,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(1, vocab, (rows, width), generator=g)
    keep = torch.arange(width)[None, :] < lengths[:, None]
    ids = ids * keep
    labels = torch.roll(ids, -1, dims=1) * keep
    prompt = 8
    index = (prompt - 1 + torch.arange(width - prompt))[None, :].expand(rows, -1)  # [n, r]: predicts the response
    mask = (index < (lengths - 1)[:, None]).float()
    label_mask = keep & (torch.arange(width)[None, :] >= prompt - 1) & (torch.arange(width)[None, :] < (lengths - 1)[:, None])
    rows_ = TokenRows(input_ids=ids, lengths=lengths, labels=labels, response_index=index.contiguous(),
                      positional={"mask": mask, "label_mask": label_mask.float()})
    return collate("rows", rows_, [list(range(rows))], packed=packed)[0]  # one micro-batch of every row


def _loss(batch, logits, vocab: int, entropy: bool):
    """hpa's heads as the losses call them: response log-probs (and entropy) and label log-probs."""
    from hpa.engine.head import label_log_probs, response_log_probs

    logp, ent = response_log_probs(batch, logits, None, vocab_size=vocab, entropy=entropy)  # [n, r]
    labels = label_log_probs(batch, logits, None, vocab_size=vocab)  # [n, s]
    loss = -(logp * batch["mask"]).sum() - (labels * batch["label_mask"]).sum()
    return loss - (ent * batch["mask"]).sum() * 0.01 if ent is not None else loss


def _one_pass(model, batch, groups, *, backward: bool, vocab: int) -> dict:
    from hpa.distributed.device_mode import SyncCounter
    from hpa.distributed.sync_ops import SyncOps
    from hpa.engine.step import model_inputs, to_model_device

    model.train(backward)
    with SyncCounter() as syncs, SyncOps() as sync_ops, OpCounter() as ops:
        with torch.set_grad_enabled(backward):
            b = to_model_device(batch, groups.device)
            ids, positions, packed, s = model_inputs(b, 1)
            kwargs = {"packed_seq_params": packed} if packed is not None else {}
            logits = model(ids, positions, None, **kwargs)
            loss = _loss(b, logits, vocab, entropy=backward)
            if backward:
                loss.backward()
    return {"aten_ops": ops.aten_ops, "kernel_ops": ops.kernel_ops, "syncs": syncs.count,
            "sync_ops": sync_ops.count, "sync_sites": dict(sync_ops.by_site)}


def _step_syncs(model, groups, packed: bool, vocab: int) -> int:
    from hpa.distributed.device_mode import SyncCounter
    from hpa.engine.step import forward_backward

    batches = [_micro_batch(8, packed, vocab, seed=100 + i) for i in range(4)]

    def loss_fn(batch, output, _hidden):
        loss = _loss(batch, output, vocab, entropy=False) / 1000.0
        return loss, {"loss": loss.detach()}

    with SyncCounter() as syncs:
        for forward_only in (True, True, False):
            model.train(not forward_only)
            with torch.set_grad_enabled(not forward_only):
                forward_backward(model, batches, loss_fn, groups, forward_only=forward_only)
    return syncs.count


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=56)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=152)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--no-step", action="store_true", help="skip syncs_per_step")
    parser.add_argument("--out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)

    from hpa.config.schema import ModelConfig, ParallelConfig
    from hpa.distributed import LaunchEnv, destroy, initialize
    from hpa.models import build_policy

    torch.set_num_threads(1)
    groups = initialize(ParallelConfig(backend="gloo"),
                        launch=LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                                         master_port=0, launcher="single"))
    try:
        cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                          num_query_groups=args.kv_heads, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                          max_sequence_length=4096, make_vocab_size_divisible_by=64, add_qkv_bias=True,
                          untie_embeddings_and_output_weights=False)
        model = build_policy(cfg, ParallelConfig(), groups)
        result = {"forward": {}, "update": {}}
        for phase, backward in (("forward", False), ("update", True)):
            for layout in ("padded", "packed"):
                result[phase][layout] = {}
                for rows in args.rows:
                    batch = _micro_batch(rows, layout == "packed", args.vocab, seed=rows)
                    _one_pass(model, batch, groups, backward=backward, vocab=args.vocab)  # warm caches (rotary tables...)
                    batch = _micro_batch(rows, layout == "packed", args.vocab, seed=rows)
                    result[phase][layout][f"rows{rows}"] = _one_pass(model, batch, groups, backward=backward, vocab=args.vocab)
        if not args.no_step:
            result["syncs_per_step"] = {layout: _step_syncs(model, groups, layout == "packed", args.vocab)
                                        for layout in ("padded", "packed")}
        result["config"] = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                            "kv_heads": args.kv_heads, "ffn": args.ffn, "vocab": args.vocab,
                            "torch": torch.__version__}
    finally:
        destroy()
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return result


if __name__ == "__main__":
    main()
