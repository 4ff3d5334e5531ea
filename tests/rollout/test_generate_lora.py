"""``hpa generate`` (and so ``hpa serve``, which loads through the same ``load_policy``) with a LoRA adapter
checkpoint over its base, and the rollout engines with adapters.

One spawn (tp1_pp1_dp1): a random base, adapters with random B saved as an adapter checkpoint, then
* ``run_generate`` with ``model.lora.adapter_path`` (greedy): the responses are those the native engine gives
  on the *merged* plain model (an independent path: no adapter code in the forward), and the KL the guard
  reports (to the base, the reference) equals a full forward of the merged model against the base;
* the weight stream a vLLM sync reads (``hf_tensors_from_megatron``) of the LoRA model is the merged model's, and
  the base's with the adapters off.
"""

import json

import pytest

from demo_data import make_task, write_prompt_file
from multirank import run_ranks

NUM_PROMPTS = 5


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = make_task(tmp_path_factory.mktemp("gen_lora"), 64, 4)
    write_prompt_file(root, NUM_PROMPTS)
    return root


def _config(root, *extra):
    from hpa.config import load_config

    d = root / "data"
    return load_config(None, [f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
                              f"data.preference_path={d / 'preferences.jsonl'}", "rollout.max_new_tokens=6",
                              "rollout.temperature=0", "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
                              f"model.policy_path={root / 'base'}", "algorithm.advantage.estimator=grpo", *extra])


def worker(groups, root):
    import torch

    from hpa.data.prompts import PromptDataset
    from hpa.generate import run_generate
    from hpa.models import build_policy
    from hpa.models.convert import hf_tensors_from_megatron
    from hpa.models.lora import adapters, adapters_disabled, attach_lora
    from hpa.models.lora_io import merged_model, save_adapters
    from hpa.models.weights import save_model_weights
    from hpa.rollout import SamplingParams, TokenizerInfo, build_rollout_engine

    base_cfg = _config(root)
    torch.manual_seed(0)
    base = build_policy(base_cfg.model, base_cfg.parallel, groups)
    save_model_weights(base, root / "base", groups)
    cfg = _config(root, "model.lora.rank=4", "model.lora.alpha=8", f"model.lora.adapter_path={root / 'adapters'}")
    model = build_policy(cfg.model, cfg.parallel, groups)
    model.load_state_dict(base.state_dict())
    attach_lora(model, cfg.model.lora, groups, seed=3)
    torch.manual_seed(1)
    with torch.no_grad():
        for _, a in adapters(model):
            a.B.normal_(0, 0.5)
    save_adapters(model, root / "adapters", groups)
    model.eval()

    summary = run_generate(cfg, groups, prompts_path=str(root / "prompts.jsonl"), output_path=str(root / "out.jsonl"),
                           max_retries=0, batch_size=NUM_PROMPTS)
    records = [json.loads(line) for line in open(root / "out.jsonl")]

    merged = merged_model(model, cfg.model, cfg.parallel, groups).eval()
    from hpa.data.tokenizer import build_tokenizer
    from hpa.rollout.base import decode_responses

    tok = build_tokenizer("sentencepiece", str(root / "data" / "tok.model"))
    data = PromptDataset.load(str(root / "prompts.jsonl"), tok, max_prompt_length=cfg.data.max_prompt_length)
    engine = build_rollout_engine(cfg.rollout, merged, groups, TokenizerInfo.from_tokenizer(tok), model_cfg=cfg.model)
    batch = engine.generate([data[i].prompt_ids for i in range(len(data))],
                            SamplingParams.from_config(cfg.rollout, n=1))
    ts = batch.training_sequences()
    with torch.no_grad():
        logps = []
        for m in (merged, base.eval()):
            logits = m(ts.input_ids, ts.position_ids, None)[..., :tok.vocab_size].float()
            logps.append(ts.to_response(torch.log_softmax(logits, -1).gather(2, ts.labels.unsqueeze(2))[..., 0]))
    mask = batch.response_mask
    kl = ((logps[0] - logps[1]) * mask).sum(1) / mask.sum(1)

    stream = dict(hf_tensors_from_megatron(model, cfg.model, groups))
    merged_stream = dict(hf_tensors_from_megatron(merged, cfg.model, groups))
    with adapters_disabled(model):
        off_stream = dict(hf_tensors_from_megatron(model, cfg.model, groups))
    base_stream = dict(hf_tensors_from_megatron(base, base_cfg.model, groups))
    return {"summary": summary, "records": records, "independent": decode_responses(tok, batch),
            "independent_kl": kl.tolist(),
            "stream_is_merged": sorted(stream) == sorted(merged_stream)
            and all(torch.equal(stream[k], merged_stream[k]) for k in stream),
            "off_is_base": all(torch.equal(off_stream[k], base_stream[k]) for k in base_stream),
            "adapted_differs": not torch.equal(stream["model.layers.0.self_attn.q_proj.weight"],
                                               base_stream["model.layers.0.self_attn.q_proj.weight"])}


@pytest.mark.multirank
def test_tp1_pp1_dp1_generate_with_an_adapter_checkpoint(demo):
    out = run_ranks(worker, args=(demo,))[0]
    assert out["summary"]["num_prompts"] == NUM_PROMPTS and not out["summary"]["reference_is_policy"]
    assert [r["response"] for r in out["records"]] == out["independent"]
    kls = [r["kl"] for r in out["records"]]
    assert kls == pytest.approx(out["independent_kl"], abs=1e-5)
    assert max(abs(k) for k in kls) > 1e-3  # the adapters move the policy away from the base (the reference)
    assert out["stream_is_merged"] and out["off_is_base"] and out["adapted_differs"]


def test_generate_with_lora_needs_the_adapters(tmp_path):
    """``model.lora.rank`` without ``model.lora.adapter_path`` would sample the bare base: an error naming the key;
    and ``adapter_path`` without LoRA on is refused by the config itself."""
    from hpa.config import ConfigError, load_config
    from hpa.inference import _with_adapters

    cfg = load_config(None, ["model.lora.rank=4", "algorithm.advantage.estimator=grpo", "model.policy_path=x"])
    with pytest.raises(ConfigError, match="model.lora.adapter_path"):
        _with_adapters(cfg, None, None, command="hpa generate", load_reference=True, engine_kwargs=None)
    with pytest.raises(ConfigError, match="adapter_path"):
        load_config(None, [f"model.lora.adapter_path={tmp_path}"])
