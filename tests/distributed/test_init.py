"""Launch-environment parsing, backend choice and the one-owner rule for parallel_state."""

import pathlib
import re

import pytest

from hpa.distributed.init import choose_backend, first_slurm_host, read_launch_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "1234",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 8, 1)
    assert (launch.master_addr, launch.master_port, launch.launcher) == ("node7", 1234, "torchrun")


def test_slurm_variables_without_torchrun():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[003-004,010],cpu1", "SLURM_JOB_ID": "4242"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (9, 16, 1)
    assert launch.master_addr == "gpu003"
    assert launch.master_port == 20000 + 4242 % 20000
    assert launch.launcher == "slurm"


def test_slurm_master_port_from_env():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a1", "MASTER_PORT": "4000"}
    assert read_launch_env(env).master_port == 4000


def test_single_process_default():
    launch = read_launch_env({})
    assert (launch.rank, launch.world_size, launch.launcher) == (0, 1, "single")


def test_bad_integer_names_the_variable():
    with pytest.raises(ValueError, match="RANK='x'"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("nodelist,first", [
    ("node001", "node001"),
    ("node[001-004]", "node001"),
    ("node[7,9-12]", "node7"),
    ("gpu-a[01-02]-ib,gpu-b[05]", "gpu-a01-ib"),
    ("cpu1,cpu2", "cpu1"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_backend_choice_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert choose_backend("auto") == "gloo"
    with pytest.raises(RuntimeError, match="nccl needs CUDA"):
        choose_backend("nccl")


def test_parallel_state_is_imported_only_by_hpa_distributed():
    pattern = re.compile(r"^\s*(from|import)\s+megatron\.core(\.parallel_state|\s+import\s+.*\bparallel_state\b|\.mpu)",
                         re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "hpa").rglob("*.py")
                 if pattern.search(p.read_text()) and "distributed" not in p.relative_to(ROOT / "hpa").parts[:1]]
    assert offenders == []
    # and the rule does see the owner's import, so it cannot pass vacuously
    assert pattern.search((ROOT / "hpa" / "distributed" / "init.py").read_text())


def test_algorithms_do_not_touch_torch_distributed():
    offenders = [p.name for p in (ROOT / "hpa" / "algorithms").rglob("*.py")
                 if re.search(r"^\s*(import torch\.distributed|from torch import distributed|from torch\.distributed|"
                              r"import hpa\.config|from hpa\.config|.*\bdist\.)", p.read_text(), re.M)]
    assert offenders == []
