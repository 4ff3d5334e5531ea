"""A CPU detector of the operations that make the host wait for a CUDA device, forward and backward.

``SyncCounter`` (``device_mode.py``) counts the host's reads of device values in hpa's code and the models'
forwards. CUDA also blocks the host inside operations whose result size or validity depends on device values,
and on copies from pageable host memory. ``SyncOps`` sees those too, in the test device mode
(``HPA_TEST_MODEL_DEVICE=lazy``) or on a real device, through two modes entered together:

* a ``TorchDispatchMode`` (every aten operation, the backward pass's included) counts, on device values:
  ``_local_scalar_dense`` (``.item()``, ``bool``/``int``/``float`` of a tensor), ``nonzero``/``argwhere``,
  ``masked_select``, indexing or ``index_put`` with a boolean mask (a ``nonzero``), ``index_put`` with
  ``accumulate=True`` (CUDA reads each index tensor's min and max to check the range), ``unique*``,
  ``repeat_interleave`` without ``output_size``, ``bincount``, ``equal``;
* a ``TorchFunctionMode`` counts what never reaches aten on a CPU stand-in: ``.tolist()``/``.numpy()``/``.cpu()``
  of device values, host-to-device copies that block (``non_blocking`` off, or a non-contiguous source, which
  CUDA stages through pageable memory), tensors built on the device from host data (``torch.tensor(list,
  device=...)``), and ``torch.unravel_index`` of device indices (it builds such a tensor of the shape).

Autograd calls Python backward functions without torch-function modes, so in a backward pass only the
dispatch side sees: there ``lift_fresh`` (a tensor built from host data, which a backward builds only to use on
the device) counts as a blocking copy to the device.

A value is on the device when it is a ``DeviceTensor`` or a CUDA tensor, or anything computed inside a model's
forward (test device mode) or in a backward pass, or inside a call that was handed a device value.

Autograd's own derivative formulas take a different branch under any dispatch mode (``index``'s backward calls
the range-checked ``index_put(accumulate=True)`` where CUDA without a mode calls the unchecked
``_index_put_impl_``): ``index_put`` issued by autograd's engine itself is not counted.

``count`` is the total, ``by_op`` the counts by operation, ``by_site`` by ``file:line op`` (the innermost frame
outside torch; ``autograd`` for an op of a derivative formula).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import device_mode

__all__ = ["SyncOps"]

_SCALAR_READS = {"_local_scalar_dense", "nonzero", "argwhere", "masked_select", "unique_consecutive",
                 "_unique", "_unique2", "unique_dim", "bincount", "equal", "nonzero_numpy"}
_INDEX = {"index", "_unsafe_index"}
_INDEX_PUT = {"index_put", "index_put_", "_index_put_impl_"}
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
_FROM_HOST_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_SKIP = ("/torch/", "/hpa/distributed/sync_ops.py", "/hpa/distributed/device_mode.py")
_MODE_HANDLERS = ("__torch_dispatch__", "__torch_function__")  # other modes (op counters) around the op
_state = threading.local()


def _in_device_call() -> bool:
    return getattr(_state, "device_call", 0) > 0


def _device_context() -> bool:
    """Inside a model's forward (test device mode) or a backward pass: every tensor stands for a device one."""
    return device_mode._model_depth > 0 or torch._C._current_graph_task_id() != -1


def _is_device(value) -> bool:
    return isinstance(value, torch.Tensor) and (device_mode.is_device_tensor(value) or value.is_cuda)


def _any_device(values) -> bool:
    for v in values:
        if _is_device(v) or (isinstance(v, (list, tuple)) and any(_is_device(x) for x in v)):
            return True
    return False


def _device_items(data) -> int:
    """How many device tensors a (nested) list or tuple holds: ``torch.tensor`` copies each to the host."""
    if isinstance(data, (list, tuple)):
        return sum(_device_items(x) for x in data)
    return int(_is_device(data))


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _site() -> str:
    """``file:line`` of the innermost frame outside torch and this module; ``autograd`` when the op came from
    the autograd engine's own derivative formulas."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if name.endswith("torch/autograd/graph.py"):
            return "autograd"
        if not any(part in name for part in _SKIP) and frame.f_code.co_name not in _MODE_HANDLERS:
            for root in ("/site-packages/", "/hpa/", "/bench/", "/tests/", "/megatron_patches/"):
                if root in name:
                    name = name[name.index(root) + (len("/site-packages/") if root == "/site-packages/" else 1):]
                    break
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class _DispatchSide(TorchDispatchMode):
    def __init__(self, owner: "SyncOps"):
        super().__init__()
        self.owner = owner

    def _syncs(self, name: str, args, kwargs) -> bool:
        if name in _SCALAR_READS:
            return True
        if name in _INDEX:
            return _bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))
        if name in _INDEX_PUT:
            indices = args[1] if len(args) > 1 else kwargs.get("indices")
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            return _bool_index(indices) or bool(accumulate)
        if name == "lift_fresh":  # torch.tensor(host data) in a backward pass, where every tensor is on the device
            return torch._C._current_graph_task_id() != -1
        if name == "repeat_interleave":
            return len(args) < 2 and kwargs.get("output_size") is None and not isinstance(args[0], int)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if self._syncs(name, args, kwargs):
            on_device = (_in_device_call() or _device_context() or _any_device(args)
                         or _any_device(kwargs.values()))
            if on_device:
                site = _site()
                if not (site == "autograd" and name in _INDEX_PUT and not _bool_index(args[1])):
                    self.owner._record("tensor from host data" if name == "lift_fresh" else name, site)
        return func(*args, **kwargs)


class _FunctionSide(TorchFunctionMode):
    def __init__(self, owner: "SyncOps"):
        super().__init__()
        self.owner = owner

    def _check(self, func, args, kwargs, device_args: bool) -> None:
        if func in _HOST_READS and (_is_device(args[0]) or _device_context()):
            self.owner._record(func.__name__, _site())
        elif func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor):
            if len(args) > 1 and isinstance(args[1], torch.Tensor):
                to_device, non_blocking = _is_device(args[1]), kwargs.get("non_blocking", False)
            else:
                device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
                if device is None:
                    return
                to_device = device.type != "cpu"
            if not to_device and _is_device(args[0]):
                self.owner._record("to(cpu)", _site())
            elif to_device and not _is_device(args[0]) and not (non_blocking and args[0].is_contiguous()):
                self.owner._record("blocking host-to-device copy", _site())
        elif func is torch.Tensor.copy_ and _is_device(args[0]) and not _is_device(args[1]):
            if not ((args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) and args[1].is_contiguous()):
                self.owner._record("blocking host-to-device copy", _site())
        elif func in _FROM_HOST_DATA and args and isinstance(args[0], (list, tuple)) \
                and (reads := _device_items(args[0])):
            for _ in range(reads):  # one device-to-host read per tensor in the list
                self.owner._record(f"{func.__name__}(list of device tensors)", _site())
        elif func in _FROM_HOST_DATA and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type != "cpu" and not _is_device(args[0] if args else None):
            self.owner._record(f"{func.__name__}(host data, device=...)", _site())
        elif func is torch.unravel_index and device_args:
            self.owner._record("unravel_index", _site())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == device_mode._DEVICE_GETTER:
            return func(*args, **kwargs)
        device_args = _device_context() or _any_device(args) or _any_device(kwargs.values())
        self._check(func, args, kwargs, device_args)
        if not device_args:
            return func(*args, **kwargs)
        _state.device_call = getattr(_state, "device_call", 0) + 1
        try:
            return func(*args, **kwargs)
        finally:
            _state.device_call -= 1


class SyncOps:
    """Counts the operations that synchronise the host with a CUDA device (module docstring)::

        with SyncOps() as syncs:
            loss = forward(batch); loss.backward()
        assert syncs.count == 0, syncs.by_site
    """

    def __init__(self):
        self.count = 0
        self.by_op: Counter = Counter()
        self.by_site: Counter = Counter()
        self._modes = (_FunctionSide(self), _DispatchSide(self))

    def _record(self, op: str, site: str) -> None:
        self.count += 1
        self.by_op[op] += 1
        self.by_site[f"{site} {op}"] += 1

    def __enter__(self) -> "SyncOps":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False
