"""Workers of tests/models/test_lora_critic.py (gloo ranks via tests/multirank.py): the LoRA run's models as
``hpa.trainer.setup.build_models`` builds them with a critic, a few critic and policy steps, and what the tests
compare."""

from __future__ import annotations

import torch


def _micro_batches(vocab, num=2, b=2, s=12, seed=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = torch.randint(0, vocab, (b, s + 1), generator=g)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(s).expand(b, s)})
    return out


def _log_probs(model, groups, mbs):
    from hpa.engine.step import forward_backward
    from hpa.ops.vocab_parallel import vocab_parallel_log_probs

    def fn(batch, logits, hidden):
        return logits.sum() * 0, {"logp": vocab_parallel_log_probs(logits, batch["labels"], groups.tp_group)}

    with torch.no_grad():
        out = forward_backward(model, mbs, fn, groups, forward_only=True)
    return torch.cat([o["logp"] for o in out]).detach().clone() if groups.is_last_stage else None


def _steps(trainable, groups, mbs, loss_of, num):
    from hpa.engine.step import forward_backward, optimizer_step, zero_grad

    losses = []
    for _ in range(num):
        zero_grad(trainable.model, trainable.optimizer)
        res = forward_backward(trainable.model, mbs, loss_of, groups)
        assert optimizer_step(trainable.optimizer)[0]
        losses.append(float(sum(r["loss"] for r in res)) if groups.is_last_stage else None)
    return losses


def _snapshot(params):
    return {k: p.detach().clone() for k, p in params.items()}


def critic_worker(groups, cfg):
    """build_models with LoRA + GAE; 3 value-regression steps of the critic, then 1 NLL step of the policy."""
    from hpa.models import unwrap
    from hpa.models.lora import CriticView, adapter_parameters, is_adapter_key
    from hpa.ops.vocab_parallel import vocab_parallel_log_probs
    from hpa.trainer.setup import build_models

    torch.manual_seed(0)
    policy, reference, critic = build_models(cfg, groups)
    gpt, view = unwrap(policy.model), unwrap(critic.model)
    assert isinstance(view, CriticView)
    mbs = _micro_batches(cfg.model.vocab_size)
    base = {k: p for k, p in gpt.named_parameters() if not is_adapter_key(k)}
    base_before, base_ptrs = _snapshot(base), {k: p.data_ptr() for k, p in base.items()}
    policy_adapters = adapter_parameters(gpt)
    critic_params = dict(view.named_parameters())
    critic_ids = {id(p) for p in critic_params.values()}
    out = {"critic_names": sorted(critic_params), "critic_numel": sum(p.numel() for p in critic_params.values()),
           "policy_numel": sum(p.numel() for p in gpt.parameters()),
           "critic_base_is_policy": view.base is gpt,
           "critic_shares_no_param_with_policy": not critic_ids & {id(p) for p in gpt.parameters()},
           "critic_grad_buffers_are_critic": {id(p) for b in critic.model.buffers for p in b.params} == critic_ids,
           "policy_grad_buffers_are_adapters": {id(p) for b in policy.model.buffers for p in b.params}
           == {id(p) for p in policy_adapters.values()},
           "logp_before": _log_probs(policy.model, groups, mbs)}
    policy_adapters_before = _snapshot(policy_adapters)

    def value_loss(batch, values, hidden):  # [b, s, 1] -> regress every position to 0.5
        loss = ((values[..., 0] - 0.5) ** 2).mean() / len(mbs)
        return loss, {"loss": loss.detach()}

    out["critic_losses"] = _steps(critic, groups, mbs, value_loss, 3)
    out["critic_optimizer_params_are_critic"] = (
        {id(p) for g in critic.optimizer.param_groups for p in g["params"]} == critic_ids
        and {id(p) for p in critic.optimizer.optimizer.state} == critic_ids)
    out["critic_B_norm"] = sum(float(a.B.detach().norm()) for a in view.adapters.values())
    out["policy_adapters_unchanged_by_critic"] = all(
        torch.equal(policy_adapters_before[k], p) for k, p in policy_adapters.items())
    out["policy_adapters_no_grad_from_critic"] = all(
        getattr(p, "main_grad", None) is None or not p.main_grad.any() for p in policy_adapters.values())
    # the policy's forward with the trained critic adapters hooked in, and with them unhooked
    out["logp_with_critic"] = _log_probs(policy.model, groups, mbs)
    out["reference_with_critic"] = _log_probs(reference, groups, mbs)
    hooked = [m for m in gpt.modules() if "_hpa_lora_critic" in m.__dict__]
    saved = [m.__dict__.pop("_hpa_lora_critic") for m in hooked]
    out["logp_without_critic"] = _log_probs(policy.model, groups, mbs)
    out["reference_without_critic"] = _log_probs(reference, groups, mbs)
    for m, a in zip(hooked, saved):
        m.__dict__["_hpa_lora_critic"] = a
    out["num_hooked"] = len(hooked)
    critic_before = _snapshot(critic_params)

    def nll(batch, logits, hidden):
        loss = -vocab_parallel_log_probs(logits, batch["labels"], groups.tp_group).mean() / len(mbs)
        return loss, {"loss": loss.detach()}

    _steps(policy, groups, mbs, nll, 1)
    out["critic_unchanged_by_policy_step"] = all(torch.equal(critic_before[k], p) for k, p in critic_params.items())
    out["policy_moved"] = any(not torch.equal(policy_adapters_before[k], p) for k, p in policy_adapters.items())
    out["base_bit_identical"] = all(torch.equal(base_before[k], p) for k, p in base.items())
    out["base_same_storage"] = all(p.data_ptr() == base_ptrs[k] for k, p in base.items())
    return out
