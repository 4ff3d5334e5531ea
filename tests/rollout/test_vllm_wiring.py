"""``rollout.engine: vllm`` wired into the trainer, ``hpa generate`` and the synthetic-pair generator,
against the recording stand-in of ``fake_vllm`` (no vLLM needed): the engine is built from the policy's
model section with the tokenizer's vocabulary, the policy's current weights are synced before every
rollout (training and evaluation), vLLM sleeps after each, and every request stops on EOS."""


import pytest

import fake_vllm
from demo_data import make_task, write_prompt_file
from multirank import run_ranks

pytestmark = pytest.mark.multirank

PROMPTS = 6


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = make_task(tmp_path_factory.mktemp("vllm_wiring"), 32, 4)
    write_prompt_file(root, PROMPTS)
    return root


def _overrides(root, *extra):
    d = root / "data"
    return [f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
            f"data.preference_path={d / 'preferences.jsonl'}", f"data.eval_prompt_path={d / 'eval_prompts.jsonl'}",
            f"trainer.run_dir={root / 'run'}", "logging.wandb.mode=disabled", "logging.progress_bar=false",
            "trainer.total_steps=2", "trainer.global_batch_size=2", "trainer.preference_batch_size=2",
            "trainer.micro_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_interval=2",
            "rollout.engine=vllm", "rollout.vllm_tensor_parallel_size=1", f"model.policy_path={root / 'strong'}",
            "algorithm.advantage.estimator=grpo", *extra]


def _embedding(model, rows):
    from hpa.models import unwrap

    return unwrap(model).embedding.word_embeddings.weight.detach()[:rows].clone()


def wiring_worker(groups, root):
    import torch

    fake_vllm.install(on_cpu=False)  # as on CUDA: sleep mode on
    from data_tools.synth_preferences import run_synth
    from hpa.config import load_config
    from hpa.data.tokenizer import build_tokenizer
    from hpa.models import build_policy
    from hpa.models.weights import save_model_weights
    from hpa.generate import run_generate
    from hpa.trainer.loop import HPATrainer

    cfg = load_config(None, _overrides(root))
    for name, seed in (("strong", 0), ("weak", 1)):
        torch.manual_seed(seed)
        save_model_weights(build_policy(cfg.model, cfg.parallel, groups), str(root / name), groups)
    vocab = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path).vocab_size
    eos = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path).eos_id
    out = {"vocab": vocab, "eos": eos, "model_vocab": cfg.model.vocab_size}

    trainer = HPATrainer(cfg, groups)
    initial = _embedding(trainer.parts.policy.model, vocab)
    trainer.train()
    llm = fake_vllm.FakeLLM.instances[-1]
    out["trainer"] = dict(kwargs=llm.kwargs, hf_config=llm.hf_config, rollouts=fake_vllm.rollouts(llm.calls),
                          stops=[sp["stop_token_ids"] for sp in llm.sampling],
                          first_sync_is_initial=bool(torch.equal(llm.history[0]["model.embed_tokens.weight"],
                                                                 initial)),
                          last_sync_is_current=bool(torch.equal(llm.history[-1]["model.embed_tokens.weight"],
                                                                _embedding(trainer.parts.policy.model, vocab))),
                          syncs_differ=not torch.equal(llm.history[1]["model.embed_tokens.weight"],
                                                       llm.history[2]["model.embed_tokens.weight"]))

    gen_cfg = load_config(None, _overrides(root))
    run_generate(gen_cfg, groups, prompts_path=str(root / "prompts.jsonl"), output_path=str(root / "gen.jsonl"),
                 max_retries=0, batch_size=4)
    llm = fake_vllm.FakeLLM.instances[-1]
    out["generate"] = dict(calls=[c[0] for c in llm.calls], hf_config=llm.hf_config)

    summary = run_synth(gen_cfg, groups, strong_path=str(root / "strong"), weak_path=str(root / "weak"),
                        prompts_path=str(root / "prompts.jsonl"), output_path=str(root / "synth.jsonl"), k=2,
                        batch_size=3)
    llm = fake_vllm.FakeLLM.instances[-1]
    strong, weak = (_embedding(_load(gen_cfg, groups, root / n), vocab) for n in ("strong", "weak"))
    out["synth"] = dict(calls=[c[0] for c in llm.calls],
                        synced=["strong" if torch.equal(h["model.embed_tokens.weight"], strong) else
                                "weak" if torch.equal(h["model.embed_tokens.weight"], weak) else "?"
                                for h in llm.history], num_prompts=summary["num_prompts"])
    return out


def _load(cfg, groups, path):
    from hpa.models import build_policy
    from hpa.models.weights import load_model_weights

    model = build_policy(cfg.model, cfg.parallel, groups)
    load_model_weights(model, str(path), groups)
    return model


@pytest.fixture(scope="module")
def wiring(task):
    return run_ranks(wiring_worker, args=(task,))[0]


def test_trainer_builds_vllm_from_the_model_section_with_the_tokenizers_vocabulary(wiring):
    t = wiring["trainer"]
    assert wiring["vocab"] < wiring["model_vocab"]  # the demo's tokenizer is smaller than model.vocab_size
    assert t["hf_config"]["vocab_size"] == wiring["vocab"]
    assert t["hf_config"]["num_hidden_layers"] == 2 and t["hf_config"]["hidden_size"] == 64
    assert t["kwargs"]["load_format"] == "dummy" and t["kwargs"]["max_model_len"] == 64
    assert t["kwargs"]["dtype"] == "float32"


def test_trainer_syncs_before_every_rollout_and_sleeps_after(wiring):
    """Evaluation at step 0, rollouts of steps 1 and 2, evaluation at step 2: four generate calls, each
    right after a sync (weights woken first, KV cache after) and followed by sleep."""
    rollouts = wiring["trainer"]["rollouts"]
    assert len(rollouts) == 4
    assert rollouts[0][0] == [("reload_weights", rollouts[0][0][0][1]), ("reset_prefix_cache",)]
    for before, _ in rollouts[1:]:  # asleep since the previous rollout: weights first, the KV cache after
        assert before[0] == ("wake_up", ("weights",)) and before[1][0] == "reload_weights", before
        assert before[2:] == [("reset_prefix_cache",), ("wake_up", ("kv_cache",))], before
    assert all(after == ("sleep", 2) for _, after in rollouts)
    t = wiring["trainer"]
    assert t["first_sync_is_initial"] and t["last_sync_is_current"] and t["syncs_differ"]


def test_trainer_requests_stop_on_eos(wiring):
    stops = wiring["trainer"]["stops"]
    assert stops and all(s == [wiring["eos"]] for s in stops)


def test_generate_syncs_once_and_never_samples_without_weights(wiring):
    calls = wiring["generate"]["calls"]
    assert calls[0] == "reload_weights" and calls.count("reload_weights") == 1 and "generate" in calls
    assert wiring["generate"]["hf_config"]["vocab_size"] == wiring["vocab"]


def test_synth_uses_one_engine_synced_from_each_policy_in_turn(wiring):
    """Two chunks of 3 prompts: strong, weak, strong, weak, each synced right before its generate."""
    s = wiring["synth"]
    assert s["num_prompts"] == PROMPTS
    assert s["synced"] == ["strong", "weak", "strong", "weak"]
    gens = [i for i, c in enumerate(s["calls"]) if c == "generate"]
    assert len(gens) == 4 and all("reload_weights" in s["calls"][i - 2:i] for i in gens)
