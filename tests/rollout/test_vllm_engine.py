"""vLLM engine: output parsing and weight sync against a fake ``vllm`` (CPU), and the real thing on a
GPU (skipped without CUDA and vllm): vLLM's log-probs on synced weights match the Megatron forward."""

import importlib.util
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from multirank import run_ranks

PAD, EOS = 0, 1


class FakeLLM:
    """Records what the engine asks of ``vllm.LLM``; answers generate() with fixed completions."""

    def __init__(self, **kwargs):
        self.kwargs, self.loaded, self.calls = kwargs, [], []
        model = SimpleNamespace(load_weights=lambda weights: self.loaded.extend(n for n, _ in weights))
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)))

    def generate(self, requests, sampling, use_tqdm=False):
        outs = []
        for i, (req, sp) in enumerate(zip(requests, sampling)):
            ids = [5, EOS] if i % 2 == 0 else [6, 7, 8]
            logprobs = [{t: SimpleNamespace(logprob=-0.5 * (j + 1))} for j, t in enumerate(ids)]
            reason = "stop" if i % 2 == 0 else "length"
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs,
                                                                 finish_reason=reason)]))
            self.calls.append((req, sp))
        return outs

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def test_vllm_engine_logic_with_a_fake_vllm(monkeypatch):
    from hpa.config.schema import RolloutConfig
    from hpa.rollout import SamplingParams, TokenizerInfo, build_rollout_engine
    from hpa.rollout import vllm_engine

    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM
    fake.SamplingParams = lambda **kw: kw
    monkeypatch.setattr(vllm_engine, "_import_vllm", lambda: fake)
    groups = SimpleNamespace(world_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                             data_parallel_size=1, mp_group=None)
    engine = build_rollout_engine(RolloutConfig(engine="vllm", vllm_tensor_parallel_size=1), None, groups,
                                  TokenizerInfo(vocab_size=16, eos_token_id=EOS, pad_token_id=PAD),
                                  model_cfg=SimpleNamespace(max_sequence_length=64, params_dtype="float32"),
                                  hf_model_path="/nonexistent")
    assert engine.llm.kwargs["load_format"] == "dummy" and engine.llm.kwargs["skip_tokenizer_init"]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=4)
    with pytest.raises(RuntimeError, match="sync_weights"):
        engine.generate([[3, 4]], params)
    engine.sleep()
    assert engine.sync_weights([("a", torch.zeros(1)), ("b", torch.ones(2))]) == 2
    assert engine.llm.loaded == ["a", "b"]
    assert ("wake_up", ["weights"]) in engine.llm.calls and ("wake_up", ["kv_cache"]) in engine.llm.calls
    batch = engine.generate([[3, 4], [9]], params)
    assert batch.response_ids.tolist() == [[5, EOS, PAD], [6, 7, 8]] * 2
    assert batch.finish_reasons == ["stop", "length"] * 2
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.prompt_ids.tolist() == [[3, 4], [3, 4], [PAD, 9], [PAD, 9]]
    np.testing.assert_allclose(batch.log_probs[1].numpy(), [-0.5, -1.0, -1.5])
    assert batch.response_mask.sum(1).tolist() == [2, 3, 2, 3]
    seeds = [c[1]["seed"] for c in engine.llm.calls if len(c) == 2 and isinstance(c[0], dict)]
    assert len(set(seeds)) == 4  # one seed per response


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
        mb = {k: v.to(groups.device) for k, v in seq.micro_batch().items()}

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
