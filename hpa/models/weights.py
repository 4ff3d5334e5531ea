"""Model weights on disk: megatron ``dist_checkpointing`` directories, loadable under any TP/PP.

Used by conversion, the reference and reward models, SFT output and run checkpoints (whose
``policy/`` directory holds the same format plus the optimizer).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Dict, Optional

from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.models import lora
from hpa.models.heads import unwrap

# the file a run checkpoint writes last (see hpa.trainer.checkpoint); its presence marks a run checkpoint
MANIFEST = "manifest.json"


def sharded_state_dict(model):
    return unwrap(model).sharded_state_dict(prefix="")


# what launchers send to stop a job (torchrun forwards them to each worker's whole process group)
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}


def dist_save(sharded, directory: os.PathLike, content_metadata: Optional[Dict] = None) -> None:
    """``dist_checkpointing.save`` with the stop signals blocked in this thread while it runs.

    megatron's writer starts a helper process from this thread (a multiprocessing manager, started at
    the first save and kept) and the helper inherits this thread's signal mask. torchrun sends SIGUSR1
    or SIGTERM to the worker's whole process group; a helper that does not block them dies of them, and
    the checkpoint the trainer then writes because of that signal fails. The trainer still sees the
    signal: the kernel hands it to a thread that does not block it, and Python runs the handler in the
    main thread (at the latest when the mask is restored). ``content_metadata`` is stored in the checkpoint
    (``dist_checkpointing.load_content_metadata`` reads it back).
    """
    from megatron.core import dist_checkpointing

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        dist_checkpointing.save(sharded, str(directory), content_metadata=content_metadata)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def save_model_weights(model, directory: os.PathLike, groups: ParallelGroups) -> Path:
    """Save the weights of ``model`` (any layout) to ``directory`` (created; must be empty)."""
    directory = Path(directory)
    if groups.is_main:
        directory.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    dist_save(sharded_state_dict(model), directory)
    comm.barrier()
    return directory


def load_model_weights(model, directory: os.PathLike, groups: ParallelGroups, strict: bool = True,
                       exclude_prefixes: tuple = ()) -> None:
    """Load weights saved by ``save_model_weights`` (or a run checkpoint's model) under any layout.

    Args:
        directory: a weights directory, or a run checkpoint ``step_N`` (its ``policy/`` is read).
        exclude_prefixes: parameters to leave as they are (e.g. ``("output_layer.",)`` to start a critic
            from a policy checkpoint: same backbone, different head).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    directory = Path(directory)
    if (directory / MANIFEST).is_file() and (directory / "policy").is_dir():
        directory = directory / "policy"
    if not (directory / "metadata.json").is_file():
        raise FileNotFoundError(f"{directory} is not a megatron distributed checkpoint "
                                f"(no metadata.json); point model.*_path at a saved checkpoint directory")
    if (directory / lora.MARKER).is_file():
        raise lora.LoRAError(f"{directory} is a LoRA checkpoint (adapters only, {lora.MARKER}), not full model "
                             f"weights: resume it as a LoRA run (model.lora.rank > 0, model.policy_path its base) "
                             f"or export the merged model first")
    sharded = {k: v for k, v in sharded_state_dict(model).items()
               if not k.startswith(tuple(exclude_prefixes)) and not lora.is_adapter_key(k)}
    # tensors are found by their global keys, so a run checkpoint's {"model", "optimizer"} loads too
    state = dist_checkpointing.load(sharded, str(directory), strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    state = {k: v for k, v in state.items() if k in sharded}  # drop a run checkpoint's optimizer part
    missing, unexpected = unwrap(model).load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(tuple(exclude_prefixes)) and not k.endswith("_extra_state")
               and not lora.is_adapter_key(k)]  # adapters are not base weights
    if strict and (missing or unexpected):
        raise RuntimeError(f"checkpoint {directory} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
