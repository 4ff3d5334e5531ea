"""Device placement on a CPU machine: the test device mode (``hpa/distributed/device_mode.py``).

With ``HPA_TEST_MODEL_DEVICE=lazy`` the models live on a second device with CUDA's rules, so a batch that
never reaches the model's device, or a model result that meets a host tensor, fails here instead of on the
first GPU run. One process runs every command that runs a model (``tests/device_runs.py``): ``hpa sft``,
``hpa generate``, ``hpa train`` with GAE (padded, and packed: ``trainer.sequence_packing``) and with group
advantages (each with an evaluation) and ``hpa train-rm``. Before the fixes of issue 21 the first four stopped at their first forward ("GPTModel input
0: a tensor on cpu reached a model on lazy:0"), and with the batches moved but the forward-only results left
on the device, ``hpa train`` stopped where the rollout's log-probs meet the training ones.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from demo_data import make_task
from hpa.distributed.device_mode import StrictDeviceMode, is_device_tensor

DEVICE = torch.device("lazy", 0)
COMMANDS = ("sft", "generate", "train_gae", "train_grpo", "train_rm", "train_packed")


def _run(root: Path, out: Path, test_device: bool):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]))
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "HPA_TEST_MODEL_DEVICE"):
        env.pop(k, None)
    if test_device:
        env["HPA_TEST_MODEL_DEVICE"] = "lazy"
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "device_runs.py"), str(root), str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def on_test_device(tmp_path_factory):
    root = make_task(tmp_path_factory.mktemp("device"), 16, 4)
    return root, _run(root, root / "results.json", test_device=True)


@pytest.mark.e2e
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_runs_with_its_models_on_another_device(on_test_device, command):
    _, results = on_test_device
    r = results[command]
    assert r["ok"], r["error"] + "\n" + r["traceback"]
    if command == "generate":  # the reference is the policy: every KL is exactly 0
        assert len(r["result"]) == 4 and all(row["kl"] == 0.0 for row in r["result"])
        return
    last = r["result"][-1]
    assert last["step"] == 1
    assert all(math.isfinite(v) for v in last.values())
    if command != "sft":  # the evaluation ran on the test device too
        assert any(k.startswith(("eval/", "rm/eval_")) for k in last)


@pytest.mark.slow
def test_results_on_the_test_device_equal_the_cpu_run(on_test_device, tmp_path):
    """The mode changes no numerics: every command's numbers equal a plain CPU run's."""
    _, lazy = on_test_device
    root = make_task(tmp_path, 16, 4)
    cpu = _run(root, root / "results.json", test_device=False)
    for command in COMMANDS:
        assert cpu[command]["ok"] and cpu[command]["result"] == lazy[command]["result"], command


# ---- the mode's rules, one by one ------------------------------------------------------------------------

@pytest.fixture
def mode():
    with StrictDeviceMode(DEVICE) as m:
        yield m


def test_moves_report_the_device_and_refuse_mixing(mode):
    host = torch.arange(6.0).reshape(2, 3)
    dev = host.to(DEVICE)
    assert is_device_tensor(dev) and dev.device == DEVICE and host.device.type == "cpu"
    assert torch.equal((dev * 2).cpu(), host * 2)  # values are the CPU's
    with pytest.raises(RuntimeError, match=r"found at least two devices, lazy:0 and cpu! \(add\)"):
        dev + host
    with pytest.raises(RuntimeError, match="lazy:0 and cpu"):
        torch.cat([dev, host])
    assert is_device_tensor(dev * torch.tensor(2.0))  # a 0-dim host tensor mixes, as a CPU scalar with CUDA
    back = dev.cpu()
    assert not is_device_tensor(back) and torch.equal(back + host, host * 2)
    assert not is_device_tensor(dev.to("cpu")) and is_device_tensor(dev.to(torch.float64))
    with pytest.raises(TypeError, match="numpy"):
        dev.numpy()
    before = dev.clone()
    with pytest.raises(RuntimeError, match="lazy:0 and cpu"):
        dev.add_(host)  # refused before it writes
    assert torch.equal(dev.cpu(), before.cpu())
    assert is_device_tensor(host.to(dev)) and not is_device_tensor(dev.to(host))  # .to(other tensor)
    assert torch.equal(host[dev.cpu() > 2], torch.tensor([3.0, 4.0, 5.0]))


def test_factories_on_the_device(mode):
    z = torch.zeros(3, device=DEVICE)
    assert is_device_tensor(z) and z.device == DEVICE
    assert is_device_tensor(torch.arange(3, device=z.device) + z)
    assert not is_device_tensor(torch.zeros(3))


def test_a_model_refuses_host_inputs_and_returns_device_outputs(mode):
    from hpa.models.device_boundary import install

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Linear(3, 3)
            self.output_layer = torch.nn.Linear(3, 2)
            self.post_process = True

        def forward(self, x):
            return self.output_layer(self.decoder(x))

    model = install(Tiny(), DEVICE)
    x = torch.ones(1, 3)
    with pytest.raises(RuntimeError, match="Tiny input 0: a tensor on cpu reached a model on lazy:0"):
        model(x)
    out = model(x.to(DEVICE))
    assert out.device == DEVICE
    with torch._C.DisableTorchFunction():
        assert torch.equal(out.as_subclass(torch.Tensor), Tiny.forward(model, x))
