"""Patches of megatron-core, applied once and explicitly: CPU/gloo support (``apply_cpu_patches``, by
``hpa.distributed.init`` when CUDA is not in use), the local layer spec's packed-sequence RoPE
(``apply_model_patches``, by ``hpa.models.specs`` on every device) and the optimizer's multi-tensor fallbacks
where TE and apex are absent (a sync-free gradient norm, one-operation clipping and main -> model copies:
``apply_optimizer_patches``, by ``hpa.engine.optimizer`` on every device).

Each patch lives in its own module and says what it changes, why, the upstream version it targets
and when it can be removed. Nothing is patched on import. None of the patches changes numerics.
"""

from __future__ import annotations

import importlib
from typing import Tuple

SUPPORTED_MEGATRON_CORE = ("0.16.",)

# Order matters: cpu_device proxies the module-level ``torch`` of every megatron module loaded by
# then, so the patches that replace functions come after it and see the proxied modules.
PATCHES: Tuple[str, ...] = (
    "cpu_device",
    "rng_tracker",
    "clip_grads",
    "distrib_optimizer",
    "tied_embeddings",
    "sequence_parallel_norm",
)

# the local layer spec's, on every device: packed RoPE, the row-parallel linears' own TP group (no warning per
# call), the column-parallel ones' collectives inside compiled layers (``hpa.models.compiled_layers``)
MODEL_PATCHES: Tuple[str, ...] = ("packed_rope", "row_parallel_group", "column_parallel_comm")

# the optimizer's, on every device (``hpa.engine.optimizer.build_optimizer``)
OPTIMIZER_PATCHES: Tuple[str, ...] = ("foreach_l2norm", "foreach_scale")

_applied: Tuple[str, ...] = ()


class UnsupportedMegatronVersion(RuntimeError):
    pass


def check_megatron_version() -> str:
    """Return the installed megatron-core version, or raise when the patches do not target it."""
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if not any(version.startswith(prefix) for prefix in SUPPORTED_MEGATRON_CORE):
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is not supported by hpa's CPU patches (supported: "
            f"{', '.join(p + 'x' for p in SUPPORTED_MEGATRON_CORE)}). Install the pinned version: "
            f"pip install 'megatron-core>=0.16,<0.17'."
        )
    return version


def apply_cpu_patches() -> Tuple[str, ...]:
    """Apply every patch once; returns the names applied. Idempotent."""
    global _applied
    if _applied:
        return _applied
    check_megatron_version()
    for name in PATCHES:
        importlib.import_module(f"{__name__}.{name}").apply()
    _applied = PATCHES
    return _applied


def apply_model_patches() -> Tuple[str, ...]:
    """Apply ``MODEL_PATCHES`` once (each is idempotent); returns their names."""
    check_megatron_version()
    for name in MODEL_PATCHES:
        importlib.import_module(f"{__name__}.{name}").apply()
    return MODEL_PATCHES


def apply_optimizer_patches() -> Tuple[str, ...]:
    """Apply ``OPTIMIZER_PATCHES`` once (each is idempotent); returns their names."""
    check_megatron_version()
    for name in OPTIMIZER_PATCHES:
        importlib.import_module(f"{__name__}.{name}").apply()
    return OPTIMIZER_PATCHES


def applied() -> Tuple[str, ...]:
    return _applied
