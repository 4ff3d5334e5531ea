import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hpa.algorithms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    SEMANTIC_DISTANCES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    hierarchical_kl,
    kl_loss,
    kl_penalty,
    kl_warmup_scale,
    make_kl_controller,
)
from hpa.algorithms.masked import mean_pool
from hpa.algorithms.losses import Aggregation

LP = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
REF = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)


def test_estimators_by_hand():
    d = [0.5, -1.0]  # logprob - ref
    torch.testing.assert_close(kl_penalty(LP, REF, "kl"), torch.tensor([d], dtype=torch.float64))
    torch.testing.assert_close(kl_penalty(LP, REF, "k1"), torch.tensor([d], dtype=torch.float64))
    torch.testing.assert_close(kl_penalty(LP, REF, "abs"), torch.tensor([[0.5, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(kl_penalty(LP, REF, "mse"), torch.tensor([[0.125, 0.5]], dtype=torch.float64))
    k3 = [math.exp(-x) + x - 1 for x in d]  # r = ref - logprob = -d
    torch.testing.assert_close(kl_penalty(LP, REF, "low_var_kl"), torch.tensor([k3], dtype=torch.float64))
    torch.testing.assert_close(kl_penalty(LP, REF, "k3"), torch.tensor([k3], dtype=torch.float64))


def test_k3_clamps():
    lp = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[50.0, -50.0]], dtype=torch.float64)
    out = kl_penalty(lp, ref, "k3")
    # exponent clamped to +-20, result clamped to [-10, 10]
    torch.testing.assert_close(out, torch.tensor([[10.0, math.exp(-20) + 20 - 1]], dtype=torch.float64).clamp(max=10))


def test_straight_through_value_and_gradient():
    for name in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"):
        lp = LP.clone().requires_grad_()
        value = kl_penalty(lp, REF, name + "+")
        torch.testing.assert_close(value, kl_penalty(LP, REF, name))
        value.sum().backward()
        torch.testing.assert_close(lp.grad, LP - REF)  # gradient of 0.5·(lp - ref)²


def test_k2_plus_by_hand():
    # verl accepts "k2+"/"mse+": value 0.5·d², gradient d, with d = logprob - ref = [0.5, -1.0]
    for name in ("k2+", "mse+"):
        lp = LP.clone().requires_grad_()
        value = kl_penalty(lp, REF, name)
        torch.testing.assert_close(value, torch.tensor([[0.125, 0.5]], dtype=torch.float64))
        value.sum().backward()
        torch.testing.assert_close(lp.grad, torch.tensor([[0.5, -1.0]], dtype=torch.float64))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-15, 0), min_size=1, max_size=6), st.lists(st.floats(-15, 0), min_size=1, max_size=6))
@example(a=[-1.1401898799920416e-14], b=[0.0])  # verl's exp(d) - d - 1 rounds to -1.1e-16 here
def test_k2_k3_non_negative_and_zero_when_equal(a, b):
    """Non-negative up to rounding: k3 is verl's formula as written (exp(d) - d - 1), which can round a
    difference of 1e-14 to -1.1e-16 (hypothesis found it); expm1(d) - d would not, but would not be verl's."""
    n = min(len(a), len(b))
    lp, ref = torch.tensor([a[:n]], dtype=torch.float64), torch.tensor([b[:n]], dtype=torch.float64)
    for name in ("k2", "k3"):
        assert (kl_penalty(lp, ref, name) >= -4 * torch.finfo(torch.float64).eps).all()
        assert (kl_penalty(lp, lp, name) == 0).all()


def test_k3_gradcheck():
    lp = torch.tensor([[-1.0, -0.3, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.2, -0.1, -4.0]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, "k3"), (lp,))


def test_apply_kl_penalty_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -2.0], [-0.5, -1.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards, m = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kind="kl")
    kl = torch.tensor([[0.5, 0.0, 1.0], [-0.5, 0.5, 0.0]])
    torch.testing.assert_close(rewards, scores - 0.1 * kl)
    assert m["reward_kl"].item() == pytest.approx((0.5 + 0.0) / 2)  # mean of (1.5/3, 0/2)
    assert m["reward_kl_coef"].item() == pytest.approx(0.1)


def test_kl_loss_term():
    lp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = kl_loss(lp, ref, mask, kind="mse")
    assert loss.item() == pytest.approx(0.25)
    assert m["kl_loss"].item() == pytest.approx(0.25)


def test_adaptive_controller_matches_verl_formula_and_checkpoints():
    ctl = AdaptiveKLController(init_kl_coef=0.001, target_kl=0.015, horizon=10000)
    ctl.update(current_kl=0.03, n_steps=256)  # error 1.0 clipped to 0.2
    assert ctl.value == 0.001 * (1 + 0.2 * 256 / 10000)
    ctl.update(current_kl=0.0, n_steps=256)  # error -1.0 clipped to -0.2
    assert ctl.value == pytest.approx(0.001 * (1 + 0.2 * 256 / 10000) * (1 - 0.2 * 256 / 10000))
    ctl.update(current_kl=torch.tensor(0.0165), n_steps=100)  # error 0.1, not clipped
    state = ctl.state_dict()
    fresh = AdaptiveKLController(init_kl_coef=1.0, target_kl=1.0, horizon=1)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    ctl.update(0.02, 64)
    fresh.update(0.02, 64)
    assert ctl.value == fresh.value


def test_fixed_controller_and_factory():
    ctl = make_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctl, FixedKLController)
    ctl.update(10.0, 100)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05
    assert isinstance(make_kl_controller("adaptive", kl_coef=0.001, target_kl=0.015, horizon=10), AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", kl_coef=0.001)
    assert KL_CONTROLLERS.names() == ("adaptive", "fixed")


def test_kl_warmup():
    assert kl_warmup_scale(0.0, 0.2) == 0.0
    assert kl_warmup_scale(0.199, 0.2) == 0.0
    assert kl_warmup_scale(0.2, 0.2) == 1.0
    assert kl_warmup_scale(1.0, 0.2) == 1.0
    assert kl_warmup_scale(0.0, 0.0) == 1.0


def test_mean_pool():
    hidden = torch.arange(12, dtype=torch.float64).reshape(2, 3, 2)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(mean_pool(hidden, mask), torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64))


def test_hierarchical_kl_by_hand():
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0], [-1.0, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    pol = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    refh = torch.tensor([[1.0, 0.0], [3.0, 4.0]], dtype=torch.float64)
    loss, m = hierarchical_kl(lp, ref, mask, pol, refh, lambda_token=1.0, lambda_semantic=0.2, kind="mse")
    token = (0.125 + 0.5 + 0.0) / 3
    semantic = ((0 + 4) / 2 + (9 + 16) / 2) / 2
    assert m["token_kl"].item() == pytest.approx(token)
    assert m["semantic_distance"].item() == pytest.approx(semantic)
    assert loss.item() == pytest.approx(token + 0.2 * semantic)
    assert m["lambda_semantic"].item() == pytest.approx(0.2)
    # row weights (the coverage trust's abstention) scale each row's token KL and distance in the loss, not the
    # counts; the metrics stay the policy's KL and distance (the guard rolls back on kl/token: a weight of 21 on
    # the far rows must not read as a KL spike)
    w = torch.tensor([2.0, 5.0], dtype=torch.float64)
    weighted, mw = hierarchical_kl(lp, ref, mask, pol, refh, lambda_token=1.0, lambda_semantic=0.2, kind="mse",
                                   row_weights=w)
    assert weighted.item() == pytest.approx((2 * (0.125 + 0.5) + 5 * 0.0) / 3
                                            + 0.2 * (2 * (0 + 4) / 2 + 5 * (9 + 16) / 2) / 2)
    assert mw["token_kl"].item() == pytest.approx(token)
    assert mw["semantic_distance"].item() == pytest.approx(semantic)
    assert mw["hier_kl"].item() == pytest.approx(token + 0.2 * semantic)
    cos, mc = hierarchical_kl(lp, ref, mask, pol, refh, lambda_token=0.0, lambda_semantic=1.0, distance="cosine")
    expected = (1 - 1 / math.sqrt(5) + 1 - 0.0) / 2  # second row: zero vector has cosine 0
    assert cos.item() == pytest.approx(expected)
    assert torch.autograd.gradcheck(
        lambda p: hierarchical_kl(lp, ref, mask, p, refh, lambda_token=0.5, lambda_semantic=0.5)[0],
        (pol.detach().clone().requires_grad_(),),
    )


def test_hierarchical_kl_token_weights_by_hand():
    """The rollout correction's IS weights (``token_weights``): each token's KL times its weight, each row's
    distance times the row's mean weight over the mask, the counts unchanged; with the coverage trust's row
    weights the two multiply; the metrics stay unweighted; None is the unweighted loss bit for bit."""
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0], [-1.0, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    pol = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    refh = torch.tensor([[1.0, 0.0], [3.0, 4.0]], dtype=torch.float64)
    tw = torch.tensor([[2.0, 0.5], [3.0, 7.0]], dtype=torch.float64)  # row 1's second token is padding
    kw = dict(lambda_token=1.0, lambda_semantic=0.2, kind="mse")
    loss, m = hierarchical_kl(lp, ref, mask, pol, refh, token_weights=tw, **kw)
    # mse per token: 0.125, 0.5 | 0.0 (pad); distances 2 and 12.5; row mean weights 1.25 and 3
    assert loss.item() == pytest.approx((2 * 0.125 + 0.5 * 0.5 + 3 * 0.0) / 3 + 0.2 * (1.25 * 2 + 3 * 12.5) / 2)
    assert m["token_kl"].item() == pytest.approx((0.125 + 0.5) / 3)
    assert m["semantic_distance"].item() == pytest.approx((2 + 12.5) / 2)
    w = torch.tensor([2.0, 5.0], dtype=torch.float64)
    both, _ = hierarchical_kl(lp, ref, mask, pol, refh, token_weights=tw, row_weights=w, **kw)
    assert both.item() == pytest.approx((2 * (2 * 0.125 + 0.5 * 0.5) + 5 * 0.0) / 3
                                        + 0.2 * (2 * 1.25 * 2 + 5 * 3 * 12.5) / 2)
    plain, _ = hierarchical_kl(lp, ref, mask, pol, refh, **kw)
    unweighted, _ = hierarchical_kl(lp, ref, mask, pol, refh, token_weights=None, **kw)
    assert torch.equal(plain, unweighted)
    ones, _ = hierarchical_kl(lp, ref, mask, pol, refh, token_weights=torch.ones_like(tw), **kw)
    assert ones.item() == pytest.approx(plain.item(), rel=1e-12)


def test_hierarchical_kl_semantic_uses_global_sequence_count():
    lp = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)  # second row empty: excluded
    pol = torch.tensor([[1.0], [5.0]], dtype=torch.float64)
    refh = torch.zeros(2, 1, dtype=torch.float64)
    _, m = hierarchical_kl(lp, lp, mask, pol, refh, lambda_token=1.0, lambda_semantic=1.0)
    assert m["semantic_distance"].item() == pytest.approx(1.0)
    _, m = hierarchical_kl(lp, lp, mask, pol, refh, lambda_token=1.0, lambda_semantic=1.0,
                           aggregation=Aggregation(num_global_seqs=4))
    assert m["semantic_distance"].item() == pytest.approx(0.25)


def test_registries():
    assert KL_ESTIMATORS.names() == (
        "abs", "abs+", "k1", "k1+", "k2", "k2+", "k3", "k3+", "kl", "kl+", "low_var_kl", "low_var_kl+", "mse",
        "mse+",
    )
    assert SEMANTIC_DISTANCES.names() == ("cosine", "mse")
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LP, REF, "low_var")
