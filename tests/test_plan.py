"""``hpa plan``: exact parameter counts, the 70B plan, and the estimate against measured memory.

Measured on CPU gloo ranks, deterministically (no RSS), with the models ``build_policy`` builds:

* **static**: parameters, fp32 main grads and Adam state, summed over the unique tensor storages
  megatron allocates after one optimizer step (``wrap_ddp`` + ``build_optimizer``); the planner is
  exact up to torch's one-element ``step`` tensors.
* **static with LoRA**: the same after ``attach_lora`` (as the trainer sets it up): the base frozen, grads
  and Adam state for the adapters only, the reference (the base with the adapters off) adding nothing.
* **activations**: one training micro-batch of the planner's largest shape through megatron DDP,
  ``hpa.engine.step.forward_backward`` and the trainer's fused head (``hpa.engine.head``: log-probs and
  entropy at the response positions, or label log-probs for pairs), under ``LiveStorages``, a
  ``TorchDispatchMode`` that adds the bytes of every storage an op creates while it is alive: the peak over
  forward *and* backward of what is allocated, gradients and the head's chunks included (parameters and
  grad buffers, made before, excluded), as a GPU allocator's ``max_memory_allocated`` would count the same
  tensors. Recompute none / selective / full, for two sizes (GQA + RMSNorm + SwiGLU; MHA + LayerNorm + GeLU
  + dropout) under TP1 and TP2, and the GPU-check config's shapes scaled down (token-budget micro-batches, a
  chunked head, a forward-only pass).
* **KV cache**: the ``.keys`` and ``.values`` a ``CachedDecoder`` allocates for the rollout batch the
  planner assumes (``global_batch_size/DP·n`` rows of prompt + new tokens); the planner is exact.
* **peak**: measured static (policy + reference) + max(measured activations, measured KV cache)
  against the planner's total.

Sequence parallelism is measured too (TP2, activations only: the KV-cache decoder refuses it). What
stays formula-only: the Transformer Engine (GPU, bf16) activation terms and pipeline parallelism
(1F1B in-flight micro-batches).
"""

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from multirank import layout_id, run_ranks

ROOT = Path(__file__).resolve().parent.parent


# two tiny sizes: the default's GQA + RMSNorm + SwiGLU, and MHA + LayerNorm + GeLU with dropout
SIZES = {
    "gqa": ["model.num_layers=4", "model.hidden_size=64", "model.ffn_hidden_size=160", "model.vocab_size=250",
            "model.add_qkv_bias=true"],
    "mha": ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=8",
            "model.num_query_groups=8", "model.ffn_hidden_size=352", "model.vocab_size=500",
            "model.normalization=LayerNorm", "model.activation=gelu", "model.hidden_dropout=0.1",
            "model.attention_dropout=0.1", "model.max_sequence_length=128", "data.max_prompt_length=64",
            "data.max_response_length=32", "rollout.max_new_tokens=32", "trainer.micro_batch_size=4"],
}


def tiny_cfg(tp=1, pp=1, distributed_optimizer=False, size="gqa", sequence_parallel=False):
    from hpa.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", [
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        f"parallel.use_distributed_optimizer={str(distributed_optimizer).lower()}",
        f"parallel.sequence_parallel={str(sequence_parallel).lower()}"]
        # the planner takes sequence parallelism only with rollouts that allow it (not the native engine)
        + (["rollout.engine=vllm"] if sequence_parallel else [])
        # the measurements decode eagerly (CPU); graph decode's bucket: test_graph_decode_keeps_its_bucket_...
        + ["rollout.cuda_graphs=false"] + SIZES[size])
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, backend="gloo"))


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
    # transformer_impl=auto without Transformer Engine installed here: megatron's local spec
    assert not result["transformer_engine"]
    te = plan(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, transformer_impl="transformer_engine")),
              world_size=8, gpu_memory_gb=80)
    # Transformer Engine's fused attention keeps no [s, s] tensor, so selective recomputation saves
    # nothing there; nor does the local spec's, one SDPA call per layer (flash attention in bf16), unless
    # attention dropout sends it through torch's math kernel on the CPU (float32) path
    te_acts = te["models"]["policy"]["activations_gb_by_recompute"]
    assert te["transformer_engine"] and te_acts["full"] < te_acts["selective"] == te_acts["none"]
    local = plan(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, transformer_impl="local")),
                 world_size=8, gpu_memory_gb=80)
    assert local["models"]["policy"]["activations_gb_by_recompute"] == acts
    local_acts = local["models"]["policy"]["activations_gb_by_recompute"]
    assert local_acts["full"] < local_acts["selective"] == local_acts["none"]
    math = plan(dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, transformer_impl="local", params_dtype="float32", attention_dropout=0.1)), world_size=8,
        gpu_memory_gb=80)["models"]["policy"]["activations_gb_by_recompute"]
    assert math["full"] < math["selective"] < math["none"]
    assert not result["fits"] and result["suggestions"]
    assert any("use_distributed_optimizer" in " ".join(s["changes"]) for s in result["suggestions"])
    assert all(s["total_gb"] <= 80 for s in result["suggestions"])


def test_70b_plan_and_cli(capsys):
    from hpa.plan import main

    assert main(["--config", str(ROOT / "configs" / "llama2_70b.yaml"), "--world-size", "64",
                 "--gpu-memory-gb", "80"]) == 0
    text = capsys.readouterr().out
    assert "TP8 x PP8 x DP1" in text and "FITS" in text
    for name in ("policy", "critic", "reference", "reward"):
        assert name in text
    main(["--config", str(ROOT / "configs" / "llama2_70b.yaml"), "--world-size", "64",
          "--gpu-memory-gb", "80", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["models"]["policy"]["parameters"] == pytest.approx(69e9, rel=0.01)
    assert 40 < result["total_gb"] < 80
    # at PP4 the training state leaves too little for vLLM's share, and the plan says what helps
    rc = main(["--config", str(ROOT / "configs" / "llama2_70b.yaml"), "--world-size", "64",
               "--gpu-memory-gb", "80", "--json", "parallel.pipeline_model_parallel_size=4",
               "model.recompute_granularity=null"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 1 and not result["fits"] and result["suggestions"]
    assert all(s["total_gb"] <= 80 for s in result["suggestions"])


def test_bad_layout_is_a_config_error(capsys):
    from hpa.plan import main

    assert main(["--world-size", "3", "--gpu-memory-gb", "80",
                 "parallel.tensor_model_parallel_size=2"]) == 2
    assert "tensor_model_parallel_size" in capsys.readouterr().err


def measure_static(groups, cfg):
    """Bytes held by parameters, main grads and optimizer state after one optimizer step, and by the
    reference model's parameters."""
    import torch

    from hpa.models import build_policy, build_reference
    from hpa.engine.optimizer import build_optimizer, wrap_ddp
    from hpa.engine.step import optimizer_step, zero_grad

    torch.manual_seed(0)
    model = build_policy(cfg.model, cfg.parallel, groups)
    if cfg.model.lora.enabled:  # the trainer's set-up: adapters over the frozen base, the reference is the base
        from hpa.models.lora import attach_lora

        attach_lora(model, cfg.model.lora, groups, seed=0)
    ddp = wrap_ddp(model, cfg.parallel, groups)
    opt = build_optimizer(ddp, cfg.optim, cfg.parallel, groups)
    zero_grad(ddp, opt)
    for p in ddp.parameters():
        if p.requires_grad:
            p.main_grad.fill_(1e-3)
    optimizer_step(opt)

    params = storage_bytes(p.data for p in model.parameters())
    grads = storage_bytes(p.main_grad for p in model.parameters() if p.requires_grad)
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    state = [t for o in inner for s in o.state.values() for t in s.values()
             if torch.is_tensor(t) and t.dim() > 0]  # leaves out torch's one-element `step`
    masters = [p for o in inner for g in o.param_groups for p in g["params"]]
    opt_bytes = storage_bytes(state)
    opt_bytes.update({k: v for k, v in storage_bytes(masters).items() if k not in params})
    if cfg.model.lora.enabled:  # BaseView(policy): no weights of its own
        reference_bytes = 0
    else:
        reference = build_reference(cfg.model, cfg.parallel, groups)
        reference_bytes = sum(storage_bytes(p.data for p in reference.parameters()).values())
    return {"params": sum(params.values()), "grads": sum(grads.values()),
            "optimizer": sum(opt_bytes.values()), "reference": reference_bytes,
            "numel": sum(p.numel() for p in model.parameters())}


def storage_bytes(tensors):
    """``{storage data_ptr: nbytes}``: every storage once, however many views of it there are."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return seen


class LiveStorages:
    """A ``TorchDispatchMode`` that counts the bytes of every tensor storage an op creates while it is alive:
    ``peak`` is the most bytes alive at once (after any op, forward or backward), as a caching allocator's
    ``max_memory_allocated`` counts on a GPU (less its block rounding). A storage is freed when its last user
    drops it (a finalizer on the storage's Python object, which torch keeps while the storage lives).
    Storages that existed before (parameters, grad buffers) are not counted."""

    def __new__(cls):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.live, self.now, self.peak = {}, 0, 0

            def _free(self, key):
                self.now -= self.live.pop(key, 0)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        storage = t.untyped_storage()
                        if id(storage) not in self.live:
                            self.live[id(storage)] = storage.nbytes()
                            self.now += storage.nbytes()
                            weakref.finalize(storage, self._free, id(storage))
                self.peak = max(self.peak, self.now)
                return out

        return Mode()


def measure_activations(groups, cfg, recompute, rows, seq_length, kind="preference", forward_only=False,
                        chunk_elements=None):
    """Peak bytes alive during one micro-batch ``[rows, seq_length]`` through the trainer's path (module
    docstring): megatron DDP, ``forward_backward``, the fused head at the response positions (rollout: log-probs
    and entropy of the last ``rollout.max_new_tokens`` positions, plus the pooled hidden states; preference:
    the label log-probs of the last ``data.max_response_length`` positions), or a forward-only pass."""
    import torch

    from hpa.algorithms.masked import mean_pool
    from hpa.engine.head import label_log_probs, response_log_probs
    from hpa.engine.micro_batch import MicroBatch
    from hpa.engine.optimizer import wrap_ddp
    from hpa.engine.step import forward_backward
    from hpa.models import build_policy

    if chunk_elements is not None:
        import hpa.ops.fused_head

        hpa.ops.fused_head.CHUNK_ELEMENTS = chunk_elements
    torch.manual_seed(0)
    model = build_policy(dataclasses.replace(cfg.model, recompute_granularity=recompute), cfg.parallel, groups)
    if cfg.model.lora.enabled:
        from hpa.models.lora import attach_lora

        attach_lora(model, cfg.model.lora, groups, seed=0)
    ddp = wrap_ddp(model, cfg.parallel, groups)
    ddp.train()
    vocab = cfg.model.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (rows, seq_length + 1), generator=gen)
    lengths = torch.full((rows,), seq_length)
    if kind == "rollout":
        r = cfg.rollout.max_new_tokens
        index = (seq_length - r - 1 + torch.arange(r)).expand(rows, r).contiguous()
        pool = torch.zeros(rows, seq_length)
        pool[:, seq_length - r:] = 1
        mb = MicroBatch.from_padded("rollout", ids[:, :-1], ids[:, 1:], lengths, response_index=index, pool_mask=pool)

        def loss_fn(batch, logits, hidden):  # logits [b, s, v/tp], hidden [b, s, h]
            logp, ent = response_log_probs(batch, logits, groups.tp_group, vocab_size=vocab, entropy=True)
            pooled = mean_pool(batch.unpack(hidden).float(), batch["pool_mask"])
            return logp.mean() + 0.01 * ent.mean() + 0.0 * pooled.sum(), {}
    else:
        mask = torch.zeros(rows, seq_length)
        mask[:, seq_length - cfg.data.max_response_length:] = 1
        mb = MicroBatch.from_padded("pairs", ids[:, :-1], ids[:, 1:], lengths, label_mask=mask)

        def loss_fn(batch, logits, hidden):
            return label_log_probs(batch, logits, groups.tp_group, vocab_size=vocab).mean(), {}

    mode = LiveStorages()
    with mode, torch.set_grad_enabled(not forward_only):  # as hpa.engine.forward runs the forward-only passes
        forward_backward(ddp, [mb], loss_fn, groups, forward_only=forward_only, capture_hidden=kind == "rollout")
    return mode.peak


def measure_kv_cache(groups, cfg, rows, positions):
    from hpa.models import build_policy
    from hpa.rollout.kv_cache import CachedDecoder

    cache = CachedDecoder(build_policy(cfg.model, cfg.parallel, groups), rows, positions)
    return sum(t.nbytes for t in cache.keys + cache.values)


def measure_worker(groups, cfgs):
    """Static memory of the first config; activations (PP1 only) and KV cache of every config.

    Args:
        cfgs: ``{size name: Config}``.
    """
    from hpa.plan import rollout_batch

    out = {"static": measure_static(groups, next(iter(cfgs.values())))}
    if groups.pipeline_model_parallel_size == 1:
        for size, cfg in cfgs.items():
            kind, (rows, seq_length) = planned_micro_batch(cfg)
            out[size] = {
                "activations": {r or "none": measure_activations(groups, cfg, r, rows, seq_length, kind)
                                for r in (None, "selective", "full")},
                # the KV-cache decoder refuses sequence parallelism (it decodes one position a step)
                "kv_cache": None if cfg.parallel.sequence_parallel else
                measure_kv_cache(groups, cfg, *rollout_batch(cfg, groups.data_parallel_size))}
    return out


def planned_micro_batch(cfg):
    """``(kind, (rows, seq_length))`` of the training micro-batch whose activations the planner counts."""
    from hpa.plan import activation_bytes, head_positions, training_micro_batches

    p = cfg.parallel
    return max(training_micro_batches(cfg).items(), key=lambda item: activation_bytes(
        cfg.model, tp=p.tensor_model_parallel_size, sequence_parallel=p.sequence_parallel,
        recompute=cfg.model.recompute_granularity, micro_batch_size=item[1][0], seq_length=item[1][1],
        positions=head_positions(cfg, item[0], item[1][0])))


TP1, TP2, PP2_DP2 = layout_id(1, 1, 1), layout_id(2, 1, 1), layout_id(1, 2, 2) + "_distopt"
TP2_SP = layout_id(2, 1, 1) + "_sp"
LAYOUTS = {TP1: dict(tp=1, pp=1, dp=1, distributed_optimizer=False),
           TP2: dict(tp=2, pp=1, dp=1, distributed_optimizer=False),
           TP2_SP: dict(tp=2, pp=1, dp=1, distributed_optimizer=False, sequence_parallel=True),
           PP2_DP2: dict(tp=1, pp=2, dp=2, distributed_optimizer=True)}


@functools.lru_cache(maxsize=None)
def measured(layout_name):
    """One spawn per layout, shared by the tests below: per-rank measurements."""
    lay = LAYOUTS[layout_name]
    sp = lay.get("sequence_parallel", False)
    cfgs = {size: tiny_cfg(lay["tp"], lay["pp"], lay["distributed_optimizer"], size, sequence_parallel=sp)
            for size in SIZES}
    return run_ranks(measure_worker, tp=lay["tp"], pp=lay["pp"], dp=lay["dp"], args=(cfgs,),
                     parallel_kwargs={"use_distributed_optimizer": lay["distributed_optimizer"],
                                      "sequence_parallel": sp})


@pytest.mark.multirank
@pytest.mark.parametrize("layout_name", [TP2, PP2_DP2])
def test_static_estimate_matches_measured(layout_name):
    from hpa.plan import plan

    lay = LAYOUTS[layout_name]
    cfg = tiny_cfg(lay["tp"], lay["pp"], lay["distributed_optimizer"])
    measured_ranks = [r["static"] for r in measured(layout_name)]
    worst = max(measured_ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
    result = plan(cfg, world_size=lay["tp"] * lay["pp"] * lay["dp"], gpu_memory_gb=80)
    policy = result["models"]["policy"]
    assert policy["parameters_per_gpu"] == max(r["numel"] for r in measured_ranks)
    for key, est in (("params", policy["params_gb"]), ("grads", policy["grads_gb"]),
                     ("optimizer", policy["optimizer_gb"])):
        assert est * 1e9 == pytest.approx(worst[key], rel=0.15), (key, est * 1e9, worst[key])
    total_est = policy["static_gb"] * 1e9
    total_measured = worst["params"] + worst["grads"] + worst["optimizer"]
    assert abs(total_est - total_measured) / total_measured < 0.15
    print(f"{layout_name}: estimated {total_est:.0f} B, measured {total_measured:.0f} B, "
          f"error {100 * (total_est - total_measured) / total_measured:+.2f}%")


@pytest.mark.multirank
@pytest.mark.parametrize("layout_name", [TP1, TP2, TP2_SP])
@pytest.mark.parametrize("size", list(SIZES))
def test_activation_estimate_matches_measured(layout_name, size):
    from hpa.plan import plan

    lay = LAYOUTS[layout_name]
    cfg = tiny_cfg(lay["tp"], size=size, sequence_parallel=lay.get("sequence_parallel", False))
    kind, (rows, seq_length) = planned_micro_batch(cfg)
    assert kind == "preference" and (rows, seq_length) == (2 * cfg.trainer.micro_batch_size,
                                  cfg.data.max_prompt_length + cfg.data.max_response_length)  # DPO pairs
    policy = plan(cfg, world_size=lay["tp"], gpu_memory_gb=80)["models"]["policy"]
    for recompute, est_gb in policy["activations_gb_by_recompute"].items():
        est, got = est_gb * 1e9, max(r[size]["activations"][recompute] for r in measured(layout_name))
        print(f"{layout_name} {size} {rows}x{seq_length} recompute={recompute}: estimated {est:.0f} B, "
              f"measured {got} B, error {100 * (est - got) / got:+.2f}%")
        assert abs(est - got) / got < 0.10, (recompute, est, got)
    acts = measured(layout_name)[0][size]["activations"]
    assert acts["full"] < acts["selective"] < acts["none"]


@pytest.mark.multirank
@pytest.mark.parametrize("layout_name", [TP1, TP2])
@pytest.mark.parametrize("size", list(SIZES))
def test_kv_cache_estimate_is_exact(layout_name, size):
    from hpa.plan import kv_cache_bytes, rollout_batch

    lay = LAYOUTS[layout_name]
    cfg = tiny_cfg(lay["tp"], size=size)
    # one generate call per rank: its prompts x n rows, the longest prompt + max_new_tokens positions
    assert rollout_batch(cfg, 1) == (cfg.trainer.global_batch_size * cfg.rollout.n,
                                     cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    est = kv_cache_bytes(cfg, tp=lay["tp"], pp=1, dp=1)
    assert est > 0
    assert all(r[size]["kv_cache"] == est for r in measured(layout_name))


@pytest.mark.multirank
@pytest.mark.parametrize("layout_name", [TP1, TP2])
def test_peak_estimate_matches_measured(layout_name):
    from hpa.plan import plan

    lay = LAYOUTS[layout_name]
    cfg = tiny_cfg(lay["tp"])
    result = plan(cfg, world_size=lay["tp"], gpu_memory_gb=80)
    assert set(result["models"]) == {"policy", "reference"}  # GRPO without reward models
    peaks = []
    for r in measured(layout_name):
        static = r["static"]["params"] + r["static"]["grads"] + r["static"]["optimizer"] + r["static"]["reference"]
        m = r["gqa"]
        peaks.append(static + max(m["activations"][cfg.model.recompute_granularity or "none"], m["kv_cache"]))
    est, got = result["total_gb"] * 1e9, max(peaks)
    print(f"{layout_name} peak: estimated {est:.0f} B, measured {got} B, error {100 * (est - got) / got:+.2f}%")
    assert abs(est - got) / got < 0.15


# every shipped GPU config, the hardware its comment names (GPUs x GB), and the headroom it promises
SHIPPED_GPU_CONFIGS = [("llama2_7b.yaml", 8, 80, 2.0), ("llama2_70b.yaml", 64, 80, 2.0),
                       ("llama2_70b_lora.yaml", 8, 80, 8.0), ("qwen2_0.5b_gpu_check.yaml", 1, 80, 2.0),
                       ("qwen2_0.5b_gpu_perf.yaml", 1, 80, 10.0)]


def test_every_shipped_gpu_config_is_checked_here():
    shipped = {p.name for p in (ROOT / "configs").glob("*.yaml")
               if "backend: nccl" in p.read_text()}
    assert shipped == {name for name, *_ in SHIPPED_GPU_CONFIGS}


@pytest.mark.parametrize("te_installed", [True, False], ids=["te", "no_te"])
@pytest.mark.parametrize("name,world_size,gpu_gb,headroom_gb", SHIPPED_GPU_CONFIGS)
def test_shipped_gpu_configs_fit_the_hardware_their_comment_names(name, world_size, gpu_gb, headroom_gb,
                                                                  te_installed, monkeypatch):
    """Each shipped GPU config fits its hardware by its own plan, with or without Transformer Engine installed
    (``transformer_impl: auto`` takes either), and its comment names that hardware. Colocated vLLM takes
    rollout.gpu_memory_utilization of the GPU while megatron's training state stays."""
    from hpa.config import load_config
    from hpa.plan import plan

    monkeypatch.setattr("hpa.plan.transformer_engine_installed", lambda: te_installed)
    text = (ROOT / "configs" / name).read_text()
    assert f"{gpu_gb} GB" in text.split("\nparallel:")[0] or f"--gpu-memory-gb {gpu_gb}" in text
    cfg = load_config(ROOT / "configs" / name)
    result = plan(cfg, world_size=world_size, gpu_memory_gb=gpu_gb)
    if result["rollout_engine"] == "vllm":
        assert result["rollout_gb"] == pytest.approx(cfg.rollout.gpu_memory_utilization * gpu_gb)
    assert result["total_gb"] == pytest.approx(result["static_gb"] + result["graph_cache_gb"]
                                               + max(result["activations_gb"], result["rollout_gb"]))
    assert result["fits"] and gpu_gb - result["total_gb"] >= headroom_gb, result["total_gb"]


def test_70b_lora_fits_one_node_with_ten_percent_headroom():
    """configs/llama2_70b_lora.yaml on 8 x 80 GB: at least 10 % headroom, planning the reward model with the
    policy's architecture (no record at its placeholder path) and with its own 7B size (--reward-config); the
    frozen 70B base is held once (the reference adds nothing) and only adapters carry grads and Adam state."""
    from hpa.config import load_config
    from hpa.plan import main, plan

    cfg = load_config(ROOT / "configs" / "llama2_70b_lora.yaml")
    stand_in = plan(cfg, world_size=8, gpu_memory_gb=80)
    own = plan(cfg, world_size=8, gpu_memory_gb=80, reward_config=load_config(ROOT / "configs" / "llama2_7b.yaml"))
    for result in (stand_in, own):
        assert result["fits"] and result["total_gb"] <= 0.9 * 80, result["total_gb"]
        assert result["models"]["reference"]["static_gb"] == 0 and "critic" not in result["models"]
        policy = result["models"]["policy"]
        assert policy["grads_gb"] < 0.02 * policy["params_gb"] and policy["optimizer_gb"] < 0.05 * policy["params_gb"]
    assert own["models"]["reward"]["parameters"] == pytest.approx(6.6e9, rel=0.01)
    assert stand_in["models"]["reward"]["parameters"] == pytest.approx(68.7e9, rel=0.01)
    assert own["total_gb"] < stand_in["total_gb"] - 15
    assert any("no record there" in n for n in stand_in["notes"])
    assert main(["--config", str(ROOT / "configs" / "llama2_70b_lora.yaml"), "--world-size", "8",
                 "--gpu-memory-gb", "80", "--reward-config", str(ROOT / "configs" / "llama2_7b.yaml")]) == 0


def test_reward_model_record_gives_its_own_size(tmp_path):
    """A reward model directory with its record (``hpa_reward_model.json``, as ``hpa train-rm`` writes it) is
    planned with the recorded architecture, whatever --reward-config says."""
    from hpa.config import load_config
    from hpa.plan import count_parameters, plan
    from hpa.reward.model import write_reward_model_info

    small = load_config(None, ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2",
                               "model.num_query_groups=1", "model.ffn_hidden_size=48"])
    rm = tmp_path / "rm"
    rm.mkdir()
    write_reward_model_info(rm, num_heads=4, model=small.model)
    cfg = load_config(None, [f"reward.model_paths=[{rm}]", "reward.num_heads=4"])
    result = plan(cfg, world_size=1, gpu_memory_gb=80, reward_config=cfg)
    assert result["models"]["reward"]["parameters"] == count_parameters(small.model, 4)
    assert result["models"]["reward"]["parameters"] < result["models"]["policy"]["parameters"] / 2
    assert not any("no record" in n for n in result["notes"])


def test_vllm_share_that_does_not_fit_gets_a_utilization_suggestion(monkeypatch):
    from hpa.config import load_config
    from hpa.plan import plan, vllm_minimum_gb

    monkeypatch.setattr("hpa.plan.transformer_engine_installed", lambda: True)  # the config's cluster

    cfg = load_config(ROOT / "configs" / "llama2_7b.yaml", ["rollout.gpu_memory_utilization=0.85"])
    result = plan(cfg, world_size=8, gpu_memory_gb=80)
    assert not result["fits"] and result["total_gb"] == pytest.approx(result["static_gb"] + 0.85 * 80)
    only_util = [s for s in result["suggestions"] if len(s["changes"]) == 1]
    assert only_util and only_util[0]["changes"][0].startswith("rollout.gpu_memory_utilization=")
    util = float(only_util[0]["changes"][0].split("=")[1])
    # the largest multiple of 0.05 leaving 2 GB, and enough for vLLM's weight shard + one sequence
    assert result["static_gb"] + util * 80 <= 78 < result["static_gb"] + (util + 0.05) * 80
    assert util * 80 >= vllm_minimum_gb(cfg)
    assert all("offload" not in c for s in result["suggestions"] for c in s["changes"])


def test_native_engine_layouts_are_suggested_without_sequence_parallelism():
    """The native rollout engine refuses sequence parallelism, so the planner neither assumes it in
    the activations of a larger TP nor suggests it."""
    from hpa.config import load_config
    from hpa.plan import plan

    cfg = load_config(ROOT / "configs" / "llama2_7b.yaml", ["rollout.engine=megatron", "parallel.sequence_parallel=false",
                                                            "parallel.tensor_model_parallel_size=1"])
    result = plan(cfg, world_size=8, gpu_memory_gb=80)
    assert not result["fits"] and result["suggestions"]
    assert all("sequence_parallel" not in " ".join(s["changes"]) for s in result["suggestions"])
    assert all(not s["layout"]["sequence_parallel"] for s in result["suggestions"])
    vllm = plan(load_config(ROOT / "configs" / "llama2_7b.yaml", ["rollout.gpu_memory_utilization=0.85"]),
                world_size=8, gpu_memory_gb=80)
    assert any("sequence_parallel=true" in " ".join(s["changes"]) for s in vllm["suggestions"])


def test_auto_follows_the_layer_spec_in_use(monkeypatch):
    """``transformer_impl=auto`` in bf16 is Transformer Engine only where TE is installed (the builder
    falls back to the local spec otherwise); fp32 and explicit choices do not depend on it."""
    from hpa.config.schema import ModelConfig
    from hpa.plan import transformer_engine_expected

    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, max_sequence_length=64)
    bf16, fp32 = ModelConfig(**shape, params_dtype="bfloat16"), ModelConfig(**shape)
    assert transformer_engine_expected(bf16, installed=True)
    assert not transformer_engine_expected(bf16, installed=False)
    assert not transformer_engine_expected(fp32, installed=True)
    assert transformer_engine_expected(dataclasses.replace(bf16, transformer_impl="transformer_engine"), installed=False)
    assert not transformer_engine_expected(dataclasses.replace(bf16, transformer_impl="local"), installed=True)
    monkeypatch.setattr("hpa.plan.transformer_engine_installed", lambda: False)
    assert not transformer_engine_expected(bf16)


def test_local_attention_keeps_no_probabilities_outside_the_math_kernel():
    """The local spec's core attention is one SDPA call per layer (flash attention on CUDA in 16 bits, torch's
    flash kernel on CPU): no ``[s, s]`` term, so the bytes per token do not grow with the sequence, and
    selective recomputation saves nothing. Only attention dropout on the float32 (CPU) path runs torch's math
    kernel, which keeps the probabilities, their dropped-out copy and the mask: ``a·s·(2e + e)/t`` per token."""
    from hpa.config.schema import ModelConfig
    from hpa.plan import _layer_activations

    a, layers = 14, 24
    model = ModelConfig(num_layers=layers, hidden_size=896, num_attention_heads=a, num_query_groups=2,
                        ffn_hidden_size=4864, vocab_size=151936, max_sequence_length=2048, params_dtype="bfloat16")
    short, long = (_layer_activations(model, tp=1, sequence_parallel=False, seq_length=s, transformer_engine=False)
                   for s in (128, 2048))
    assert short == long and short["none"] == short["selective"]
    h, g, d, f, e = 896, 2, 64, 4864, 2
    # two RMSNorms (input, output, x·rstd), q and k after RoPE + the qkv output + the context + the fp32 LSE,
    # SwiGLU's fc1 output, its two halves' activations and their product
    assert short["none"] == pytest.approx(2 * 3 * h * e + (2 * h + g * d + (a + 2 * g) * d) * e + a * 4
                                          + 5 * f * e, rel=1e-12)
    math = dataclasses.replace(model, params_dtype="float32", attention_dropout=0.1)
    m128, m2048 = (_layer_activations(math, tp=1, sequence_parallel=False, seq_length=s, transformer_engine=False)
                   for s in (128, 2048))
    assert m2048["none"] - m128["none"] == pytest.approx(a * (2048 - 128) * 3 * 4, rel=1e-12)


def test_lm_head_is_the_fused_head_s_chunks_and_the_logits_gradient():
    """The LM head by hand for the GPU-check shape (Qwen2-0.5B, bf16, TP1): the logits ``L`` and their gradient
    (2 B each per token and vocabulary entry) plus the fused head's chunk of ``2^28 / V_pad`` rows (two fp32
    copies and a bf16 read), never an fp32 copy of the whole ``[tokens, vocab]``; forward only: the logits'
    contiguous copy (``2L``) or the logits and one forward chunk."""
    from hpa.config.schema import ModelConfig
    from hpa.ops.fused_head import CHUNK_ELEMENTS
    from hpa.plan import lm_head_bytes

    model = ModelConfig(num_layers=24, hidden_size=896, num_attention_heads=14, num_query_groups=2,
                        ffn_hidden_size=4864, vocab_size=151936, max_sequence_length=512, params_dtype="bfloat16",
                        untie_embeddings_and_output_weights=False)
    v = 151936  # already a multiple of 128
    tokens, positions = 8192, 5504
    chunk = CHUNK_ELEMENTS // v  # 1,766 rows
    assert lm_head_bytes(model, tp=1, tokens=tokens, positions=positions) == 2 * tokens * v * 2 + chunk * v * 10
    # forward only: the logits' contiguous copy, or the logits and the forward's chunk (here the larger)
    assert lm_head_bytes(model, tp=1, tokens=tokens, positions=positions, backward=False) == \
        max(2 * tokens * v * 2, tokens * v * 2 + chunk * v * 10) == tokens * v * 2 + chunk * v * 10
    few = lm_head_bytes(model, tp=1, tokens=64, positions=10)  # the output layer's backward dominates
    assert few == 2 * 64 * v * 2 + v * 896 * 2 + 64 * 896 * 2
    # the old estimate's fp32 copy of the whole logits would be 4 B per entry: 5.0 GB here
    assert lm_head_bytes(model, tp=1, tokens=tokens, positions=positions) < tokens * v * (2 + 4) + chunk * v * 10


# configs/qwen2_0.5b_gpu_check.yaml scaled down for a CPU run, in its proportions: a vocabulary ~130x the
# width (Qwen2: 170x; the head dominates), GQA, qkv bias, tied embeddings, SwiGLU, token-budget micro-batches
# (8192 and 16384 there, 10 and 20 rows here), and the fused head's chunk smaller than the positions it reads
GPU_CHECK_SCALED = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4",
                    "model.num_query_groups=2", "model.ffn_hidden_size=352", "model.vocab_size=8192",
                    "model.max_sequence_length=64", "model.params_dtype=float32", "data.max_prompt_length=16",
                    "data.max_response_length=32", "rollout.max_new_tokens=32", "trainer.micro_batch_size=4",
                    "trainer.ppo_max_token_len_per_rank=480", "trainer.log_prob_max_token_len_per_rank=960"]
SCALED_CHUNK_ELEMENTS = 2 ** 17  # 16 rows of the 8,192-entry vocabulary: 20 chunks per 320 read positions


def scaled_gpu_check_worker(groups, cfg):
    from hpa.plan import forward_micro_batch, training_micro_batches

    rows, width = training_micro_batches(cfg)["rollout"]
    fwd_rows, fwd_width = forward_micro_batch(cfg)
    return {"training": measure_activations(groups, cfg, None, rows, width, "rollout",
                                            chunk_elements=SCALED_CHUNK_ELEMENTS),
            "forward": measure_activations(groups, cfg, None, fwd_rows, fwd_width, "rollout", forward_only=True,
                                           chunk_elements=SCALED_CHUNK_ELEMENTS)}


@pytest.mark.multirank
def test_activation_term_against_a_cpu_run_of_the_gpu_check_shapes(monkeypatch):
    """The plan's activation terms for the GPU-check config's shapes (scaled down, float32) against the peak
    bytes alive (``LiveStorages``) in a CPU run of the same micro-batches: a rollout micro-batch of the update's
    token budget through forward and backward with the fused head at the response positions, and a forward-only
    micro-batch of the log-prob budget. Also: the plan no longer counts an fp32 copy of the whole logits."""
    from hpa.config import load_config
    from hpa.plan import plan

    monkeypatch.setattr("hpa.ops.fused_head.CHUNK_ELEMENTS", SCALED_CHUNK_ELEMENTS)
    cfg = load_config(ROOT / "configs" / "qwen2_0.5b_gpu_check.yaml", GPU_CHECK_SCALED)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, backend="gloo"))
    result = plan(cfg, world_size=1, gpu_memory_gb=80)
    assert result["training_micro_batches"]["rollout"] == {"rows": 10, "seq_length": 48}
    got = run_ranks(scaled_gpu_check_worker, args=(cfg,))[0]
    policy = result["models"]["policy"]
    for name, est in (("training", policy["activations_gb"] * 1e9), ("forward", policy["forward_gb"] * 1e9)):
        print(f"gpu-check shapes (scaled) {name}: estimated {est:.0f} B, measured {got[name]} B, "
              f"error {100 * (est - got[name]) / got[name]:+.2f}%")
        assert abs(est - got[name]) / got[name] < 0.10, (name, est, got[name])
    tokens_x_vocab = 10 * 48 * 8192 * 4
    assert got["training"] < policy["activations_gb"] * 1e9 + tokens_x_vocab  # the old fp32 copy is not there


def lora_static_worker(groups, cfgs):
    return {name: measure_static(groups, cfg) for name, cfg in cfgs.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_static_bytes_with_and_without_lora_match_the_plan(tp):
    """configs/tiny_cpu.yaml's parameter + gradient + optimizer bytes (policy and reference), measured as the
    unique storages after one optimizer step, against the plan, with and without LoRA (rank 8 on all four
    linears; the base frozen and held once, fp32 grads and Adam state for the adapters only)."""
    from hpa.config import load_config
    from hpa.plan import plan

    def cfg_of(*extra):
        cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", [f"parallel.tensor_model_parallel_size={tp}", *extra])
        return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, backend="gloo"))

    cfgs = {"full": cfg_of(), "lora": cfg_of("model.lora.rank=8", "model.lora.alpha=16")}
    measured_by_rank = run_ranks(lora_static_worker, tp=tp, args=(cfgs,))
    totals = {}
    for name, cfg in cfgs.items():
        models = plan(cfg, world_size=tp, gpu_memory_gb=80)["models"]
        est = sum(r["static_gb"] for n, r in models.items() if n in ("policy", "reference")) * 1e9
        got = max(r[name]["params"] + r[name]["grads"] + r[name]["optimizer"] + r[name]["reference"]
                  for r in measured_by_rank)
        print(f"tiny_cpu tp{tp} {name}: planned {est:.0f} B, measured {got} B, error {100 * (est - got) / got:+.2f}%")
        assert abs(est - got) / got < 0.10, (name, est, got)
        totals[name] = got
        if name == "lora":
            assert models["reference"]["static_gb"] == 0 and models["reference"]["shares_base"]
            policy = models["policy"]
            assert policy["trainable_per_gpu"] < policy["parameters_per_gpu"] / 2
            assert policy["grads_gb"] * 1e9 == pytest.approx(4 * policy["trainable_per_gpu"])  # fp32 main grads
    # no reference copy, no grads or Adam state for the base (0.32 of full at TP1, 0.35 at TP2: the replicated
    # halves of the adapters do not shrink with TP)
    assert totals["lora"] < totals["full"] / 2


def test_a_bad_reward_model_record_is_a_config_error(tmp_path, capsys):
    """An unreadable record, or one with an unknown architecture key, stops ``hpa plan`` with the key and the
    file named (exit 2), not a traceback."""
    from hpa.plan import main

    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "hpa_reward_model.json").write_text("{not json")
    assert main(["--world-size", "1", "--gpu-memory-gb", "80", f"reward.model_paths=[{rm}]"]) == 2
    err = capsys.readouterr().err
    assert "reward.model_paths" in err and "hpa_reward_model.json" in err
    (rm / "hpa_reward_model.json").write_text('{"num_heads": 1, "architecture": {"num_layerz": 2}}')
    assert main(["--world-size", "1", "--gpu-memory-gb", "80", f"reward.model_paths=[{rm}]"]) == 2
    assert "num_layerz" in capsys.readouterr().err


def test_graph_buckets_are_the_engines():
    """The planner restates the graph decode's bucket arithmetic (it imports no megatron): the same numbers."""
    from hpa.plan import graph_bucket
    from hpa.rollout.megatron_engine import SLOT_BLOCK, row_bucket, slot_bucket

    for rows in (1, 2, 3, 5, 64, 65, 1000):
        for positions, context in ((1, 4096), (40, 64), (128, 4096), (129, 4096), (3000, 2048)):
            assert graph_bucket(rows, positions, context) == (row_bucket(rows), slot_bucket(positions, context))
    assert SLOT_BLOCK == 128


def test_graph_decode_keeps_its_bucket_through_training():
    """With graph decode (TP = PP = 1) the rollout cache is the bucket's (64 rows x 64 slots for 64 rows of
    24 + 16 positions in a 64-token context), held through training: peak = static + cache + max(activations,
    the step's fp32 logits). At TP 2 the engine decodes eagerly and the plan is the eager one."""
    from hpa.plan import _padded_vocab, graph_bucket, plan, rollout_batch

    eager_cfg = tiny_cfg()
    graph_cfg = dataclasses.replace(eager_cfg, rollout=dataclasses.replace(eager_cfg.rollout, cuda_graphs=True))
    eager, graph = (plan(c, world_size=1, gpu_memory_gb=80) for c in (eager_cfg, graph_cfg))
    rows, positions = rollout_batch(eager_cfg, 1)
    assert (rows, positions) == (64, 40) and graph_bucket(rows, positions, 64) == (64, 64)
    assert graph["kv_cache_gb"] == pytest.approx(eager["kv_cache_gb"] * 64 / 40)
    assert eager["graph_cache_gb"] == 0 and graph["graph_cache_gb"] == graph["kv_cache_gb"]
    assert graph["graph_bucket"] == [64, 64] and eager["graph_bucket"] is None
    assert any("bucket of 64x64" in n for n in graph["notes"])
    vocab = _padded_vocab(graph_cfg.model, 1)
    assert graph["rollout_gb"] == pytest.approx(64 * vocab * 4 / 1e9)  # [rows, padded vocab] fp32 logits
    assert graph["total_gb"] == pytest.approx(graph["static_gb"] + graph["kv_cache_gb"]
                                              + max(graph["activations_gb"], graph["rollout_gb"]))
    assert eager["total_gb"] == pytest.approx(eager["static_gb"] + max(eager["activations_gb"], eager["kv_cache_gb"]))
    assert any("graph decode" in n for n in graph["notes"]) and not any("graph decode" in n for n in eager["notes"])
    tp2 = tiny_cfg(tp=2)
    tp2 = plan(dataclasses.replace(tp2, rollout=dataclasses.replace(tp2.rollout, cuda_graphs=True)), world_size=2,
               gpu_memory_gb=80)
    assert tp2["graph_cache_gb"] == 0 and tp2["graph_bucket"] is None


def test_disaggregated_plan_splits_trainer_and_rollout_ranks(capsys):
    """9 GPUs, 8 trainer ranks (DP 8) and 1 rollout rank, the 7B shapes of ``test_7b_plan_sane``: the rollout rank
    holds the bf16 weights whole (13.48 GB) and one job's KV cache (global 64 prompts x n 4 / DP 8 = 32 rows,
    graph decode: bucket 32 rows x 1024 slots; 2·32 layers·32 rows·32 kv-heads·1024·128·2 B = 17.18 GB) and the
    step's fp32 logits (32 x 32000 x 4 B); the trainer ranks hold no cache: static + activations."""
    from hpa.config import load_config
    from hpa.plan import format_plan, plan

    overrides = ["model.num_layers=32", "model.hidden_size=4096", "model.num_attention_heads=32",
                 "model.num_query_groups=32", "model.ffn_hidden_size=11008", "model.max_sequence_length=2048",
                 "data.max_prompt_length=512", "rollout.max_new_tokens=512", "rollout.engine=megatron",
                 "rollout.n=4", "trainer.global_batch_size=64",
                 "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                 "parallel.sequence_parallel=false", "parallel.use_distributed_optimizer=true"]
    cfg = load_config(ROOT / "configs" / "llama2_70b.yaml", [*overrides, "rollout.placement=disaggregated",
                                                             "rollout.num_ranks=1"], world_size=9)
    result = plan(cfg, world_size=9, gpu_memory_gb=80)
    colocated = plan(load_config(ROOT / "configs" / "llama2_70b.yaml", overrides, world_size=8), world_size=8,
                     gpu_memory_gb=80)
    r = result["rollout_ranks"]
    assert r["num_ranks"] == 1 and r["cache_shape"] == [32, 1024]
    assert r["weights_gb"] == pytest.approx(6_738_415_616 * 2 / 1e9)
    assert r["kv_cache_gb"] == pytest.approx(2 * 32 * 32 * 32 * 1024 * 128 * 2 / 1e9)
    assert r["logits_gb"] == pytest.approx(32 * 32000 * 4 / 1e9)
    assert r["total_gb"] == pytest.approx(r["weights_gb"] + r["kv_cache_gb"] + r["logits_gb"])
    # the trainer ranks: the colocated run's model, gradients and optimizer at the same DP, without the cache
    assert result["layout"]["data_parallel_size"] == 8
    assert result["static_gb"] == pytest.approx(colocated["static_gb"])
    assert result["kv_cache_gb"] == 0 and result["graph_cache_gb"] == 0 and colocated["graph_cache_gb"] > 0
    assert result["total_gb"] == pytest.approx(result["static_gb"] + result["activations_gb"])
    assert result["total_gb"] < colocated["total_gb"]
    text = format_plan(result)
    assert "(8 trainer + 1 rollout ranks)" in text and "per rollout rank (1, TP1, native engine)" in text
    assert colocated["rollout_ranks"] is None and "rollout rank" not in format_plan(colocated)
