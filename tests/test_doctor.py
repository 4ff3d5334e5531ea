"""``hpa doctor``: its verdict and fix for each pair, on made-up installs; and the real one here."""

import pytest
from packaging.specifiers import SpecifierSet

from hpa import doctor
from hpa.cli import main
from hpa.doctor import Installed, diagnose, report
from setup_args import setup_kwargs

# torch pinned by each vLLM release (read from the package index's metadata of each release)
VLLM_TORCH_PINS = {"0.26.0": "2.11.0", "0.27.0": "2.13.0", "0.27.1": "2.13.0", "0.28.0": "2.13.0",
                   "0.29.0": "2.13.0", "0.30.0": "2.13.0", "0.31.0": "2.13.0", "0.32.0": "2.13.0",
                   "0.33.0": "2.14.0"}

GOOD_GPU = Installed(
    python="3.11.7", torch="2.13.0+cu128", torch_cuda="12.8", cuda_available=True, nccl="2.27.5",
    torch_nccl_requirement='nvidia-nccl-cu12==2.27.5; platform_system == "Linux"', nccl_package="2.27.5",
    megatron_core="0.16.1", transformer_engine="2.11.0", transformer_engine_torch="2.11.0",
    vllm="0.31.0", vllm_requires=("transformers<5.18.0,>=5.10.4", "torch==2.13.0", "torchvision==0.28.0"),
    transformers="5.17.0")


def _by_pair(inst):
    return {c.pair: c for c in diagnose(inst)}


def _replace(**kw):
    import dataclasses

    return dataclasses.replace(GOOD_GPU, **kw)


def test_a_consistent_gpu_stack_passes():
    checks = diagnose(GOOD_GPU)
    assert [c.status for c in checks] == ["ok"] * len(checks)
    assert {"torch / hpa", "megatron-core / torch", "CUDA / torch", "NCCL / torch", "vLLM / torch",
            "vLLM / transformers", "Transformer Engine / megatron-core",
            "Transformer Engine / torch"} == {c.pair for c in checks}
    text = report(GOOD_GPU, checks)
    for version in ("2.13.0+cu128", "12.8", "2.27.5", "0.16.1", "2.11.0", "0.31.0"):
        assert version in text
    assert text.endswith("every pair is compatible")


def test_vllm_that_replaced_torch():
    # what `pip install -e .[gpu]` did with vllm>=0.10: vLLM 0.33.0 and its torch 2.14.0
    checks = _by_pair(_replace(torch="2.14.0+cu128", vllm="0.33.0",
                               vllm_requires=("torch==2.14.0", "transformers<5.21.0,>=5.16.1")))
    assert checks["torch / hpa"].status == "FAIL" and "2.14.0" in checks["torch / hpa"].detail
    assert checks["torch / hpa"].fix == "pip install torch==2.13.0"
    vllm = checks["vLLM / torch"]
    assert vllm.status == "FAIL" and "vLLM 0.33.0" in vllm.detail and "torch==2.14.0" in vllm.detail
    assert vllm.fix == 'pip install torch==2.13.0 "vllm>=0.27,<0.33"'
    assert "2 incompatible pair(s)" in report(GOOD_GPU, list(checks.values()))


def test_vllm_whose_torch_pin_differs_from_the_installed_torch():
    checks = _by_pair(_replace(vllm="0.30.0", vllm_requires=("torch==2.13.1",)))
    assert checks["vLLM / torch"].status == "FAIL" and "requires torch==2.13.1" in checks["vLLM / torch"].detail


def test_cpu_build_of_vllm_with_its_cpu_torch():
    checks = _by_pair(_replace(torch="2.13.0+cpu", torch_cuda=None, cuda_available=False, nccl=None,
                               vllm="0.32.0", vllm_requires=("torch==2.13.0+cpu", "transformers<5.20.0,>=5.16.1"),
                               transformers="5.19.1", transformer_engine=None, transformer_engine_torch=None))
    assert checks["vLLM / torch"].status == "ok" and "CUDA 13 driver" in checks["vLLM / torch"].detail
    assert checks["CUDA / torch"].status == "skip" and checks["NCCL / torch"].status == "skip"
    assert checks["Transformer Engine / megatron-core"].status == "skip"
    assert "--no-build-isolation" in checks["Transformer Engine / megatron-core"].detail


def test_transformers_outside_vllms_range():
    check = _by_pair(_replace(transformers="5.19.1"))["vLLM / transformers"]
    assert check.status == "FAIL" and "transformers<5.18.0,>=5.10.4" in check.detail
    assert check.fix == 'pip install "transformers<5.18.0,>=5.10.4"'


@pytest.mark.parametrize("te,te_torch,error,reason", [
    ("2.20.2", "2.20.2", None, "tested with transformer_engine>=2.9,<2.12"),
    ("2.11.0", None, None, "transformer_engine_torch) is not installed"),
    ("2.11.0", "2.10.0", None, "must be one release"),
    ("2.11.0", "2.11.0", "import transformer_engine.pytorch failed: ImportError: undefined symbol",
     "built against another torch"),
])
def test_transformer_engine_failures_name_the_no_build_isolation_install(te, te_torch, error, reason):
    checks = [c for c in diagnose(_replace(transformer_engine=te, transformer_engine_torch=te_torch,
                                           transformer_engine_error=error)) if c.status == "FAIL"]
    assert len(checks) == 1 and reason in checks[0].detail, checks
    assert checks[0].fix == ('pip uninstall -y transformer_engine transformer_engine_torch && '
                             'pip install --no-build-isolation "transformer_engine[pytorch]>=2.9,<2.12"')


def test_nccl_wheel_replaced():
    check = _by_pair(_replace(nccl_package="2.26.2"))["NCCL / torch"]
    assert check.status == "FAIL" and "nvidia-nccl-cu12==2.27.5" in check.detail and "2.26.2" in check.detail
    assert check.fix == 'pip install "nvidia-nccl-cu12==2.27.5"'


def test_cuda_build_without_a_gpu():
    check = _by_pair(_replace(cuda_available=False))["CUDA / torch"]
    assert check.status == "FAIL" and "CUDA 12.8" in check.detail and check.fix.startswith("nvidia-smi")


def test_megatron_core_outside_the_patched_release():
    check = _by_pair(_replace(megatron_core="0.17.0"))["megatron-core / torch"]
    assert check.status == "FAIL" and check.fix == 'pip install "megatron-core>=0.16,<0.17"'


def test_the_gpu_extra_is_the_vllm_range_that_keeps_torch(monkeypatch):
    """setup.py's `gpu` extra admits exactly the vLLM releases that pin hpa's torch, and no
    Transformer Engine (it is built against the installed torch, without build isolation)."""
    extras = setup_kwargs(monkeypatch)["extras_require"]
    assert extras["gpu"] == [f"vllm{doctor.VLLM}"]
    admitted = {v for v in VLLM_TORCH_PINS if SpecifierSet(doctor.VLLM).contains(v)}
    assert admitted == {v for v, t in VLLM_TORCH_PINS.items() if t == doctor.TORCH}


def test_doctor_on_this_machine(capsys):
    import torch

    code = main(["doctor"])
    out = capsys.readouterr().out
    assert "hpa doctor: installed versions" in out and torch.__version__ in out
    assert "megatron-core" in out and "compatibility" in out
    assert code == (1 if "FAIL" in out else 0)
