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
