"""What the reward models measure for the controllers that trust them (``hpa.reward.embeddings``), on scripted
reward models."""

import pytest
import torch

from hpa.reward.embeddings import heldout_reward_ceiling


def test_heldout_reward_ceiling_is_the_chosen_mean_and_the_margin_over_the_rejected():
    """The trust gate's ceiling from a scripted reward ensemble (2 heads): each pair's chosen and rejected
    response is scored with its prompt, the heads averaged, over micro-batches of 2 pairs."""
    from hpa.data.preferences import PreferenceExample
    from hpa.reward.shaping import BaseRewardOutput

    pairs = [PreferenceExample(prompt_ids=[5] * (1 + i), chosen_ids=[7] * (2 + i), rejected_ids=[9]) for i in range(3)]
    seen = []

    def model_reward(inputs):  # heads: (number of response tokens, 0.1 x prompt tokens)
        seen.append(inputs)
        return BaseRewardOutput(rewards=torch.stack([inputs.response_mask.sum(1).float(),
                                                     0.1 * inputs.prompt_mask.sum(1).float()], dim=1))

    ceiling, margin = heldout_reward_ceiling(model_reward, pairs, pad_id=0, micro_batch_size=2)
    chosen = [((2 + i) + 0.1 * (1 + i)) / 2 for i in range(3)]
    rejected = [(1 + 0.1 * (1 + i)) / 2 for i in range(3)]
    assert ceiling == pytest.approx(sum(chosen) / 3)
    assert margin == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / 3)
    assert len(seen) == 4  # chosen and rejected of two micro-batches
    assert seen[0].response_ids[1].tolist() == [7, 7, 7] and seen[1].response_ids[:, 0].tolist() == [9, 9]
    with pytest.raises(ValueError, match="heldout_preference_path"):
        heldout_reward_ceiling(model_reward, [], pad_id=0)
