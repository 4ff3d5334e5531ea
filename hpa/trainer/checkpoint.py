"""Checkpoints: megatron ``dist_checkpointing`` for models and optimizers, plus the run state.

Layout of one checkpoint ``<dir>/step_00000012/``::

    policy/            dist checkpoint: {"model": ..., "optimizer": ...} (any TP/PP can load it); with LoRA
                       the adapters and their optimizer state only, marked by lora.json (docs/lora.md)
    critic/            the same for the critic (when there is one)
    trainer_state.pt   step, LR schedulers, KL controller, samplers, reward-shaping state, guard, ...
    rng/rank_00003.pt  CPU / CUDA / numpy / python / megatron-tracker RNG states of each rank
    manifest.json      every file with its size and sha256; written last

Saving is atomic: everything goes into ``step_N.tmp``, the manifest is written last, the directory is
renamed, and only then does the ``latest`` pointer move. The previous checkpoint is deleted only by
retention, after the new one is complete. A save that fails on any rank (out of space, I/O error)
fails on every rank (they agree through a collective, so none waits for the others forever), its
``.tmp`` directory is removed, and ``latest`` and the previous checkpoints stay as they were:
``CheckpointSaveError`` says what failed where. A ``.tmp`` directory left by a process that died
while saving is never a resume candidate and is removed on the next start. Loading verifies the
manifest and reports the first bad file; ``resume=auto`` then falls back to the newest checkpoint
that verifies. Every ``.pt`` load uses ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from hpa.config.schema import CheckpointConfig
from hpa.config.startup import LATEST, checkpoint_candidates, checkpoint_root
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.distributed.watchdog import is_collective_failure
from hpa.engine.optimizer import use_multi_tensor_adam
from hpa.models import lora
from hpa.models.heads import unwrap
from hpa.models.weights import MANIFEST, dist_save, sharded_state_dict
from hpa.trainer import faults

logger = logging.getLogger("hpa")


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or corrupt; the message names the file."""


class CheckpointSaveError(RuntimeError):
    """A save that failed; the previous checkpoint and ``latest`` are intact. Names the ranks and errors."""


EXIT_SAVE_FAILED = 74  # EX_IOERR: the exit status of checkpoint.on_save_failure=stop


# ------------------------------------------------------------------------------------------------
# RNG


def rng_state() -> Dict:
    from megatron.core import tensor_parallel

    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_version": random.getstate()[0], "python_gauss": random.getstate()[2],
             "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------------------------------------
# manifest


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, step: int, score: Optional[float]) -> None:
    """A run checkpoint's manifest: its step and score beside its files (``seal``)."""
    seal(directory, {"step": step, "score": score})


def seal(directory: Path, fields: Dict) -> None:
    """Write ``directory``'s manifest, atomically and last: every file with its size and sha256, plus
    ``fields``; ``verify`` checks it (run checkpoints, the reference log-prob cache)."""
    files = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({**fields, "files": files}, indent=1))
    os.replace(tmp, directory / MANIFEST)


# megatron-core 0.16.1's default distributed-optimizer sharding, 'fully_sharded_model_space', is deprecated and
# its ShardedTensors (flattened_range) are refused by its own dist_checkpointing. 'dp_reshardable' (one
# ShardedTensor per contiguous buffer) saves and loads fully in parallel and reshards over DP, as megatron's
# training loop saves it (megatron/training/checkpointing.py, distrib_optim_sharding_type).
DISTRIB_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def optim_metadata(optimizer) -> Optional[Dict]:
    """The ``metadata`` to save ``optimizer`` with: the sharding above for a distributed optimizer (any of a
    chained one's parts); None (megatron's plain format, unchanged) for the full optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return dict(DISTRIB_OPTIM_METADATA) if any(isinstance(o, DistributedOptimizer) for o in parts) else None


def prime_for_load(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet the (zero) state its ``sharded_state_dict`` needs.

    Without TransformerEngine or Apex, megatron-core 0.16.1's ``DistributedOptimizer.state_dict`` reads the
    torch optimizer's per-parameter ``step`` and asserts there is one; a freshly built optimizer (a resume)
    has none. The zeros are overwritten by the load; the full optimizer is left alone."""
    from megatron.core.optimizer import distrib_optimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if not isinstance(part, distrib_optimizer.DistributedOptimizer) or inner is None or len(inner.state):
            continue
        if part.init_state_fn is not None:
            part.init_state_fn(inner, part.config)  # exp_avg, exp_avg_sq
        if not distrib_optimizer.HAVE_APEX_OR_TE:
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p]["step"] = torch.tensor(0.0)


def restore_steps(optimizer) -> None:
    """Set a distributed optimizer's per-parameter Adam ``step`` from the loaded param groups.

    megatron-core 0.16.1 (no TransformerEngine or Apex) keeps ``step`` out of the dp_reshardable checkpoint
    (a LocalNonpersistentObject, 'handled via param_groups') but then copies the local, not loaded, value
    over the step it had set from the param groups: a resume would restart Adam's bias correction. One
    tensor per parameter, as torch's Adam makes them (its in-place increments must not be shared)."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part, distrib_optimizer.DistributedOptimizer):
            for group in part.optimizer.param_groups:
                for p in group["params"] if "step" in group else ():
                    part.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))


# megatron's DDP keeps one buffer per (parameter, gradient) dtype, and a distributed optimizer saves each
_FP32_BUFFER = "dtype_(torch.float32, torch.float32)"


def check_fp32_norm_buffer(directory: Path, model) -> None:
    """Raise ``CheckpointError`` when ``directory`` (a model's part of a run checkpoint that failed to load) holds
    a distributed optimizer's buffer of fp32 weights and ``model`` has no fp32 weight: saved by an older hpa,
    whose bf16/fp16 models kept the local spec's norm weights in fp32."""
    from megatron.core import dist_checkpointing

    if any(p.dtype == torch.float32 for p in model.parameters()):
        return
    if any(_FP32_BUFFER in key for key in dist_checkpointing.load_tensors_metadata(str(directory))):
        raise CheckpointError(
            f"{directory}: its distributed-optimizer state holds the norms' weights in an fp32 buffer of their "
            f"own (an older hpa left them in fp32 in a 16-bit model); today's model holds them in "
            f"{next(model.parameters()).dtype}, so that state does not load. Start a new run from its weights "
            f"instead (model.policy_path or model.critic_path={directory}); its optimizer then starts afresh")


def verify(directory: Path) -> Dict:
    """The manifest of ``directory`` after checking every file; raises CheckpointError naming the first bad one."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{directory}: no {MANIFEST} (the save did not complete)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from None
    for name, meta in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        if path.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, the manifest says {meta['bytes']} "
                                  f"(truncated shard)")
        if file_sha256(path) != meta["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (corrupt shard)")
    return manifest


# ------------------------------------------------------------------------------------------------
# the manager


class CheckpointManager:
    """Saves, finds, verifies, loads and prunes the run checkpoints of one run.

    Args:
        cfg: the ``checkpoint`` section.
        run_dir: ``trainer.run_dir``; checkpoints go to ``cfg.dir`` or ``<run_dir>/checkpoints``.
        groups: the layout (every rank takes part in saving and loading).
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: os.PathLike, groups: ParallelGroups):
        self.cfg, self.groups = cfg, groups
        self.root = checkpoint_root(cfg.dir, run_dir)

    @staticmethod
    def name(step: int) -> str:
        return f"step_{step:08d}"

    def save(self, step: int, models: Dict[str, Tuple], state: Dict, score: Optional[float] = None) -> Path:
        """Save ``models`` (name -> (ddp_model, optimizer)) and the picklable run ``state`` at ``step``.

        Raises ``CheckpointSaveError`` on every rank when writing failed on any rank; the partial
        ``.tmp`` directory is then removed and ``latest`` still names the previous checkpoint.
        """
        final = self.root / self.name(step)
        tmp = self.root / (self.name(step) + ".tmp")
        error = self._agree(self._write_shards, step, models, state, tmp)
        if error is None:  # every rank wrote its part; the main rank seals the checkpoint
            error = self._agree(self._publish if self.groups.is_main else lambda *_: None, step, score, tmp, final)
        if error is not None:
            if self.groups.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            comm.barrier()
            kept = (self.root / LATEST).read_text().strip() if (self.root / LATEST).is_file() else None
            raise CheckpointSaveError(f"saving checkpoint {final} failed ({error}); removed {tmp.name}, "
                                      f"'latest' still names {kept}")
        logger.info("saved checkpoint %s", final)
        return final

    def _agree(self, write, *args) -> Optional[str]:
        """Run this rank's ``write(*args)``; None when it succeeded on every rank, else what failed where."""
        try:
            write(*args)
            mine = ""
        except Exception as exc:  # disk full, I/O error, a shard write megatron or torch reports as failed
            if is_collective_failure(exc):  # a peer is gone: there is no one to agree with
                raise
            mine = f"rank {self.groups.rank}: {type(exc).__name__}: {exc}"
            logger.error("checkpoint save failed on %s", mine)
        failed = torch.tensor([float(bool(mine))])
        comm.all_reduce_max(failed, None)
        if failed.item() == 0:
            return None
        errors = [e for e in comm.all_gather_objects(mine, None) if e]
        return "; ".join(errors)

    def _write_shards(self, step: int, models: Dict[str, Tuple], state: Dict, tmp: Path) -> None:

        if self.groups.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        comm.barrier()
        for name, (model, optimizer) in models.items():
            model_sd = lora.checkpoint_state_dict(model, sharded_state_dict(model))  # LoRA: adapters only
            metadata = optim_metadata(optimizer)
            sharded = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata)}
            if self.groups.is_main:
                (tmp / name).mkdir()
            comm.barrier()
            dist_save(sharded, tmp / name, content_metadata=metadata)
            if lora.has_lora(model):
                fingerprint = lora.base_fingerprint(model, self.groups)  # collective; cached after the first
                if self.groups.is_main:
                    lora.write_marker(tmp / name, model, fingerprint)
        faults.maybe_fail_save(step, self.groups.rank)
        torch.save(rng_state(), tmp / "rng" / f"rank_{self.groups.rank:05d}.pt")
        if self.groups.is_main:
            torch.save(state, tmp / "trainer_state.pt")

    def _publish(self, step: int, score: Optional[float], tmp: Path, final: Path) -> None:
        """Manifest, rename, then the ``latest`` pointer (each step atomic); then retention."""
        write_manifest(tmp, step, score)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = self.root / (LATEST + ".tmp")
        pointer.write_text(final.name)
        os.replace(pointer, self.root / LATEST)
        self.prune()

    def remove_partial(self) -> None:
        """Remove the ``.tmp`` directories of saves that never finished (main rank)."""
        for tmp in self.root.glob("step_*.tmp") if self.groups.is_main and self.root.is_dir() else ():
            logger.warning("removing %s, left by a save that did not finish", tmp)
            shutil.rmtree(tmp, ignore_errors=True)

    def candidates(self) -> List[Path]:
        """Complete checkpoints, newest first (the ``latest`` pointer's target first)."""
        return checkpoint_candidates(self.root)

    def find_resumable(self, resume: str) -> Optional[Path]:
        """The checkpoint to resume from: ``auto`` -> the newest one that verifies (falling back and saying
        so), ``never`` -> None, a path -> that checkpoint (verified). The answer is the main rank's."""
        choice: Optional[str] = None
        self.remove_partial()
        if self.groups.is_main and resume != "never":
            paths = [Path(resume)] if resume != "auto" else self.candidates()
            for path in paths:
                try:
                    verify(path)
                    choice = str(path)
                    break
                except CheckpointError as exc:
                    if resume != "auto":
                        raise
                    logger.warning("checkpoint unusable, falling back to the previous one: %s", exc)
        return Path(choice) if (choice := comm.broadcast_object(choice, src=0)) else None

    def load(self, path: Path, models: Dict[str, Tuple]) -> Dict:
        """Restore models, optimizers and this rank's RNG from ``path``; return the run state."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from megatron.core.dist_checkpointing.validation import StrictHandling

        for name, (model, optimizer) in models.items():
            lora.check_checkpoint_kind(path / name, model)
            if lora.has_lora(model):  # the same rank, scaling, targets and base, else megatron's shape errors
                lora.check_marker(path / name, model, self.groups)
            model_sd = lora.checkpoint_state_dict(model, sharded_state_dict(model))
            # the optimizer's sharding as it was saved (recorded in the checkpoint), not as we would save now
            metadata = dist_checkpointing.load_content_metadata(str(path / name))
            prime_for_load(optimizer)
            sharded = {"model": model_sd,
                       "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
            try:
                loaded = dist_checkpointing.load(sharded, str(path / name), strict=StrictHandling.RAISE_ALL)
            except CheckpointingException:
                check_fp32_norm_buffer(path / name, model)
                raise
            unwrap(model).load_state_dict(loaded["model"], strict=False)
            with torch.no_grad():  # the distributed optimizer copies into its main params, which may be leaves
                optimizer.load_state_dict(loaded["optimizer"])
            restore_steps(optimizer)
            use_multi_tensor_adam(optimizer)  # the saved param groups brought back the kernel they were saved with
        state = torch.load(path / "trainer_state.pt", weights_only=True)
        rng_file = path / "rng" / f"rank_{self.groups.rank:05d}.pt"
        if state.get("layout") == self.groups.layout and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=True))
        elif self.groups.is_main:  # RNG streams belong to ranks of one layout; they cannot be resharded
            logger.warning("checkpoint %s was saved under %s; resuming under %s with fresh RNG streams",
                           path, state.get("layout"), self.groups.layout)
        return state

    def prune(self) -> None:
        """Keep the ``keep_last`` newest and the ``keep_top_k`` best-scoring checkpoints (main rank)."""
        found = sorted((p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
                       key=lambda p: p.name)
        keep = set(found[-self.cfg.keep_last:])
        scored = []
        for p in found:
            try:
                score = json.loads((p / MANIFEST).read_text()).get("score")
            except (OSError, json.JSONDecodeError):
                continue
            if score is not None:
                scored.append((score, p.name, p))
        keep |= {p for _, _, p in sorted(scored, reverse=True)[:self.cfg.keep_top_k]}
        for p in found:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)
