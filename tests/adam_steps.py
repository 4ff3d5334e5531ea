"""The set-up of the ``use_multi_tensor_adam`` tests (``tests/engine/test_adam_kernels.py`` on the CPU,
``tests/gpu/test_fused_adam.py`` on CUDA): three parameters, a megatron-shaped optimizer over them, seeded steps."""

import types

import torch


def wrapped(params, **kw):
    """A megatron optimizer's shape: the torch optimizer as ``.optimizer`` (two groups, as weight decay makes)."""
    inner = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2, **kw)
    return types.SimpleNamespace(optimizer=inner)


def parameters(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(device)) for shape in [(5, 3), (7,), (2, 2)]]


def step(opt, params, seed):
    """Gradients drawn from ``seed``, then one optimizer step."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device)
    opt.optimizer.step()
