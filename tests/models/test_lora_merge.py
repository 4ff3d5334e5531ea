"""The merge of an adapter into a bf16 weight (the vLLM sync and the merged export, ``convert._local_weight``):
``W + scaling · B A`` computed in fp32 and rounded once to bf16, against an independent fp32 reference; the
earlier bf16 arithmetic (``B A`` rounded, scaled and rounded, then added and rounded) differed from it on a
share of the weights. What one rounding of the merged weight still loses is measured, not asserted away."""

import types

import torch

from hpa.models.convert import _local_weight


def _adapter(a, b, scaling):
    return types.SimpleNamespace(A=a, B=b, scaling=scaling, enabled=True,
                                 delta_weight=lambda: (b @ a) * scaling)  # the adapter's own bf16 product


def test_a_bf16_merge_rounds_once():
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 256, generator=gen) * 0.02).to(torch.bfloat16)
    for step in (1e-5, 1e-4, 1e-3):  # B's size after that many lr-sized updates
        a = (torch.randn(8, 256, generator=gen) / 16).to(torch.bfloat16)
        b = (torch.randn(256, 8, generator=gen) * step).to(torch.bfloat16)
        delta = (b.float() @ a.float()) * 2.0  # fp32
        merged = _local_weight({"w": weight}, {"w": _adapter(a, b, 2.0)}, "w")
        assert merged.dtype == torch.bfloat16
        assert torch.equal(merged, (weight.float() + delta).to(torch.bfloat16)), step
        twice = weight + ((b @ a) * 2.0).to(torch.bfloat16)  # the bf16 arithmetic this replaced
        assert (twice != merged).any(), step
    # the one rounding left: a 1e-5-sized update mostly vanishes into W's bf16 grid (vLLM holds bf16 weights)
    lost = ((merged.float() - weight.float()) - delta).norm() / delta.norm()
    assert 0 < lost < 0.5  # at 1e-3 most of the update survives


def test_an_fp32_merge_is_unchanged():
    gen = torch.Generator().manual_seed(1)
    weight, a, b = torch.randn(16, 8, generator=gen), torch.randn(4, 8, generator=gen), torch.randn(16, 4, generator=gen)
    merged = _local_weight({"w": weight}, {"w": _adapter(a, b, 0.5)}, "w")
    torch.testing.assert_close(merged, weight + 0.5 * b @ a, rtol=0, atol=1e-6)
    assert torch.equal(_local_weight({"w": weight}, {}, "w"), weight)  # no adapter: the weight itself
