"""Process-group initialisation from torchrun or Slurm, and megatron's model-parallel state.

This is the only module that imports ``megatron.core.parallel_state`` (a test enforces it).
``initialize`` is called once per process; it returns the ``ParallelGroups`` the rest of hpa uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from hpa.config.errors import UserError
from hpa.config.schema import ParallelConfig, data_parallel_size, validate

from . import device_mode
from .console import configure_logging
from .groups import ParallelGroups
from .rollout_groups import ROLLOUT, TRAINER, build_placement, split_world, stop_serving

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29500


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """Where this process sits, read from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int  # 0 for one process: it meets no one
    launcher: str  # "torchrun", "slurm" or "single"


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``"gpu[003-005,9],cpu1"`` -> ``"gpu003"``."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise UserError("SLURM_JOB_NODELIST is empty")
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end]
    match = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", first)
    if not match:
        return first
    prefix, ranges, suffix = match.groups()
    head = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{head}{suffix}"


def _int_env(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise UserError(f"environment variable {key}={env[key]!r} is not an integer") from None


def read_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """torchrun variables first; else Slurm's (``srun`` without torchrun); else one process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(rank=_int_env(env, "RANK"), world_size=_int_env(env, "WORLD_SIZE"),
                         local_rank=_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                         master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                         master_port=_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT, launcher="torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if "SLURM_JOB_NODELIST" not in env and "MASTER_ADDR" not in env:
            raise UserError("launched by srun but neither SLURM_JOB_NODELIST nor MASTER_ADDR is set")
        addr = env.get("MASTER_ADDR") or first_slurm_host(env["SLURM_JOB_NODELIST"])
        port = _int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else \
            20000 + (_int_env(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0) % 20000
        return LaunchEnv(rank=_int_env(env, "SLURM_PROCID"), world_size=_int_env(env, "SLURM_NTASKS"),
                         local_rank=_int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
                         master_addr=addr, master_port=port, launcher="slurm")
    # one process: no rendezvous, so no port (``initialize`` gives it a store in its own memory); several
    # single-process jobs share a machine without racing for one
    return LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0, launcher="single")


@contextlib.contextmanager
def launched(cfg, *, disaggregate: bool = False):
    """The one launch preamble of every entry point: check ``cfg`` at this launch's world size (torchrun,
    Slurm or one process), initialise distributed and logging, yield ``(cfg, groups)``, tear down.

    ``disaggregate``: ``hpa train`` splits the launch into trainer and rollout ranks when
    ``rollout.placement`` is disaggregated (``groups.placement``); the other commands use every rank, as
    colocated.

    Raises:
        ConfigError: when the config does not fit the launch (the caller prints it and exits with 2).
    """
    import logging

    launch = read_launch_env()
    if cfg.rollout.placement == "disaggregated" and not disaggregate:
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, placement="colocated", num_ranks=0))
    validate(cfg, launch.world_size)
    configure_logging(cfg.logging.level)
    rollout_ranks = cfg.rollout.num_ranks if cfg.rollout.placement == "disaggregated" else 0
    groups = initialize(cfg.parallel, seed=cfg.trainer.seed, launch=launch, rollout_ranks=rollout_ranks)
    note = megatron_fallback_note(groups.device)
    if note and groups.rank == 0:
        logger.warning("%s", note)
    try:
        yield cfg, groups
    finally:
        destroy()


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def megatron_fallback_note(device: torch.device) -> Optional[str]:
    """On a GPU without Transformer Engine, what megatron runs in its place (its own import-time warnings,
    several per process, are silenced at hpa's entry); None on CPU, where the fallbacks are expected."""
    if device.type != "cuda" or _importable("transformer_engine.pytorch"):
        return None
    if _importable("apex.optimizers"):
        return ("Transformer Engine is not installed: megatron's local layers run in its place, with Apex's fused "
                "norms and optimizers (slower on GPUs); `hpa doctor` prints the install command")
    return ("Transformer Engine and Apex are not installed: megatron's local layers, torch's norms and optimizers "
            "and its own multi-tensor kernels run in their place (slower on GPUs); `hpa doctor` prints the "
            "install command")


TEST_MODEL_DEVICE_ENV = "HPA_TEST_MODEL_DEVICE"


def test_model_device() -> Optional[torch.device]:
    """``lazy:0`` when ``HPA_TEST_MODEL_DEVICE=lazy`` (the test device mode, ``device_mode.py``: the models
    live on a second device with CUDA's rules, on a CPU machine; entered here, once per process), else None."""
    name = os.environ.get(TEST_MODEL_DEVICE_ENV, "")
    if not name:
        return None
    if name != "lazy":
        raise ValueError(f"{TEST_MODEL_DEVICE_ENV}={name!r}: the only test model device is 'lazy'")
    return device_mode.enter(torch.device("lazy", 0))


def choose_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("parallel.backend=nccl needs CUDA, which is not available here; use gloo or auto")
    return requested


def initialize(parallel: ParallelConfig, *, seed: int = 1234, launch: Optional[LaunchEnv] = None,
               rollout_ranks: int = 0) -> ParallelGroups:
    """Initialise torch.distributed and megatron's model-parallel state; return the groups.

    Args:
        parallel: the ``parallel`` config section.
        seed: base seed; megatron derives the TP-rank-specific model-parallel RNG stream from it.
        launch: overrides the environment (tests); default ``read_launch_env()``.
        rollout_ranks: the last ``rollout_ranks`` ranks of the launch are rollout ranks (disaggregated
            rollouts, ``rollout_groups.py``): torch.distributed's world and megatron's state are this process's
            side of the split (the trainer ranks with ``parallel``'s layout; the rollout ranks at TP = PP = 1),
            and ``groups.placement`` holds the groups between the two sides.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    launch = launch or read_launch_env()
    backend = choose_backend(parallel.backend)
    full_launch = launch
    if rollout_ranks:
        launch, parallel = _side_of_split(launch, parallel, rollout_ranks)
    dp = data_parallel_size(parallel, launch.world_size)
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank)
        device = torch.device("cuda", launch.local_rank)
    else:
        import megatron_patches

        megatron_patches.apply_cpu_patches()
        device = test_model_device() or torch.device("cpu")

    store = None
    if not dist.is_initialized():
        store = _init_world(full_launch, launch, parallel, backend, rollout_ranks)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        distributed_timeout_minutes=parallel.timeout_minutes,
        create_gloo_process_groups=backend != "gloo",
    )
    set_seed(seed)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    groups = ParallelGroups(
        world_size=launch.world_size, rank=launch.rank, local_rank=launch.local_rank, backend=backend,
        device=device,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size, data_parallel_size=dp,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        tp_group=pgs.tp, pp_group=pgs.pp, cp_group=pgs.cp, dp_group=pgs.dp, dp_cp_group=pgs.dp_cp,
        mp_group=pgs.mp, embd_group=getattr(pgs, "embd", None), pg_collection=pgs,
    )
    if rollout_ranks:
        groups = _with_placement(groups, store, full_launch, rollout_ranks, parallel.timeout_minutes)
    role = f"{groups.placement.role} ranks, " if groups.placement is not None else ""
    logger.info("initialised %s on %s (%s%s, launcher=%s)", groups.layout, device, role, backend, launch.launcher)
    return groups


def _side_of_split(launch: LaunchEnv, parallel: ParallelConfig, rollout_ranks: int):
    """``(launch, parallel)`` of this process's side of a disaggregated launch: its rank and size within the
    trainer or the rollout ranks; a rollout rank's layout is TP = PP = CP = 1 (a whole copy of the policy)."""
    role, rank, size, _ = split_world(rank=launch.rank, world_size=launch.world_size,
                                      num_rollout_ranks=rollout_ranks)
    if role == ROLLOUT:
        parallel = dataclasses.replace(parallel, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                       context_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                                       sequence_parallel=False, use_distributed_optimizer=False)
    return dataclasses.replace(launch, rank=rank, world_size=size), parallel


def _init_world(full_launch: LaunchEnv, launch: LaunchEnv, parallel: ParallelConfig, backend: str,
                rollout_ranks: int) -> Optional[dist.Store]:
    """torch.distributed's default group over ``launch`` (this process's side of the launch); returns the store
    of the whole launch when it is split for rollout ranks (the groups between the sides are made on it)."""
    timeout = datetime.timedelta(minutes=parallel.timeout_minutes)
    if rollout_ranks:
        store = _restart_safe_store(full_launch, timeout) or dist.TCPStore(
            full_launch.master_addr, full_launch.master_port, full_launch.world_size,
            is_master=full_launch.rank == 0, timeout=timeout)
        prefix = split_world(rank=full_launch.rank, world_size=full_launch.world_size,
                             num_rollout_ranks=rollout_ranks)[3]
        dist.init_process_group(backend=backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout,
                                store=dist.PrefixStore(prefix, store))
        return store
    # one process meets no one: a store in its own memory (a port found free may be taken before it is bound)
    store = dist.HashStore() if launch.launcher == "single" else _restart_safe_store(launch, timeout)
    dist.init_process_group(
        backend=backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout,
        **({"store": store} if store is not None else
           {"init_method": f"tcp://{launch.master_addr}:{launch.master_port}"}))
    return None


def _with_placement(groups: ParallelGroups, store, full_launch: LaunchEnv, rollout_ranks: int,
                    timeout_minutes: float) -> ParallelGroups:
    """``groups`` with the groups between the trainer and the rollout ranks (``groups.placement``); a trainer rank
    tells its rollout rank that it is done at ``destroy``."""
    if store is None:
        raise RuntimeError("disaggregated rollouts initialise torch.distributed themselves (it was initialised "
                           "before hpa.distributed.initialize)")
    placement = build_placement(store, rank=full_launch.rank, world_size=full_launch.world_size,
                                num_rollout_ranks=rollout_ranks, backend=groups.backend, device=groups.device,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    if placement.role == TRAINER:
        on_destroy(lambda: stop_serving(placement))
    return dataclasses.replace(groups, placement=placement)


def _restart_safe_store(launch: LaunchEnv, timeout: datetime.timedelta,
                        env: Optional[Mapping[str, str]] = None) -> Optional[dist.Store]:
    """The store of this attempt when torchrun's agent hosts it, else None (``tcp://`` init).

    torchrun's agent keeps one TCPStore for all the restarts it makes (static rendezvous, and c10d
    rendezvous unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). A restarted worker reading it would find
    the dead workers' gloo/NCCL addresses still there and fail to connect. One agent (one node) numbers
    its restarts consistently, so ``TORCHELASTIC_RESTART_COUNT`` namespaces the keys; agents on several
    nodes do not (a healthy node restarts without counting), so there the store must not be shared.
    """
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if env.get("GROUP_WORLD_SIZE", "1") != "1":
        if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            logger.warning("torchrun shares its rendezvous store across %s nodes with --max-restarts; a restart "
                           "may read stale addresses from it: export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                           "(launch/slurm.sbatch does)", env["GROUP_WORLD_SIZE"])
        return None
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"hpa/attempt_{attempt}", store)


def set_seed(seed: int) -> None:
    """Seed python/numpy/torch and megatron's model-parallel RNG tracker (TP-rank aware)."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


_BEFORE_DESTROY: list = []


def on_destroy(fn) -> None:
    """Call ``fn()`` at the start of ``destroy``, while the process groups still exist: for what shares
    them (a vLLM engine under the external launcher, whose own exit handler would otherwise tear its
    groups down after they are gone, and fail)."""
    _BEFORE_DESTROY.append(fn)


def destroy() -> None:
    from megatron.core import parallel_state

    while _BEFORE_DESTROY:
        _BEFORE_DESTROY.pop()()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
