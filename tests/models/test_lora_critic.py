"""The critic of a LoRA run (hpa.models.lora.CriticView, docs/lora.md): its own adapters and value head over the
policy's frozen base, built by hpa.trainer.setup.build_models with ``algorithm.advantage.estimator: gae``."""

import dataclasses
from pathlib import Path

import pytest
import torch

import lora_critic_workers as W
from multirank import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tp=1, pp=1, sp=False):
    from hpa.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml",
                      ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.advantage.estimator=gae",
                       f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
                       f"parallel.sequence_parallel={str(sp).lower()}", "optim.lr=1e-2", "optim.lr_warmup_fraction=0"],
                      world_size=tp * pp)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, backend="gloo"))


@pytest.fixture(scope="module")
def critic_tp1():
    return run_ranks(W.critic_worker, args=(_cfg(),))[0]


@pytest.mark.multirank
@pytest.mark.parametrize("tp,pp,sp", [(2, 1, True), (1, 2, False)], ids=["tp2_sp", "pp2"])
def test_critic_over_the_shared_base_under_tp_sp_and_pp(tp, pp, sp):
    """The same invariants on every rank of TP2+SP and PP2 (the last stage holds the value head and log-probs);
    the plan's critic row is the largest rank's (it counts the value head on every stage)."""
    from hpa.plan import plan

    ranks = run_ranks(W.critic_worker, tp=tp, pp=pp, args=(_cfg(tp, pp, sp),))
    last = ranks[-1]
    for r in ranks:
        assert all(n.startswith(("adapters.", "value_head.")) for n in r["critic_names"])
        assert r["critic_base_is_policy"] and r["critic_shares_no_param_with_policy"]
        assert r["critic_grad_buffers_are_critic"] and r["policy_grad_buffers_are_adapters"]
        assert r["critic_optimizer_params_are_critic"] and r["critic_B_norm"] > 0
        assert r["policy_adapters_unchanged_by_critic"] and r["policy_adapters_no_grad_from_critic"]
        assert r["critic_unchanged_by_policy_step"] and r["base_bit_identical"] and r["base_same_storage"]
    assert last["critic_losses"][-1] < last["critic_losses"][0]
    assert torch.equal(last["logp_with_critic"], last["logp_before"])
    assert torch.equal(last["logp_with_critic"], last["logp_without_critic"])
    assert torch.equal(last["reference_with_critic"], last["reference_without_critic"])
    critic = plan(_cfg(tp, pp, sp), world_size=tp * pp, gpu_memory_gb=80)["models"]["critic"]
    assert critic["trainable_per_gpu"] == max(r["critic_numel"] for r in ranks)


@pytest.mark.multirank
def test_critic_trains_only_its_adapters_and_value_head_tp1(critic_tp1):
    r = critic_tp1
    names = r["critic_names"]
    assert names and all(n.startswith("adapters.") or n.startswith("value_head.") for n in names), names
    assert {"value_head.weight", "value_head.bias"} <= set(names)
    assert len([n for n in names if n.startswith("adapters.")]) == 2 * 4 * 2  # layers x targets x (A, B)
    assert r["critic_base_is_policy"] and r["critic_shares_no_param_with_policy"]
    assert r["critic_grad_buffers_are_critic"] and r["policy_grad_buffers_are_adapters"]
    assert r["critic_optimizer_params_are_critic"]
    assert r["num_hooked"] == 2 * 4
    # it trained: the loss fell and its adapters moved off B = 0
    assert r["critic_losses"][-1] < r["critic_losses"][0] and r["critic_B_norm"] > 0


@pytest.mark.multirank
def test_critic_leaves_the_policy_and_base_alone_tp1(critic_tp1):
    r = critic_tp1
    assert r["policy_adapters_unchanged_by_critic"] and r["policy_adapters_no_grad_from_critic"]
    assert torch.equal(r["logp_with_critic"], r["logp_before"])
    assert torch.equal(r["logp_with_critic"], r["logp_without_critic"])
    assert torch.equal(r["reference_with_critic"], r["reference_without_critic"])
    assert r["critic_unchanged_by_policy_step"] and r["policy_moved"]
    assert r["base_bit_identical"] and r["base_same_storage"]


@pytest.mark.multirank
def test_plan_counts_the_critic_as_built_tp1(critic_tp1):
    """hpa plan's critic row with LoRA: the critic's adapters + value head, no base of its own."""
    from hpa.plan import plan

    models = plan(_cfg(), world_size=1, gpu_memory_gb=80)["models"]
    critic = models["critic"]
    assert critic["shares_base"]
    assert critic["parameters_per_gpu"] == critic["trainable_per_gpu"] == critic_tp1["critic_numel"]
    assert models["policy"]["parameters_per_gpu"] == critic_tp1["policy_numel"]
