"""The policy's NLL of held-out preference pairs (``data.heldout_preference_path``): the ``heldout_nll``
trust gate's signal. What the reward models measure on those pairs is ``hpa.reward.embeddings``."""

from __future__ import annotations

import torch

from hpa.distributed import comm
from hpa.engine import forward
from hpa.trainer import micro_batches


def heldout_nll(policy, examples, ctx) -> float:
    """The policy's NLL per token of the chosen responses of held-out preference pairs, at temperature 1
    over the true vocabulary; each DP rank scores ``examples[dp_rank::dp]`` and the sums are reduced over
    DP, so every rank returns the same number. ``ctx``: the step's ``phases.StepContext``."""
    g = ctx.groups
    mine = [examples[i] for i in range(g.dp_rank, len(examples), g.data_parallel_size)]
    mbs = micro_batches.chosen_micro_batches(mine, ctx.batching)
    sums = torch.zeros(2, dtype=torch.float64)
    if mbs:
        with torch.no_grad():
            logp = forward.pair_sequence_log_probs(policy, mbs, g, vocab_size=ctx.vocab_size)  # [n]
        sums[0] = -float(logp.double().sum())
        sums[1] = sum(float(mb["label_mask"].sum()) for mb in mbs)
    comm.all_reduce_sum(sums, g.dp_group)
    return float(sums[0] / sums[1].clamp(min=1.0))
