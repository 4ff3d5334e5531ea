"""Shared helper for the patches that get past megatron's CUDA tensor-type checks (not a patch)."""

from __future__ import annotations

import contextlib
import functools

import torch

_CPU_TO_CUDA = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def cpu_tensors_report_cuda_type():
    """Inside the block, ``cpu_tensor.type()`` (no arguments) answers with the CUDA type name.

    Only the no-argument query is changed; conversions (``t.type(dtype)``) behave as usual.
    """
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CPU_TO_CUDA.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def with_cuda_type_names(fn):
    """Wrap ``fn`` so that it runs under ``cpu_tensors_report_cuda_type``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cpu_tensors_report_cuda_type():
            return fn(*args, **kwargs)

    wrapper.__hpa_patched__ = True
    return wrapper
