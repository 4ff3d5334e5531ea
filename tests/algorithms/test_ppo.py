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
    assert POLICY_LOSSES.names() == ("cispo", "geo_mean", "gspo", "vanilla")
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


def test_token_truncated_importance_weights_by_hand():
    """The trainer's token TIS (``algorithm.rollout_correction.rollout_is: token``, formerly
    ``algorithm.ppo.rollout_is_threshold``): ``min(π_old/π_rollout, threshold)``, 0 on padding."""
    from hpa.algorithms.rollout_correction import rollout_is_weights

    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    rollout = torch.tensor([[-1.0, -2.5, -2.5, -1.0]])  # ratios 1, e^0.5, e^2 (capped), e^-2
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, m = rollout_is_weights(old - rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    expected = torch.tensor([[1.0, math.exp(0.5), 2.0, 0.0]])
    torch.testing.assert_close(w, expected)
    assert float(m["rollout_corr/rollout_is_mean"]) == pytest.approx((1.0 + math.exp(0.5) + math.exp(2.0)) / 3)
    assert float(m["rollout_corr/rollout_is_ratio_fraction_high"]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        rollout_is_weights(old - rollout, mask, rollout_is="token", rollout_is_threshold=0.0)


# -- GSPO, CISPO, GMPO against transcriptions of verl's functions -------------------------------------
# verl/trainer/ppo/core_algos.py (compute_policy_loss_gspo, compute_policy_loss_cispo,
# compute_policy_loss_geo_mean, agg_loss) and verl/utils/torch_functional.py (masked_sum, masked_mean) of
# verl 0.9.1, transcribed with verl's variable names; config.global_batch_info is empty (one micro-batch,
# DP 1) unless a test passes it (dp_size, batch_num_tokens, global_batch_size).


def verl_masked_sum(values, mask, axis=None):
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum() if axis is None else (valid * mask).sum(axis)


def verl_masked_mean(values, mask, axis=None):
    s = verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        return verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return verl_masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        loss = verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":  # 0.9.1: the seq-mean over the scale factor
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        return verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    raise ValueError(loss_agg_mode)


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_ratio_low, clip_ratio_high,
              rollout_is_weights=None, global_batch_info=None):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    # 0.9.1 aggregates by the configured mode (it only recommends seq-mean-token-mean)
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode, **(global_batch_info or {}))
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {"pg_clipfrac": pg_clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": torch.tensor(0.0)}


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_ratio_low, clip_ratio_high,
               rollout_is_weights=None):
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_ratio_sg = clipped_ratio.detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    pg_clipfrac = verl_masked_mean((ratio != clipped_ratio).float(), response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"pg_clipfrac": pg_clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": torch.tensor(0.0)}


def verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_ratio_low, clip_ratio_high,
                  rollout_is_weights=None):
    cliprange_low, cliprange_high = clip_ratio_low, clip_ratio_high
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
        pg_losses = pg_losses * seq_is_weights
    pg_loss = torch.mean(pg_losses)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = verl_masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = verl_masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, {"pg_clipfrac": pg_clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": pg_clipfrac_lower}


VERL_LOSSES = {"gspo": verl_gspo, "cispo": verl_cispo, "geo_mean": verl_geo_mean}
ALL_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# the aggregation modes verl's function honours (GMPO ignores the mode)
VERL_MODES = {"gspo": ["seq-mean-token-mean"] + [m for m in ALL_MODES if m != "seq-mean-token-mean"],
              "geo_mean": ["token-mean", "seq-mean-token-sum"], "cispo": ALL_MODES}
CLIPS = {"gspo": (3e-3, 4e-3), "cispo": (10.0, 0.2), "geo_mean": (0.4, 0.4)}


def _case(seed, b=6, r=9, fully_masked_row=False, all_zero=False, with_is=False, token_advantages=True):
    g = torch.Generator().manual_seed(seed)
    old = -1.5 + 0.5 * torch.randn(b, r, generator=g)
    new = old + 0.3 * torch.randn(b, r, generator=g)  # ratios from about 0.4 to 2.5: both clips are hit
    if token_advantages:
        adv = torch.randn(b, r, generator=g)
    else:  # an outcome advantage per sequence, as GRPO gives
        adv = torch.randn(b, 1, generator=g).expand(b, r).clone()
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    if fully_masked_row:
        mask[2] = 0.0
    if all_zero:
        mask.zero_()
    weights = (0.5 + torch.rand(b, r, generator=g)) * mask if with_is else None
    return old, new, adv, mask, weights


def _both(name, mode, old, new, adv, mask, weights):
    low, high = CLIPS[name]
    ours_lp = new.clone().requires_grad_()
    ours, ours_m = policy_loss(old, ours_lp, adv, mask, name=name, clip_ratio_low=low, clip_ratio_high=high,
                               aggregation=Aggregation(mode=mode), importance_weights=weights)
    ours.backward()
    theirs_lp = new.clone().requires_grad_()
    theirs, theirs_m = VERL_LOSSES[name](old, theirs_lp, adv, mask, mode, low, high, rollout_is_weights=weights)
    theirs.backward()
    return (ours, ours_lp.grad, ours_m), (theirs, theirs_lp.grad, theirs_m)


def _assert_same(ours, theirs):
    (loss, grad, m), (v_loss, v_grad, v_m) = ours, theirs
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, v_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, v_grad, atol=1e-6, rtol=1e-6)
    for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        torch.testing.assert_close(m[key].float(), v_m[key].float(), atol=1e-6, rtol=1e-6)
    assert float(m["pg_loss"]) == float(loss.detach())


CASES = [(name, mode) for name, modes in VERL_MODES.items() for mode in modes]


@pytest.mark.parametrize("name,mode", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_is", [False, True])
def test_sequence_level_losses_match_verl(name, mode, seed, with_is):
    """Values, gradients w.r.t. log_prob and metrics, fp32, 1e-6, on partly masked rows."""
    _assert_same(*_both(name, mode, *_case(seed, with_is=with_is)))


@pytest.mark.parametrize("name", ["gspo", "cispo", "geo_mean"])
def test_sequence_level_losses_match_verl_on_outcome_advantages(name):
    _assert_same(*_both(name, VERL_MODES[name][0], *_case(5, token_advantages=False)))


@pytest.mark.parametrize("name,mode", [c for c in CASES if c[0] != "geo_mean"])
def test_gspo_and_cispo_match_verl_with_a_fully_masked_row(name, mode):
    _assert_same(*_both(name, mode, *_case(3, fully_masked_row=True)))


def test_geo_mean_does_not_count_a_fully_masked_row_unlike_verl():
    """verl averages GMPO's sequence losses with torch.mean over the micro-batch's rows, a fully masked
    row included; hpa averages over the non-empty rows (a dropped or filtered response must not dilute
    the loss). So hpa equals verl on the batch without that row, and verl x 6/5 on the batch with it."""
    old, new, adv, mask, w = _case(3, fully_masked_row=True)
    keep = torch.tensor([0, 1, 3, 4, 5])
    ours, theirs = _both("geo_mean", "token-mean", old, new, adv, mask, w)
    _, without = _both("geo_mean", "token-mean", old[keep], new[keep], adv[keep], mask[keep], w)
    _assert_same(ours[:1] + (ours[1][keep],) + ours[2:], without)
    torch.testing.assert_close(ours[0], theirs[0] * 6 / 5, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name,mode", CASES)
def test_sequence_level_losses_on_an_all_zero_mask(name, mode):
    """A micro-batch with nothing in the loss gives loss 0 and no gradient. verl agrees where its function
    divides by no count (GMPO's mean over rows, token-sum); where it divides by the empty batch's own
    count it returns NaN (0/0), which hpa's aggregation turns into 0 (the documented difference in
    ``hpa/algorithms/losses.py``; the trainer always passes global counts)."""
    (loss, grad, m), (v_loss, v_grad, v_m) = _both(name, mode, *_case(4, all_zero=True))
    assert float(loss.detach()) == 0.0 and not grad.any()
    assert all(float(v) == 0.0 for v in m.values())
    if name == "geo_mean" or mode == "token-sum":
        _assert_same((loss, grad, m), (v_loss, v_grad, v_m))
    else:
        assert torch.isnan(v_loss)


@pytest.mark.parametrize("name", ["gspo", "cispo", "geo_mean"])
def test_sequence_level_losses_add_up_over_micro_batches_with_global_counts(name):
    """Two micro-batches with the global counts give the loss and gradient of the one batch."""
    old, new, adv, mask, w = _case(7, fully_masked_row=True, with_is=True)
    mode = "seq-mean-token-mean" if name == "gspo" else "token-mean"
    low, high = CLIPS[name]
    counts = dict(num_global_tokens=mask.sum(), num_global_seqs=(mask.sum(-1) > 0).sum())
    full_lp = new.clone().requires_grad_()
    full, _ = policy_loss(old, full_lp, adv, mask, name=name, clip_ratio_low=low, clip_ratio_high=high,
                          aggregation=Aggregation(mode=mode, **counts), importance_weights=w)
    full.backward()
    split_lp = new.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        part, _ = policy_loss(old[rows], split_lp[rows], adv[rows], mask[rows], name=name, clip_ratio_low=low,
                              clip_ratio_high=high, aggregation=Aggregation(mode=mode, **counts),
                              importance_weights=w[rows])
        total = total + part
    total.backward()
    torch.testing.assert_close(total, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(split_lp.grad, full_lp.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_gspo_matches_verl_with_global_batch_info(mode):
    """Each micro-batch of a DP-2 batch, normalised by the global counts, as verl 0.9.1 with
    ``config.global_batch_info`` (dp_size, batch_num_tokens, global_batch_size): values and gradients."""
    old, new, adv, mask, w = _case(8, b=8, fully_masked_row=True, with_is=True)
    low, high = CLIPS["gspo"]
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    info = dict(dp_size=2, batch_num_tokens=num_tokens, global_batch_size=num_seqs)
    aggregation = Aggregation(mode=mode, num_global_tokens=num_tokens, num_global_seqs=num_seqs, dp_size=2)
    for rows in (slice(0, 3), slice(3, 8)):
        ours_lp = new[rows].clone().requires_grad_()
        ours, _ = policy_loss(old[rows], ours_lp, adv[rows], mask[rows], name="gspo", clip_ratio_low=low,
                              clip_ratio_high=high, aggregation=aggregation, importance_weights=w[rows])
        ours.backward()
        theirs_lp = new[rows].clone().requires_grad_()
        theirs, _ = verl_gspo(old[rows], theirs_lp, adv[rows], mask[rows], mode, low, high,
                              rollout_is_weights=w[rows], global_batch_info=info)
        theirs.backward()
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, atol=1e-6, rtol=1e-6)


def test_gspo_by_hand():
    """One sequence of two tokens with log-ratios 0.1 and 0.3: s = exp(0.2) for both tokens; A = 1 and the
    clip at 1.1 binds (s = 1.2214), so the loss is -1.1 and no gradient flows."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[0.1, 0.3]], dtype=torch.float64, requires_grad=True)
    adv = torch.ones(1, 2, dtype=torch.float64)
    loss, m = policy_loss(old, new, adv, torch.ones(1, 2), name="gspo", clip_ratio=0.1)
    # (the clip fraction divides by count + 1e-8)
    assert loss.item() == pytest.approx(-1.1, abs=1e-7) and m["pg_clipfrac"].item() == pytest.approx(1.0)
    loss.backward()
    assert not new.grad.any()
    # unclipped (clip 0.5): L = -mean_t exp(0.2) = -e^0.2, dL/dlog_prob_t = -e^0.2 / 2 for each token
    new.grad = None
    loss, _ = policy_loss(old, new, adv, torch.ones(1, 2), name="gspo", clip_ratio=0.5)
    assert loss.item() == pytest.approx(-math.exp(0.2), abs=1e-7)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.full((1, 2), -math.exp(0.2) / 2, dtype=torch.float64))


def test_cispo_by_hand():
    """ratio e^0.5 = 1.65 is clipped to 1.2 but keeps its gradient: dL/dlog_prob = -1.2·A."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[0.5, -0.1]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    loss, m = policy_loss(old, new, adv, torch.ones(1, 2), name="cispo", clip_ratio_low=10.0, clip_ratio_high=0.2)
    r1 = math.exp(-0.1)
    assert loss.item() == pytest.approx((-1.2 * 2.0 * 0.5 + r1 * -1.0 * -0.1 * -1) / 2)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.2 * 2.0 / 2, r1 * 1.0 / 2]], dtype=torch.float64))


def test_geo_mean_by_hand():
    """A > 0 clips the log-ratio from above only: 0.6 -> 0.4, -0.6 stays; rho = exp((0.4 - 0.6) / 2)."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[0.6, -0.6]], dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    loss, m = policy_loss(old, new, adv, torch.ones(1, 2), name="geo_mean", clip_ratio=0.4)
    assert loss.item() == pytest.approx(-math.exp(-0.1))
    # the clip fractions (verl's) count the tokens whose log-ratio lies outside [-0.4, 0.4], either side
    assert m["pg_clipfrac"].item() == pytest.approx(1.0) and m["pg_clipfrac_lower"].item() == 0.0
    # A < 0: the lower side binds instead: -0.6 -> -0.4, 0.6 stays; L = +exp(0.1)
    loss, m = policy_loss(old, new, -adv, torch.ones(1, 2), name="geo_mean", clip_ratio=0.4)
    assert loss.item() == pytest.approx(math.exp(0.1))
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1.0) and m["pg_clipfrac"].item() == 0.0


def test_new_policy_losses_are_reachable_from_yaml():
    from hpa.config import load_config
    from hpa.config.errors import ConfigError

    for name in ("gspo", "cispo", "geo_mean"):
        assert load_config(None, [f"algorithm.ppo.policy_loss={name}"]).algorithm.ppo.policy_loss == name
    # CISPO bounds only the upper side: clip_ratio_low >= 1 is allowed there, not for the others
    assert load_config(None, ["algorithm.ppo.policy_loss=cispo", "algorithm.ppo.clip_ratio_low=10"])
    with pytest.raises(ConfigError, match="algorithm.ppo.clip_ratio_low"):
        load_config(None, ["algorithm.ppo.policy_loss=gspo", "algorithm.ppo.clip_ratio_low=10"])
