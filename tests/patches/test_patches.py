"""The patches (CPU support, and the local spec's packed RoPE): version gate, one file per patch with its documentation, explicit application."""

import importlib
import pathlib
import subprocess
import sys

import pytest

import megatron_patches

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_each_patch_documents_what_why_upstream_and_removal():
    for name in megatron_patches.PATCHES + megatron_patches.MODEL_PATCHES + megatron_patches.OPTIMIZER_PATCHES:
        doc = importlib.import_module(f"megatron_patches.{name}").__doc__
        for word in ("What:", "Why:", "Upstream:", "Remove when:"):
            assert word in doc, (name, word)
    files = {p.stem for p in (ROOT / "megatron_patches").glob("*.py") if not p.stem.startswith("_")}
    assert files == set(megatron_patches.PATCHES + megatron_patches.MODEL_PATCHES + megatron_patches.OPTIMIZER_PATCHES)


def test_unsupported_version_is_refused(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.12.0")
    with pytest.raises(megatron_patches.UnsupportedMegatronVersion, match="0.12.0 is not supported.*0.16"):
        megatron_patches.check_megatron_version()


def test_not_applied_on_import_and_idempotent():
    code = (
        "import torch, megatron_patches, megatron.core.tensor_parallel.random as r\n"
        "assert megatron_patches.applied() == ()\n"
        "orig = r.CudaRNGStatesTracker.add\n"
        "a = megatron_patches.apply_cpu_patches(); b = megatron_patches.apply_cpu_patches()\n"
        "assert a == b == megatron_patches.PATCHES\n"
        "assert r.CudaRNGStatesTracker.add is not orig\n"
        "import megatron.core.utils as u\n"
        "assert u.torch.cuda.current_device() == 'cpu'\n"
        "assert torch.cuda.current_device is not u.torch.cuda.current_device  # torch itself untouched\n"
        "buf = u.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, 'x')\n"
        "assert buf.device.type == 'cpu' and buf.shape == (2, 3)\n"
    )
    if __import__("torch").cuda.is_available():
        pytest.skip("CPU-only")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_rng_tracker_forks_cpu_states():
    code = (
        "import torch, megatron_patches\n"
        "megatron_patches.apply_cpu_patches()\n"
        "from megatron.core.tensor_parallel import random as r\n"
        "r.initialize_rng_tracker(force_reset=True)\n"
        "t = r.get_cuda_rng_tracker(); t.add('mp', 77)\n"
        "torch.manual_seed(1); before = torch.get_rng_state()\n"
        "with t.fork('mp'): a = torch.rand(3)\n"
        "assert torch.equal(torch.get_rng_state(), before)  # default stream untouched\n"
        "torch.manual_seed(77); assert torch.equal(a, torch.rand(3))  # fork used seed 77\n"
        "with t.fork('mp'): b = torch.rand(3)\n"
        "assert not torch.equal(a, b)  # the forked stream advanced\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_torch_norm_accepts_sequence_parallel_and_marks_its_parameters():
    code = (
        "import torch, megatron_patches\n"
        "from megatron.core.transformer import TransformerConfig\n"
        "from megatron.core.transformer.torch_norm import WrappedTorchNorm\n"
        "cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,\n"
        "                        sequence_parallel=True, normalization='LayerNorm', use_cpu_initialization=True)\n"
        "try:\n"
        "    WrappedTorchNorm(cfg, 8)\n"
        "except AssertionError as e:\n"
        "    assert 'sequence parallel' in str(e)\n"
        "else:\n"
        "    raise SystemExit('megatron accepted sequence parallelism unpatched: the patch can go')\n"
        "megatron_patches.apply_cpu_patches()\n"
        "norm = WrappedTorchNorm(cfg, 8)\n"
        "assert isinstance(norm, torch.nn.LayerNorm) and cfg.sequence_parallel\n"
        "assert [getattr(p, 'sequence_parallel', False) for p in norm.parameters()] == [True, True]\n"
        "cfg.sequence_parallel = False\n"
        "assert not any(hasattr(p, 'sequence_parallel') for p in WrappedTorchNorm(cfg, 8).parameters())\n"
    )
    if __import__("torch").cuda.is_available():
        pytest.skip("CPU-only")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
