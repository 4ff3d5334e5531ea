"""Model weights through megatron ``dist_checkpointing`` (resharding between any TP/PP layouts).

A checkpoint saved under one layout loads under another: megatron stores global tensors as shards
with their global offsets. The full run checkpoint (optimizer, RNG, data positions, manifest) builds
on these two functions.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hpa.distributed.groups import ParallelGroups
from hpa.models.heads import unwrap


def _sharded_state_dict(model):
    return unwrap(model).sharded_state_dict(prefix="")


def save_model_weights(model, directory: os.PathLike, groups: ParallelGroups) -> Path:
    """Save the weights of ``model`` (any layout) to ``directory`` (created; must be empty)."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if groups.is_main:
        directory.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(_sharded_state_dict(model), str(directory))
    torch.distributed.barrier()
    return directory


def load_model_weights(model, directory: os.PathLike, groups: ParallelGroups, strict: bool = True,
                       exclude_prefixes: tuple = ()) -> None:
    """Load weights saved by ``save_model_weights`` under any layout into ``model``.

    Args:
        exclude_prefixes: parameters to leave as they are (e.g. ``("output_layer.",)`` to start a critic
            from a policy checkpoint: same backbone, different head).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    directory = Path(directory)
    if not (directory / "metadata.json").is_file():
        raise FileNotFoundError(f"{directory} is not a megatron distributed checkpoint "
                                f"(no metadata.json); point model.*_path at a saved checkpoint directory")
    sharded = {k: v for k, v in _sharded_state_dict(model).items() if not k.startswith(tuple(exclude_prefixes))}
    state = dist_checkpointing.load(
        sharded, str(directory),
        strict=StrictHandling.RAISE_ALL if strict and not exclude_prefixes else StrictHandling.ASSUME_OK_UNEXPECTED)
    missing, unexpected = unwrap(model).load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(tuple(exclude_prefixes)) and not k.endswith("_extra_state")]
    if strict and (missing or unexpected):
        raise RuntimeError(f"checkpoint {directory} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
