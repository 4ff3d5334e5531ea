"""``megatron_patches.foreach_scale`` and ``hpa.engine.optimizer.use_multi_tensor_adam``: the optimizer step's
clipping, main -> model copy and Adam as multi-tensor operations, bit for bit megatron's own path on CPU."""

import pytest
import torch

import megatron_patches
from megatron_patches.foreach_scale import foreach_scale
from multirank import run_ranks


def _tensors(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * scale).to(dtype)
            for shape, scale in [((7, 5), 1.0), ((13,), 1e-3), ((3, 4, 2), 30.0), ((1,), 2.0)]]


def test_equals_megatrons_local_scale_bit_for_bit():
    from megatron.core.utils import local_multi_tensor_scale

    flag = torch.zeros(1, dtype=torch.int)
    for scale in (0.37, 1.0, 1e-7):
        ref, out = _tensors(0), _tensors(0)
        local_multi_tensor_scale(0, flag, [ref, ref], scale)  # in place: the clip
        foreach_scale(0, flag, [out, out], scale)
        assert all(torch.equal(a, b) for a, b in zip(ref, out))
        for dtype in (torch.bfloat16, torch.float16, torch.float32):  # main -> model copies
            src = _tensors(1)
            ref, out = _tensors(2, dtype), _tensors(2, dtype)
            local_multi_tensor_scale(0, flag, [src, ref], scale)
            foreach_scale(0, flag, [src, out], scale)
            assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(ref, out)), (scale, dtype)
    foreach_scale(0, flag, [[], []], 0.5)  # nothing to scale


def test_a_fused_kernel_is_left_alone():
    from megatron.core.optimizer import clip_grads

    originals = clip_grads.multi_tensor_scale_impl, clip_grads.clip_grad_by_total_norm_fp32
    fused = object()  # TE's or apex's multi_tensor_scale
    try:
        clip_grads.multi_tensor_scale_impl = fused
        megatron_patches.apply_optimizer_patches()
        assert clip_grads.multi_tensor_scale_impl is fused
        assert clip_grads.clip_grad_by_total_norm_fp32 is originals[1]
    finally:
        clip_grads.multi_tensor_scale_impl, clip_grads.clip_grad_by_total_norm_fp32 = originals


def _steps_worker(groups, dtype_name, patched):
    """Weights after 4 steps (clipping active) of megatron's optimizer, built by hpa (``patched``) or as megatron
    builds it without TE or apex (no optimizer patches, torch's default Adam)."""
    import dataclasses
    from unittest import mock

    from hpa.config import load_config
    from hpa.engine.optimizer import build_optimizer, wrap_ddp
    from hpa.engine.step import guarded_optimizer_step, optimizer_step, zero_grad
    from hpa.models import build_policy

    cfg = load_config(None, ["model.num_layers=2", "optim.lr=1e-2", "optim.weight_decay=0.1", "optim.clip_grad=0.5"])
    parallel = dataclasses.replace(cfg.parallel, backend="gloo")
    torch.manual_seed(0)
    model = build_policy(cfg.model, parallel, groups)
    if dtype_name == "bfloat16":  # hpa builds bf16 on GPUs only; the optimizer is the GPU's
        model = model.bfloat16()
        model.config.bf16, model.config.params_dtype = True, torch.bfloat16
    ddp = wrap_ddp(model, parallel, groups)
    if patched:
        opt = build_optimizer(ddp, cfg.optim, parallel, groups)
    else:
        with mock.patch("megatron_patches.apply_optimizer_patches", lambda: ()), \
                mock.patch("hpa.engine.optimizer.use_multi_tensor_adam", lambda optimizer: None):
            opt = build_optimizer(ddp, cfg.optim, parallel, groups)
    from megatron.core.optimizer import clip_grads

    kernels = (clip_grads.multi_tensor_scale_impl.__name__,
               sorted({(g["foreach"], g["fused"]) for g in opt.optimizer.param_groups}, key=str))
    g = torch.Generator().manual_seed(1)
    norms = []
    for step in range(4):
        zero_grad(ddp, opt)
        for p in ddp.parameters():
            p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=g) * 3.0)
        if step % 2:
            _, norm = optimizer_step(opt)
        else:
            _, norm = guarded_optimizer_step(opt, None, lambda n: "step", lambda: 1.0)
        norms.append(norm)
    main = [p.detach().clone() for group in opt.optimizer.param_groups for p in group["params"]]
    return [p.detach().clone() for p in ddp.parameters()], main, norms, kernels


@pytest.mark.multirank
def test_steps_are_bit_identical_to_megatrons_path():
    for dtype_name in ("float32", "bfloat16"):
        [(ref, ref_main, ref_norms, ref_kernels)] = run_ranks(_steps_worker, args=(dtype_name, False))
        [(out, out_main, out_norms, kernels)] = run_ranks(_steps_worker, args=(dtype_name, True))
        assert ref_kernels == ("local_multi_tensor_scale", [(None, None)])  # megatron's fallback, torch's default
        assert kernels == ("foreach_scale", [(True, False)])
        assert min(ref_norms) > 0.5  # the clip scaled every step
        assert ref_norms == out_norms
        assert {p.dtype for p in out} == {getattr(torch, dtype_name)}
        assert all(torch.equal(a, b) for a, b in zip(ref, out)), dtype_name
        assert all(torch.equal(a, b) for a, b in zip(ref_main, out_main)), dtype_name
        start = run_ranks(_initial_worker)[0]
        assert not all(torch.equal(a.to(b.dtype), b) for a, b in zip(start, out))  # the steps moved the weights


def _initial_worker(groups):
    import dataclasses

    from hpa.config import load_config
    from hpa.models import build_policy

    cfg = load_config(None, ["model.num_layers=2"])
    torch.manual_seed(0)
    return [p.detach().clone() for p in build_policy(cfg.model, dataclasses.replace(cfg.parallel, backend="gloo"),
                                                      groups).parameters()]
