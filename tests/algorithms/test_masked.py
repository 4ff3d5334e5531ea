
import numpy as np
import pytest
import torch

from hpa.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten, mean_pool

X = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
MASK = torch.tensor([[1, 1, 1, 0]])


def test_hand_computed():
    # masked: 1, 2, 3 -> sum 6, mean 2, squared deviations 1, 0, 1
    assert masked_sum(X, MASK).item() == 6.0
    assert masked_mean(X, MASK).item() == pytest.approx(2.0)
    assert masked_var(X, MASK, unbiased=False).item() == pytest.approx(2 / 3)
    assert masked_var(X, MASK).item() == pytest.approx(1.0)
    # the element outside the mask is transformed too, not zeroed (verl)
    torch.testing.assert_close(masked_whiten(X, MASK), torch.tensor([[-1.0, 0.0, 1.0, 98.0]]))
    torch.testing.assert_close(masked_whiten(X, MASK, shift_mean=False), torch.tensor([[1.0, 2.0, 3.0, 100.0]]))


def test_dim_and_empty_rows():
    x = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    torch.testing.assert_close(masked_sum(x, mask, dim=-1), torch.tensor([4.0, 0.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 0.0]))  # empty row: 0, not NaN
    torch.testing.assert_close(masked_mean(x, mask, dim=0), torch.tensor([1.0, 3.0]))
    assert masked_mean(x, torch.zeros_like(x)).item() == 0.0


def test_nan_outside_mask_does_not_leak():
    x = torch.tensor([1.0, float("nan"), float("inf"), 3.0])
    mask = torch.tensor([True, False, False, True])
    assert masked_sum(x, mask).item() == 4.0
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_var(x, mask).item() == pytest.approx(2.0)


def test_unbiased_var_refuses_fewer_than_two_elements():
    with pytest.raises(ValueError, match="empty"):
        masked_var(X, torch.zeros_like(MASK))
    with pytest.raises(ValueError, match="only one element"):
        masked_var(X, torch.tensor([[0, 1, 0, 0]]))
    assert masked_var(X, torch.tensor([[0, 1, 0, 0]]), unbiased=False).item() == 0.0


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64], ids=["bool", "float", "int"])
def test_against_numpy_reference(mask_dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    keep = torch.rand(6, 9, generator=gen) < 0.6
    mask = keep.to(mask_dtype)
    picked = x.numpy()[keep.numpy()]
    assert masked_sum(x, mask).item() == pytest.approx(picked.sum())
    assert masked_mean(x, mask).item() == pytest.approx(picked.mean())
    assert masked_var(x, mask).item() == pytest.approx(picked.var(ddof=1))
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(picked.var(ddof=0))
    rows = [x.numpy()[i][keep.numpy()[i]] for i in range(6)]
    np.testing.assert_allclose(masked_mean(x, mask, dim=1).numpy(),
                               [r.mean() if len(r) else 0.0 for r in rows], rtol=1e-7)
    expected = (x.numpy() - picked.mean()) / np.sqrt(picked.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(masked_whiten(x, mask).numpy(), expected, rtol=1e-7)
    np.testing.assert_allclose(masked_whiten(x, mask, shift_mean=False).numpy(), expected + picked.mean(), rtol=1e-7)
    whitened = masked_whiten(x, mask)
    assert masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-9)
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, abs=1e-6)


def test_mean_pool():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [float("nan"), 9.0]],
                           [[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    pooled = mean_pool(hidden, mask)
    torch.testing.assert_close(pooled, torch.tensor([[2.0, 3.0], [0.0, 0.0]]))  # empty row: zeros, not NaN
    pooled.sum().backward()
    expected_grad = torch.tensor([[[0.5, 0.5], [0.5, 0.5], [0.0, 0.0]], [[0.0, 0.0]] * 3])
    torch.testing.assert_close(hidden.grad, expected_grad)


def test_mean_pool_against_loop_reference():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 7, 5, generator=gen)
    mask = torch.rand(4, 7, generator=gen) < 0.5
    mask[0] = False
    expected = torch.stack([hidden[i][mask[i]].mean(0) if mask[i].any() else torch.zeros(5) for i in range(4)])
    torch.testing.assert_close(mean_pool(hidden, mask), expected)
    with pytest.raises(ValueError, match=r"hidden \[b, s, h\]"):
        mean_pool(hidden[0], mask[0])
