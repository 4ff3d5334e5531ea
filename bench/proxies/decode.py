"""CPU proxy of the native engine's decode step: the kernels one captured step launches.

Usage::

    python bench/proxies/decode.py        # ~1-2 min on one CPU core (one inductor compilation); one JSON line

The step is ``hpa.rollout.kv_cache.StaticDecodeStep``, what the engine captures in a CUDA graph and replays per
token, on Qwen2-0.5B's structure (24 layers, 14 query heads / 2 KV heads, RoPE, SwiGLU, RMSNorm, QKV biases,
tied embeddings) at narrow widths (``bench/host_overhead.py``'s: the kernel count does not depend on them):

- ``decode.kernels_per_step``: the compiled step (as the engine compiles it before the capture, at the perf
  config's 256 rows): the kernels inductor's generated code launches (its fused kernels, extern calls such as
  the matmuls and the attention, and aten fallbacks), plus the aten kernel ops outside the compiled region,
  none: the step compiles to one graph (``decode.compiled_graphs`` 1, else this proxy fails).
- ``decode.eager_kernels_per_step`` and ``decode.rows64.eager_kernels_per_step``: the step uncompiled (the CPU
  default), at 256 and 64 rows: aten ops that launch a kernel (``bench/host_overhead.py``'s definition: all
  but views, ``detach``/``alias``/``lift_fresh`` and allocations without initialisation).

The count of a CUDA compilation differs a little (Triton's fusion choices are not the C++ backend's); the
eager count was ~1,070 before the mask and RoPE were built once a step (docs/gpu.md).
"""

from __future__ import annotations

import re

from _common import main, measure_in_child, qwen2_shaped_policy

LAYERS = 24
ROWS, SLOTS = 256, 384  # the perf config's rows; slots for 256 new tokens after short prompts
_NO_KERNEL = {"detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided", "_local_scalar_dense"}
# one launch per line of the generated ``call``: a C++ or Triton kernel, an extern kernel, an aten fallback
_LAUNCH = re.compile(r"^\s*(?:\w+\s*=\s*)?(cpp_fused_\w+|triton_\w+\.run|\w+\.run|extern_kernels\.\w+"
                     r"|torch\.ops\.\w+\.\w+(?:\.\w+)?|aten\.\w+(?:\.\w+)?)\(")


def launches(code: str) -> int:
    """Kernel launches in the ``call`` function of inductor's generated module ``code``."""
    body = code[code.index("def call("):]
    return sum(1 for line in body.splitlines() if _LAUNCH.match(line))


def _eager_kernel_ops(step) -> int:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
                self.count += 1
            return func(*args, **(kwargs or {}))

    step()  # warm
    with Counter() as counter:
        step()
    return counter.count


def _measure_here() -> dict:
    """The counts, in this process (plain CPU tensors: inductor does not trace hpa's test device mode)."""
    import torch
    from torch._inductor.utils import run_and_get_code

    from hpa.rollout.kv_cache import StaticDecodeStep

    with qwen2_shaped_policy(LAYERS, SLOTS) as model:
        model.eval()
        result = {}
        for rows, key in ((ROWS, "decode.eager_kernels_per_step"), (64, "decode.rows64.eager_kernels_per_step")):
            step = StaticDecodeStep(model, rows, SLOTS, capture=False)
            step.key_valid[:, :8] = True
            step.position.fill_(8)
            result[key] = _eager_kernel_ops(step)
        step = StaticDecodeStep(model, ROWS, SLOTS, capture=False, compile=True)
        step.key_valid[:, :8] = True
        step.position.fill_(8)
        torch._dynamo.reset()
        _, codes = run_and_get_code(step)
        if step.compiled is not True or len(codes) != 1:
            raise RuntimeError(f"the decode step did not compile to one graph ({len(codes)} graphs, "
                               f"compiled={step.compiled})")
        result["decode.kernels_per_step"] = launches(codes[0])
        result["decode.compiled_graphs"] = len(codes)
    return result


def measure() -> dict:
    """The counts, from a child process (``_common.measure_in_child``)."""
    return measure_in_child(__file__)


if __name__ == "__main__":
    main(measure, _measure_here)
