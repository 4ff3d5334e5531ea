"""``build_policy_stack``: what each reference and critic kind is, with LoRA (one shared base) and without."""

import dataclasses

import pytest
import torch


def model_config(**lora):
    from hpa.config.schema import LoRAConfig, ModelConfig

    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                       vocab_size=64, max_sequence_length=16, make_vocab_size_divisible_by=16,
                       untie_embeddings_and_output_weights=True, lora=LoRAConfig(**lora))


def _state(model):
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def test_full_stack_reference_is_a_frozen_copy_and_critic_a_value_model(groups):
    from hpa.config.schema import ParallelConfig
    from hpa.models.stack import build_policy_stack

    torch.manual_seed(0)
    stack = build_policy_stack(model_config(), ParallelConfig(), groups, seed=0, critic=True)
    assert stack.reference is not stack.policy
    assert not any(p.requires_grad for p in stack.reference.parameters())
    ref = _state(stack.reference)
    assert all(torch.equal(ref[k], v) for k, v in _state(stack.policy).items())
    assert tuple(stack.critic.output_layer.weight.shape)[0] == 1  # one value per token, not the vocabulary
    same = build_policy_stack(model_config(), ParallelConfig(), groups, seed=0, reference="policy")
    assert same.reference is same.policy and same.critic is None
    assert build_policy_stack(model_config(), ParallelConfig(), groups, seed=0, reference="none").reference is None
    with pytest.raises(ValueError, match="reference"):
        build_policy_stack(model_config(), ParallelConfig(), groups, seed=0, reference="copy")


def test_lora_stack_shares_one_base(groups):
    from hpa.config.schema import ParallelConfig
    from hpa.models.lora import BaseView, CriticView, adapters, has_lora
    from hpa.models.stack import build_policy_stack

    stack = build_policy_stack(model_config(rank=4, alpha=8.0), ParallelConfig(), groups, seed=3, critic=True)
    assert has_lora(stack.policy) and isinstance(stack.reference, BaseView) and isinstance(stack.critic, CriticView)
    assert stack.critic.base is stack.policy  # the critic's adapters sit on the policy's base: no copy
    trainable = [n for n, p in stack.policy.named_parameters() if p.requires_grad]
    assert trainable and all("_lora." in n for n in trainable)
    again = build_policy_stack(model_config(rank=4, alpha=8.0), ParallelConfig(), groups, seed=3)
    a = dict(adapters(stack.policy))
    for name, adapter in adapters(again.policy):  # the seed draws the adapters' A
        assert torch.equal(adapter.A, a[name].A)
    other = build_policy_stack(model_config(rank=4, alpha=8.0), ParallelConfig(), groups, seed=4, reference="none")
    assert not torch.equal(next(iter(adapters(other.policy)))[1].A, next(iter(a.values())).A)
    assert other.reference is None and other.critic is None
    assert dataclasses.is_dataclass(other)
