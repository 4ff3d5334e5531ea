"""Rollout correction: values and metrics against cases worked by hand from verl v0.7.0's definitions
(``verl/trainer/ppo/rollout_corr_helper.py``) and one taken from its ``tests/trainer/ppo/test_rollout_corr.py``;
decoupled PPO equal to the PPO loss when behaviour == proximal."""

import math

import pytest
import torch

from hpa.algorithms.losses import Aggregation
from hpa.algorithms.ppo import POLICY_LOSSES, policy_loss
from hpa.algorithms.rollout_correction import (IS_LEVELS, RS_LEVELS, RolloutCorrection, decoupled_policy_loss,
                                               rollout_correction, rollout_is_weights, rollout_rejection_mask,
                                               token_veto)
from hpa.registry import UnknownNameError

L = math.log
# Two rows with padding: ratios π_prox/π_behaviour of 0.5, 3, 1 | 1.5, 0.25. The padding holds extreme ratios
# that must not leak into any value or metric.
LOG_RATIO = torch.tensor([[L(0.5), L(3.0), 0.0, -30.0],
                          [L(1.5), L(0.25), 30.0, -30.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0],
                     [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)


def _close(metrics, key, expected):
    value = float(metrics[f"rollout_corr/{key}"])
    assert value == pytest.approx(expected, rel=1e-6, abs=1e-9), f"{key}: {value} != {expected}"


def test_token_is_weights_and_metrics_by_hand():
    weights, metrics = rollout_is_weights(LOG_RATIO, MASK, rollout_is="token", rollout_is_threshold=2.0)
    expected = torch.tensor([[0.5, 2.0, 1.0, 0.0], [1.5, 0.25, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)
    assert not weights.requires_grad
    # metrics before truncation, over the five valid tokens
    _close(metrics, "rollout_is_mean", (0.5 + 3 + 1 + 1.5 + 0.25) / 5)
    _close(metrics, "rollout_is_max", 3.0)
    _close(metrics, "rollout_is_min", 0.25)
    _close(metrics, "rollout_is_ratio_fraction_high", 1 / 5)  # 3 > 2
    _close(metrics, "rollout_is_ratio_fraction_low", 1 / 5)  # 0.25 < 1/2; 0.5 is not below
    # std and ESS on the weights clamped to [1/2, 2]: 0.5, 2, 1, 1.5, 0.5
    mean, second = 5.5 / 5, (0.25 + 4 + 1 + 2.25 + 0.25) / 5
    _close(metrics, "rollout_is_std", math.sqrt(second - mean ** 2))
    _close(metrics, "rollout_is_eff_sample_size", mean ** 2 / second)
    rows = [(0.5 + 3 + 1) / 3, (1.5 + 0.25) / 2]
    _close(metrics, "rollout_is_seq_mean", sum(rows) / 2)
    _close(metrics, "rollout_is_seq_std", abs(rows[0] - rows[1]) / math.sqrt(2))
    _close(metrics, "rollout_is_seq_max", rows[0])
    _close(metrics, "rollout_is_seq_min", rows[1])
    _close(metrics, "rollout_is_seq_max_deviation", 0.5)
    _close(metrics, "rollout_is_seq_fraction_high", 0.0)
    _close(metrics, "rollout_is_seq_fraction_low", 0.0)


def test_sequence_is_with_an_empty_row():
    log_ratio = torch.cat([LOG_RATIO, torch.full((1, 4), 5.0, dtype=torch.float64)])
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.float64)])
    weights, metrics = rollout_is_weights(log_ratio, mask, rollout_is="sequence", rollout_is_threshold=2.0)
    # row weights: 0.5·3·1 = 1.5, 1.5·0.25 = 0.375; the empty row has none
    expected = torch.tensor([[1.5, 1.5, 1.5, 0.0], [0.375, 0.375, 0.0, 0.0], [0.0] * 4], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)
    _close(metrics, "rollout_is_max", 1.5)  # over the rows' log sums: log 1.5, log 0.375, 0 (the empty row)
    _close(metrics, "rollout_is_min", 0.375)
    _close(metrics, "rollout_is_mean", (1.5 * 3 + 0.375 * 2) / 5)
    _close(metrics, "rollout_is_ratio_fraction_high", 0.0)
    _close(metrics, "rollout_is_ratio_fraction_low", 1 / 3)  # verl averages over all rows
    _close(metrics, "rollout_is_seq_mean", (1.5 + 0.375 + 0.0) / 3)


def test_sequence_is_truncates():
    weights, metrics = rollout_is_weights(LOG_RATIO, MASK, rollout_is="sequence", rollout_is_threshold=1.2)
    torch.testing.assert_close(weights[0, :3], torch.full((3,), 1.2, dtype=torch.float64))
    _close(metrics, "rollout_is_ratio_fraction_high", 1 / 2)
    _close(metrics, "rollout_is_max", 1.5)  # before truncation


def test_token_rejection_by_hand():
    kept, metrics = rollout_rejection_mask(LOG_RATIO, MASK, rollout_rs="token", rollout_rs_threshold=2.0)
    torch.testing.assert_close(kept, torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]],
                                                  dtype=torch.float64))
    _close(metrics, "rollout_rs_masked_fraction", 2 / 5)
    _close(metrics, "rollout_rs_seq_masked_fraction", 1.0)
    _close(metrics, "rollout_rs_mean", 6.25 / 5)
    _close(metrics, "rollout_rs_max", 3.0)
    _close(metrics, "rollout_rs_min", 0.25)


def test_sequence_rejection_and_explicit_lower_bound():
    kept, metrics = rollout_rejection_mask(LOG_RATIO, MASK, rollout_rs="sequence", rollout_rs_threshold=2.0)
    torch.testing.assert_close(kept, torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0] * 4], dtype=torch.float64))
    _close(metrics, "rollout_rs_masked_fraction", 2 / 5)
    _close(metrics, "rollout_rs_seq_masked_fraction", 1 / 2)
    kept, _ = rollout_rejection_mask(LOG_RATIO, MASK, rollout_rs="sequence", rollout_rs_threshold=2.0,
                                     rollout_rs_threshold_lower=0.3)
    torch.testing.assert_close(kept, MASK)


def test_geometric_rejection_of_every_row():
    log_ratio = torch.cat([LOG_RATIO, torch.zeros(1, 4, dtype=torch.float64)])
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.float64)])
    # geometric means: 1.5^(1/3) = 1.145 > 1.1 and 0.375^(1/2) = 0.612 < 0.9: both rows rejected
    kept, metrics = rollout_rejection_mask(log_ratio, mask, rollout_rs="geometric", rollout_rs_threshold=1.1,
                                           rollout_rs_threshold_lower=0.9)
    assert kept.sum() == 0
    _close(metrics, "rollout_rs_masked_fraction", 1.0)
    _close(metrics, "rollout_rs_seq_masked_fraction", 2 / 3)  # the empty row's ratio is 1: not rejected
    _close(metrics, "rollout_rs_max", 1.5 ** (1 / 3))
    _close(metrics, "rollout_rs_min", 0.375 ** 0.5)
    _close(metrics, "rollout_rs_ratio_fraction_high", 1 / 3)
    _close(metrics, "rollout_rs_ratio_fraction_low", 1 / 3)
    # a policy loss over an all-rejected batch is 0, not NaN
    loss, _ = policy_loss(torch.zeros(3, 4), torch.zeros(3, 4, requires_grad=True), torch.ones(3, 4), kept.float())
    assert float(loss.detach()) == 0.0


def test_token_veto_by_hand():
    kept, metrics = token_veto(LOG_RATIO, MASK, rollout_token_veto_threshold=0.3)
    # row 1 holds 0.25 < 0.3; row 0's padding (ratio e^-30) does not count
    torch.testing.assert_close(kept, torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0] * 4], dtype=torch.float64))
    _close(metrics, "rollout_is_veto_fraction", 1 / 2)
    _close(metrics, "rollout_is_catastrophic_token_fraction", 1 / 5)


def test_combined_in_verls_order():
    correction = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token",
                                   rollout_rs_threshold=2.5, rollout_token_veto_threshold=0.3)
    # the rejection bounds [0.4, 2.5] lie clear of every ratio: at a bound, the rounding of
    # (behaviour + log ratio) - behaviour would decide
    behaviour = torch.randn(2, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (weights, kept), metrics = rollout_correction(behaviour + LOG_RATIO, behaviour, MASK, correction)
    # weights on the original mask (not zeroed by rejection or veto), mask after rejection, then the veto
    torch.testing.assert_close(weights, torch.tensor([[0.5, 2.0, 1.0, 0.0], [1.5, 0.25, 0.0, 0.0]],
                                                     dtype=torch.float64))
    torch.testing.assert_close(kept, torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0] * 4], dtype=torch.float64))
    _close(metrics, "rollout_is_veto_fraction", 1 / 2)
    _close(metrics, "rollout_rs_masked_fraction", 2 / 5)
    off = rollout_correction(behaviour, behaviour, MASK, RolloutCorrection())
    assert off[0][0] is None and off[0][1] is MASK
    _close(off[1], "rollout_is_veto_fraction", 0.0)


def test_verl_mask_mode_case():
    """verl v0.7.0 tests/trainer/ppo/test_rollout_corr.py::test_mask_mode."""
    old = torch.full((2, 5), -2.0)
    rollout = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    correction = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token",
                                   rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5)
    (weights, kept), metrics = rollout_correction(old, rollout, torch.ones(2, 5), correction)
    torch.testing.assert_close(weights[0], torch.full((5,), math.exp(-1.0)))
    torch.testing.assert_close(weights[1], torch.full((5,), math.exp(0.5)))
    assert torch.all(kept[0] == 0) and torch.all(kept[1] == 1)
    _close(metrics, "rollout_rs_masked_fraction", 0.5)


def test_bool_mask_keeps_its_dtype():
    kept, _ = rollout_rejection_mask(LOG_RATIO, MASK.bool(), rollout_rs="token", rollout_rs_threshold=2.0)
    assert kept.dtype == torch.bool and kept.sum() == 3
    kept, _ = token_veto(LOG_RATIO, MASK.bool(), rollout_token_veto_threshold=0.3)
    assert kept.dtype == torch.bool and kept.sum() == 3


@pytest.mark.parametrize("option,call", [
    ("rollout_is_threshold", lambda v: rollout_is_weights(LOG_RATIO, MASK, rollout_is="token", rollout_is_threshold=v)),
    ("rollout_rs_threshold", lambda v: rollout_rejection_mask(LOG_RATIO, MASK, rollout_rs="token",
                                                              rollout_rs_threshold=v)),
    ("rollout_rs_threshold_lower", lambda v: rollout_rejection_mask(LOG_RATIO, MASK, rollout_rs="token",
                                                                    rollout_rs_threshold=2.0,
                                                                    rollout_rs_threshold_lower=v)),
    ("rollout_token_veto_threshold", lambda v: token_veto(LOG_RATIO, MASK, rollout_token_veto_threshold=v)),
    ("rollout_is_threshold", lambda v: RolloutCorrection(rollout_is="token", rollout_is_threshold=v)),
    ("rollout_rs_threshold", lambda v: RolloutCorrection(rollout_rs="token", rollout_rs_threshold=v)),
    ("rollout_token_veto_threshold", lambda v: RolloutCorrection(rollout_token_veto_threshold=v)),
])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_threshold_names_the_option(option, call, value):
    with pytest.raises(ValueError, match=option):
        call(value)


def test_missing_threshold_names_the_option():
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        RolloutCorrection(rollout_rs="geometric")
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        rollout_is_weights(LOG_RATIO, MASK, rollout_is="token", rollout_is_threshold=None)


def test_lower_above_upper_and_unknown_levels():
    with pytest.raises(ValueError, match="rollout_rs_threshold_lower"):
        RolloutCorrection(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0)
    with pytest.raises(UnknownNameError, match="rollout_is level 'geometric'.*sequence, token"):
        RolloutCorrection(rollout_is="geometric")
    with pytest.raises(UnknownNameError, match="rollout_rs level"):
        rollout_rejection_mask(LOG_RATIO, MASK, rollout_rs="seq", rollout_rs_threshold=2.0)
    assert IS_LEVELS.names() == ("sequence", "token")
    assert RS_LEVELS.names() == ("geometric", "sequence", "token")
    with pytest.raises(ValueError, match="no valid token"):
        rollout_is_weights(LOG_RATIO, torch.zeros_like(MASK), rollout_is="token", rollout_is_threshold=2.0)


def _ppo_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 3
    current = (old + 0.3 * torch.randn(3, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.float64)
    return old, current, advantages, mask


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_decoupled_equals_ppo_when_behaviour_is_proximal(name, mode):
    old, current, advantages, mask = _ppo_inputs(0)
    kwargs = dict(name=name, clip_ratio=0.2, aggregation=Aggregation(mode=mode))
    if name == "geo_mean":
        kwargs["clip_ratio"] = 0.4
    loss, metrics = policy_loss(old, current, advantages, mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, current)
    correction = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token",
                                   rollout_rs_threshold=2.0, rollout_token_veto_threshold=1e-4)
    d_loss, d_metrics = decoupled_policy_loss(old, old.clone(), current, advantages, mask, correction=correction,
                                              **kwargs)
    (d_grad,) = torch.autograd.grad(d_loss, current)
    if name == "geo_mean":  # GMPO weights a row by exp(mean log(w + 1e-10)) (verl's): 1 + 1e-10 at w = 1
        torch.testing.assert_close(d_loss, loss, rtol=1e-9, atol=0.0)
        torch.testing.assert_close(d_grad, grad, rtol=1e-9, atol=0.0)
        return
    assert torch.equal(loss, d_loss) and torch.equal(grad, d_grad)
    for key, value in metrics.items():
        assert torch.equal(value, d_metrics[key]), key
    assert float(d_metrics["rollout_corr/rollout_is_mean"]) == pytest.approx(1.0)  # masked_mean divides by n + 1e-8


def test_decoupled_weights_the_loss_by_prox_over_behaviour():
    # at log_prob == proximal and A = 1 every vanilla token loss is -1, so the token-mean loss is -mean(w)
    prox = torch.zeros(1, 3, dtype=torch.float64)
    behaviour = torch.tensor([[L(2.0), 0.0, L(0.25)]], dtype=torch.float64)  # w = 0.5, 1, 4 -> 0.5, 1, 3
    current = prox.clone().requires_grad_(True)
    loss, metrics = decoupled_policy_loss(prox, behaviour, current, torch.ones(1, 3), torch.ones(1, 3),
                                          correction=RolloutCorrection(rollout_is="token", rollout_is_threshold=3.0))
    assert float(loss.detach()) == pytest.approx(-(0.5 + 1 + 3) / 3)
    assert "rollout_corr/rollout_is_eff_sample_size" in metrics
    with pytest.raises(ValueError, match="importance_weights"):
        decoupled_policy_loss(prox, behaviour, current, torch.ones(1, 3), torch.ones(1, 3),
                              correction=RolloutCorrection(), importance_weights=torch.ones(1, 3))
