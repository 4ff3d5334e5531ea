"""The policy stack: policy, reference and critic, with LoRA or full weights, built in one place.

Training (``hpa.trainer.setup``), generation and serving (``hpa.inference``) call ``build_policy_stack``;
adapter I/O (``hpa.models.lora_io``) builds its base plus adapters with ``lora_io.build_lora_model``, the same
function the stack's LoRA policy comes from. With LoRA there is one frozen base: the policy is the base plus
its adapters, the reference is the same module with the adapters off (``BaseView``) and the critic is its own
adapter set and value head over it (``CriticView``). Without LoRA the reference is its own frozen model (from
``model.reference_path``, else a copy of the loaded policy) and the critic a value model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from hpa.config.schema import ModelConfig, ParallelConfig
from hpa.distributed.groups import ParallelGroups

from .builders import build_policy, build_reference, build_value, value_head
from .heads import unwrap
from .lora import BaseView, CriticView
from .lora_io import build_lora_model
from .weights import load_model_weights

REFERENCE_KINDS = ("frozen", "policy", "none")


@dataclass
class PolicyStack:
    """The models of one run, built and loaded, none wrapped for training.

    Attributes:
        policy: the policy GPTModel (with LoRA: the base with its adapters attached, the base frozen).
        reference: the frozen reference (with LoRA: ``BaseView(policy)``), the policy itself, or None.
        critic: the value model (with LoRA: a ``CriticView`` over the policy's base), or None.
    """

    policy: nn.Module
    reference: Optional[nn.Module]
    critic: Optional[nn.Module]


def build_policy_stack(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups, *, seed: int,
                       reference: str = "frozen", critic: bool = False,
                       adapter_key: str = "model.policy_path") -> PolicyStack:
    """Build and load the policy (``model.policy_path``; with LoRA plus ``model.lora``'s adapters, loaded from
    ``model.lora.adapter_path`` when set), its reference and, with ``critic``, the critic.

    Args:
        seed: draws the adapters' A (and the critic's, from another stream).
        reference: ``frozen``: the frozen reference (LoRA: the base; else ``model.reference_path``, or a copy of
            the loaded policy); ``policy``: the policy itself (a KL against it is 0); ``none``: no reference.
        critic: build the critic (LoRA: adapters and a fresh value head over the base; else a value model from
            ``model.critic_path``, else the policy's backbone, its output layer fresh).
        adapter_key: where the base came from, named when the adapters were trained on another base.
    """
    if reference not in REFERENCE_KINDS:
        raise ValueError(f"reference={reference!r}; choose one of {REFERENCE_KINDS}")
    if model.lora.enabled:
        policy = build_lora_model(model, parallel, groups, model.policy_path, seed=seed,
                                  adapter_path=model.lora.adapter_path, base_key=adapter_key)
        ref = {"frozen": BaseView(policy), "policy": policy, "none": None}[reference]
        value = None
        if critic:
            head = (value_head(model, groups, sequence_parallel=unwrap(policy).config.sequence_parallel)
                    if groups.is_last_stage else None)
            value = CriticView(policy, model.lora, groups, head=head, seed=seed)
        return PolicyStack(policy, ref, value)
    policy = build_policy(model, parallel, groups)
    if model.policy_path:
        load_model_weights(policy, model.policy_path, groups)
    ref = policy if reference == "policy" else None
    if reference == "frozen":
        ref = build_reference(model, parallel, groups)
        if model.reference_path:
            load_model_weights(ref, model.reference_path, groups)
        else:  # the frozen reference is the initial policy
            ref.load_state_dict(policy.state_dict())
    value = None
    if critic:
        value = build_value(model, parallel, groups)
        start = model.critic_path or model.policy_path
        if start:
            load_model_weights(value, start, groups, exclude_prefixes=("output_layer.",))
    return PolicyStack(policy, ref, value)
