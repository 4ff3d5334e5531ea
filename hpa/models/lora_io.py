"""LoRA adapters in and out: adapter checkpoints into a model, PEFT adapter directories out and in.

megatron fuses q/k/v into ``linear_qkv`` (rows grouped per query group, ``hpa.models.convert``) and gate/up into
``linear_fc1``; PEFT adapts each HF projection on its own. One fused adapter ``scaling · B A`` maps onto PEFT
exactly: every projection of the fused linear gets the same ``A`` and the rows of ``B`` that the weight
conversion gives that projection (the update is linear in B's rows, so splitting B's rows like the weight's
splits the update like the weight)::

    linear_qkv_lora   A [r, h]     B [(n+2g)·d, r]  ->  q_proj / k_proj / v_proj: lora_A = A, lora_B = B's q / k / v rows
    linear_proj_lora  A [r, n·d]   B [h, r]         ->  o_proj
    linear_fc1_lora   A [r, h]     B [2f, r]        ->  gate_proj / up_proj: lora_A = A, lora_B = B's gate / up rows
    linear_fc2_lora   A [r, f]     B [h, r]         ->  down_proj

PEFT's scaling ``lora_alpha / r`` (or ``/ sqrt(r)`` with ``use_rslora``) is written from ``model.lora``, so it
equals hpa's. The other way, a PEFT adapter whose projections of one fused linear share their ``A`` imports
at its own rank; one whose ``A`` differ (any adapter PEFT trained) imports exactly in block form: the fused
adapter's A stacks the projections' A (rank k·r for k projections), B places each projection's B in its own
column block. Every target then has that larger rank (the others' extra rows of A drawn as a fresh adapter's,
their B columns zero, so the update is unchanged and they can still train).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from hpa.config import load_config
from hpa.config.errors import UserError
from hpa.config.linears import BY_NAME as LINEARS
from hpa.config.schema import LoRAConfig, ModelConfig
from hpa.distributed.comm import all_gather_objects, barrier
from hpa.distributed.groups import ParallelGroups

from . import lora
from .builders import build_policy, build_reference
from .layouts import gather, global_layer_of, hf_to_megatron_full, megatron_full_to_hf, shard
from .heads import unwrap
from .weights import MANIFEST, dist_save, load_model_weights, sharded_state_dict

# megatron target -> (HF parent module, HF projections, the layout kind of hpa.models.layouts): the linears table's
PEFT_MODULES: Dict[str, Tuple[str, Tuple[str, ...], str]] = {
    name: (linear.hf_parent, linear.hf_projections, linear.layout) for name, linear in LINEARS.items()}
PEFT_PREFIX = "base_model.model.model.layers"  # PeftModel(LlamaForCausalLM).state_dict() names
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_BASE = "base"  # the HF base a PEFT export's adapter_config.json names, inside the export


class AdapterImportError(UserError):
    """A PEFT adapter or adapter checkpoint that cannot be used as given; the message says what to do."""


def full_adapters(model, model_cfg: ModelConfig, groups: ParallelGroups
                  ) -> Iterator[Tuple[int, str, torch.Tensor, torch.Tensor]]:
    """Yield ``(global layer, target, A [r, in], B [out, r])`` of every adapter, full (TP gathered, B's rows in
    the fused weight's full row order), on every rank of the model-parallel group in the same order.

    Collective over TP and PP (as ``hf_tensors_from_megatron``): every rank of one replica must iterate to the end.
    """
    gpt = unwrap(model)
    found = dict(lora.adapters(gpt))
    if not found:
        raise AdapterImportError("the model has no LoRA adapters (model.lora.rank is 0)")
    tp, pp = groups.tensor_model_parallel_size, groups.pipeline_model_parallel_size
    local_to_global = global_layer_of(gpt)
    owners: Dict[int, int] = {}
    for stage, layers in enumerate(all_gather_objects(sorted(local_to_global.values()), groups.pp_group)):
        owners.update({g: stage for g in layers})
    global_to_local = {g: l for l, g in local_to_global.items()}
    rank = next(iter(found.values())).A.shape[0]
    targets = [t for t in PEFT_MODULES if any(n.endswith(f".{t}{lora.SUFFIX}") for n in found)]
    dtype = next(iter(found.values())).A.dtype
    for layer in range(model_cfg.num_layers):
        for target in targets:
            parent = LINEARS[target].parent
            a_shape, b_shape = LINEARS[target].lora_shapes(model_cfg, rank)  # full (TP=1)
            if groups.pp_rank == owners[layer]:
                adapter = found[f"decoder.layers.{global_to_local[layer]}.{parent}.{target}{lora.SUFFIX}"]
                kind = PEFT_MODULES[target][2]
                if kind == "row":  # A's columns split like the weight's, B replicated
                    a, b = gather("row", adapter.A.detach(), groups.tp_group, tp), adapter.B.detach()
                else:  # A replicated, B's rows split like the weight's
                    a, b = adapter.A.detach(), gather(kind, adapter.B.detach(), groups.tp_group, tp)
                a, b = a.contiguous(), b.contiguous()
            else:
                a = torch.empty(a_shape, dtype=dtype, device=groups.device)
                b = torch.empty(b_shape, dtype=dtype, device=groups.device)
            if pp > 1:
                src = dist.get_global_rank(groups.pp_group, owners[layer])
                dist.broadcast(a, src=src, group=groups.pp_group)
                dist.broadcast(b, src=src, group=groups.pp_group)
            if (tuple(a.shape), tuple(b.shape)) != (a_shape, b_shape):
                raise ValueError(f"layer {layer} {target}: adapter shapes {tuple(a.shape)}, {tuple(b.shape)}, "
                                 f"expected {a_shape}, {b_shape} from the model config")
            yield layer, target, a, b


def peft_tensors(layer: int, target: str, a: torch.Tensor, b: torch.Tensor, model_cfg: ModelConfig
                 ) -> List[Tuple[str, torch.Tensor]]:
    """PEFT's ``(name, tensor)`` pairs of one full fused adapter: shared A, B split like the weight."""
    parent, projections, kind = PEFT_MODULES[target]
    parts = megatron_full_to_hf(kind, b, model_cfg) if kind in ("qkv", "fc1") else (b,)
    out = []
    for proj, part in zip(projections, parts):
        stem = f"{PEFT_PREFIX}.{layer}.{parent}.{proj}"
        out += [(f"{stem}.lora_A.weight", a), (f"{stem}.lora_B.weight", part)]
    return out


def peft_config(lora_cfg: LoRAConfig, targets: List[str], base_model_name_or_path: Optional[str] = None) -> Dict:
    """The ``adapter_config.json`` of an export (PEFT's LoraConfig fields)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
            "use_rslora": lora_cfg.rslora, "lora_dropout": lora_cfg.dropout, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "target_modules": sorted(p for t in targets for p in PEFT_MODULES[t][1]),
            "base_model_name_or_path": base_model_name_or_path, "modules_to_save": None}


def export_peft_adapter(model, model_cfg: ModelConfig, lora_cfg: LoRAConfig, groups: ParallelGroups,
                        out_dir: Union[str, os.PathLike], *, base_model_name_or_path: Optional[str] = None,
                        dtype: Optional[torch.dtype] = None) -> Path:
    """Write the adapters of ``model`` (any layout) as a PEFT LoRA directory (``adapter_model.safetensors``,
    ``adapter_config.json``) for ``PeftModel.from_pretrained(hf_base, out_dir)``. Collective (DP replica 0
    gathers, global rank 0 writes)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors: Dict[str, torch.Tensor] = {}
    targets: List[str] = []
    if groups.dp_rank == 0:
        for layer, target, a, b in full_adapters(model, model_cfg, groups):
            if target not in targets:
                targets.append(target)
            if groups.is_main:
                for name, t in peft_tensors(layer, target, a, b, model_cfg):
                    tensors[name] = t.detach().to("cpu", dtype or t.dtype, copy=True).contiguous()
    if groups.is_main:
        scaling = next(a.scaling for _, a in lora.adapters(model))
        if not math.isclose(scaling, lora_cfg.scaling, rel_tol=1e-6):
            raise AdapterImportError(f"the model's adapters scale by {scaling} but model.lora gives "
                                     f"{lora_cfg.scaling}; export with the config the adapters were trained with")
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out_dir / PEFT_WEIGHTS), metadata={"format": "pt"})
        (out_dir / PEFT_CONFIG).write_text(json.dumps(peft_config(lora_cfg, targets, base_model_name_or_path),
                                                      indent=2) + "\n")
    barrier()
    return out_dir


# ---------------------------------------------------------------------------------------------------
# adapter checkpoints into a model


def adapter_checkpoint_dir(path: Union[str, os.PathLike]) -> Path:
    """The adapter directory of ``path``: a run checkpoint ``step_N`` (its ``policy/``) or an adapter
    directory itself; it must carry the ``lora.json`` marker."""
    path = Path(path)
    if (path / MANIFEST).is_file() and (path / "policy").is_dir():
        path = path / "policy"
    if not (path / lora.MARKER).is_file():
        raise AdapterImportError(f"{path} is not a LoRA adapter checkpoint (no {lora.MARKER}); give a LoRA run's "
                                 f"checkpoint (<run_dir>/checkpoints/step_N) or an 'hpa convert peft-to-megatron' "
                                 f"output, or load full weights with model.policy_path")
    return path


def load_adapters(model, path: Union[str, os.PathLike], groups: ParallelGroups, *,
                  base_key: str = "model.policy_path") -> Path:
    """Load the adapters of an adapter checkpoint (any TP/PP layout) into ``model``, whose base is already
    loaded and whose adapters are attached with the checkpoint's rank and scaling. Every adapter of the file
    lands and every adapted linear of the model gets one.

    Args:
        base_key: where the model's base came from, named when it is not the base the adapters were trained on.

    Raises:
        AdapterImportError: not an adapter checkpoint, adapters in the file that the model has no target for
            or targets the file has no adapter for.
        LoRAError: another rank, scaling or base (``lora.check_marker``).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    directory = adapter_checkpoint_dir(path)
    lora.check_marker(directory, model, groups, base_key=base_key)
    sharded = {k: v for k, v in sharded_state_dict(model).items() if lora.is_adapter_key(k)}
    stored = {k for k in dist_checkpointing.load_tensors_metadata(str(directory))
              if lora.is_adapter_key(k) and not k.startswith("optimizer.")}  # a run checkpoint's Adam state
    wanted = {v.key for v in sharded.values()}  # megatron's keys: layers stacked, as stored
    extra, absent = sorted(stored - wanted), sorted(wanted - stored)
    if extra or absent:
        raise AdapterImportError(f"{directory} does not match model.lora.target_modules "
                                 f"{lora.adapter_targets(model)}: adapters in the file without a target "
                                 f"{extra}; targets without an adapter in the file {absent}; use the targets "
                                 f"the adapters were trained with")
    try:
        state = dist_checkpointing.load(sharded, str(directory), strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    except Exception as exc:  # megatron names the first key it cannot load (a shape: another model)
        raise AdapterImportError(f"{directory} does not hold this model's adapters ({type(exc).__name__}: "
                                 f"{str(exc)[:300]}); check model.lora against the run's") from None
    state = {k: v for k, v in state.items() if k in sharded}  # a run checkpoint's optimizer part stays out
    missing, unexpected = unwrap(model).load_state_dict(state, strict=False)
    missing = [k for k in missing if lora.is_adapter_key(k)]
    if missing or unexpected:
        raise AdapterImportError(f"{directory} does not match the model's adapters: missing {missing[:4]}, "
                                 f"unexpected {unexpected[:4]}")
    return directory


# ---------------------------------------------------------------------------------------------------
# PEFT adapters in


def read_peft_adapter(peft_dir: Union[str, os.PathLike]) -> Tuple[Dict, Dict[str, torch.Tensor]]:
    """``(adapter_config.json, tensors)`` of a PEFT LoRA directory (names without the adapter name)."""
    from safetensors.torch import load_file

    peft_dir = Path(peft_dir)
    config_path, weights = peft_dir / PEFT_CONFIG, peft_dir / PEFT_WEIGHTS
    if not config_path.is_file() or not weights.is_file():
        raise AdapterImportError(f"{peft_dir} is not a PEFT adapter directory (needs {PEFT_CONFIG} and "
                                 f"{PEFT_WEIGHTS})")
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != "LORA":
        raise AdapterImportError(f"{config_path}: peft_type {config.get('peft_type')!r}; only LORA adapters import")
    for key, allowed in (("fan_in_fan_out", False), ("use_dora", False), ("bias", "none")):
        if config.get(key, allowed) != allowed:
            raise AdapterImportError(f"{config_path}: {key}={config.get(key)!r} is not supported (only {allowed!r})")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterImportError(f"{config_path}: per-module rank_pattern/alpha_pattern are not supported")
    return config, load_file(str(weights))


def _peft_scaling(config: Dict) -> float:
    r = config["r"]
    return config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)


def fused_from_peft(config: Dict, tensors: Dict[str, torch.Tensor], model_cfg: ModelConfig, targets: List[str]
                    ) -> Tuple[int, Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]]]:
    """Full fused adapters ``(rank, {(layer, target): (A [R, in], B [out, R] with PEFT's scaling folded in)})``.

    Projections of one fused linear that share A keep rank r; otherwise the block form (rank k·r) is exact.
    """
    r = config["r"]
    scale = _peft_scaling(config)
    out: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}
    used = set()
    for layer in range(model_cfg.num_layers):
        for target in targets:
            parent, projections, kind = PEFT_MODULES[target]
            pairs = []
            for proj in projections:
                stem = f"{PEFT_PREFIX}.{layer}.{parent}.{proj}"
                a, b = tensors.get(f"{stem}.lora_A.weight"), tensors.get(f"{stem}.lora_B.weight")
                if a is None or b is None:
                    raise AdapterImportError(f"the PEFT adapter has no {stem}.lora_A/B (model.lora.target_modules "
                                             f"names {target}); its target_modules: {config.get('target_modules')}")
                pairs.append((a.float(), b.float() * scale))
                used |= {f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"}
            if all(torch.equal(pairs[0][0], a) for a, _ in pairs):  # shared A: the fused adapter at rank r
                a_full, bs = pairs[0][0], [b for _, b in pairs]
            else:  # block form: A stacked, each B in its own column block
                k = len(pairs)
                a_full = torch.cat([a for a, _ in pairs])  # [k·r, in]
                bs = [torch.nn.functional.pad(b, (i * r, (k - 1 - i) * r)) for i, (_, b) in enumerate(pairs)]
            b_full = hf_to_megatron_full(kind, bs, model_cfg, 0) if kind in ("qkv", "fc1") else bs[0]
            out[(layer, target)] = (a_full, b_full)
    left = sorted(set(tensors) - used)
    if left:  # every adapter of the file lands, or none does
        modules = sorted({n.rsplit(".lora_", 1)[0].split(".", 5)[-1] for n in left})
        wanted = sorted({t for t, (_, projections, _) in PEFT_MODULES.items() for n in left
                         if any(f".{p}." in n for p in projections)} - set(targets))
        fix = (f"add {wanted} to model.lora.target_modules" if wanted else
               f"its layers are not the model's (model.num_layers: {model_cfg.num_layers})")
        raise AdapterImportError(f"the PEFT adapter has {len(left)} tensors that model.lora.target_modules "
                                 f"{targets} leaves out (on {modules[:6]}{' ...' if len(modules) > 6 else ''}); "
                                 f"{fix}")
    rank = max(a.shape[0] for a, _ in out.values())
    return rank, out


def import_peft_adapter(model, peft_dir: Union[str, os.PathLike], model_cfg: ModelConfig, lora_cfg: LoRAConfig,
                        groups: ParallelGroups, *, seed: int = 0) -> None:
    """Set the adapters of ``model`` (attached with ``lora_cfg``, any layout) from a PEFT LoRA directory so its
    forward equals ``PeftModel.from_pretrained(hf_base, peft_dir)``'s.

    Raises:
        AdapterImportError: a PEFT adapter hpa cannot express, or ``lora_cfg.rank`` not the rank the import
            needs (the message gives it).
    """
    config, tensors = read_peft_adapter(peft_dir)
    rank, fused = fused_from_peft(config, tensors, model_cfg, list(lora_cfg.target_modules))
    if lora_cfg.rank != rank:
        raise AdapterImportError(f"the PEFT adapter {peft_dir} (r={config['r']}) imports exactly at rank {rank}"
                                 f"{' (block form: its q/k/v or gate/up projections have their own A)' if rank != config['r'] else ''}"
                                 f"; set model.lora.rank: {rank}")
    gen = torch.Generator().manual_seed(seed)
    tp, tp_rank = groups.tensor_model_parallel_size, groups.tp_rank
    local_to_global = global_layer_of(model)
    with torch.no_grad():
        for name, adapter in lora.adapters(model):
            local = int(name.split(".")[2])
            target = name.rsplit(".", 1)[1][:-len(lora.SUFFIX)]
            a_full, b_full = fused[(local_to_global[local], target)]
            if a_full.shape[0] < rank:  # a fresh adapter's A rows, zero B columns: the update is unchanged
                bound = 1.0 / math.sqrt(a_full.shape[1])
                extra = torch.empty(rank - a_full.shape[0], a_full.shape[1]).uniform_(-bound, bound, generator=gen)
                a_full = torch.cat([a_full, extra])
                b_full = torch.nn.functional.pad(b_full, (0, rank - b_full.shape[1]))
            b_full = b_full / adapter.scaling
            kind = PEFT_MODULES[target][2]
            if kind == "row":
                a, b = shard("row", a_full, tp, tp_rank), b_full
            else:
                a, b = a_full, shard(kind, b_full, tp, tp_rank)
            adapter.A.copy_(a)
            adapter.B.copy_(b)


# ---------------------------------------------------------------------------------------------------
# hpa convert: LoRA checkpoints out, PEFT adapters in


def is_adapter_checkpoint(path: Union[str, os.PathLike]) -> bool:
    try:
        adapter_checkpoint_dir(path)
        return True
    except AdapterImportError:
        return False


def run_config_of(path: Union[str, os.PathLike]) -> Optional[Path]:
    """The ``config.yaml`` of the run that wrote a checkpoint ``<run_dir>/checkpoints/step_N[/policy]``."""
    for parent in Path(path).resolve().parents:
        if (parent / "config.yaml").is_file():
            return parent / "config.yaml"
    return None


def build_lora_model(model_cfg: ModelConfig, parallel_cfg, groups: ParallelGroups, base_dir: Optional[str], *,
                     seed: int = 0, adapter_path: Optional[str] = None, base_key: str = "model.policy_path"):
    """The base of ``base_dir`` (None: as initialised) with ``model_cfg.lora``'s adapters attached (B = 0), or
    loaded from ``adapter_path`` (``load_adapters``; ``base_key`` names where the base came from). The one
    assembly of base plus adapters (``hpa.models.stack.build_policy_stack``'s LoRA policy)."""
    model = build_policy(model_cfg, parallel_cfg, groups)
    if base_dir:
        load_model_weights(model, base_dir, groups)
    lora.attach_lora(model, model_cfg.lora, groups, seed=seed)
    if adapter_path:  # continue from trained (or imported PEFT) adapters
        load_adapters(model, adapter_path, groups, base_key=base_key)
    return model


def load_lora_checkpoint(args, parallel_cfg, groups: ParallelGroups):
    """``hpa convert megatron-to-hf`` of an adapter checkpoint: ``(model with its adapters, ModelConfig, family,
    HF config base)``; the config is ``--config`` or the run's ``config.yaml``, the base ``--base-dir`` or its
    ``model.policy_path``."""
    import dataclasses

    config = args.config or run_config_of(args.megatron_dir)
    if config is None:
        raise AdapterImportError(f"{args.megatron_dir} is a LoRA checkpoint and no config.yaml of its run was found "
                                 "above it; pass --config with the run's YAML (model and model.lora)")
    cfg = load_config(str(config))
    model_cfg = dataclasses.replace(cfg.model, transformer_impl=args.transformer_impl)
    base_dir = args.base_dir or model_cfg.policy_path
    if not model_cfg.lora.enabled:
        raise AdapterImportError(f"{config} has model.lora.rank 0 but {args.megatron_dir} holds LoRA adapters; "
                                 "pass --config with the LoRA run's YAML")
    if not base_dir:
        raise AdapterImportError(f"{args.megatron_dir} holds adapters only; pass --base-dir (the frozen base's "
                                 f"megatron weights) or set model.policy_path in {config}")
    model = build_lora_model(model_cfg, parallel_cfg, groups, base_dir)
    load_adapters(model, args.megatron_dir, groups,
                  base_key="--base-dir" if args.base_dir else "model.policy_path")
    family = args.family or ("qwen2" if model_cfg.add_qkv_bias else "llama")
    return model, model_cfg, family, None


def merged_model(model, model_cfg: ModelConfig, parallel_cfg, groups: ParallelGroups):
    """A model without LoRA (same layout) holding ``W + scaling · B A`` for every adapted weight."""
    plain = build_reference(model_cfg, parallel_cfg, groups)
    missing, unexpected = plain.load_state_dict(lora.merged_state_dict(model), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"merged weights do not fit the plain model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return plain


def base_model(model, model_cfg: ModelConfig, parallel_cfg, groups: ParallelGroups):
    """A model without LoRA (same layout) holding the frozen base of ``model``: what its adapters go on."""
    plain = build_reference(model_cfg, parallel_cfg, groups)
    missing, unexpected = plain.load_state_dict(lora.BaseView(model).state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"the base does not fit the plain model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return plain


def save_adapters(model, out_dir: Union[str, os.PathLike], groups: ParallelGroups) -> Path:
    """Write the adapters of ``model`` alone as an adapter checkpoint (megatron shards + ``lora.json``)."""
    out_dir = Path(out_dir)
    if groups.is_main:
        if out_dir.exists() and any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory")
        out_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    dist_save({k: v for k, v in sharded_state_dict(model).items() if lora.is_adapter_key(k)}, out_dir)
    fingerprint = lora.base_fingerprint(model, groups)  # collective
    if groups.is_main:
        lora.write_marker(out_dir, model, fingerprint)
    barrier()
    return out_dir


def import_peft_checkpoint(peft_dir: str, config: str, out_dir: str, parallel_cfg, groups: ParallelGroups, *,
                           transformer_impl: str = "auto") -> Path:
    """``hpa convert peft-to-megatron``: the PEFT adapter as an adapter checkpoint over ``model.policy_path``."""
    import dataclasses

    cfg = load_config(config)
    model_cfg = dataclasses.replace(cfg.model, transformer_impl=transformer_impl)
    if not model_cfg.policy_path:
        raise AdapterImportError(f"{config}: set model.policy_path to the base the PEFT adapter was trained on "
                                 "(its megatron weights: 'hpa convert hf-to-megatron' of the HF base)")
    # the adapter against model.lora before any model is built: every tensor lands, at the rank it needs
    rank, _ = fused_from_peft(*read_peft_adapter(peft_dir), model_cfg, list(model_cfg.lora.target_modules))
    if model_cfg.lora.rank != rank:
        raise AdapterImportError(f"{config}: model.lora.rank is {model_cfg.lora.rank}; the PEFT adapter imports "
                                 f"at rank {rank}: set model.lora.rank: {rank}")
    model = build_lora_model(model_cfg, parallel_cfg, groups, model_cfg.policy_path, seed=cfg.trainer.seed)
    import_peft_adapter(model, peft_dir, model_cfg, model_cfg.lora, groups, seed=cfg.trainer.seed)
    return save_adapters(model, out_dir, groups)
