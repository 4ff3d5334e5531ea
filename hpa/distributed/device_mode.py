"""A test mode in which the models live, as far as hpa's code can tell, on a second device.

With ``HPA_TEST_MODEL_DEVICE=lazy`` (the test suite sets it for the runs that check device placement),
``hpa.distributed.initialize`` reports ``lazy:0`` as the models' device (``ParallelGroups.device``) and
enters ``StrictDeviceMode``. The lazy device is only a name here: a tensor "on" it is a CPU tensor of the
class ``DeviceTensor`` that answers ``lazy:0`` to ``.device``. The mode gives such tensors CUDA's rules:

* ``.to(groups.device)`` and factories with ``device=groups.device`` make device tensors; ``.cpu()`` and
  ``.to("cpu")`` make host tensors again;
* an op that mixes a device tensor with a host tensor of one or more dimensions raises, as torch does for
  CUDA and CPU tensors (0-dim host tensors mix, as CPU scalars do with CUDA tensors);
* ``.numpy()`` of a device tensor raises.

Each GPTModel refuses input tensors that are not on the device and returns its outputs (logits, values,
the final hidden states) on it (``hpa/models/device_boundary.py``). Inside, the model computes on the CPU with plain tensors, so
a batch that never reaches "the GPU", or a result that meets a host tensor without being brought back,
fails on a CPU machine with numerics unchanged. (torch's real lazy device was tried first: its
TorchScript backend computes some scalar divisions' gradients in the wrong dtype, and has no generators.)

Limits: one pipeline stage; backward passes are not checked (autograd makes host gradients); the native
rollout engine computes on the parameters' device (the CPU here); code that reads a parameter's device sees
the CPU.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map


class DeviceTensor(torch.Tensor):
    """A CPU tensor that stands for a tensor on the test device (see the module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


def _raw(fn, *args, **kwargs):
    with torch._C.DisableTorchFunction():
        return fn(*args, **kwargs)


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if type(tensor) is DeviceTensor else _raw(torch.Tensor.as_subclass, tensor, DeviceTensor)


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    return _raw(torch.Tensor.as_subclass, tensor, torch.Tensor) if type(tensor) is DeviceTensor else tensor


def is_device_tensor(value) -> bool:
    return type(value) is DeviceTensor


def _is_host(value) -> bool:
    return isinstance(value, torch.Tensor) and type(value) is not DeviceTensor and value.dim() > 0


def _any_device(values) -> bool:
    for v in values:
        if type(v) is DeviceTensor:
            return True
        if isinstance(v, (list, tuple)) and any(type(x) is DeviceTensor for x in v):
            return True
    return False


def _wrap(out):
    return tree_map(lambda t: on_device(t) if isinstance(t, torch.Tensor) else t, out)


_DEVICE_GETTER = torch.Tensor.device.__get__  # a new method-wrapper on every access: compared with ==
_UNCHECKED = {torch.Tensor.copy_, torch.Tensor.__getitem__}  # cross-device copies and host indices are allowed


class StrictDeviceMode(TorchFunctionMode):
    """CUDA's device rules for ``DeviceTensor`` (see the module docstring)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def _target(self, device) -> str:
        """"device", "host" or "" (no device given)."""
        if device is None:
            return ""
        return "device" if torch.device(device) == self.device else "host"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GETTER:
            return self.device if is_device_tensor(args[0]) else func(*args)
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            return self._to(func, args, kwargs)
        if func is torch.Tensor.numpy and is_device_tensor(args[0]):
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() "
                            f"to copy the tensor to host memory first.")
        target = self._target(kwargs.get("device"))
        if target == "device":  # a factory on the device
            return _wrap(func(*args, **dict(kwargs, device="cpu")))
        if target == "host":  # a factory on the host (``zeros_like(device_tensor, device="cpu")`` too)
            return tree_map(lambda t: on_host(t) if isinstance(t, torch.Tensor) else t, func(*args, **kwargs))
        if not _any_device(args) and not _any_device(kwargs.values()):
            return func(*args, **kwargs)  # the fast path: every op inside the models
        if torch._C._current_graph_task_id() != -1:
            return func(*args, **kwargs)  # inside a backward pass: autograd's gradients are host tensors
        values, _ = tree_flatten((args, kwargs))
        if func not in _UNCHECKED and any(_is_host(v) for v in values):  # before an in-place op writes
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{self.device} and cpu! ({getattr(func, '__name__', func)})")
        return _wrap(func(*args, **kwargs))

    def _to(self, func, args, kwargs):
        tensor = args[0]
        if func is torch.Tensor.cpu:
            return on_host(func(*args, **kwargs))
        if func is torch.Tensor.cuda:
            raise RuntimeError("a .cuda() call in the test device mode: move tensors to groups.device")
        if len(args) > 1 and isinstance(args[1], torch.Tensor):  # .to(other): other's device as the mode reports it
            other = args[1]
            device, dtype = (self.device if is_device_tensor(other) else other.device), other.dtype
            non_blocking = kwargs.get("non_blocking", False)
        else:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        target = self._target(device)
        if target == "":
            out = func(*args, **kwargs)
            return on_device(out) if is_device_tensor(tensor) else out
        out = _raw(torch.Tensor.to, on_host(tensor), device="cpu",
                   **({"dtype": dtype} if dtype is not None else {}), non_blocking=non_blocking)
        return on_device(out) if target == "device" else on_host(out)


_entered = None


def enter(device: torch.device) -> torch.device:
    """Enter ``StrictDeviceMode(device)`` for the rest of the process (once); returns ``device``."""
    global _entered
    if _entered is None:
        _entered = StrictDeviceMode(device)
        _entered.__enter__()
    return _entered.device


# reads of a tensor's values on the host: each waits for the device (a host-device sync on CUDA)
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}
_model_depth = 0  # > 0 inside a model's forward in the test device mode (``device_boundary``)


def enter_model() -> None:
    global _model_depth
    _model_depth += 1


def leave_model() -> None:
    global _model_depth
    _model_depth = max(0, _model_depth - 1)


# megatron's RNG tracker compares the CPU generator's state with itself: host tensors, no device involved
_HOST_CHECKS = ("megatron/core/tensor_parallel/random.py",)


def _host_check() -> bool:
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code.co_filename.replace("\\", "/").endswith(_HOST_CHECKS):
            return True
        frame = frame.f_back
    return False


class SyncCounter(TorchFunctionMode):
    """Counts host-device syncs: reads of device values (``.item()``, ``.tolist()``, tensor ``bool``/``int``/
    ``float``, ``.numpy()``, device-to-host copies) in the test device mode.

    A device value is a ``DeviceTensor``, or any tensor inside a model's forward (the model computes on the
    CPU behind its edges, where every tensor stands for one on the device). Backward passes are not seen
    (autograd runs outside the model's forward hooks). ``count`` holds the total, ``by_op`` the counts by name.
    """

    def __init__(self):
        super().__init__()
        self.count = 0
        self.by_op = {}

    def _device_value(self, value) -> bool:
        return isinstance(value, torch.Tensor) and (is_device_tensor(value) or _model_depth > 0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and self._device_value(args[0]):
            read = func in _READS
            if func is torch.Tensor.to:
                device = args[1] if len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)) \
                    else kwargs.get("device")
                read = device is not None and torch.device(device).type == "cpu" and is_device_tensor(args[0])
            if read and not _host_check():
                self.count += 1
                name = getattr(func, "__name__", str(func))
                self.by_op[name] = self.by_op.get(name, 0) + 1
        return func(*args, **kwargs)
