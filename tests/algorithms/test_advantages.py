import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpa.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    compute_gae,
    compute_group_advantages,
    compute_reinforce_plus_plus,
)


def gae_reference(rewards, values, mask, gamma, lam):
    """Plain python: walk each row backwards over the valid tokens only."""
    b, r = len(rewards), len(rewards[0])
    vals, valid_mask = values.tolist(), mask.tolist()
    adv = [[0.0] * r for _ in range(b)]
    for i in range(b):
        next_value, last = 0.0, 0.0
        for t in reversed(range(r)):
            if valid_mask[i][t]:
                delta = rewards[i][t] + gamma * next_value - vals[i][t]
                last = delta + gamma * lam * last
                next_value = vals[i][t]
            adv[i][t] = last  # masked tokens carry the running advantage
    adv = torch.tensor(adv, dtype=torch.float64)
    returns = adv + values
    valid = adv[mask.bool()]
    # verl's masked statistics: sums over (count + 1e-8), then Bessel's n/(n-1). The 1e-8 moves the
    # mean by ~1e-8 relative, which whitening a low-variance batch can lift above assert_close's 1e-7.
    n = len(valid)
    mean = valid.sum() / (n + 1e-8)
    var = ((valid - mean) ** 2).sum() / (n + 1e-8) * (n / (n - 1))
    whitened = (adv - mean) / torch.sqrt(var + 1e-8)
    return whitened, returns


def test_gae_by_hand_single_token_steps():
    # one row, gamma = lam = 1: raw advantages = reward-to-go minus value
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.25, 0.75]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64))
    raw = torch.tensor([0.5, 0.75, 0.25], dtype=torch.float64)
    torch.testing.assert_close(adv[0], (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8))


def test_gae_skips_masked_tokens_inside_the_response():
    # token 1 is an observation (mask 0): the TD step goes from token 0 straight to token 2
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.1, 9.0, 0.2, 0.3, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    _, ret = compute_gae(rewards, values, mask, gamma, lam)
    d3 = 1.0 - 0.3
    d2 = 0.0 + gamma * 0.3 - 0.2
    d0 = 0.0 + gamma * 0.2 - 0.1
    a3 = d3
    a2 = d2 + gamma * lam * a3
    a0 = d0 + gamma * lam * a2
    expected_raw = torch.tensor([[a0, a2, a2, a3, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(ret - values, expected_raw)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(2, 7), st.integers(0, 10_000), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_python_reference(b, r, seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, r, generator=g, dtype=torch.float64)
    values = torch.randn(b, r, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, r, generator=g) > 0.3).double()
    mask[0, :2] = 1.0  # at least two valid tokens to whiten
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values, mask, gamma, lam)
    torch.testing.assert_close(ret, ref_ret)
    torch.testing.assert_close(adv, ref_adv)


def test_gae_bool_mask_and_no_grad():
    rewards = torch.randn(2, 4, requires_grad=True)
    values = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    adv, ret = compute_gae(rewards, values, mask, 0.99, 0.95)
    assert not adv.requires_grad and not ret.requires_grad
    adv2, _ = compute_gae(rewards, values, mask.float(), 0.99, 0.95)
    torch.testing.assert_close(adv, adv2)


def group_reference(scores, groups, norm_by_std, eps, leave_one_out=False):
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        n = len(members)
        if leave_one_out:
            out.append(s if n == 1 else s - (sum(members) - s) / (n - 1))
            continue
        if n == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(members) / n
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1))
        out.append((s - mean) / (std + eps) if norm_by_std else s - mean)
    return out


def test_grpo_by_hand_with_tie_and_singleton():
    # group 7: scores 1, 3 (mean 2, std sqrt(2)); group 8: tie 5, 5; group 9: singleton 4
    rewards = torch.zeros(5, 3, dtype=torch.float64)
    rewards[:, -1] = torch.tensor([1.0, 3.0, 5.0, 5.0, 4.0], dtype=torch.float64)
    mask = torch.ones(5, 3, dtype=torch.float64)
    mask[4, 2] = 0.0
    adv, ret = compute_group_advantages(rewards, mask, [7, 7, 8, 8, 9])
    s = math.sqrt(2)
    expected = torch.tensor([-1 / (s + 1e-6), 1 / (s + 1e-6), 0.0, 0.0, 4 / (1 + 1e-6)], dtype=torch.float64)
    torch.testing.assert_close(adv[:, 0], expected)
    assert adv[4, 2] == 0.0 and torch.equal(adv, ret)
    no_std, _ = compute_group_advantages(rewards, mask, torch.tensor([7, 7, 8, 8, 9]), norm_by_std=False)
    torch.testing.assert_close(no_std[:, 0], torch.tensor([-1.0, 1.0, 0.0, 0.0, 4.0], dtype=torch.float64))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 1.0, 0.5, -2.0])), min_size=1, max_size=10),
       st.booleans())
def test_group_advantages_match_python_reference(rows, norm_by_std):
    groups = [g for g, _ in rows]
    scores = [s for _, s in rows]  # few distinct values: many ties
    rewards = torch.zeros(len(rows), 2, dtype=torch.float64)
    rewards[:, 0] = torch.tensor(scores, dtype=torch.float64)
    mask = torch.ones(len(rows), 2, dtype=torch.float64)
    adv, _ = compute_group_advantages(rewards, mask, groups, norm_by_std=norm_by_std)
    torch.testing.assert_close(adv[:, 1], torch.tensor(group_reference(scores, groups, norm_by_std, 1e-6),
                                                       dtype=torch.float64))
    loo, _ = compute_group_advantages(rewards, mask, groups, baseline="leave_one_out")
    torch.testing.assert_close(loo[:, 0], torch.tensor(group_reference(scores, groups, True, 0, True),
                                                       dtype=torch.float64))


def test_rloo_by_hand():
    rewards = torch.tensor([[1.0], [2.0], [6.0], [3.0]])
    adv, _ = compute_advantages("rloo", rewards, torch.ones(4, 1), group_ids=["a", "a", "a", "b"])
    torch.testing.assert_close(adv[:, 0], torch.tensor([1 - 4.0, 2 - 3.5, 6 - 1.5, 3.0]))


def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    adv, ret = compute_reinforce_plus_plus(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]], dtype=torch.float64))
    valid = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0], dtype=torch.float64)
    white = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    torch.testing.assert_close(adv[mask.bool()], white)
    assert adv[0, 3] == 0 and adv[1, 2] == 0


def test_reinforce_plus_plus_skips_masked_tokens_inside_the_response():
    # Row 0 has observation tokens at t=1 and t=3: their rewards are ignored and the running return
    # carries across them undiscounted. gamma = 0.5, backwards:
    #   t=3 masked: return 0, running stays 0;  t=2: 2 + 0.5·0 = 2;
    #   t=1 masked: return 0, running stays 2;  t=0: 1 + 0.5·2 = 2.
    rewards = torch.tensor([[1.0, 4.0, 2.0, 3.0], [0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    adv, ret = compute_reinforce_plus_plus(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[2.0, 0.0, 2.0, 0.0], [0.25, 0.5, 1.0, 0.0]], dtype=torch.float64))
    valid = torch.tensor([2.0, 2.0, 0.25, 0.5, 1.0, 0.0], dtype=torch.float64)
    white = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    torch.testing.assert_close(adv[mask.bool()], white)
    assert adv[0, 1] == 0 and adv[0, 3] == 0
    adv_b, ret_b = compute_advantages("reinforce_plus_plus", rewards, mask.bool(), gamma=0.5)
    torch.testing.assert_close(ret_b, ret)
    torch.testing.assert_close(adv_b, adv)


def test_registry_dispatch_and_errors():
    assert ADVANTAGE_ESTIMATORS.names() == ("gae", "grpo", "reinforce_plus_plus", "rloo")
    r, m = torch.randn(4, 3), torch.ones(4, 3)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", r, m)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", r, m)
    v = torch.randn(4, 3)
    torch.testing.assert_close(compute_advantages("gae", r, m, values=v, gamma=0.9, lam=0.8)[0],
                               compute_gae(r, v, m, 0.9, 0.8)[0])
    torch.testing.assert_close(compute_advantages("grpo", r, m, group_ids=[0, 0, 1, 1], norm_by_std=False)[0],
                               compute_group_advantages(r, m, [0, 0, 1, 1], norm_by_std=False)[0])


def _verl_masked_whiten(values, mask):
    """Transcription of verl.utils.torch_functional.masked_whiten (unbiased var, 1e-8)."""
    def mmean(v, m):
        return (torch.where(m.bool(), v, 0.0) * m).sum() / (m.sum() + 1e-8)

    mean = mmean(values, mask)
    var = mmean((values - mean) ** 2, mask)
    n = mask.sum()
    var = var * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """Transcription of verl compute_gae_advantage_return."""
    nextvalues, lastgaelam, out = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    advantages = torch.stack(out[::-1], dim=1)
    returns = advantages + values
    return _verl_masked_whiten(advantages, response_mask), returns


def _verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm=True):
    """Transcription of verl compute_grpo_outcome_advantage."""
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = {}, {}, {}
    for i in range(scores.shape[0]):
        id2score.setdefault(index[i], []).append(scores[i])
    for idx, s in id2score.items():
        if len(s) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx], id2std[idx] = torch.mean(torch.stack(s)), torch.std(torch.stack(s))
    for i in range(scores.shape[0]):
        if norm:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores.unsqueeze(-1) * response_mask


def test_gae_and_grpo_bitwise_equal_to_verl_float32():
    g = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    mask = (torch.rand(8, 32, generator=g) > 0.2).long()  # verl's masks are integer
    adv, ret = compute_gae(rewards, values, mask, 0.99, 0.95)
    ref_adv, ref_ret = _verl_gae(rewards, values, mask, 0.99, 0.95)
    assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)
    index = ["a", "a", "a", "b", "b", "c", "d", "d"]
    rewards[3:5] = rewards[3]  # a tied group
    for norm in (True, False):
        adv, _ = compute_group_advantages(rewards, mask, index, norm_by_std=norm)
        assert torch.equal(adv, _verl_grpo(rewards.clone(), mask, index, norm=norm))


def test_component_advantages_normalise_each_component_within_its_group():
    """Two groups of two: the rule separates group 0 and abstains (0, 0) on group 1; the learned reward
    varies in both. Each component is normalised on its own; a tied component contributes 0."""
    from hpa.algorithms.advantages import compute_component_advantages

    rule = torch.tensor([4.0, 0.0, 0.0, 0.0])
    learned = torch.tensor([0.3, 0.9, 1.0, 0.2])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    group_ids = torch.tensor([0, 0, 1, 1])
    eps = 1e-6
    adv, ret = compute_component_advantages([rule, learned], [0.8, 0.1], mask, group_ids, epsilon=eps)
    s = math.sqrt(2.0)  # unbiased std of a pair {x, y} is |x - y| / sqrt(2)
    rule_n = [2.0 / (4 / s + eps), -2.0 / (4 / s + eps), 0.0, 0.0]
    learned_n = [-0.3 / (0.6 / s + eps), 0.3 / (0.6 / s + eps), 0.4 / (0.8 / s + eps), -0.4 / (0.8 / s + eps)]
    expected = torch.tensor([0.8 * a + 0.1 * b for a, b in zip(rule_n, learned_n)])
    torch.testing.assert_close(adv, expected[:, None] * mask, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret, adv)
    # the sum is not renormalised: halving the learned weight halves its part exactly
    half, _ = compute_component_advantages([rule, learned], [0.8, 0.05], mask, group_ids, epsilon=eps)
    torch.testing.assert_close(adv - half, (0.05 * torch.tensor(learned_n))[:, None] * mask, atol=1e-6, rtol=1e-6)


def test_component_advantages_add_the_offset_centred_and_unnormalised():
    from hpa.algorithms.advantages import compute_component_advantages

    mask = torch.ones(4, 3)
    group_ids = [0, 0, 1, 1]
    zero = torch.zeros(4)
    offset = torch.tensor([-0.01, -0.03, 0.0, -0.02])
    adv, _ = compute_component_advantages([zero], [1.0], mask, group_ids, offset=offset)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.01, -0.01, 0.01, -0.01]), atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="one weight per component"):
        compute_component_advantages([zero, zero], [1.0], mask, group_ids)


def test_component_row_weights_scale_their_component_after_normalisation_and_leave_the_others():
    """The coverage trust: a far row's learned part gets weight 0, a near row's keeps all of it; the group's
    baseline is still the unweighted one, and the rule component is the same bits with or without weights."""
    from hpa.algorithms.advantages import compute_component_advantages

    rule = torch.tensor([4.0, 0.0, 1.0, 3.0])
    learned = torch.tensor([0.3, 0.9, 1.0, 0.2])
    mask = torch.ones(4, 2)
    group_ids = torch.tensor([0, 0, 1, 1])
    trust = torch.tensor([1.0, 0.0, 0.5, 1.0])
    rule_only, _ = compute_component_advantages([rule, learned], [0.5, 0.0], mask, group_ids)
    learned_only, _ = compute_component_advantages([rule, learned], [0.0, 0.5], mask, group_ids)
    plain, _ = compute_component_advantages([rule, learned], [0.5, 0.5], mask, group_ids)
    weighted, _ = compute_component_advantages([rule, learned], [0.5, 0.5], mask, group_ids,
                                                row_weights=[None, trust])
    torch.testing.assert_close(weighted, rule_only + learned_only * trust[:, None], atol=1e-6, rtol=0)
    assert weighted[1, 0] == rule_only[1, 0]  # the far row: its rule part alone, untouched
    # row weights on the rule component alone leave the learned component's rows as they were
    rule_weighted, _ = compute_component_advantages([rule, learned], [0.5, 0.5], mask, group_ids,
                                                    row_weights=[torch.zeros(4), None])
    torch.testing.assert_close(rule_weighted, learned_only, atol=1e-6, rtol=0)
    # all-ones weights change nothing
    ones, _ = compute_component_advantages([rule, learned], [0.5, 0.5], mask, group_ids,
                                           row_weights=[torch.ones(4), torch.ones(4)])
    torch.testing.assert_close(ones, plain, atol=0, rtol=0)
    with pytest.raises(ValueError, match="row weights for 2 components"):
        compute_component_advantages([rule, learned], [0.5, 0.5], mask, group_ids, row_weights=[trust])
