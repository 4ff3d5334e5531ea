"""``hpa generate`` (hpa.generate) on CPU: the KL guard, DP sharding and the CLI.

One spawn (tp1_pp1_dp2) saves a policy (seed 0) and a differently seeded reference (seed 1) and runs:
policy == reference (KL 0, nothing regenerated); reference differs with the guard off (the first-round
KLs); the same with the threshold at their median and a greedy guard (exactly the rows above it are
regenerated, to the greedy response, with the KL an independent full forward gives). A single-process
CLI run checks ``main``.
"""

import json
import os
import subprocess
import sys

import pytest

from demo_data import make_task, write_prompt_file
from multirank import run_ranks

NUM_PROMPTS = 7  # odd: DP ranks get 4 and 3 prompts; batch_size 2 gives uneven chunks


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = make_task(tmp_path_factory.mktemp("gen"), 64, 4)
    write_prompt_file(root, NUM_PROMPTS)
    return root


def _overrides(root, *extra):
    d = root / "data"
    return [f"data.tokenizer_path={d / 'tok.model'}", f"data.prompt_path={d / 'prompts.jsonl'}",
            f"data.preference_path={d / 'preferences.jsonl'}", f"data.eval_prompt_path={d / 'eval_prompts.jsonl'}",
            "rollout.max_new_tokens=6", "rollout.temperature=1.0", "trainer.micro_batch_size=2",
            f"model.policy_path={root / 'policy'}", *extra]


def _read(path):
    return [json.loads(line) for line in open(path).read().splitlines()]


def _full_forward_kl(policy, reference, batch, vocab_size):
    """Independent check: mean k1 KL per row from plain (TP1, PP1) forwards at temperature 1."""
    import torch

    ts = batch.training_sequences()
    out = []
    for model in (policy, reference):
        with torch.no_grad():
            logits = model(ts.input_ids, ts.position_ids, None)[..., :vocab_size].float()  # [b, s, v]
        logp = torch.log_softmax(logits, dim=-1).gather(2, ts.labels.unsqueeze(2))[..., 0]  # [b, s]
        out.append(ts.to_response(logp))  # [b, r]
    m = batch.response_mask
    return ((out[0] - out[1]) * m).sum(1) / m.sum(1)  # [b]


def generate_worker(groups, root):
    import torch

    from hpa.config import load_config
    from hpa.data.prompts import PromptDataset
    from hpa.data.tokenizer import build_tokenizer
    from hpa.models import build_policy
    from hpa.rollout import SamplingParams, TokenizerInfo, build_rollout_engine
    from hpa.generate import run_generate
    from hpa.models.weights import load_model_weights, save_model_weights

    cfg = load_config(None, _overrides(root), world_size=2)
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        save_model_weights(build_policy(cfg.model, cfg.parallel, groups), str(root / name), groups)
    prompts = str(root / "prompts.jsonl")
    kw = dict(prompts_path=prompts, batch_size=2)
    out = {}
    out["same"] = run_generate(cfg, groups, output_path=str(root / "same.jsonl"), kl_threshold=0.0, **kw)

    cfg_ref = load_config(None, _overrides(root, f"model.reference_path={root / 'reference'}"), world_size=2)
    out["off"] = run_generate(cfg_ref, groups, output_path=str(root / "off.jsonl"), max_retries=0, **kw)
    torch.distributed.barrier()
    kls = sorted(r["kl"] for r in _read(root / "off.jsonl"))
    threshold = kls[len(kls) // 2]  # the median: 3 of 7 rows are above it
    out["threshold"] = threshold
    out["guard"] = run_generate(cfg_ref, groups, output_path=str(root / "guard.jsonl"), kl_threshold=threshold,
                                guard_temperature=0.0, **kw)

    # the expected regenerations: greedy responses and their KL from plain forwards
    tok = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path)
    policy = build_policy(cfg.model, cfg.parallel, groups)
    load_model_weights(policy, str(root / "policy"), groups)
    reference = build_policy(cfg.model, cfg.parallel, groups)
    load_model_weights(reference, str(root / "reference"), groups)
    policy.eval()
    reference.eval()
    data = PromptDataset.load(prompts, tok, max_prompt_length=cfg.data.max_prompt_length)
    engine = build_rollout_engine(cfg.rollout, policy, groups, TokenizerInfo.from_tokenizer(tok))
    greedy = engine.generate([e.prompt_ids for e in data], SamplingParams.from_config(cfg.rollout, n=1, temperature=0))
    eos = tok.eos_id
    out["greedy_texts"] = [tok.decode([t for t, k in zip(ids, m) if k and t != eos])
                           for ids, m in zip(greedy.response_ids.tolist(), greedy.response_mask.tolist())]
    out["greedy_kl"] = _full_forward_kl(policy, reference, greedy, tok.vocab_size).tolist()
    return out


@pytest.fixture(scope="module")
def results(demo):
    return run_ranks(generate_worker, dp=2, args=(demo,)), demo


@pytest.mark.multirank
def test_tp1_pp1_dp2_reference_is_policy(results):
    ranks, root = results
    summary = ranks[0]["same"]
    assert summary == ranks[1]["same"]
    assert summary["reference_is_policy"] and summary["num_regenerated"] == 0
    assert summary["num_prompts"] == NUM_PROMPTS and summary["kl_mean_before"] == 0.0
    records = _read(root / "same.jsonl")
    assert [r["prompt"] for r in records] == [json.loads(x)["prompt"]
                                               for x in (root / "prompts.jsonl").read_text().splitlines()]
    for r in records:
        assert set(r) == {"prompt", "response", "kl", "regenerated", "finish_reason"}
        assert r["kl"] == 0.0 and not r["regenerated"] and r["finish_reason"] in ("stop", "length")


@pytest.mark.multirank
def test_tp1_pp1_dp2_guard_regenerates_rows_above_threshold(results):
    ranks, root = results
    out = ranks[0]
    off, guard = _read(root / "off.jsonl"), _read(root / "guard.jsonl")
    assert len(off) == len(guard) == NUM_PROMPTS
    assert [r["prompt"] for r in off] == [r["prompt"] for r in guard]
    assert not any(r["regenerated"] for r in off) and out["off"]["num_regenerated"] == 0
    assert not out["off"]["reference_is_policy"] and any(abs(r["kl"]) > 0 for r in off)
    above = [r["kl"] > out["threshold"] for r in off]
    assert [r["regenerated"] for r in guard] == above and sum(above) == out["guard"]["num_regenerated"] > 0
    assert out["guard"]["kl_mean_before"] == pytest.approx(out["off"]["kl_mean_after"])
    for i, (a, b) in enumerate(zip(off, guard)):
        if b["regenerated"]:  # greedy (guard_temperature 0) regeneration, KL of the new response
            assert b["response"] == out["greedy_texts"][i]
            assert b["kl"] == pytest.approx(out["greedy_kl"][i], abs=1e-5)
        else:  # same seeds: the first-round sample is kept as it was
            assert (b["response"], b["kl"]) == (a["response"], pytest.approx(a["kl"], abs=1e-6))


@pytest.mark.e2e
def test_cli_single_process(results):
    _, root = results
    out = root / "cli.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "hpa.generate", "--prompts", str(root / "prompts.jsonl"),
                           "--output", str(out), "--kl-threshold", "0.1", "--guard-temperature", "0.5",
                           *_overrides(root, f"model.reference_path={root / 'reference'}")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["num_prompts"] == NUM_PROMPTS == len(_read(out))
    assert summary["kl_threshold"] == 0.1 and summary["guard_temperature"] == 0.5
