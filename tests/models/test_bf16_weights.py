"""A bf16 model built with the local spec holds every weight in bf16, its norms included.

megatron's ``WrappedTorchNorm`` builds ``torch.nn.RMSNorm`` / ``LayerNorm`` without a dtype and leaves the cast to
``Float16Module``, which hpa does not use; the norms then kept fp32 weights, every norm of a bf16 run took torch's
unfused path (bf16 input, fp32 weight) and megatron's plain mixed-precision optimizer could not save its state
(it maps the state of its bf16 parameters only). The builders refuse bf16 on the CPU, so these tests give them
the bf16 ``TransformerConfig`` a GPU run gets. Checkpoints written by the builder before the change (fp32 norm
weights) still load as weights; a distributed optimizer's state from then does not, and says what to do.
"""

import dataclasses

import pytest
import torch

from multirank import run_ranks

pytestmark = pytest.mark.multirank

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
             vocab_size=48, max_sequence_length=32, make_vocab_size_divisible_by=16, params_dtype="bfloat16")


def _bf16_on_cpu():
    from hpa.models import builders

    fp32_config = builders.transformer_config

    def bf16_config(model, parallel, groups):
        config = fp32_config(dataclasses.replace(model, params_dtype="float32"), parallel, groups)
        return dataclasses.replace(config, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True)

    builders.transformer_config = bf16_config


def _as_before(model):
    """The model the builder made before the norms were cast: norm weights in fp32, of values that are not the
    initial ones (so a load that skipped them would show)."""
    g = torch.Generator().manual_seed(5)
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.float()
            with torch.no_grad():
                for p in module.parameters():
                    p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)).bfloat16())
    return model


def _trained(model, parallel, groups):
    from hpa.config.schema import OptimConfig
    from hpa.engine.optimizer import make_trainable
    from hpa.engine.step import optimizer_step, zero_grad

    trainable = make_trainable(model, OptimConfig(), parallel, groups, 10)
    zero_grad(trainable.model, trainable.optimizer)
    for p in trainable.model.parameters():
        p.main_grad.fill_(1e-3)
    optimizer_step(trainable.optimizer)
    return trainable


def _error(fn):
    try:
        fn()
    except Exception as exc:  # reported to the test, which names what it expected
        return f"{type(exc).__name__}: {exc}"
    return None


def bf16_worker(groups, directory):
    import warnings

    from hpa.config.schema import CheckpointConfig, LoRAConfig, ModelConfig, OptimConfig, ParallelConfig
    from hpa.engine.optimizer import make_trainable
    from hpa.models import build_policy, build_reference, build_reward, build_value
    from hpa.models.lora import attach_lora
    from hpa.models.weights import load_model_weights, save_model_weights
    from hpa.trainer.checkpoint import CheckpointManager

    _bf16_on_cpu()
    model, parallel = ModelConfig(**MODEL), ParallelConfig()
    out = {}
    torch.manual_seed(0)
    policy = build_policy(model, parallel, groups)
    ids = torch.randint(0, 48, (2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = policy(input_ids=ids, position_ids=torch.arange(8).expand(2, 8), attention_mask=None)
    out["mismatch_warnings"] = [str(w.message) for w in caught if "Mismatch dtype" in str(w.message)]
    out["logits_dtype"] = logits.dtype

    built = {"policy": policy, "reference": build_reference(model, parallel, groups),
             "value": build_value(model, parallel, groups), "reward": build_reward(model, parallel, groups, 2)}
    lora_policy = build_policy(model, parallel, groups)
    attach_lora(lora_policy, LoRAConfig(rank=4), groups, seed=0)
    built["lora"] = lora_policy
    out["dtypes"] = {kind: {n: p.dtype for n, p in m.named_parameters()} for kind, m in built.items()}
    out["lora_trainable"] = sorted(n for n, p in lora_policy.named_parameters() if p.requires_grad)

    # a run checkpoint with megatron's plain mixed-precision optimizer (the default), saved and resumed
    saved = _trained(policy, parallel, groups)
    manager = CheckpointManager(CheckpointConfig(), f"{directory}/run", groups)
    out["save_error"] = _error(lambda: manager.save(1, {"policy": saved.state()}, {"layout": groups.layout}))
    if out["save_error"] is None:
        torch.manual_seed(1)
        resumed = make_trainable(build_policy(model, parallel, groups), OptimConfig(), parallel, groups, 10)
        manager.load(manager.root / manager.name(1), {"policy": resumed.state()})
        pairs = list(zip(saved.model.parameters(), resumed.model.parameters()))
        out["resumed_weights_equal"] = all(torch.equal(a, b) for a, b in pairs)
        out["resumed_masters_equal"] = all(torch.equal(a.main_param, b.main_param) for a, b in pairs)
        out["masters_dtype"] = {b.main_param.dtype for _, b in pairs}

    # weights saved by the builder before the change (fp32 norms) load into today's bf16 model
    torch.manual_seed(2)
    old = _as_before(build_policy(model, parallel, groups))
    save_model_weights(old, f"{directory}/old_weights", groups)
    torch.manual_seed(3)
    new = build_policy(model, parallel, groups)
    load_model_weights(new, f"{directory}/old_weights", groups)
    out["old_weights_equal"] = all(torch.equal(a.bfloat16(), b) for a, b in zip(old.parameters(), new.parameters()))
    out["old_weights_dtypes"] = {p.dtype for p in new.parameters()}

    # a distributed optimizer's run checkpoint from then: its fp32 buffer has no place in today's model
    distributed = ParallelConfig(use_distributed_optimizer=True)
    torch.manual_seed(4)
    old_run = _trained(_as_before(build_policy(model, distributed, groups)), distributed, groups)
    old_manager = CheckpointManager(CheckpointConfig(), f"{directory}/old_run", groups)
    old_manager.save(1, {"policy": old_run.state()}, {"layout": groups.layout})
    fresh = make_trainable(build_policy(model, distributed, groups), OptimConfig(), distributed, groups, 10)
    out["old_distributed_error"] = _error(
        lambda: old_manager.load(old_manager.root / old_manager.name(1), {"policy": fresh.state()}))
    advised = build_policy(model, parallel, groups)  # what the error says to do
    load_model_weights(advised, old_manager.root / old_manager.name(1) / "policy", groups)
    out["advice_loads"] = all(torch.equal(a.bfloat16(), b) for a, b in zip(old_run.model.parameters(),
                                                                            advised.parameters()))
    return out


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return run_ranks(bf16_worker, args=(str(tmp_path_factory.mktemp("bf16")),))[0]


def test_every_weight_of_every_model_is_bf16_tp1_pp1_dp1(res):
    for kind, dtypes in res["dtypes"].items():
        assert {n: d for n, d in dtypes.items() if d != torch.bfloat16} == {}, kind
    assert any("layernorm" in n for n in res["dtypes"]["policy"])  # the norms are among them


def test_lora_trains_only_its_bf16_adapters_over_the_bf16_base_tp1_pp1_dp1(res):
    from hpa.models.lora import is_adapter_key

    assert res["lora_trainable"] and all(is_adapter_key(n) for n in res["lora_trainable"])


def test_a_bf16_forward_meets_no_dtype_mismatch_in_a_norm_tp1_pp1_dp1(res):
    assert res["mismatch_warnings"] == []
    assert res["logits_dtype"] == torch.bfloat16


def test_a_bf16_run_checkpoint_saves_and_resumes_with_the_plain_optimizer_tp1_pp1_dp1(res):
    assert res["save_error"] is None
    assert res["resumed_weights_equal"] and res["resumed_masters_equal"]
    assert res["masters_dtype"] == {torch.float32}  # fp32 master copies of every bf16 weight, norms included


def test_weights_saved_with_fp32_norms_load_into_the_bf16_model_tp1_pp1_dp1(res):
    assert res["old_weights_equal"]
    assert res["old_weights_dtypes"] == {torch.bfloat16}


def test_a_distributed_optimizer_checkpoint_with_fp32_norms_says_what_to_do_tp1_pp1_dp1(res):
    error = res["old_distributed_error"]
    assert error is not None and error.startswith("CheckpointError")
    assert "fp32" in error and "model.policy_path" in error
    assert res["advice_loads"]  # its weights, as a new run's starting weights
