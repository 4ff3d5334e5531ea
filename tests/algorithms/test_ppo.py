import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpa.algorithms.losses import Aggregation, agg_loss
from hpa.algorithms.ppo import POLICY_LOSSES, entropy_bonus, explained_variance, policy_loss, value_loss

RATIOS = torch.tensor([[1.5, 0.5, 5.0, 1.0]], dtype=torch.float64)
ADV = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
MASK = torch.ones(1, 4, dtype=torch.float64)


def test_policy_loss_by_hand():
    old = torch.zeros(1, 4, dtype=torch.float64)
    loss, m = policy_loss(old, RATIOS.log(), ADV, MASK, clip_ratio=0.2, clip_ratio_c=3.0)
    # per token: clipped -1.2; clipped 0.8; dual-clipped 3 (would be 5); unclipped -1
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 1.0) / 4)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert m["ppo_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(5.0)) / 4)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_asymmetric_clip_and_importance_weights():
    old = torch.zeros(1, 4, dtype=torch.float64)
    loss, _ = policy_loss(old, RATIOS.log(), ADV, MASK, clip_ratio_low=0.1, clip_ratio_high=0.3)
    # -1.3 (high side 0.3); -A·clip(0.5 → 0.9) = 0.9; dual 3; -1
    assert loss.item() == pytest.approx((-1.3 + 0.9 + 3.0 - 1.0) / 4)
    w = torch.tensor([[2.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    loss_w, _ = policy_loss(old, RATIOS.log(), ADV, MASK, importance_weights=w)
    assert loss_w.item() == pytest.approx((-2.4 + 0.0 + 3.0 - 1.0) / 4)


def test_log_ratio_is_clamped():
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, m = policy_loss(old, torch.full((1, 1), 100.0, dtype=torch.float64), torch.full((1, 1), -1.0, dtype=torch.float64),
                          torch.ones(1, 1))
    assert torch.isfinite(loss) and loss.item() == pytest.approx(3.0)
    assert m["ppo_kl"].item() == pytest.approx(-20.0)


def verl_vanilla(old_log_prob, log_prob, advantages, response_mask, low, high, c):
    """Transcription of verl compute_policy_loss_vanilla (token-mean), for a bitwise comparison."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    valid = torch.where(response_mask.bool(), pg_losses, 0.0)
    return (valid * response_mask).sum() / response_mask.sum()


def test_matches_verl_bitwise():
    torch.manual_seed(0)
    old, new, adv = torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16)
    mask = (torch.rand(8, 16) > 0.2).float()
    loss, _ = policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    assert torch.equal(loss, verl_vanilla(old, new, adv, mask, 0.2, 0.28, 3.0))


@settings(max_examples=100, deadline=None)
@given(st.floats(-10.0, -1e-3), st.floats(-30.0, 30.0), st.floats(1.01, 10.0), st.floats(0.05, 0.5))
def test_dual_clip_bounds_negative_advantage_loss(adv, log_ratio, c, eps):
    loss, _ = policy_loss(torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), log_ratio, dtype=torch.float64),
                          torch.full((1, 1), adv, dtype=torch.float64), torch.ones(1, 1),
                          clip_ratio=eps, clip_ratio_c=c)
    assert loss.item() <= abs(adv) * c * (1 + 1e-12)


def test_policy_gradcheck():
    old = torch.zeros(1, 4, dtype=torch.float64)
    # ratios away from the clip and dual-clip kinks
    log_prob = torch.tensor([[0.05, -0.05, -0.5, 0.5]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, -2.0, 0.5]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda lp: policy_loss(old, lp, adv, MASK)[0], (log_prob,))
    log_prob.grad = None
    policy_loss(old, log_prob, adv, MASK)[0].backward()
    # clipped tokens get no gradient: token 2 (A < 0, ratio 0.61 < 0.8), token 3 (A > 0, ratio 1.65 > 1.2)
    assert log_prob.grad[0, 2].item() == 0.0 and log_prob.grad[0, 3].item() == 0.0
    assert log_prob.grad[0, 0].item() == pytest.approx(-math.exp(0.05) / 4)


def test_unknown_policy_loss_and_bad_c():
    assert POLICY_LOSSES.names() == ("vanilla",)
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(x, x, x, torch.ones(1, 1), clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="vanilla"):
        policy_loss(x, x, x, torch.ones(1, 1), name="vanila")


def test_value_loss_by_hand():
    vpreds = torch.tensor([[1.0, 0.1]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    loss, m = value_loss(vpreds, returns, old, torch.ones(1, 2), clip_range_value=0.2)
    # token 0: max((1-2)², (0.2-2)²) = 3.24 (clipped); token 1: 0.01 both
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.01) / 2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # the clipped branch has no gradient w.r.t. vpreds (clip active) -> only token 1 contributes
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 0.5 * 2 * 0.1 / 2]], dtype=torch.float64))
    assert torch.autograd.gradcheck(
        lambda v: value_loss(v, returns, old, torch.ones(1, 2), clip_range_value=0.5)[0],
        (torch.tensor([[0.3, -0.2]], dtype=torch.float64, requires_grad=True),),
    )


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0, abs=1e-5)
    values = torch.tensor([[2.0, 2.0, 2.0, 0.0]])  # predicts the mean: EV 0
    assert explained_variance(values, returns, mask).item() == pytest.approx(1 - 1 / (1 + 1e-5), abs=1e-6)


def test_entropy_bonus():
    ent = torch.tensor([[1.0, 3.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    term, m = entropy_bonus(ent, mask, 0.01)
    assert term.item() == pytest.approx(-0.02)
    assert m["entropy"].item() == pytest.approx(2.0)
    term.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.005, -0.005, 0.0]]))
    term2, _ = entropy_bonus(ent, mask, 0.01, aggregation=Aggregation(mode="seq-mean-token-sum"))
    assert term2.item() == pytest.approx(-0.04)


def test_global_token_count_is_used():
    old, new, adv = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
    mask = torch.ones(2, 3)
    loss, _ = policy_loss(old, new, adv, mask, aggregation=Aggregation(num_global_tokens=12))
    assert loss.item() == pytest.approx(-0.5)
    assert agg_loss(-adv, mask, num_global_tokens=12).item() == pytest.approx(-0.5)


def test_truncated_importance_weights_by_hand():
    from hpa.algorithms.ppo import truncated_importance_weights

    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    rollout = torch.tensor([[-1.0, -2.5, -2.5, -1.0]])  # ratios 1, e^0.5, e^2 (capped), e^-2
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, m = truncated_importance_weights(old, rollout, mask, threshold=2.0)
    expected = torch.tensor([[1.0, math.exp(0.5), 2.0, 0.0]])
    torch.testing.assert_close(w, expected)
    assert float(m["is_weight_mean"]) == pytest.approx((1.0 + math.exp(0.5) + 2.0) / 3)
    assert float(m["is_truncated_frac"]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="threshold > 0"):
        truncated_importance_weights(old, rollout, mask, threshold=0.0)


def test_rollout_is_threshold_is_reachable_from_yaml():
    from hpa.config import load_config
    from hpa.config.errors import ConfigError

    cfg = load_config(None, ["algorithm.ppo.rollout_is_threshold=2.0"])
    assert cfg.algorithm.ppo.rollout_is_threshold == 2.0
    assert load_config(None, []).algorithm.ppo.rollout_is_threshold is None
    with pytest.raises(ConfigError, match="rollout_is_threshold"):
        load_config(None, ["algorithm.ppo.rollout_is_threshold=-1"])
