"""CPU proxy of the policy update: the aten ops the host issues for one whole update, and its micro-batches.

Usage::

    python bench/proxies/update.py [--shapes rows64 rows256]

Prints one JSON line (``measure()``'s keys, below). What runs is hpa's own update, ``hpa.trainer.phases.
update_policy`` (every micro-batch's forward and backward through megatron's schedule, the losses, the guarded
optimizer step), with the step's pairs cut by ``hpa.trainer.phases.preference_micro_batches`` as the trainer
cuts them; one process, TP1/PP1, gloo, fp32. The model is Qwen2-0.5B's structure (24 layers, 14 query heads
over 2 KV heads, RoPE, SwiGLU, RMSNorm, QKV biases, tied embeddings) at narrow widths (hidden 56, vocabulary
256): on a GPU the host issues one kernel per operation whatever the widths, so the counts are those of the
real shape while the proxy runs in seconds. Lengths are seeded draws that look like the configs' data.

Shapes (``SHAPES``):

- ``rows64``: ``configs/qwen2_0.5b_gpu_check.yaml``'s update: 16 prompts x 4 responses (prompts of 8 to 24
  tokens, responses of 20 to 100: ~4.9k rollout tokens), 16 demo-task pairs (~8-token rows), a token budget of
  8,192 a rank, packed, ``trainer.micro_batch_size`` 8.
- ``rows256``: the perf config's: 64 prompts x 4 responses (prompts of 16 to 64 tokens, responses of 32 to 256),
  64 pairs (prompts of 16 to 64, responses of 16 to 128), a 32k-token budget a rank, packed,
  ``trainer.micro_batch_size`` at its default.

Keys, per shape ``S``:

- ``update.S.aten_ops``: every aten operation one update dispatches (a ``TorchDispatchMode``; views included),
  the optimizer step included; ``update.S.aten_ops_without_optimizer``: the same less those inside the guarded
  optimizer step (what other work on the optimizer changes is then added apart).
- ``update.S.trained_tokens``: the real tokens of the update's micro-batches (rollout and pair rows).
- ``update.S.aten_ops_per_token``: ``aten_ops / trained_tokens``.
- ``update.S.micro_batches.<stream>``: the micro-batches of each stream (``rollout``, ``pairs``...), a pair
  micro-batch riding in a rollout one counted in both (``MicroBatch.parts``); ``update.S.micro_batches.total``:
  the forward and backward passes the update runs.

The balance is taken as frozen (no measured step: one backward pass, as every step after
``algorithm.hpa.balance.measure_steps``). The first update of each shape warms caches (rotary tables) and is
not counted; the second is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

VOCAB = 256
MODEL = dict(num_layers=24, hidden_size=56, num_attention_heads=14, num_query_groups=2, ffn_hidden_size=152,
             vocab_size=VOCAB, max_sequence_length=512, make_vocab_size_divisible_by=64, add_qkv_bias=True,
             untie_embeddings_and_output_weights=False, normalization="RMSNorm", activation="swiglu")


class Shape(NamedTuple):  # not a dataclass: loaded by file path, the module is in no sys.modules
    prompts: int
    n: int
    prompt_len: tuple
    response_len: tuple
    pairs: int
    pair_prompt_len: tuple
    pair_response_len: tuple
    token_budget: int
    micro_batch_size: int


SHAPES: Dict[str, Shape] = {
    "rows64": Shape(prompts=16, n=4, prompt_len=(8, 24), response_len=(20, 100), pairs=16, pair_prompt_len=(3, 8),
                    pair_response_len=(1, 6), token_budget=8192, micro_batch_size=8),
    "rows256": Shape(prompts=64, n=4, prompt_len=(16, 64), response_len=(32, 256), pairs=64,
                     pair_prompt_len=(16, 64), pair_response_len=(16, 128), token_budget=32768, micro_batch_size=1),
}


class OpCounter(TorchDispatchMode):
    """Counts aten operations, and apart those dispatched while ``in_optimizer`` is set."""

    def __init__(self):
        super().__init__()
        self.aten_ops = 0
        self.optimizer_ops = 0
        self.in_optimizer = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.aten_ops += 1
        self.optimizer_ops += self.in_optimizer
        return func(*args, **(kwargs or {}))


def _draw(g: torch.Generator, low_high: tuple, size: int) -> list:
    return torch.randint(low_high[0], low_high[1] + 1, (size,), generator=g).tolist()


def _rollouts(shape: Shape, seed: int, hidden: int):
    """A ``RolloutBatch`` with what scoring, the forwards and the advantages write."""
    from hpa.rollout.base import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    b = shape.prompts * shape.n
    prompt_lens = [x for x in _draw(g, shape.prompt_len, shape.prompts) for _ in range(shape.n)]
    response_lens = _draw(g, shape.response_len, b)
    p, r = max(prompt_lens), max(response_lens)
    prompt_mask = (torch.arange(p)[None, :] >= p - torch.tensor(prompt_lens)[:, None]).long()  # left-padded
    response_mask = (torch.arange(r)[None, :] < torch.tensor(response_lens)[:, None]).float()
    batch = RolloutBatch(prompt_ids=torch.randint(1, VOCAB, (b, p), generator=g) * prompt_mask,
                         prompt_mask=prompt_mask,
                         response_ids=(torch.randint(1, VOCAB, (b, r), generator=g) * response_mask).long(),
                         response_mask=response_mask, log_probs=-4.0 * response_mask,
                         finish_reasons=["stop"] * b, group_ids=torch.arange(b) // shape.n)
    batch.set("mask", response_mask.clone())
    batch.set("old_log_probs", (-4.0 + 0.3 * torch.randn(b, r, generator=g)) * response_mask)
    batch.set("ref_log_probs", (-4.1 + 0.3 * torch.randn(b, r, generator=g)) * response_mask)
    batch.set("ref_pooled", torch.randn(b, hidden, generator=g))
    batch.set("advantages", torch.randn(b, 1, generator=g) * response_mask)
    batch.set("returns", torch.zeros(b, r))
    return batch


def _pairs(shape: Shape, seed: int):
    """Preference examples and their reference log-probs ``[m, 2]`` (as the reference cache gives them)."""
    from hpa.data.preferences import PreferenceExample

    g = torch.Generator().manual_seed(seed + 1)
    prompts = _draw(g, shape.pair_prompt_len, shape.pairs)
    chosen, rejected = _draw(g, shape.pair_response_len, shape.pairs), _draw(g, shape.pair_response_len, shape.pairs)

    def ids(k):
        return torch.randint(1, VOCAB, (k,), generator=g).tolist()

    examples = [PreferenceExample(prompt_ids=ids(p), chosen_ids=ids(c), rejected_ids=ids(r))
                for p, c, r in zip(prompts, chosen, rejected)]
    return examples, -20.0 + torch.randn(shape.pairs, 2, generator=g)


def _config(shape: Shape):
    from hpa.config import load_config

    overrides = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        "model.params_dtype=float32", "algorithm.advantage.estimator=grpo", "algorithm.kl.use_kl_in_reward=false",
        f"trainer.global_batch_size={shape.prompts}", f"trainer.preference_batch_size={shape.pairs}",
        f"trainer.micro_batch_size={shape.micro_batch_size}", "trainer.sequence_packing=true",
        f"trainer.ppo_max_token_len_per_rank={shape.token_budget}",
        f"trainer.log_prob_max_token_len_per_rank={2 * shape.token_budget}", f"rollout.n={shape.n}",
        "data.max_prompt_length=64", "data.max_response_length=256", "rollout.max_new_tokens=256"]
    return load_config(None, overrides)


def _count_update(name: str, shape: Shape, groups) -> Dict[str, float]:
    from hpa.engine.optimizer import make_trainable
    from hpa.models import build_policy
    from hpa.trainer import phases
    from hpa.trainer.guard import Guard
    from hpa.trainer.objective import StepWeights

    cfg = _config(shape)
    ctx = phases.StepContext.from_config(cfg, groups, vocab_size=VOCAB, pad_id=0)
    torch.manual_seed(0)
    policy = make_trainable(build_policy(cfg.model, cfg.parallel, groups), cfg.optim, cfg.parallel, groups, 10)
    guard = Guard(cfg.guard)
    weights = StepWeights(w_ppo=0.4, w_dpo=0.4, w_kl=0.2, lambda_token=0.7, lambda_semantic=0.5,
                          entropy_coef=0.01, reward_kl_coef=0.0)

    counter = OpCounter()
    seen = []
    real_step, real_fb = phases.guarded_optimizer_step, phases.forward_backward

    def optimizer_step(*a, **kw):
        counter.in_optimizer = True
        try:
            return real_step(*a, **kw)
        finally:
            counter.in_optimizer = False

    def forward_backward(model, mbs, *a, **kw):
        seen.extend(mbs)
        return real_fb(model, mbs, *a, **kw)

    phases.guarded_optimizer_step, phases.forward_backward = optimizer_step, forward_backward
    try:
        for counted in (False, True):
            batch = _rollouts(shape, seed=1 + counted, hidden=MODEL["hidden_size"])
            examples, ref = _pairs(shape, seed=1 + counted)
            seen.clear()
            if counted:
                with counter:
                    pair_mbs = phases.preference_micro_batches(examples, None, ctx, ref)
                    phases.update_policy(batch, pair_mbs, weights, policy, guard, ctx)
            else:
                pair_mbs = phases.preference_micro_batches(examples, None, ctx, ref)
                phases.update_policy(batch, pair_mbs, weights, policy, guard, ctx)
    finally:
        phases.guarded_optimizer_step, phases.forward_backward = real_step, real_fb
    tokens = sum(mb.tokens for mb in seen)
    out = {f"update.{name}.aten_ops": counter.aten_ops,
           f"update.{name}.aten_ops_without_optimizer": counter.aten_ops - counter.optimizer_ops,
           f"update.{name}.trained_tokens": tokens,
           f"update.{name}.aten_ops_per_token": round(counter.aten_ops / tokens, 4)}
    out[f"update.{name}.micro_batches.total"] = len(seen)
    for mb in seen:
        for part in mb.parts or (mb,):
            key = f"update.{name}.micro_batches.{part.kind}"
            out[key] = out.get(key, 0) + 1
    return out


def measure(shapes=("rows64", "rows256")) -> Dict[str, float]:
    """The keys of the module docstring for each of ``shapes``."""
    from hpa.config.schema import ParallelConfig
    from hpa.distributed import LaunchEnv, destroy, initialize

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    groups = initialize(ParallelConfig(backend="gloo"),
                        launch=LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                                         master_port=0, launcher="single"))
    try:
        out: Dict[str, float] = {}
        for name in shapes:
            out.update(_count_update(name, SHAPES[name], groups))
        return out
    finally:
        destroy()
        torch.set_num_threads(threads)


def main(argv=None) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args(argv)
    result = measure(tuple(args.shapes))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
