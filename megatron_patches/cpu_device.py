"""Patch: inside megatron-core, the device "cuda" means the CPU.

What: every loaded ``megatron.core`` module gets a proxy in place of its global ``torch``. The proxy
  delegates everything to torch, except that (a) ``torch.cuda.current_device()`` returns ``"cpu"``,
  ``torch.cuda.synchronize`` / streams / events / NVTX ranges are no-ops, and (b) tensor factory
  functions (``zeros``, ``empty``, ``tensor``, ``ones``, ``full``, ``arange``, ``*_like``, ...) called
  with ``device="cuda"`` (or ``torch.device("cuda", i)``) allocate on the CPU instead.
Why: megatron-core allocates buffers with ``device=torch.cuda.current_device()`` or a literal
  ``"cuda"`` in its layers, embeddings (RoPE), attention masks, p2p communication, pipeline
  schedules, DDP buffers, GlobalMemoryBuffer, the optimizer and dist_checkpointing. On a machine
  without CUDA each of those raises. The patch is scoped to megatron's own modules: torch itself and
  user code see the real ``torch.cuda``.
Numerics: unchanged; only the allocation device differs.
Upstream: megatron-core 0.16.x (checked on 0.16.1).
Remove when: megatron-core gains a device-agnostic allocation path (tracked upstream as CPU/"device
  abstraction" support); hpa's own code never relies on this proxy.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

# megatron modules hpa uses; imported before the proxy is installed so that it reaches them all.
MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.serialization",
)

_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "linspace",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "eye", "triu", "tril",
)


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _on_cpu(fn):
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__wrapped__ = fn
    return wrapper


class _NullStream:
    def wait_stream(self, *_a, **_k):
        pass

    def wait_event(self, *_a, **_k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *_a, **_k):
        return _NullEvent()


class _NullEvent:
    def __init__(self, *_a, **_k):
        pass

    def record(self, *_a, **_k):
        pass

    def wait(self, *_a, **_k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as megatron sees it on a CPU-only machine."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.current_device = lambda: "cpu"
        self.synchronize = lambda *a, **k: None
        self.is_available = lambda: False
        self.device_count = lambda: 0
        self.current_stream = lambda *a, **k: _NullStream()
        self.default_stream = lambda *a, **k: _NullStream()
        self.Stream = lambda *a, **k: _NullStream()
        self.Event = _NullEvent
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.set_device = lambda *a, **k: None
        self.empty_cache = lambda: None
        self.memory_allocated = lambda *a, **k: 0
        self.max_memory_allocated = lambda *a, **k: 0
        self.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                          range=lambda *a, **k: contextlib.nullcontext())

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as megatron sees it on a CPU-only machine."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_PROXY = None


def apply() -> None:
    global _PROXY
    if _PROXY is not None:
        return
    _PROXY = _TorchOnCpu()
    for name in MODULES:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _PROXY
