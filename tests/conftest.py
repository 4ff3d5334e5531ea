"""Suite-wide settings (spawned ranks inherit the environment)."""

import os

# hpa.distributed.comm checks, right before every collective, that the tensor is on its process
# group's device: a CPU tensor on an NCCL group then fails here, on CPU, not on the first GPU run
os.environ.setdefault("HPA_STRICT_COMM_DEVICE", "1")

# hypothesis draws the same examples on every run (CI and here): a property test that fails does so every
# time, not by chance on one machine; HYPOTHESIS_PROFILE=explore draws new ones each run (docs/testing.md)
from hypothesis import settings  # noqa: E402

settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def groups():
    """A single-rank gloo group in this process (megatron needs one to build a model); a file's own ``groups``
    fixture takes precedence."""
    import torch.distributed as dist

    from hpa.config.schema import ParallelConfig
    from hpa.distributed import LaunchEnv, destroy, initialize

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    g = initialize(ParallelConfig(backend="gloo"), launch=LaunchEnv(
        rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0, launcher="single"))
    yield g
    destroy()
