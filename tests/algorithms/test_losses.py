import pytest
import torch

from hpa.algorithms.losses import AGG_MODES, Aggregation, agg_loss
from hpa.algorithms.masked import masked_mean, masked_var, masked_whiten
from hpa.registry import UnknownNameError

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_modes_by_hand():
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert agg_loss(LOSS, MASK, "token-sum").item() == pytest.approx(7.0)
    # per-sequence sums 3, 4 (the empty third row does not count)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx(3.5)
    # per-sequence means 1.5, 4
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx(2.75)
    # seq-mean-token-sum (3.5, two non-empty rows) divided by the padded length 3 (verl 0.9.1)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(3.5 / 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(0.5)


def test_global_counts_and_dp_size():
    assert agg_loss(LOSS, MASK, "token-mean", num_global_tokens=14).item() == pytest.approx(0.5)
    assert agg_loss(LOSS, MASK, "token-mean", num_global_tokens=14, dp_size=2).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", num_global_seqs=7).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean", num_global_seqs=torch.tensor(11.0)).item() == pytest.approx(0.5)
    # token sum 7, times dp_size (DDP's average over 2 ranks then gives the global sum)
    assert agg_loss(LOSS, MASK, "token-sum", dp_size=2).item() == pytest.approx(14.0)
    # sums 3 + 4 over 7 global sequences, times dp_size 2, over loss_scale_factor 4
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", num_global_seqs=7, dp_size=2,
                    loss_scale_factor=4).item() == pytest.approx(0.5)


@pytest.mark.parametrize("mode,key", [("token-mean", "num_global_tokens"), ("seq-mean-token-sum", "num_global_seqs"),
                                      ("seq-mean-token-mean", "num_global_seqs"),
                                      ("seq-mean-token-sum-norm", "num_global_seqs")])
def test_dp_size_without_global_count_raises(mode, key):
    # a local count times dp_size is only right if every rank holds as many tokens/sequences
    with pytest.raises(ValueError, match=key):
        agg_loss(LOSS, MASK, mode, dp_size=2)
    assert torch.isfinite(agg_loss(LOSS, MASK, mode, dp_size=2, **{key: 5}))
    with pytest.raises(ValueError, match="num_global_seqs"):
        Aggregation(dp_size=2).seq_mean(torch.ones(3))


def test_nan_outside_mask_does_not_leak_and_empty_batch_is_zero():
    loss = LOSS.clone()
    loss[2, 2] = float("nan")
    assert torch.isfinite(agg_loss(loss, MASK, "token-mean"))
    assert agg_loss(LOSS, torch.zeros(3, 3), "token-mean").item() == 0.0
    assert agg_loss(LOSS, torch.zeros(3, 3), "seq-mean-token-mean").item() == 0.0


def test_unknown_mode_lists_valid_names():
    with pytest.raises(UnknownNameError, match="token-mean"):
        agg_loss(LOSS, MASK, "token_mean")
    with pytest.raises(UnknownNameError):
        Aggregation(mode="bogus")


def _split_invariance(mode, count_key):
    torch.manual_seed(0)
    b, r = 6, 5
    mask = (torch.rand(b, r) > 0.3).float()
    mask[2] = 0.0  # an empty sequence in the first micro-batch
    mask[:, 0] = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    weights = torch.randn(b, r)

    w_full = torch.randn(b, r, dtype=torch.float64).requires_grad_()
    full = agg_loss(w_full * weights, mask, mode)
    full.backward()

    w_mb = w_full.detach().clone().requires_grad_()
    counts = {"tokens": mask.sum(), "seqs": (mask.sum(-1) > 0).sum()}
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        kwargs = {}
        if count_key == "tokens":
            kwargs["num_global_tokens"] = counts["tokens"]
        elif count_key == "seqs":
            kwargs["num_global_seqs"] = counts["seqs"]
        part = agg_loss(w_mb[rows] * weights[rows], mask[rows], mode, **kwargs)
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(w_mb.grad, w_full.grad)


@pytest.mark.parametrize(
    "mode,count_key",
    [("token-mean", "tokens"), ("seq-mean-token-sum", "seqs"), ("seq-mean-token-mean", "seqs"),
     ("seq-mean-token-sum-norm", "seqs"), ("token-sum", "none")],
)
def test_micro_batches_with_global_count_equal_one_batch(mode, count_key):
    _split_invariance(mode, count_key)


def test_dp_ranks_average_to_one_batch():
    # Two DP ranks, DDP averages gradients: mean over ranks of (loss_k with dp_size=2) == full loss.
    torch.manual_seed(1)
    loss, mask = torch.randn(4, 3), (torch.rand(4, 3) > 0.4).float()
    mask[:, 0] = 1
    full = agg_loss(loss, mask, "token-mean")
    n = mask.sum()
    ranks = [agg_loss(loss[i : i + 2], mask[i : i + 2], "token-mean", num_global_tokens=n, dp_size=2) for i in (0, 2)]
    torch.testing.assert_close(sum(ranks) / 2, full)


def test_masked_stats_match_torch():
    torch.manual_seed(0)
    x, m = torch.randn(4, 6, dtype=torch.float64), torch.rand(4, 6) > 0.3
    valid = x[m]
    torch.testing.assert_close(masked_mean(x, m), valid.mean())
    torch.testing.assert_close(masked_var(x, m), valid.var())
    w = masked_whiten(x, m)
    torch.testing.assert_close(w[m].mean(), torch.tensor(0.0, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(w[m].std(), torch.tensor(1.0, dtype=torch.float64), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="only one element"):
        one = torch.zeros_like(m)
        one[0, 0] = True
        masked_whiten(x, one)


def test_registry_names():
    assert AGG_MODES.names() == (
        "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean", "token-sum"
    )
