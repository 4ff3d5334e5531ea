"""``hpa plan``: exact parameter counts, the 70B plan, and the estimate against measured memory.

The accuracy check measures **static memory only** (parameters, fp32 main grads and Adam state,
summed over the unique tensor storages megatron actually allocates after one optimizer step) on
CPU ranks built with ``build_policy`` + ``wrap_ddp`` + ``build_optimizer``, and asserts the
planner's parameters + gradients + optimizer estimate is within 15% (it is exact up to torch's
one-element ``step`` tensors). Activations and the KV cache are not measured: peak RSS on a shared
CPU box is too noisy to check a 15% bound honestly.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from multirank import layout_id, run_ranks

ROOT = Path(__file__).resolve().parent.parent


def tiny_cfg(tp=1, pp=1, distributed_optimizer=False):
    from hpa.config import load_config

    return load_config(ROOT / "configs" / "tiny_cpu.yaml", [
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        f"parallel.use_distributed_optimizer={str(distributed_optimizer).lower()}",
        "model.num_layers=4", "model.hidden_size=64", "model.ffn_hidden_size=160", "model.vocab_size=250",
        "model.add_qkv_bias=true"])


def llama2_7b():
    from hpa.config.schema import ModelConfig

    return ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                       vocab_size=32000, max_sequence_length=4096, params_dtype="bfloat16")


def test_llama2_7b_parameter_count():
    from hpa.plan import count_parameters, stage_parameters

    m = llama2_7b()
    assert count_parameters(m) == pytest.approx(6.74e9, rel=0.01)
    assert count_parameters(m) == 6_738_415_616  # Llama-2-7b-hf's exact count
    # TP shards the linear layers, replicates the norms; PP splits layers, embedding first, output last
    stages = stage_parameters(m, tp=2, pp=2)
    assert stages[1] - stages[0] == 4096  # the final norm
    assert sum(stages) * 2 == pytest.approx(count_parameters(m), rel=1e-3)
    tied = dataclasses.replace(m, untie_embeddings_and_output_weights=False)
    assert count_parameters(m) - count_parameters(tied) == 32000 * 4096


def test_7b_plan_sane():
    from hpa.config import load_config
    from hpa.plan import plan

    cfg = load_config(ROOT / "configs" / "llama2_70b.yaml", [
        "model.num_layers=32", "model.hidden_size=4096", "model.num_attention_heads=32",
        "model.num_query_groups=32", "model.ffn_hidden_size=11008", "model.max_sequence_length=2048",
        "data.max_prompt_length=512", "rollout.max_new_tokens=512",
        "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
        "parallel.sequence_parallel=false", "parallel.use_distributed_optimizer=false"])
    result = plan(cfg, world_size=8, gpu_memory_gb=80)
    policy = result["models"]["policy"]
    assert policy["parameters"] == 6_738_415_616
    # bf16 weights 2 B, fp32 grads 4 B, Adam 12 B per parameter
    assert policy["params_gb"] == pytest.approx(13.48, rel=1e-3)
    assert policy["grads_gb"] == pytest.approx(26.95, rel=1e-3)
    assert policy["optimizer_gb"] == pytest.approx(80.86, rel=1e-3)
    assert policy["optimizer_gb_distributed"] == pytest.approx(80.86 / 8, rel=1e-3)
    acts = policy["activations_gb_by_recompute"]
    assert acts["full"] < acts["selective"] < acts["none"]
    assert not result["fits"] and result["suggestions"]
    assert any("use_distributed_optimizer" in " ".join(s["changes"]) for s in result["suggestions"])
    assert all(s["total_gb"] <= 80 for s in result["suggestions"])


def test_70b_plan_and_cli(capsys):
    from hpa.plan import main

    assert main(["--config", str(ROOT / "configs" / "llama2_70b.yaml"), "--world-size", "64",
                 "--gpu-memory-gb", "80"]) == 0
    text = capsys.readouterr().out
    assert "TP8 x PP4 x DP2" in text and "FITS" in text
    for name in ("policy", "critic", "reference", "reward"):
        assert name in text
    main(["--config", str(ROOT / "configs" / "llama2_70b.yaml"), "--world-size", "64",
          "--gpu-memory-gb", "80", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["models"]["policy"]["parameters"] == pytest.approx(69e9, rel=0.01)
    assert 40 < result["total_gb"] < 80
    # without the distributed optimizer and recomputation it does not fit, and the plan says what helps
    rc = main(["--config", str(ROOT / "configs" / "llama2_70b.yaml"), "--world-size", "64",
               "--gpu-memory-gb", "80", "--json", "parallel.use_distributed_optimizer=false",
               "model.recompute_granularity=null"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 1 and not result["fits"] and result["suggestions"]


def test_bad_layout_is_a_config_error(capsys):
    from hpa.plan import main

    assert main(["--world-size", "3", "--gpu-memory-gb", "80",
                 "parallel.tensor_model_parallel_size=2"]) == 2
    assert "tensor_model_parallel_size" in capsys.readouterr().err


def measure_worker(groups, cfg):
    """Bytes held by parameters, main grads and optimizer state after one optimizer step."""
    import torch

    from hpa.models import build_policy
    from hpa.trainer.optimizer import build_optimizer, wrap_ddp
    from hpa.trainer.step import optimizer_step, zero_grad

    torch.manual_seed(0)
    model = build_policy(cfg.model, cfg.parallel, groups)
    ddp = wrap_ddp(model, cfg.parallel, groups)
    opt = build_optimizer(ddp, cfg.optim, cfg.parallel, groups)
    zero_grad(ddp, opt)
    for p in ddp.parameters():
        p.main_grad.fill_(1e-3)
    optimizer_step(opt)

    def storage_bytes(tensors):
        seen = {}
        for t in tensors:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return seen

    params = storage_bytes(p.data for p in model.parameters())
    grads = storage_bytes(p.main_grad for p in model.parameters())
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    state = [t for o in inner for s in o.state.values() for t in s.values()
             if torch.is_tensor(t) and t.dim() > 0]  # leaves out torch's one-element `step`
    masters = [p for o in inner for g in o.param_groups for p in g["params"]]
    opt_bytes = storage_bytes(state)
    opt_bytes.update({k: v for k, v in storage_bytes(masters).items() if k not in params})
    return {"params": sum(params.values()), "grads": sum(grads.values()),
            "optimizer": sum(opt_bytes.values()),
            "numel": sum(p.numel() for p in model.parameters())}


LAYOUTS = [dict(tp=2, pp=1, dp=1, distributed_optimizer=False),
           dict(tp=1, pp=2, dp=2, distributed_optimizer=True)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: layout_id(l["tp"], l["pp"], l["dp"])
                         + ("_distopt" if l["distributed_optimizer"] else ""))
def test_static_estimate_matches_measured(layout):
    from hpa.plan import plan

    tp, pp, dp, dist = layout["tp"], layout["pp"], layout["dp"], layout["distributed_optimizer"]
    cfg = tiny_cfg(tp, pp, dist)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, backend="gloo"))
    measured = run_ranks(measure_worker, tp=tp, pp=pp, dp=dp, args=(cfg,),
                         parallel_kwargs={"use_distributed_optimizer": dist})
    worst = max(measured, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
    result = plan(cfg, world_size=tp * pp * dp, gpu_memory_gb=80)
    policy = result["models"]["policy"]
    assert policy["parameters_per_gpu"] == max(r["numel"] for r in measured)
    for key, est in (("params", policy["params_gb"]), ("grads", policy["grads_gb"]),
                     ("optimizer", policy["optimizer_gb"])):
        assert est * 1e9 == pytest.approx(worst[key], rel=0.15), (key, est * 1e9, worst[key])
    total_est = policy["static_gb"] * 1e9
    total_measured = worst["params"] + worst["grads"] + worst["optimizer"]
    assert abs(total_est - total_measured) / total_measured < 0.15
    print(f"{layout_id(tp, pp, dp)}: estimated {total_est:.0f} B, measured {total_measured:.0f} B, "
          f"error {100 * (total_est - total_measured) / total_measured:+.2f}%")
