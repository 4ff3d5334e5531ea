"""vLLM engine: output parsing and weight sync against a fake ``vllm`` (CPU), and the real thing on a
GPU (skipped without CUDA and vllm): vLLM's log-probs on synced weights match the Megatron forward."""

import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fake_vllm
from multirank import run_ranks

PAD, EOS = 0, 1


def _groups(world_size=1):
    return SimpleNamespace(world_size=world_size, rank=0, local_rank=0, tensor_model_parallel_size=1,
                           pipeline_model_parallel_size=1, data_parallel_size=1, mp_group=None)


def _model_cfg(**kw):
    from hpa.config.schema import ModelConfig

    return ModelConfig(**{**dict(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32,
                                 max_sequence_length=64), **kw})


def _engine(monkeypatch, on_cpu=False, vocab_size=16, **kw):
    from hpa.config.schema import RolloutConfig
    from hpa.rollout import TokenizerInfo, build_rollout_engine

    fake_vllm.install(on_cpu=on_cpu, monkeypatch=monkeypatch)
    return build_rollout_engine(RolloutConfig(engine="vllm", vllm_tensor_parallel_size=1), None, _groups(),
                                TokenizerInfo(vocab_size=vocab_size, eos_token_id=EOS, pad_token_id=PAD),
                                model_cfg=_model_cfg(), **kw)


def test_vllm_engine_logic_with_a_fake_vllm(monkeypatch):
    from hpa.rollout import SamplingParams

    engine = _engine(monkeypatch)
    llm = engine.llm
    assert llm.kwargs["load_format"] == "dummy" and llm.kwargs["skip_tokenizer_init"]
    assert llm.kwargs["disable_custom_all_reduce"] and llm.kwargs["enable_sleep_mode"]
    assert llm.hf_config["vocab_size"] == 16  # the tokenizer's, not model.vocab_size (32)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=4)
    with pytest.raises(RuntimeError, match="sync_weights"):
        engine.generate([[3, 4]], params)
    assert engine.sync_weights([("a", torch.zeros(1)), ("b", torch.ones(2))]) == 2
    assert llm.calls[0] == ("reload_weights", ("a", "b"))
    batch = engine.generate([[3, 4], [9]], params)
    assert batch.response_ids.tolist() == [[3, 4, EOS], [4, 4, EOS], [5, 4, EOS], [6, 4, EOS]]
    assert batch.finish_reasons == ["stop"] * 4
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.prompt_ids.tolist() == [[3, 4], [3, 4], [PAD, 9], [PAD, 9]]
    np.testing.assert_allclose(batch.log_probs[1].numpy(), [-0.5, -1.0, -1.5])
    assert batch.response_mask.sum(1).tolist() == [3, 3, 3, 3]
    assert len({sp["seed"] for sp in llm.sampling}) == 4  # one seed per response


def test_eos_is_a_stop_id_unless_ignored(monkeypatch):
    """vLLM without a tokenizer knows no EOS: the engine passes the tokenizer's with every request."""
    from hpa.rollout import SamplingParams

    engine = _engine(monkeypatch)
    engine.sync_weights([])
    engine.generate([[3]], SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=(7,)))
    assert engine.llm.sampling[-1]["stop_token_ids"] == [7, EOS]
    batch = engine.generate([[3]], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    assert engine.llm.sampling[-1]["stop_token_ids"] == [] and engine.llm.sampling[-1]["ignore_eos"]
    assert batch.finish_reasons == ["length"] and batch.response_ids.shape[1] == 4


def test_vocab_rows_beyond_the_tokenizer_are_not_synced(monkeypatch):
    """model.vocab_size 32, tokenizer 16: vLLM's config has 16 tokens and gets 16 embedding / LM-head rows."""
    engine = _engine(monkeypatch)
    embed, head, norm = torch.randn(32, 16), torch.randn(32, 16), torch.randn(32)
    engine.sync_weights([("model.embed_tokens.weight", embed), ("lm_head.weight", head), ("model.norm.weight", norm)])
    w = engine.llm.weights
    assert torch.equal(w["model.embed_tokens.weight"], embed[:16]) and torch.equal(w["lm_head.weight"], head[:16])
    assert torch.equal(w["model.norm.weight"], norm)  # not a vocabulary tensor, although 32 long


def test_sleep_discards_weights_and_sync_wakes_in_two_stages(monkeypatch):
    from hpa.rollout import SamplingParams

    engine = _engine(monkeypatch)
    engine.sync_weights([])
    engine.sleep()
    assert engine.llm.calls[-1] == ("sleep", 2)
    with pytest.raises(RuntimeError, match="sync_weights"):  # level 2 kept no weights
        engine.generate([[3]], SamplingParams(temperature=0.0, max_new_tokens=2))
    engine.llm.calls.clear()
    engine.sync_weights([("a", torch.zeros(1))])
    assert engine.llm.calls == [("wake_up", ("weights",)), ("reload_weights", ("a",)), ("reset_prefix_cache",),
                                ("wake_up", ("kv_cache",))]
    engine.generate([[3]], SamplingParams(temperature=0.0, max_new_tokens=2))


def test_on_cpu_sleep_mode_is_off_and_eager(monkeypatch):
    engine = _engine(monkeypatch, on_cpu=True)
    assert not engine.llm.kwargs["enable_sleep_mode"] and engine.llm.kwargs["enforce_eager"]
    engine.sync_weights([])
    engine.sleep()
    engine.wake()
    assert ("sleep", 2) not in engine.llm.calls and engine._synced


def test_build_needs_model_cfg(monkeypatch):
    from hpa.config.schema import RolloutConfig
    from hpa.rollout import TokenizerInfo, build_rollout_engine

    fake_vllm.install(monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match="model_cfg"):
        build_rollout_engine(RolloutConfig(engine="vllm", vllm_tensor_parallel_size=1), None, _groups(),
                             TokenizerInfo(vocab_size=16, eos_token_id=EOS, pad_token_id=PAD))


def test_launcher_env_is_set_from_the_world(monkeypatch):
    from hpa.rollout.vllm_engine import set_launcher_env

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "unset")  # recorded, so whatever set_launcher_env writes is undone after the test
        monkeypatch.delenv(key)
    g = SimpleNamespace(rank=5, local_rank=1, world_size=8)
    set_launcher_env(g)
    assert [os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")] == ["5", "1", "8"]
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(RuntimeError, match="RANK=3"):
        set_launcher_env(g)


@pytest.mark.parametrize("num_rows,parts", [(7, 2), (8, 4), (3, 4), (5, 1)])
def test_instances_share_rows_contiguously(num_rows, parts):
    from hpa.rollout.vllm_engine import _share

    spans = [_share(num_rows, parts, k) for k in range(parts)]
    assert spans[0][0] == 0 and spans[-1][1] == num_rows
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1


def _replica(rank, tp, pp, dp):
    """The global ranks of ``rank``'s model replica under megatron's order (TP fastest, then DP, then PP)."""
    dp_rank = (rank // tp) % dp
    return [t + tp * dp_rank + tp * dp * p for p in range(pp) for t in range(tp)]


@pytest.mark.parametrize("tp,pp,dp,vllm_tp,expected", [
    (1, 2, 1, 1, [(2, 0), (2, 1)]),  # PP2: each stage's instance samples half the replica's rows
    (1, 2, 1, 2, [(1, 0), (1, 0)]),  # one instance spans both stages
    (2, 1, 1, 1, [(2, 0), (2, 1)]),
    (1, 1, 2, 1, [(1, 0), (1, 0)]),  # DP2: one instance per replica
    (2, 2, 2, 2, [(2, 0), (2, 0), (2, 0), (2, 0), (2, 1), (2, 1), (2, 1), (2, 1)]),
    (1, 2, 2, 2, "do not split"),  # ranks 0, 1 are the first stages of two replicas
    (2, 2, 2, 4, "do not split"),
], ids=["tp1_pp2_dp1_v1", "tp1_pp2_dp1_v2", "tp2_pp1_dp1_v1", "tp1_pp1_dp2_v1", "tp2_pp2_dp2_v2",
        "tp1_pp2_dp2_v2", "tp2_pp2_dp2_v4"])
def test_vllm_instances_in_a_model_replica(tp, pp, dp, vllm_tp, expected):
    from hpa.rollout.vllm_engine import instance_layout

    world = tp * pp * dp
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            [instance_layout(_replica(r, tp, pp, dp), r, vllm_tp) for r in range(world)]
    else:
        assert [instance_layout(_replica(r, tp, pp, dp), r, vllm_tp) for r in range(world)] == expected


def replica_worker(groups):
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(groups.mp_group))


@pytest.mark.multirank
def test_replica_ranks_follow_megatrons_order_tp1_pp2_dp2():
    """The order ``_replica`` assumes is the one hpa's groups have."""
    out = run_ranks(replica_worker, pp=2, dp=2)
    assert out == [_replica(r, 1, 2, 2) for r in range(4)]


def _gpu_ready():
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def gpu_model_config():
    from hpa.config.schema import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=512, vocab_size=512, max_sequence_length=128,
                       make_vocab_size_divisible_by=128, init_method_std=0.05, params_dtype="float32")


def vllm_consistency_worker(groups, hf_dir):
    from hpa.config.schema import ParallelConfig
    from hpa.models import build_policy
    from hpa.models.convert import hf_config_from_model_config
    from hpa.ops.vocab_parallel import vocab_parallel_log_probs
    from hpa.rollout import SamplingParams, TokenizerInfo
    from hpa.rollout.vllm_engine import VLLMRolloutEngine
    from hpa.engine.step import forward_backward

    cfg = gpu_model_config()
    torch.manual_seed(0)
    model = build_policy(cfg, ParallelConfig(), groups)
    hf_config_from_model_config(cfg, "llama", dtype="float32").save_pretrained(hf_dir)
    engine = VLLMRolloutEngine(model, groups, TokenizerInfo(vocab_size=cfg.vocab_size, eos_token_id=EOS,
                                                            pad_token_id=PAD),
                               model_cfg=cfg, hf_model_path=hf_dir, gpu_memory_utilization=0.3,
                               llm_kwargs={"enforce_eager": True})
    assert engine.sync_weights() > 0
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20, 21]]
    out = {}
    for name, params in [("greedy", SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)),
                         ("sampled", SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3))]:
        batch = engine.generate(prompts, params)
        seq = batch.training_sequences()
        mb = seq.micro_batch()  # on the host, as the trainer hands it: forward_backward moves it

        def loss_fn(b, logits, hidden):
            return logits.sum() * 0, {"logp": vocab_parallel_log_probs(logits, b["labels"], groups.tp_group,
                                                                        cfg.vocab_size).detach()}

        with torch.no_grad():
            logp = forward_backward(model, [mb], loss_fn, groups, forward_only=True)[0]["logp"]
        train = seq.to_response(logp.cpu())
        mask = batch.response_mask > 0
        out[name] = float((train - batch.log_probs).abs()[mask].max())
    engine.sleep()
    engine.wake()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and vllm")
def test_vllm_log_probs_match_megatron_forward(tmp_path):
    diffs = run_ranks(vllm_consistency_worker, args=(str(tmp_path / "hf"),),
                      parallel_kwargs={"backend": "nccl"})[0]
    assert diffs["greedy"] < 2e-3 and diffs["sampled"] < 2e-3, diffs


def test_hf_config_dir_family_vocabulary_and_imported_config(tmp_path):
    """The config vLLM builds from: llama (qwen2 with q/k/v biases), the tokenizer's vocabulary, the
    tokenizer's EOS, and the original HF config of an ``hpa convert`` import (its family and extra keys)."""
    import json

    from hpa.models.convert import META_FILE
    from hpa.models.hf_config_dir import write_hf_config_dir

    cfg = _model_cfg(num_query_groups=1)
    written = json.loads((write_hf_config_dir(cfg, tmp_path / "a", vocab_size=20, eos_token_id=7) / "config.json")
                         .read_text())
    assert written["model_type"] == "llama" and written["vocab_size"] == 20 and written["eos_token_id"] == 7
    assert written["num_key_value_heads"] == 1 and written["hidden_size"] == 16
    qwen = json.loads((write_hf_config_dir(_model_cfg(add_qkv_bias=True), tmp_path / "b") / "config.json").read_text())
    assert qwen["model_type"] == "qwen2" and qwen["vocab_size"] == 32
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / META_FILE).write_text(json.dumps({"family": "mistral", "hf_config": {"sliding_window": 4096,
                                                                                   "bos_token_id": 5}}))
    mistral = json.loads((write_hf_config_dir(cfg, tmp_path / "c", checkpoint_path=str(ckpt)) / "config.json")
                         .read_text())
    assert mistral["model_type"] == "mistral" and mistral["sliding_window"] == 4096 and mistral["bos_token_id"] == 5
    with pytest.raises(ValueError, match="model.vocab_size"):
        write_hf_config_dir(cfg, tmp_path / "d", vocab_size=33)


def test_vllm_tensor_parallel_size_follows_the_policy_by_default(monkeypatch):
    """``rollout.engine=vllm`` alone works on the tiny config (issue 25: the default of 2 stopped a
    one-process run with "must divide the world size 1"); an explicit size that cannot work names the key."""
    from hpa.config import load_config
    from hpa.rollout import TokenizerInfo, build_rollout_engine

    fake_vllm.install(on_cpu=False, monkeypatch=monkeypatch)
    cfg = load_config(None, ["rollout.engine=vllm"])
    info = TokenizerInfo(vocab_size=16, eos_token_id=EOS, pad_token_id=PAD)
    engine = build_rollout_engine(cfg.rollout, None, _groups(), info, model_cfg=_model_cfg())
    assert engine.llm.kwargs["tensor_parallel_size"] == 1  # the policy's parallel.tensor_model_parallel_size
    explicit = load_config(None, ["rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=2"])
    with pytest.raises(ValueError, match="set rollout.vllm_tensor_parallel_size"):
        build_rollout_engine(explicit.rollout, None, _groups(), info, model_cfg=_model_cfg())
