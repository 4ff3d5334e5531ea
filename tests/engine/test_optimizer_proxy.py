"""``bench/proxies/optimizer.py``: the host's aten operations for one policy optimizer step (clip, Adam, main ->
model copy, zero_grad) at Qwen2-0.5B's 170 tensors stay a handful, not a few per tensor (megatron's fallbacks
issued 1,390 with CUDA's foreach Adam, 2,562 with CPU's per-tensor Adam)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the module loaded by its file path, as bench/step_proxies.py loads it, in a process of its own (it initialises
# torch.distributed)
_CODE = (
    "import importlib.util, json, sys\n"
    "spec = importlib.util.spec_from_file_location('optimizer_proxy', 'bench/proxies/optimizer.py')\n"
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
    "print(json.dumps(module.measure()))\n"
)


@pytest.mark.e2e  # runs bench/proxies/optimizer.py's measure() in a process of its own (about 20 s)
def test_optimizer_step_ops_stay_under_the_bound():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _CODE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["optimizer.param_tensors"] == 170
    assert result["optimizer.aten_ops_per_step"] <= 100, result  # CUDA's choice: fused Adam
    # CPU's foreach Adam: torch reads each tensor's step on the host twice (340 of them), nothing else per tensor
    assert result["optimizer.aten_ops_per_step_foreach_adam"] <= 2 * 170 + 60, result
