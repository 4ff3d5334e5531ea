import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hpa.algorithms.dpo import DPO_LOSSES, dpo_loss

C, R = torch.tensor([-1.0, -4.0], dtype=torch.float64), torch.tensor([-3.0, -2.0], dtype=torch.float64)
RC, RR = torch.tensor([-2.0, -3.0], dtype=torch.float64), torch.tensor([-2.0, -3.0], dtype=torch.float64)
# logits = (C - R) - (RC - RR) = [2, -2]


def sp(x):  # -log σ(x) = softplus(-x)
    return math.log1p(math.exp(-x))


def test_sigmoid_by_hand_and_metrics():
    loss, m = dpo_loss(C, R, RC, RR, beta=0.5)
    assert loss.item() == pytest.approx((sp(1.0) + sp(-1.0)) / 2)
    # rewards: chosen 0.5·[1, -1], rejected 0.5·[-1, 1]
    assert m["dpo_chosen_reward"].item() == pytest.approx(0.0)
    assert m["dpo_reward_accuracy"].item() == pytest.approx(0.5)
    assert m["dpo_reward_margin"].item() == pytest.approx(0.0)
    l1, m1 = dpo_loss(C[:1], R[:1], RC[:1], RR[:1], beta=0.5)
    assert m1["dpo_reward_accuracy"].item() == 1.0 and m1["dpo_reward_margin"].item() == pytest.approx(2 * 0.5 * 2 / 2)


def test_label_smoothing_and_robust_by_hand():
    eps, beta = 0.1, 0.5
    loss, _ = dpo_loss(C[:1], R[:1], RC[:1], RR[:1], beta=beta, label_smoothing=eps)
    assert loss.item() == pytest.approx((1 - eps) * sp(1.0) + eps * sp(-1.0))
    loss, _ = dpo_loss(C[:1], R[:1], RC[:1], RR[:1], beta=beta, label_smoothing=eps, variant="robust")
    assert loss.item() == pytest.approx(((1 - eps) * sp(1.0) - eps * sp(-1.0)) / (1 - 2 * eps))


def test_hinge_and_ipo_by_hand():
    loss, _ = dpo_loss(C, R, RC, RR, beta=0.25, variant="hinge")
    assert loss.item() == pytest.approx((max(0, 1 - 0.5) + max(0, 1 + 0.5)) / 2)
    lc, lr = torch.tensor([2, 4]), torch.tensor([1, 2])
    loss, _ = dpo_loss(C, R, RC, RR, beta=0.25, variant="ipo", chosen_lengths=lc, rejected_lengths=lr)
    z = [(-1 + 2) / 2 - (-3 + 2) / 1, (-4 + 3) / 4 - (-2 + 3) / 2]
    assert loss.item() == pytest.approx(sum((x - 2.0) ** 2 for x in z) / 2)
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(C, R, RC, RR, variant="ipo")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(C, R, RC, RR, variant="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="0.5"):
        dpo_loss(C, R, RC, RR, variant="robust", label_smoothing=0.5)


def trl_028(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, ls, loss_type):
    """Transcription of TRL 0.28 DPOTrainer.dpo_loss (reverse KL, not reference-free)."""
    logratios = chosen_logps - rejected_logps
    ref_logratios = ref_chosen_logps - ref_rejected_logps
    logits = logratios - ref_logratios
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    if loss_type == "robust":
        return (-F.logsigmoid(beta * logits) * (1 - ls) + F.logsigmoid(-beta * logits) * ls) / (1 - 2 * ls)
    if loss_type == "hinge":
        return torch.relu(1 - beta * logits)
    return (logits - 1 / (2 * beta)) ** 2


@pytest.mark.parametrize("variant,ls", [("sigmoid", 0.0), ("sigmoid", 0.12), ("robust", 0.12), ("hinge", 0.0), ("ipo", 0.0)])
def test_matches_trl_028_bitwise(variant, ls):
    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = (torch.randn(16, generator=g) * 20 - 50 for _ in range(4))
    lc, lr = torch.randint(1, 50, (16,), generator=g), torch.randint(1, 50, (16,), generator=g)
    loss, _ = dpo_loss(c, r, rc, rr, beta=0.1, variant=variant, label_smoothing=ls, chosen_lengths=lc, rejected_lengths=lr)
    if variant == "ipo":  # TRL divides every log-prob by its completion length before dpo_loss
        c, r, rc, rr = c / lc, r / lr, rc / lc, rr / lr
    assert torch.equal(loss, trl_028(c, r, rc, rr, 0.1, ls, variant).mean())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(*(st.floats(-50, 0) for _ in range(4))), min_size=1, max_size=5), st.floats(0.01, 1.0))
def test_swapping_chosen_and_rejected_flips_margin(rows, beta):
    c, r, rc, rr = (torch.tensor(col, dtype=torch.float64) for col in zip(*rows))
    _, m = dpo_loss(c, r, rc, rr, beta=beta)
    _, s = dpo_loss(r, c, rr, rc, beta=beta)
    assert s["dpo_reward_margin"].item() == pytest.approx(-m["dpo_reward_margin"].item(), abs=1e-9)


def test_gradcheck_and_global_pairs():
    c = C.clone().requires_grad_()
    for variant, ls in (("sigmoid", 0.1), ("robust", 0.2), ("ipo", 0.0)):
        kw = dict(chosen_lengths=torch.tensor([3, 5]), rejected_lengths=torch.tensor([2, 7]))
        assert torch.autograd.gradcheck(
            lambda x: dpo_loss(x, R, RC, RR, beta=0.3, variant=variant, label_smoothing=ls, **kw)[0], (c,)
        )
    full, _ = dpo_loss(C, R, RC, RR)
    parts = [dpo_loss(C[i : i + 1], R[i : i + 1], RC[i : i + 1], RR[i : i + 1], num_global_pairs=2)[0] for i in (0, 1)]
    torch.testing.assert_close(sum(parts), full)
    # two DP ranks: (loss_k · dp_size) averaged over the ranks equals the full-batch loss
    ranks = [dpo_loss(C[i : i + 1], R[i : i + 1], RC[i : i + 1], RR[i : i + 1], num_global_pairs=2, dp_size=2)[0]
             for i in (0, 1)]
    torch.testing.assert_close(sum(ranks) / 2, full)
    with pytest.raises(ValueError, match="num_global_pairs"):
        dpo_loss(C, R, RC, RR, dp_size=2)


def test_registry_names():
    assert DPO_LOSSES.names() == ("hinge", "ipo", "robust", "sigmoid")


def test_anchor_is_alpha_times_the_token_mean_nll_of_the_chosen_rows_with_its_gradient():
    """RPO's anchor as TRL's rpo_alpha: the cross-entropy over all chosen tokens of the batch, times α."""
    from hpa.algorithms.dpo import anchor_nll

    logits = torch.tensor([[[0.2, -1.0, 0.5], [1.5, 0.1, -0.3], [0.0, 0.0, 0.0]],
                           [[-0.4, 0.9, 0.3], [0.7, 0.7, -2.0], [1.0, -1.0, 0.5]]], requires_grad=True)  # [2, 3, v]
    labels = torch.tensor([[2, 0, 1], [1, 1, 0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # 5 chosen tokens
    token_logps = torch.log_softmax(logits, dim=-1).gather(2, labels[..., None])[..., 0]
    loss, metrics = anchor_nll(token_logps, mask, alpha=0.5)
    # by hand: -log softmax at the five labelled positions
    picked = [(0, 0, 2), (0, 1, 0), (1, 0, 1), (1, 1, 1), (1, 2, 0)]
    nll = sum(-(logits[i, t, k] - torch.logsumexp(logits[i, t], 0)).item() for i, t, k in picked) / 5
    assert metrics["anchor_nll"].item() == pytest.approx(nll, rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * nll, rel=1e-6)
    # TRL: F.cross_entropy over the flattened chosen rows, ignoring the masked labels
    trl = F.cross_entropy(logits.reshape(-1, 3), torch.where(mask > 0, labels, -100).reshape(-1), ignore_index=-100)
    assert metrics["anchor_nll"].item() == pytest.approx(trl.item(), rel=1e-6)
    loss.backward()
    grad = logits.grad.clone()
    logits.grad = None
    (0.5 * trl).backward()
    torch.testing.assert_close(grad, logits.grad, atol=1e-7, rtol=1e-6)


def test_anchor_with_a_global_count_sums_over_micro_batches_to_the_batch_mean():
    from hpa.algorithms.dpo import anchor_nll

    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(4, 5, generator=g)
    mask = (torch.rand(4, 5, generator=g) > 0.3).float()
    whole, _ = anchor_nll(logps, mask, alpha=1.0)
    n = mask.sum()
    parts = sum(anchor_nll(logps[i:i + 2], mask[i:i + 2], alpha=1.0, num_global_tokens=n)[0] for i in (0, 2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    # an all-zero mask contributes 0, not NaN
    zero, _ = anchor_nll(logps, torch.zeros_like(mask), alpha=1.0)
    assert zero.item() == 0.0
    with pytest.raises(ValueError, match="num_global_tokens"):
        anchor_nll(logps, mask, alpha=1.0, dp_size=2)
