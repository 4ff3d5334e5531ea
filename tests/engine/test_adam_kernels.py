"""``hpa.engine.optimizer.use_multi_tensor_adam``: torch's Adam under megatron (no TE or apex) steps all of a
group's tensors at once, foreach off CUDA, fused on CUDA, with each ``step`` state where its kernel reads it
(also after a checkpoint load brought back another choice); other optimizers are left alone. The fused kernel
on CUDA: ``tests/gpu/test_fused_adam.py``."""

import types

import torch

import adam_steps
from hpa.engine.optimizer import use_multi_tensor_adam


def test_foreach_off_cuda_and_other_optimizers_left_alone():
    params = adam_steps.parameters("cpu")
    opt = adam_steps.wrapped(params)
    use_multi_tensor_adam(opt)
    assert [(g["foreach"], g["fused"]) for g in opt.optimizer.param_groups] == [(True, False)] * 2
    chained = types.SimpleNamespace(chained_optimizers=[opt, types.SimpleNamespace(optimizer=object())])
    use_multi_tensor_adam(chained, fused=True)  # the second part (TE's or apex's optimizer) is not torch's Adam
    assert [(g["foreach"], g["fused"]) for g in opt.optimizer.param_groups] == [(False, True)] * 2


def test_a_load_that_brings_back_another_kernel_is_undone():
    params = adam_steps.parameters("cpu")
    opt = adam_steps.wrapped(params, foreach=False)
    adam_steps.step(opt, params, 1)
    saved = opt.optimizer.state_dict()
    fresh_params = adam_steps.parameters("cpu")
    fresh = adam_steps.wrapped(fresh_params)
    use_multi_tensor_adam(fresh)
    fresh.optimizer.load_state_dict(saved)  # the saved groups' foreach=False comes back
    assert [g["foreach"] for g in fresh.optimizer.param_groups] == [False, False]
    use_multi_tensor_adam(fresh)
    assert [g["foreach"] for g in fresh.optimizer.param_groups] == [True, True]
    steps = [fresh.optimizer.state[p]["step"] for p in fresh_params]
    assert all(s.device.type == "cpu" and s.dtype == torch.float32 and float(s) == 1.0 for s in steps)
