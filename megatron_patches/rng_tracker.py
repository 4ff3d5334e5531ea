"""Patch: megatron's model-parallel RNG tracker keeps CPU generator states.

What: ``CudaRNGStatesTracker.add`` and the module helpers ``_get_cuda_rng_state`` /
  ``_set_cuda_rng_state`` read, seed and restore the CPU default generator instead of the CUDA one.
  ``fork()`` therefore swaps CPU RNG states exactly as it swaps CUDA states on a GPU.
Why: the tracker (used by TP weight init and by dropout inside ``tensor_parallel``) calls
  ``torch.cuda.get_rng_state`` / ``torch.cuda.default_generators``, which do not exist without CUDA.
Numerics: the model-parallel stream stays separate from the default stream, as on GPUs; seeds are
  the ones megatron computes (``seed + 2718 + tp_rank``).
Upstream: megatron-core 0.16.x (``megatron/core/tensor_parallel/random.py``).
Remove when: megatron-core's tracker accepts a device (or generator) argument.
"""

from __future__ import annotations

import torch

_APPLIED = False


def _get_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_state(new_state, device: int = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _add(self, name, seed):
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = _set_state
    mrandom.CudaRNGStatesTracker.add = _add
    _APPLIED = True
