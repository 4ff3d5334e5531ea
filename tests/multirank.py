"""One helper for multi-rank tests: spawn gloo workers on CPU, each with hpa's distributed init.

``run_ranks(fn, tp=2, pp=1, dp=1, args=(...))`` starts TP·PP·DP processes; each calls
``fn(groups, *args)`` after ``hpa.distributed.initialize`` and returns a picklable value; the backend
is gloo unless ``parallel_kwargs`` names another. The list
of per-rank return values (indexed by global rank) comes back; an exception in any rank fails the
test with that rank's traceback.

The ranks are forks of a forkserver that imported torch, megatron-core and hpa once per session (with
``spawn`` every rank of every test imported them again: about 4 s of CPU each, most of the tier's time);
each rank gets the caller's environment as it is at the call. ``HPA_TEST_START_METHOD=spawn`` brings the old
way back.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from typing import Any, Callable, List, Sequence

import torch.multiprocessing as mp

# forkserver: the server imports torch, megatron-core and hpa once; each rank is a fork of it (spawn
# re-imported them in every rank of every test)
START_METHOD = os.environ.get("HPA_TEST_START_METHOD", "forkserver")
if START_METHOD == "forkserver":
    mp.set_forkserver_preload(["torch", "megatron.core", "hpa.distributed", "hpa.trainer"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layout_id(tp: int = 1, pp: int = 1, dp: int = 1, rollout_ranks: int = 0) -> str:
    return f"tp{tp}_pp{pp}_dp{dp}" + (f"_r{rollout_ranks}" if rollout_ranks else "")


def _worker(rank, world_size, port, tp, pp, fn, args, parallel_kwargs, out_dir, environ=None, rollout_ranks=0):
    if environ is not None:  # the caller's environment at the call (a forkserver child has the server's)
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from hpa.config.schema import ParallelConfig
    from hpa.distributed import LaunchEnv, destroy, initialize

    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        groups = initialize(
            ParallelConfig(**{"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                              "backend": "gloo", **parallel_kwargs}),
            launch=LaunchEnv(rank=rank, world_size=world_size, local_rank=rank,
                             master_addr="127.0.0.1", master_port=port, launcher="torchrun"),
            rollout_ranks=rollout_ranks)
        result = fn(groups, *args)
        with open(path, "wb") as f:
            pickle.dump(("ok", result), f)
    except BaseException:  # report every failure with its rank
        with open(path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    finally:
        try:
            destroy()
        except Exception:
            pass


def run_ranks(fn: Callable, *, tp: int = 1, pp: int = 1, dp: int = 1, args: Sequence[Any] = (),
              parallel_kwargs: dict | None = None, rollout_ranks: int = 0) -> List[Any]:
    """Run ``fn(groups, *args)`` on TP·PP·DP gloo ranks and return each rank's result; with ``rollout_ranks``,
    that many more ranks after them, split off as disaggregated rollout ranks (``groups.placement``)."""
    world_size = tp * pp * dp + rollout_ranks
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(world_size, free_port(), tp, pp, fn, tuple(args),
                                              parallel_kwargs or {}, out_dir, dict(os.environ), rollout_ranks),
                               nprocs=world_size, join=True, start_method=START_METHOD)
        except mp.ProcessRaisedException as exc:
            raise AssertionError(f"a rank failed under {layout_id(tp, pp, dp, rollout_ranks)}:\n{exc}") from None
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed under {layout_id(tp, pp, dp, rollout_ranks)}:\n{value}")
            results.append(value)
    return results
