"""Suite-wide settings (spawned ranks inherit the environment)."""

import os

# hpa.distributed.comm checks, right before every collective, that the tensor is on its process
# group's device: a CPU tensor on an NCCL group then fails here, on CPU, not on the first GPU run
os.environ.setdefault("HPA_STRICT_COMM_DEVICE", "1")
