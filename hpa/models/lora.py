"""LoRA on megatron-core's column- and row-parallel linears, over one frozen base (docs/lora.md).

``attach_lora(gpt, cfg, groups, seed=...)`` gives each configured linear (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``) an adapter ``y = W x + scaling · B (A dropout(x))`` and freezes every base
parameter. Base parameter names do not change: the adapter is a sibling module ``<target>_lora`` (parameters
``A`` and ``B``) of the linear it adapts, and the linear's class is swapped for a subclass whose forward adds
the adapter's output, so existing checkpoints and the HF conversion read the base as before.

Shards follow the base's split (TP size t, rank r of the adapter, ``in``/``out`` the full sizes):

    column-parallel base (linear_qkv, linear_fc1):  A [r, in] (full, replicated)   B [out/t, r] (rows split)
    row-parallel base    (linear_proj, linear_fc2): A [r, in/t] (columns split)     B [out, r] (full, replicated)

Every tensor that is replicated across TP is computed identically on every TP rank, so the gradients of the
replicated ``A`` (column) and ``B`` (row) are already the full gradient on each rank: no extra reduction.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hpa.config.errors import UserError
from hpa.config.linears import BY_NAME as LINEARS
from hpa.config.schema import LoRAConfig, ModelConfig
from hpa.config.startup import LORA_RECORD, lora_record_mismatch
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups

from .heads import unwrap

SUFFIX = "_lora"  # a target's adapter is the sibling module "<target>_lora"


def num_adapter_parameters(model: ModelConfig, lora: LoRAConfig) -> int:
    """Adapter parameters of the whole model (every layer, unsharded) for this config: r·(in + out) per adapted
    linear. The number ``attach_lora`` creates over all TP ranks and pipeline stages (replicated A or B counted
    once); for memory plans."""
    if not lora.enabled:
        return 0
    per_layer = sum(lora.rank * sum(LINEARS[t].widths(model)) for t in lora.target_modules)
    return model.num_layers * per_layer


class LoRAError(UserError):
    """A model, checkpoint or layer that LoRA cannot use as given; the message says what to do."""


def is_adapter_key(key: str) -> bool:
    """True for the state-dict keys of adapter parameters (``...<target>_lora.A`` / ``.B``)."""
    parts = key.rsplit(".", 2)
    return len(parts) == 3 and parts[1].endswith(SUFFIX) and parts[1][:-len(SUFFIX)] in LINEARS and parts[2] in "AB"


class LoRAAdapter(nn.Module):
    """The low-rank update of one parallel linear: ``scaling · B (A dropout(x))``.

    Args:
        base: the megatron ColumnParallelLinear / RowParallelLinear it adapts.
        parallel_mode: "column" or "row" (how the base is split over TP).
        rank, scaling, dropout: from ``model.lora``.
        groups: the layout (TP rank and size pick this rank's shard of the full A).
        generator: seeded; draws the FULL A, of which this rank keeps its shard (so TP1 = TP2 exactly).
        gated: the base is a SwiGLU ``linear_fc1`` (its output rows are [gate; up] per TP shard).
    """

    def __init__(self, base: nn.Module, *, parallel_mode: str, rank: int, scaling: float, dropout: float,
                 groups: ParallelGroups, generator: torch.Generator, gated: bool = False):
        super().__init__()
        self.parallel_mode, self.scaling, self.gated = parallel_mode, scaling, gated
        self.tp_group, self.tp_size = base.tp_group, groups.tensor_model_parallel_size
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True
        weight = base.weight
        in_full = base.input_size
        # PEFT's default init of A (kaiming_uniform with a = sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)), drawn in full
        bound = 1.0 / math.sqrt(in_full)
        a_full = torch.empty(rank, in_full).uniform_(-bound, bound, generator=generator)  # [r, in]
        if parallel_mode == "column":
            a, b_shape = a_full, (base.output_size_per_partition, rank)
        else:
            step = in_full // self.tp_size
            a, b_shape = a_full[:, groups.tp_rank * step:(groups.tp_rank + 1) * step], (base.output_size, rank)
        self.A = nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())  # column [r, in]; row [r, in/t]
        self.B = nn.Parameter(torch.zeros(b_shape, device=weight.device, dtype=weight.dtype))  # column [out/t, r]; row [out, r]
        # megatron counts a parameter in the grad norm (and shards it in checkpoints) by these attributes;
        # without them a split A or B would count on TP rank 0 only
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        split, dim = (self.B, 0) if parallel_mode == "column" else (self.A, 1)
        set_tensor_model_parallel_attributes(split, is_parallel=True, dim=dim, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update for the base's input ``x``, shaped like the base's output."""
        from megatron.core import tensor_parallel as tpm

        if self.parallel_mode == "column":
            # x [s/t (SP) or s, b, in]. The base gathers x under SP; the adapter gathers it too, and since every
            # TP rank then holds the same x and the same A, the gradient of x is whole on each rank: split, not
            # reduce-scatter, on the way back (tensor_parallel_output_grad=False).
            if self.sequence_parallel:
                x = tpm.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                             group=self.tp_group)
            u = F.linear(self.dropout(x), self.A)  # [s, b, r]
            # B's rows are split: each rank's grad of u is partial; all-reduce it so A's grad and x's are whole
            if self.tp_size > 1:
                u = tpm.copy_to_tensor_model_parallel_region(u, group=self.tp_group)
            return F.linear(u, self.B) * self.scaling  # [s, b, out/t]
        # row: x [s, b, in/t]; the partial products x_t A_t^T are summed over TP (an r-wide all-reduce)
        with _tp_rng(self.tp_size):  # x is a TP shard: each rank draws its own dropout mask, as megatron does
            x = self.dropout(x)
        u = F.linear(x, self.A)  # [s, b, r], partial over TP
        if self.tp_size > 1:
            u = tpm.reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        out = F.linear(u, self.B) * self.scaling  # [s, b, out], the same on every TP rank
        if self.sequence_parallel:  # the base reduce-scatters its output along the sequence: take this rank's part
            out = tpm.scatter_to_sequence_parallel_region(out, group=self.tp_group)  # [s/t, b, out]
        return out

    def delta_weight(self) -> torch.Tensor:
        """``scaling · B A``, shaped like this rank's shard of the base weight."""
        return (self.B @ self.A) * self.scaling

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """A and B as megatron sharded tensors: the split one along its TP axis, the other replicated; a
        SwiGLU fc1's B is chunked [gate; up] like its weight, so any TP loads it."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axis = {"B": 0} if self.parallel_mode == "column" else {"A": 1}
        out = make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets, tp_group=self.tp_group,
                                                  dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if self.gated:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            out[f"{prefix}B"] = apply_swiglu_sharded_factory(out[f"{prefix}B"], sharded_offsets, singleton)
        return out


@contextlib.contextmanager
def _tp_rng(tp_size: int):
    if tp_size == 1:
        yield
        return
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        yield


class _LoRALinear:
    """Mixed into the base linear's class: the base's forward plus its adapter's update (when enabled)."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        # not registered children: the policy's adapter belongs to the parent module, the critic's to CriticView
        for key in ("_hpa_lora", "_hpa_lora_critic"):
            adapter = self.__dict__.get(key)
            if adapter is not None and adapter.enabled:
                output = output + adapter(input_)
        return output, bias


_CLASSES: Dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (_LoRALinear, cls), {})
    return _CLASSES[cls]


def _parallel_mode(base: nn.Module, target: str) -> str:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    mode = LINEARS[target].parallel
    expected = ColumnParallelLinear if mode == "column" else RowParallelLinear
    if not isinstance(base, expected):
        raise LoRAError(f"model.lora.target_modules: {target} is a {type(base).__name__}, not megatron's "
                        f"{expected.__name__}; LoRA runs on the local layer spec (model.transformer_impl: local), "
                        f"Transformer Engine's fused layers are not supported yet")
    if getattr(base, "gather_output", False) or getattr(base, "explicit_expert_comm", False):
        raise LoRAError(f"model.lora.target_modules: {target} gathers its output or is an expert layer; "
                        f"LoRA adapts the dense transformer linears only")
    return mode


def _gated(target: str, gpt: nn.Module) -> bool:
    """Whether the target's output rows are SwiGLU's ``[gate; up]`` (per TP shard)."""
    return LINEARS[target].layout == "fc1" and bool(gpt.config.gated_linear_unit)


def attach_lora(model: nn.Module, cfg: LoRAConfig, groups: ParallelGroups, *, seed: int) -> List[str]:
    """Add adapters to ``model`` (a GPTModel of one pipeline stage, not yet DDP-wrapped) and freeze its base.

    Each adapter's full A is drawn from ``seed``, the global layer number and the target's name, so every
    layout (TP, PP) draws the same full matrices. Returns the adapted modules' names.
    """
    gpt = unwrap(model)
    if has_lora(gpt):
        raise LoRAError("the model already has LoRA adapters")
    for p in gpt.parameters():  # the base, embeddings and output layer included
        p.requires_grad_(False)
    names = []
    for index, layer in enumerate(gpt.decoder.layers):
        for target in cfg.target_modules:
            parent = getattr(layer, LINEARS[target].parent)
            base = getattr(parent, target)
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{layer.layer_number}:{target}".encode()))
            adapter = LoRAAdapter(base, parallel_mode=_parallel_mode(base, target), rank=cfg.rank,
                                  scaling=cfg.scaling, dropout=cfg.dropout, groups=groups, generator=gen,
                                  gated=_gated(target, gpt))
            parent.add_module(target + SUFFIX, adapter)
            base.__dict__["_hpa_lora"] = adapter
            base.__class__ = _lora_class(type(base))
            names.append(f"decoder.layers.{index}.{LINEARS[target].parent}.{target}")
    return names


def adapters(model: nn.Module) -> Iterator[Tuple[str, LoRAAdapter]]:
    """``(name, adapter)`` of every adapter of ``model`` (names as in its local state dict)."""
    for name, module in unwrap(model).named_modules():
        if isinstance(module, LoRAAdapter):
            yield name, module


def has_lora(model: nn.Module) -> bool:
    return any(True for _ in adapters(model))


def adapter_parameters(model: nn.Module) -> Dict[str, nn.Parameter]:
    """The adapter parameters by their local state-dict names."""
    return {n: p for n, p in unwrap(model).named_parameters() if is_adapter_key(n)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run ``model`` as its frozen base: every adapter off inside the block (restored after, also on error)."""
    found = [a for _, a in adapters(model)]
    before = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(found, before):
            a.enabled = state


class BaseView(nn.Module):
    """The reference of a LoRA run: the policy's own module with its adapters off (no second copy).

    ``unwrap(view)`` is the policy's GPTModel (so megatron's schedule, the hidden-state capture and the
    config reads work on it); calling the view runs the policy with adapters disabled. ``train()``/``eval()``
    on the view leave the policy's mode alone; ``state_dict()`` is the base's (adapter keys left out).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = unwrap(model)

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.module):
            return self.module(*args, **kwargs)

    def train(self, mode: bool = True):
        return self

    def state_dict(self, *args, **kwargs):
        return {k: v for k, v in self.module.state_dict(*args, **kwargs).items() if not is_adapter_key(k)}


@contextlib.contextmanager
def _critic_mode(gpt: nn.Module, critic_adapters: List[LoRAAdapter], head):
    """The policy's adapters off, the critic's on and the value head in place of the LM head, inside the block."""
    with adapters_disabled(gpt):
        for a in critic_adapters:
            a.enabled = True
        lm_head = gpt._modules.get("output_layer")
        if head is not None:
            gpt._modules["output_layer"] = head
        try:
            yield
        finally:
            for a in critic_adapters:
                a.enabled = False
            if head is not None:
                gpt._modules["output_layer"] = lm_head


class CriticView(nn.Module):
    """The critic of a LoRA run: its own adapter set on the policy's adapted linears plus a value head, over the
    policy's frozen base (no second copy of the base).

    The policy's GPTModel is held outside the module tree, so ``parameters()`` (what megatron's DDP and the
    optimizer see) are the critic's adapters and value head only, and no parameter has two DDP owners. Each
    critic adapter is hooked on its base linear next to the policy's and is off except inside ``forward``,
    which runs the base with the policy's adapters off and the value head in place of the LM head. So the
    policy's forward never sees the critic's adapters, and the critic's gradients reach only its own.
    ``config`` is a copy of the policy's: megatron's DDP and optimizer set their callbacks on it.

    Args:
        policy: the policy (a GPTModel of one stage, LoRA attached, not yet DDP-wrapped).
        cfg: ``model.lora`` (the critic's adapters have the policy's rank, targets, scaling, dropout).
        head: the value head (``ScalarHead``) on the last pipeline stage, None elsewhere.
        seed: draws the critic's A (another stream than the policy's).
    """

    def __init__(self, policy: nn.Module, cfg: LoRAConfig, groups: ParallelGroups, *, head, seed: int):
        super().__init__()
        import copy

        gpt = unwrap(policy)
        if not has_lora(gpt):
            raise LoRAError("the critic's adapters go on a policy with LoRA attached (attach_lora first)")
        self.__dict__["_gpt"] = gpt  # not a child: the base is the policy's
        self.config = copy.copy(gpt.config)
        # what megatron's schedule and grad finalisation read off the model they are given
        self.pre_process, self.post_process, self.model_type = gpt.pre_process, gpt.post_process, gpt.model_type
        self.share_embeddings_and_output_weights = False
        self.adapters = nn.ModuleDict()  # keys "<global layer index>_<target>": the same under every PP layout
        for layer in gpt.decoder.layers:
            for target in cfg.target_modules:
                base = getattr(getattr(layer, LINEARS[target].parent), target)
                gen = torch.Generator().manual_seed(
                    zlib.crc32(f"critic:{seed}:{layer.layer_number}:{target}".encode()))
                adapter = LoRAAdapter(base, parallel_mode=_parallel_mode(base, target), rank=cfg.rank,
                                      scaling=cfg.scaling, dropout=cfg.dropout, groups=groups, generator=gen,
                                      gated=_gated(target, gpt))
                adapter.enabled = False
                self.adapters[f"{layer.layer_number - 1}_{target}"] = adapter
                base.__dict__["_hpa_lora_critic"] = adapter
        self.value_head = head
        self.tp_group = groups.tp_group

    @property
    def base(self) -> nn.Module:
        """The policy's GPTModel this critic runs on."""
        return self.__dict__["_gpt"]

    def forward(self, *args, **kwargs):
        with _critic_mode(self.base, list(self.adapters.values()), self.value_head):
            return self.base(*args, **kwargs)

    def set_input_tensor(self, input_tensor) -> None:  # pipeline stages after the first
        self.base.set_input_tensor(input_tensor)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The critic's adapters and value head (the value head replicated over TP) as megatron sharded tensors."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = {}
        for key, adapter in self.adapters.items():
            out.update(adapter.sharded_state_dict(f"{prefix}adapters.{key}.", (), metadata))
        if self.value_head is not None:
            state = self.value_head.state_dict(prefix="", keep_vars=True)
            out.update(make_sharded_tensors_for_checkpoint(state, f"{prefix}value_head.", {}, (),
                                                           tp_group=self.tp_group,
                                                           dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return out


def merged_weight(weight: torch.Tensor, adapter) -> torch.Tensor:
    """``W + scaling · B A`` computed in fp32 and rounded once to ``W``'s dtype. In bf16, rounding ``B A`` and
    its scaling first, then the sum, loses more of a small update than the one rounding the merged weight
    cannot avoid (docs/lora.md, "vLLM")."""
    delta = (adapter.B.detach().float() @ adapter.A.detach().float()) * adapter.scaling
    return (weight.detach().float() + delta).to(weight.dtype)


def merged_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """This rank's local state dict with every adapted weight replaced by ``W + scaling · B A`` (its shard)
    and the adapter keys left out: what a model without LoRA loads to compute the same forward."""
    gpt = unwrap(model)
    state = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
             for k, v in gpt.state_dict().items() if not is_adapter_key(k)}
    with torch.no_grad():
        for name, adapter in adapters(gpt):
            key = name[:-len(SUFFIX)] + ".weight"
            state[key] = merged_weight(state[key], adapter)
    return state


def merge_adapters_(model: nn.Module) -> None:
    """Fold every adapter into its base weight in place and zero its B (the forward is unchanged). For
    export and weight sync; the base is no longer the reference afterwards."""
    gpt = unwrap(model)
    gpt.__dict__.pop(_FINGERPRINT, None)  # the base changes
    modules = dict(gpt.named_modules())
    with torch.no_grad():
        for name, adapter in adapters(gpt):
            base = modules[name[:-len(SUFFIX)]]
            base.weight.copy_(merged_weight(base.weight, adapter))
            adapter.B.zero_()


# ------------------------------------------------------------------------------------------------
# checkpoints: with LoRA a model's checkpoint holds its adapters only (the base is frozen and comes from
# model.policy_path), marked by MARKER beside megatron's files

MARKER = LORA_RECORD


def checkpoint_state_dict(model: nn.Module, sharded: Dict) -> Dict:
    """What a run checkpoint saves of ``model`` from its full sharded state dict: everything without LoRA,
    the adapter tensors only with it."""
    if not has_lora(model) or isinstance(unwrap(model), CriticView):  # a critic's state is all trained
        return sharded
    return {k: v for k, v in sharded.items() if is_adapter_key(k)}


def adapter_targets(model: nn.Module) -> List[str]:
    """The targets (``linear_qkv``, ...) the adapters of ``model`` (a policy or a ``CriticView``) sit on."""
    names = [name.rsplit(".", 1)[-1] for name, _ in adapters(model)]
    return sorted({t for t in LINEARS for n in names if n in (t + SUFFIX, t) or n.endswith("_" + t)})


_FINGERPRINT = "_hpa_base_fingerprint"  # cached on the GPTModel: the base is frozen
_CHUNK = 1 << 24  # elements summed at a time: a 128 MiB int64 temporary at most


def base_fingerprint(model: nn.Module, groups: ParallelGroups) -> Dict:
    """What identifies the frozen base under ``model``'s adapters: its shape (``config``) and a checksum of its
    weights, the same under every TP/PP layout and weight dtype. Collective over the model-parallel group.

    The checksum sums, over every base element, the int16 bit pattern of the element rounded to bf16, in int64.
    Integer addition is exact and order-free, so any sharding and reduction order give the same number (a
    float sum would not); rounding to bf16 first gives one number whether the base is held in fp32 or bf16;
    one pass over the weights, no hashing. Elements replicated over TP count on TP rank 0 only, the tied output
    layer of the last pipeline stage (a copy of the embedding) not at all. A permutation of the same values
    would give the same checksum; another base of the same shape does not."""
    gpt = unwrap(model)
    gpt = getattr(gpt, "base", gpt)  # a CriticView: the policy's GPTModel
    cached = gpt.__dict__.get(_FINGERPRINT)
    if cached is not None:
        return cached
    total = torch.zeros(2, dtype=torch.int64, device=next(gpt.parameters()).device)  # [checksum, elements]
    for name, p in gpt.named_parameters():
        if is_adapter_key(name) or (name == "output_layer.weight" and gpt.share_embeddings_and_output_weights):
            continue
        if not getattr(p, "tensor_model_parallel", False) and groups.tp_rank != 0:
            continue
        for chunk in p.detach().reshape(-1).split(_CHUNK):  # bounded temporaries on a large shard
            total[0] += chunk.to(torch.bfloat16).view(torch.int16).to(torch.int64).sum()
        total[1] += p.numel()
    comm.all_reduce_sum(total, groups.mp_group)
    c = gpt.config
    info = {"config": {"num_layers": c.num_layers, "hidden_size": c.hidden_size, "ffn_hidden_size": c.ffn_hidden_size,
                       "num_attention_heads": c.num_attention_heads, "num_query_groups": c.num_query_groups},
            "checksum": int(total[0]), "num_elements": int(total[1])}
    gpt.__dict__[_FINGERPRINT] = info
    return info


def write_marker(directory, model: nn.Module, fingerprint: Optional[Dict] = None) -> None:
    """Mark a checkpoint directory as adapter-only (main rank, after the shards are written), with the adapters'
    settings and the base's ``fingerprint`` (``base_fingerprint``, computed on every rank before)."""
    import json
    from pathlib import Path

    gpt = unwrap(model)
    found = [a for _, a in adapters(gpt)]
    info = {"adapters_only": True, "rank": int(found[0].A.shape[0]), "scaling": found[0].scaling,
            "num_adapters": len(found), "target_modules": adapter_targets(gpt)}
    if fingerprint is not None:
        info["base"] = fingerprint
    (Path(directory) / MARKER).write_text(json.dumps(info, indent=1))


def read_marker(directory) -> Dict:
    import json
    from pathlib import Path

    path = Path(directory) / MARKER
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{path}: unreadable ({type(exc).__name__}: {exc}); it marks an adapter checkpoint "
                        f"and records its LoRA settings") from None


def check_marker(directory, model: nn.Module, groups: ParallelGroups, *, base_key: str = "model.policy_path"
                 ) -> None:
    """Refuse adapters of ``directory`` that ``model`` would load with other settings, onto other targets, or
    over another base (``base_key`` names where the base came from). A marker without a base fingerprint
    (written before it was recorded) is a warning. Collective (the base's checksum)."""
    import logging
    from pathlib import Path

    info, path = read_marker(directory), Path(directory) / MARKER
    found = [a for _, a in adapters(model)]
    if not found:
        raise LoRAError(f"{directory} holds LoRA adapters but the model has none: set model.lora.rank: "
                        f"{info.get('rank')} (and the run's alpha and target_modules)")
    mismatch = lora_record_mismatch(info, directory, rank=int(found[0].A.shape[0]), scaling=found[0].scaling,
                                    targets=adapter_targets(model))
    if mismatch is not None:
        raise LoRAError("%s: %s" % mismatch)
    mine = base_fingerprint(model, groups)
    base = info.get("base")
    if base is None:
        if groups.is_main:
            logging.getLogger(__name__).warning(
                "%s records no fingerprint of the base its adapters were trained on (written by an older hpa); "
                "%s is not checked against it", path, base_key)
        return
    if base.get("config") != mine["config"] or base.get("checksum") != mine["checksum"]:
        what = ("another shape" if base.get("config") != mine["config"] else "other weights")
        raise LoRAError(f"{base_key}: the base has {what} than the one the adapters of {directory} were trained "
                        f"on (its checksum {mine['checksum']}, recorded {base.get('checksum')} in {path}); "
                        f"give the base they were trained on")


def check_checkpoint_kind(directory, model: nn.Module) -> None:
    """Refuse an adapter-only checkpoint for a model without LoRA, and a full one for a model with it."""
    from pathlib import Path

    adapter_only, wanted = (Path(directory) / MARKER).is_file(), has_lora(model)
    if adapter_only and not wanted:
        raise LoRAError(f"{directory} is a LoRA checkpoint (adapters only, {MARKER}); it cannot be loaded as a "
                        f"full model: load it with model.lora.rank > 0 over its base (model.policy_path), or "
                        f"export the merged model first")
    if wanted and not adapter_only:
        raise LoRAError(f"{directory} is a full-model checkpoint, but this run trains LoRA adapters "
                        f"(model.lora.rank > 0): start a LoRA run from it with model.policy_path, or resume it "
                        f"with model.lora.rank: 0")
