"""What the reward models measure on preference pairs for the controllers that trust them: their ceiling over
held-out pairs and their scores of a policy's greedy and sampled answers to those pairs' prompts (the trust
gate's ``reward_ceiling`` and ``sampled_ceiling`` signals), and the first reward model's embeddings of a pair
set's prompts or chosen sequences (the coverage trust's bank and calibration). The policy's answers come
from a ``generate`` callable handed in, as the evaluator receives it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from hpa.algorithms.coverage import unique_rows
from hpa.data.collate import pad_left, pad_right
from hpa.data.sampler import dp_share
from hpa.distributed import comm
from hpa.reward.shaping import RewardInputs
from hpa.rollout.base import RolloutBatch, SamplingParams

Generate = Callable[[List[List[int]], SamplingParams], RolloutBatch]


def heldout_reward_ceiling(model_reward, examples, *, pad_id: int, micro_batch_size: int = 64) -> Tuple[float, float]:
    """The trust gate's ceiling: the reward models' mean score (over heads and models) of the held-out pairs'
    chosen responses, and the mean margin over their rejected ones (the gate's unit). Every rank scores
    every pair (the reward models' contract: the same inputs on all ranks), once per run."""
    chosen, margin = [], []
    for start in range(0, len(examples), micro_batch_size):
        rows = examples[start:start + micro_batch_size]
        prompt_ids, prompt_mask = pad_left([e.prompt_ids for e in rows], pad_id)
        scores = []
        for key in ("chosen_ids", "rejected_ids"):
            response_ids, response_mask = pad_right([getattr(e, key) for e in rows], pad_id)
            out = model_reward(RewardInputs(response_ids=response_ids, response_mask=response_mask,
                                            prompt_ids=prompt_ids, prompt_mask=prompt_mask))
            scores.append(out.rewards.double().mean(dim=1))  # [n]: the ensemble mean, as reward/learned_mean
        chosen.append(scores[0])
        margin.append(scores[0] - scores[1])
    if not chosen:
        raise ValueError("the trust gate's reward ceiling needs held-out preference pairs; "
                         "data.heldout_preference_path has none")
    return float(torch.cat(chosen).mean()), float(torch.cat(margin).mean())


def greedy_and_sampled_reward(model_reward, tokenizer, examples, generate: Generate, rollout,
                              groups) -> Tuple[float, float]:
    """The reward models' mean score of a policy's greedy responses and of its sampled ones
    (``rollout``: the run's ``RolloutConfig``, temperature, top-p, ``n`` per prompt) to the distinct prompts
    of ``examples`` (the held-out pairs): the ``sampled_ceiling`` gate's offset is their difference. The
    prompts are sharded over DP (each rank samples with its own seed) and the sums reduced, so every rank
    returns the same two numbers. ``generate``: ``(prompt_ids, SamplingParams) -> RolloutBatch`` on the
    policy's current weights."""
    prompts, _ = unique_rows([e.prompt_ids for e in examples or ()])
    if not prompts:
        raise ValueError("the sampled_ceiling gate needs held-out preference pairs; data.heldout_preference_path "
                         "has none")
    greedy = mean_learned_reward(model_reward, tokenizer, prompts, generate,
                                 SamplingParams.from_config(rollout, n=1, temperature=0.0), groups)
    sampled = mean_learned_reward(model_reward, tokenizer, prompts, generate,
                                  SamplingParams.from_config(rollout, seed=rollout.seed + 7_919 + groups.dp_rank),
                                  groups)
    return greedy, sampled


def mean_learned_reward(model_reward, tokenizer, prompts: Sequence[Sequence[int]], generate: Generate,
                        params: SamplingParams, groups, *, prompts_per_call: Optional[int] = None) -> float:
    """The reward models' mean score (the ensemble mean, as ``reward/learned_mean``) of the responses
    ``generate`` gives ``prompts`` under ``params`` (``params.n`` a prompt). The prompts are sharded over DP
    (``params`` carries each rank's seed) and the sums reduced, so every rank returns the same number.
    ``prompts_per_call``: at most this many prompts a ``generate`` call on each rank (None: one call)."""
    mine, counted = dp_share(prompts, groups.dp_rank, groups.data_parallel_size)
    step = prompts_per_call or max(len(mine), 1)
    sums = torch.zeros(2, dtype=torch.float64)  # sum, rows
    for start in range(0, len(mine), step):
        call = params if start == 0 else dataclasses.replace(params, seed=params.seed + start * 1_000_003)
        batch = generate(mine[start:start + step], call)
        with torch.no_grad():
            scores = model_reward(RewardInputs.from_batch(batch, tokenizer, [None] * batch.batch_size))
        counts = (batch.group_ids + start < counted).double().cpu()  # [rows]: rows of the counted prompts
        sums[0] += (scores.rewards.double().mean(dim=1).cpu() * counts).sum()
        sums[1] += counts.sum()
    comm.all_reduce_sum(sums, groups.dp_group)
    return float(sums[0] / sums[1])


def chosen_embeddings(model_reward, examples, *, pad_id: int, micro_batch_size: int = 64) -> torch.Tensor:
    """The first reward model's pooled embedding of each pair's chosen sequence (prompt + chosen response),
    ``[n, h]``. Every rank scores every pair (the reward models' contract), once per run."""
    out = []
    for start in range(0, len(examples), micro_batch_size):
        rows = examples[start:start + micro_batch_size]
        prompt_ids, prompt_mask = pad_left([e.prompt_ids for e in rows], pad_id)
        response_ids, response_mask = pad_right([e.chosen_ids for e in rows], pad_id)
        out.append(model_reward.sequence_embeddings(response_ids, response_mask, prompt_ids, prompt_mask))
    if not out:
        raise ValueError("the coverage trust needs preference pairs to embed; the pair file has none")
    return torch.cat(out)


def prompt_embeddings(model_reward, prompts: Sequence[Sequence[int]], *, pad_id: int,
                      micro_batch_size: int = 64) -> torch.Tensor:
    """The first reward model's pooled embedding of each prompt alone (its real tokens, no response),
    ``[n, h]``: the coverage trust's ``prompt`` space."""
    out: List[torch.Tensor] = []
    for start in range(0, len(prompts), micro_batch_size):
        ids, mask = pad_right([list(p) for p in prompts[start:start + micro_batch_size]], pad_id)
        out.append(model_reward.sequence_embeddings(ids, mask))
    if not out:
        raise ValueError("the coverage trust needs prompts to embed; the pair file has none")
    return torch.cat(out)
