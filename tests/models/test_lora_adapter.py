"""The adapter alone, in process (no process groups: a one-rank stand-in group): its math against a hand-written
reference, dropout on its input only, and A drawn in full then sharded (so every TP layout draws the same A)."""

from types import SimpleNamespace

import pytest
import torch

from hpa.models.lora import LoRAAdapter


class OneRankGroup:
    """What megatron's mappings ask of a TP group of size 1 (they return the input untouched)."""

    def size(self):
        return 1

    def rank(self):
        return 0


def base(out_features, in_features, tp=1):
    return SimpleNamespace(weight=torch.zeros(out_features // tp, in_features), input_size=in_features,
                           output_size=out_features, output_size_per_partition=out_features // tp,
                           input_size_per_partition=in_features // tp, tp_group=OneRankGroup(),
                           sequence_parallel=False)


def adapter(mode, *, tp=1, tp_rank=0, dropout=0.0, seed=3, out_features=6, in_features=8):
    return LoRAAdapter(base(out_features, in_features, tp), parallel_mode=mode, rank=2, scaling=1.5,
                       dropout=dropout, groups=SimpleNamespace(tensor_model_parallel_size=tp, tp_rank=tp_rank),
                       generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["column", "row"])
def test_adapter_computes_scaled_b_a_x(mode):
    a = adapter(mode)
    assert torch.equal(a.B, torch.zeros(6, 2)) and a.A.shape == (2, 8)
    assert a.A.abs().max() <= 1 / 8 ** 0.5  # PEFT's kaiming-uniform bound 1/sqrt(in)
    with torch.no_grad():
        a.B.normal_()
    x = torch.randn(5, 3, 8)  # [s, b, in]
    expected = 1.5 * torch.einsum("or,ri,sbi->sbo", a.B, a.A, x)
    torch.testing.assert_close(a(x), expected)
    torch.testing.assert_close(a.delta_weight(), 1.5 * a.B @ a.A)


def test_split_parameters_carry_megatron_tp_attributes():
    """megatron's grad norm counts a parameter on every TP rank only when it is marked tensor-parallel."""
    column, row = adapter("column", tp=2), adapter("row", tp=2)
    assert column.B.tensor_model_parallel and column.B.partition_dim == 0
    assert not getattr(column.A, "tensor_model_parallel", False)
    assert row.A.tensor_model_parallel and row.A.partition_dim == 1
    assert not getattr(row.B, "tensor_model_parallel", False)


def test_a_is_drawn_in_full_then_sharded():
    full = adapter("row").A
    halves = [adapter("row", tp=2, tp_rank=r).A for r in (0, 1)]
    assert [h.shape for h in halves] == [(2, 4), (2, 4)]
    assert torch.equal(torch.cat(halves, dim=1), full)
    assert torch.equal(adapter("column", tp=2, tp_rank=1).A, adapter("column").A)  # replicated in full
    assert not torch.equal(adapter("row", seed=4).A, full)


def test_dropout_acts_on_the_adapter_input_in_training_only():
    a = adapter("column", dropout=0.5)
    with torch.no_grad():
        a.B.normal_()
    x = torch.randn(5, 3, 8)
    a.eval()
    torch.testing.assert_close(a(x), 1.5 * torch.einsum("or,ri,sbi->sbo", a.B, a.A, x))
    a.train()
    torch.manual_seed(0)
    got = a(x)
    torch.manual_seed(0)
    mask_x = torch.nn.functional.dropout(x, 0.5, training=True)
    torch.testing.assert_close(got, 1.5 * torch.einsum("or,ri,sbi->sbo", a.B, a.A, mask_x))
    assert not torch.allclose(got, a.eval()(x))
