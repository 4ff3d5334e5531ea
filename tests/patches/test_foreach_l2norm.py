"""``megatron_patches.foreach_l2norm``: megatron's gradient norm without TE or apex stays on the device (its
fallback reads every tensor's norm on the host), with the fallback's value bit for bit on CPU."""

import torch

import megatron_patches
from hpa.distributed.device_mode import StrictDeviceMode, on_device
from hpa.distributed.sync_ops import SyncOps
from megatron_patches.foreach_l2norm import foreach_l2_norm

DEVICE = torch.device("lazy", 0)


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * scale
            for shape, scale in [((7, 5), 1.0), ((13,), 1e-3), ((3, 4, 2), 30.0), ((1,), 2.0)]]


def test_equals_megatrons_fallback_bit_for_bit():
    megatron_patches.apply_cpu_patches()  # the fallback builds its result on "cuda"
    from megatron.core.utils import local_multi_tensor_l2_norm

    flag = torch.zeros(1, dtype=torch.int)
    for seed in range(3):
        grads = _grads(seed)
        ref, _ = local_multi_tensor_l2_norm(2048 * 32, flag, [grads], False)
        out, none = foreach_l2_norm(2048 * 32, flag, [grads], False)
        assert none is None and out.dtype == torch.float32 and out.shape == (1,)
        assert torch.equal(out, ref), (out, ref)
    expected = torch.cat([g.reshape(-1) for g in _grads()]).double().norm()
    assert abs(float(foreach_l2_norm(0, flag, [_grads()], False)[0]) - float(expected)) < 1e-5 * float(expected)
    assert torch.equal(foreach_l2_norm(0, flag, [[]], False)[0], torch.zeros(1))


def test_the_clip_paths_norm_syncs_nothing_once_patched():
    megatron_patches.apply_cpu_patches()
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    flag = torch.zeros(1, dtype=torch.int)

    def syncs():
        with StrictDeviceMode(DEVICE):
            grads = [on_device(g) for g in _grads()]
            with SyncOps() as counted:
                clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, flag, [grads], False)
        return counted.count

    original = clip_grads.l2_norm_impl
    try:
        clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
        assert syncs() >= 1  # megatron's fallback: float() of the norm (and, on CUDA, a copy per tensor)
        megatron_patches.apply_optimizer_patches()
        assert clip_grads.l2_norm_impl is foreach_l2_norm
        assert syncs() == 0
    finally:
        clip_grads.l2_norm_impl = original


def test_a_fused_kernel_is_left_alone():
    from megatron.core.optimizer import clip_grads

    original = clip_grads.l2_norm_impl
    fused = object()  # TE's or apex's multi_tensor_l2norm
    try:
        clip_grads.l2_norm_impl = fused
        megatron_patches.apply_optimizer_patches()
        assert clip_grads.l2_norm_impl is fused
    finally:
        clip_grads.l2_norm_impl = original
