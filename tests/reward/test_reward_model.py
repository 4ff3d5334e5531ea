"""``ModelReward``: last-token scores, prompt/response joining, and one checkpoint scored the same
under tp1_pp1_dp1, tp2_pp1_dp1 and tp1_pp2_dp1; σ over heads/models; plugging into
``UncertaintyAwareReward``. The multi-rank part shares its spawns with test_train_rm.py."""

import numpy as np
import pytest
import torch

from hpa.reward.model import gather_last_token, join_prompt_response, last_token_index

ATOL = 1e-5


def test_gather_last_token_right_padding_by_hand():
    values = torch.arange(2 * 4 * 2, dtype=torch.float32).reshape(2, 4, 2)  # [b=2, s=4, K=2]
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [1, 3]
    assert gather_last_token(values, mask).tolist() == [[2.0, 3.0], [14.0, 15.0]]
    # an empty row reads position 0 rather than failing
    assert gather_last_token(values, torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0]])).tolist() == [[0.0, 1.0], [8.0, 9.0]]
    with pytest.raises(ValueError, match=r"\[b, s, K\]"):
        gather_last_token(values[0], mask)


def test_join_prompt_response_removes_both_paddings():
    prompt_ids = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]])  # left-padded
    prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    response_ids = torch.tensor([[10, 11, 0], [12, 0, 0]])  # right-padded
    response_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ids, mask, resp = join_prompt_response(response_ids, response_mask, 0, prompt_ids, prompt_mask)
    assert ids.tolist() == [[5, 6, 10, 11], [7, 8, 9, 12]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert resp.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    ids, mask, resp = join_prompt_response(response_ids, response_mask, 0)
    assert ids.tolist() == [[10, 11], [12, 0]] and mask.tolist() == [[1, 1], [1, 0]] and resp.equal(mask)


@pytest.fixture(scope="module")
def runs():
    import rm_pipeline

    return rm_pipeline.results()


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp2", "pp2"], ids=["tp2_pp1_dp1", "tp1_pp2_dp1"])
def test_scores_match_tp1_on_every_rank(runs, layout):
    ref = runs["tp1"]["score"]
    for rank_result in runs[layout]:
        got = rank_result["score"]
        np.testing.assert_allclose(got["rewards"], ref["rewards"], atol=ATOL, rtol=0)
        np.testing.assert_allclose(got["embeddings"], ref["embeddings"], atol=ATOL, rtol=0)


@pytest.mark.multirank
def test_trained_model_prefers_chosen_and_heads_disagree(runs):
    rewards = runs["tp1"]["score"]["rewards"]  # [2n, K]: chosen rows, then rejected
    from rm_pipeline import NUM_HEADS

    n = rewards.shape[0] // 2
    assert rewards.shape == (2 * n, NUM_HEADS)
    assert (rewards[:n].mean(1) > rewards[n:].mean(1)).mean() > 0.5
    assert rewards.std(axis=1).mean() > 1e-3  # σ > 0 for a K=3 bootstrap ensemble
    assert runs["tp1"]["score"]["embeddings"].shape == (2 * n, 32)


@pytest.mark.multirank
def test_several_models_concatenate_heads(runs):
    one, two = runs["tp1"]["score"]["rewards"], runs["tp1"]["score_two_models"]["rewards"]
    assert two.shape == (one.shape[0], 2 * one.shape[1])
    np.testing.assert_allclose(two, np.concatenate([one, one], axis=1), atol=ATOL, rtol=0)


@pytest.mark.multirank
def test_single_head_has_zero_sigma(runs):
    from hpa.reward import ensemble_mean_std

    k1 = torch.as_tensor(runs["tp1"]["score_k1"]["rewards"])
    assert k1.shape[1] == 1
    assert ensemble_mean_std(k1)[1].abs().max().item() == 0.0


@pytest.mark.multirank
def test_plugs_into_uncertainty_aware_reward(runs):
    from hpa.reward import ensemble_mean_std

    shaped, raw = runs["tp1"]["score"]["shaped"], torch.as_tensor(runs["tp1"]["score"]["rewards"])
    mean, sigma = ensemble_mean_std(raw)
    assert shaped["valid"].all()
    np.testing.assert_allclose(shaped["raw"], mean.numpy(), atol=ATOL)
    np.testing.assert_allclose(shaped["sigma"], sigma.numpy(), atol=ATOL)
    assert (shaped["sigma"] > 0).all()
    assert (shaped["diversity"] == 0).all()  # empty bank on the first call
    assert (runs["tp1"]["score"]["shaped_second_diversity"] > 0).any()  # the bank holds the first batch
    assert np.isfinite(shaped["rewards"]).all()
    assert runs["tp1"]["score"]["shaped_metrics"]["reward/sigma_mean"] > 0
