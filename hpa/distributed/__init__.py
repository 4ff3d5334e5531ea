"""The only package that touches torch.distributed initialisation and megatron's parallel_state."""

from .groups import ParallelGroups
from .init import LaunchEnv, destroy, first_slurm_host, initialize, launched, read_launch_env, set_seed

__all__ = ["ParallelGroups", "LaunchEnv", "destroy", "first_slurm_host", "initialize", "launched",
           "read_launch_env", "set_seed"]
