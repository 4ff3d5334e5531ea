"""``mean_learned_reward``: the reward models' mean score of a policy's responses to a prompt set (the trust
gate's start-up baseline, ``GATE_BASELINE_PROMPTS``): every sampled row counts once, the rows of
the repeats that even out the DP ranks' work do not, and splitting the prompts into calls changes nothing but
the seeds."""

import types

import pytest
import torch

from hpa.reward.embeddings import mean_learned_reward
from hpa.rollout.base import RolloutBatch, SamplingParams


def _generate(calls):
    """A scripted ``generate``: ``params.n`` rows a prompt, each row's one token the prompt's last token."""

    def generate(prompts, params):
        calls.append(([list(p) for p in prompts], params.seed))
        rows = [p[-1] for p in prompts for _ in range(params.n)]
        ids = torch.tensor([[t] for t in rows])
        mask = torch.ones(len(rows), 1)
        p_ids = torch.tensor([[t] for t in rows])
        return RolloutBatch(p_ids, torch.ones_like(p_ids), ids, mask, torch.zeros_like(mask), ["stop"] * len(rows),
                            torch.arange(len(prompts)).repeat_interleave(params.n))

    return generate


def _reward(inputs):
    """Two heads: the response token and the token + 1 (the ensemble mean is the token + 0.5)."""
    t = inputs.response_ids[:, 0].double()
    return types.SimpleNamespace(rewards=torch.stack([t, t + 1], dim=1))


TOKENIZER = types.SimpleNamespace(eos_id=99, decode=lambda ids: " ".join(map(str, ids)))


def test_every_row_counts_once_and_the_calls_split_changes_only_the_seeds():
    prompts = [[1, 10], [1, 20], [1, 30], [1, 40], [1, 50]]
    params = SamplingParams(n=3, seed=7)
    one = types.SimpleNamespace(dp_group=None, data_parallel_size=1, dp_rank=0)
    calls = []
    whole = mean_learned_reward(_reward, TOKENIZER, prompts, _generate(calls), params, one)
    assert whole == pytest.approx(30.5) and len(calls) == 1 and calls[0][1] == 7
    calls = []
    split = mean_learned_reward(_reward, TOKENIZER, prompts, _generate(calls), params, one, prompts_per_call=2)
    assert split == pytest.approx(30.5)
    assert [c[0] for c in calls] == [prompts[0:2], prompts[2:4], prompts[4:]]
    assert len({c[1] for c in calls}) == 3  # each call its own sampling stream


def test_the_dp_ranks_repeats_do_not_count():
    """Rank 1 of 2 gets every other prompt ([20], [40]) and one repeat of the first prompt to match rank 0's
    three; with no process group the sums are this rank's own: the mean of 20 and 40, not of the repeat."""
    prompts = [[1, 10], [1, 20], [1, 30], [1, 40], [1, 50]]
    rank1 = types.SimpleNamespace(dp_group=None, data_parallel_size=2, dp_rank=1)
    calls = []
    got = mean_learned_reward(_reward, TOKENIZER, prompts, _generate(calls), SamplingParams(n=2, seed=1), rank1,
                              prompts_per_call=2)
    assert got == pytest.approx(30.5)
    assert [c[0] for c in calls] == [[[1, 20], [1, 40]], [[1, 10]]]
