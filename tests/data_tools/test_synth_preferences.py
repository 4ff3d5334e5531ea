"""Synthetic preference pairs (``data_tools.synth_preferences``) and the model-backed preference cleaner.

Unit tests of ``cross_pairs`` by hand. Then one spawn (tp1_pp1_dp2) on the demo task (``copy`` of one
symbol, ``tests/reward/rm_pipeline.py``'s data and tiny model): a random policy (weak) is SFT-trained
briefly into the strong one, and a random K=3 reward model is saved. Under a torchrun-like environment
the two CLIs run as they would under ``torchrun --nproc_per_node 2``:

* the generator, strong vs weak with the rule reward ``2 · exact_match`` (recipe settings: k = 3,
  temperatures 0.7 / 0.9, margin 1.0): every kept pair must be a correct strong answer against a
  wrong weak one, and the output must load with ``PreferenceDataset``;
* the cleaner on the demo preference pairs with all three model-backed rules (reward-model margin,
  SFT-policy log-prob gap, reward-model embedding cosine), thresholds placed between the values so
  that every rule drops some pairs: its counts must equal those recomputed from scores of plain,
  unbatched, one-sequence forwards.

Before that, in the same processes, the library entry points: the generator with the sides swapped
keeps nothing; bad input (a missing checkpoint, a prompt or pair without the ground truth the rule
reward needs) is named by file and line; the cleaner's rule reward drops exactly the flipped pairs.
"""

import json
import math

import pytest

from data_tools.synth_preferences import DROP_REASONS, bradley_terry_confidence, cross_pairs

# ----------------------------------------------------------------------------------------------------
# cross_pairs by hand


def test_margin_is_strict_and_pairs_are_tagged():
    strong = [("good", 2.0), ("fine", 1.5)]
    weak = [("bad", 1.0), ("worse", 0.25)]
    records, counts = cross_pairs("p", strong, weak, margin=1.0, extra={"ground_truth": "g"})
    # good-bad: 2.0 > 2.0 is false (the boundary is dropped); good-worse: 2.0 > 1.25 kept;
    # fine-bad: 1.5 > 2.0 no; fine-worse: 1.5 > 1.25 kept
    assert [(r["chosen"], r["rejected"]) for r in records] == [("good", "worse"), ("fine", "worse")]
    assert counts == {"candidates": 4, "kept": 2, "below_margin": 2, "empty_response": 0, "nonfinite_reward": 0,
                      "identical": 0, "duplicate": 0}
    first = records[0]
    assert first == {"prompt": "p", "chosen": "good", "rejected": "worse", "ground_truth": "g",
                     "source": "synthetic", "chosen_source": "strong", "rejected_source": "weak",
                     "chosen_reward": 2.0, "rejected_reward": 0.25, "margin": 1.75,
                     "confidence": pytest.approx(1 / (1 + math.exp(-1.75)))}
    assert records[1]["margin"] == 1.25 and records[1]["confidence"] == pytest.approx(0.7772998611746911)


def test_margin_zero_and_negative():
    strong, weak = [("a", 0.0)], [("b", 0.0), ("c", -0.5)]
    records, counts = cross_pairs("p", strong, weak, margin=0.0)
    assert [r["rejected"] for r in records] == ["c"] and counts["below_margin"] == 1
    records, _ = cross_pairs("p", strong, weak, margin=-1.0)  # a negative margin keeps worse strong samples
    assert [r["rejected"] for r in records] == ["b", "c"] and records[0]["confidence"] == 0.5
    with pytest.raises(ValueError, match="margin must be a finite number"):
        cross_pairs("p", strong, weak, margin=float("nan"))


def test_dedup_within_and_across_calls_and_every_candidate_counted_once():
    strong = [("x", 3.0), ("x", 3.0), ("y", 3.0), ("", 3.0), ("z", float("nan"))]
    weak = [("w", 0.0), ("w", 0.0), ("x", 0.0), ("  ", 0.0)]
    records, counts = cross_pairs("p", strong, weak)
    assert [(r["chosen"], r["rejected"]) for r in records] == [("x", "w"), ("y", "w"), ("y", "x")]
    assert counts == {"candidates": 20, "kept": 3,
                      "empty_response": 4 + 4,  # the empty strong sample with every weak one, "  " with the others
                      "nonfinite_reward": 3,  # "z" with the three non-empty weak samples
                      "identical": 2,  # ("x", "x") twice
                      "below_margin": 0,
                      "duplicate": 4}  # ("x", "w") three more times, ("y", "w") once more
    assert counts["candidates"] == counts["kept"] + sum(counts[r] for r in DROP_REASONS)
    seen = {("p", "x", "w")}
    records, counts = cross_pairs("p", [("x", 3.0)], [("w", 0.0), ("v", 0.0)], seen=seen)
    assert [r["rejected"] for r in records] == ["v"] and counts["duplicate"] == 1
    assert ("p", "x", "v") in seen
    records, _ = cross_pairs("q", [("x", 3.0)], [("w", 0.0)], seen=seen)  # another prompt is not a duplicate
    assert len(records) == 1


def test_bradley_terry_confidence_values():
    assert bradley_terry_confidence(1.0, 1.0) == 0.5
    assert bradley_terry_confidence(2.0, 1.0) == pytest.approx(0.7310585786300049)
    assert bradley_terry_confidence(0.0, 3.0) == pytest.approx(0.04742587317756678)
    assert bradley_terry_confidence(1000.0, 0.0) == 1.0 and bradley_terry_confidence(0.0, 1000.0) == 0.0


# ----------------------------------------------------------------------------------------------------
# end to end on the demo task

NUM_SYNTH_PROMPTS = 12
SFT_STEPS = 60
RULE_WEIGHT = 2.0  # exact match is 0 or 1; weighted 2 a right answer clears the recipe's margin of 1.0


def _config(root, out, extra=()):
    from reward.rm_pipeline import make_config

    return make_config(root, f"{out}/run", extra=[
        "logging.wandb.mode=disabled", "logging.progress_bar=false", "logging.console=false",
        f"sft.total_steps={SFT_STEPS}", "sft.global_batch_size=32", "sft.lr=1e-2", "trainer.micro_batch_size=8",
        "rollout.max_new_tokens=4", *extra])


def _split(values, quantile):
    """A threshold between two neighbouring distinct values near ``quantile``, far from both."""
    distinct = sorted(set(round(v, 6) for v in values))
    start = min(max(int(quantile * len(distinct)), 1), len(distinct) - 1)
    for j in list(range(start, len(distinct))) + list(range(start - 1, 0, -1)):
        if distinct[j] - distinct[j - 1] > 1e-3:
            return (distinct[j] + distinct[j - 1]) / 2
    raise AssertionError(f"no gap between the values {distinct}")


def _independent_scores(groups, cfg, items, texts, rm_path, policy_path):
    """Per item: the reward model's mean over heads and the policy's summed response log-prob, and per
    text the embedding, each from one unpadded sequence through a plain forward."""
    import torch

    from hpa.data.tokenizer import build_tokenizer
    from hpa.models import build_policy, build_reward, capture_final_hidden
    from hpa.models.weights import load_model_weights

    tok = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path)
    rm = build_reward(cfg.model, cfg.parallel, groups, num_heads=cfg.reward.num_heads)
    load_model_weights(rm, rm_path, groups)
    policy = build_policy(cfg.model, cfg.parallel, groups)
    load_model_weights(policy, policy_path, groups)
    rm.eval()
    policy.eval()

    def run(model, ids):
        x = torch.tensor([ids])
        with capture_final_hidden(model) as box:
            out = model(x, torch.arange(len(ids))[None], None)
        return out[0], box[0][:, 0]  # [s, K | v], [s, h]

    reward, log_prob, embedding = {}, {}, {}
    with torch.no_grad():
        for prompt, response in items:
            p, r = tok.encode(prompt), tok.encode(response) + [tok.eos_id]
            heads, _ = run(rm, p + r)
            reward[(prompt, response)] = heads[-1].mean().item()
            logits, _ = run(policy, p + r)
            logp = torch.log_softmax(logits[:, :tok.vocab_size].float(), dim=-1)
            log_prob[(prompt, response)] = sum(logp[len(p) - 1 + j, t].item() for j, t in enumerate(r))
        for text in texts:
            _, hidden = run(rm, tok.encode(text) + [tok.eos_id])
            embedding[text] = hidden.mean(dim=0).tolist()
    return reward, log_prob, embedding


def _cosine(u, v):
    dot = sum(a * b for a, b in zip(u, v))
    return dot / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))


def _library_checks(groups, root, out, strong, records):
    """The library entry points with the rule reward ``2 · exact_match``: the generator with the sides
    swapped, its bad-input errors, and the cleaner's reward margin on the demo pairs given ground truths."""
    from data_tools.clean_preferences import clean_preferences, model_scores
    from data_tools.synth_preferences import run_synth
    from hpa.data.prompts import RecordError, RejectLog

    cfg = _config(root, out, ["reward.rules=[exact_match]", f"reward.rule_weight={RULE_WEIGHT}"])
    kw = dict(prompts_path=f"{out}/synth_prompts.jsonl", output_path=f"{out}/swapped.jsonl", batch_size=4)
    result = {"swapped": run_synth(cfg, groups, strong_path=f"{out}/weak", weak_path=strong, **kw), "errors": {}}
    try:
        run_synth(cfg, groups, strong_path=f"{out}/missing", weak_path=strong, **kw)
    except FileNotFoundError as exc:
        result["errors"]["missing_checkpoint"] = str(exc)
    with open(f"{out}/no_truth.jsonl", "w") as f:
        f.write('{"prompt": "copy d =", "ground_truth": "d"}\n{"prompt": "copy e ="}\n')
    try:
        run_synth(cfg, groups, strong_path=strong, weak_path=f"{out}/weak",
                  **dict(kw, prompts_path=f"{out}/no_truth.jsonl"))
    except ValueError as exc:
        result["errors"]["prompt_without_truth"] = str(exc)

    pairs = [(f"prefs.jsonl:{i}", dict(r, ground_truth=r["prompt"].split()[1])) for i, r in enumerate(records, 1)]
    pairs.append((f"prefs.jsonl:{len(pairs) + 1}", {"prompt": "copy d =", "chosen": "d", "rejected": "a"}))
    kw = dict(reward=True, log_prob=False, embedding=False)
    try:
        model_scores(cfg, groups, pairs, on_error="raise", rejects=RejectLog(None), **kw)
    except RecordError as exc:
        result["errors"]["pair_without_truth"] = str(exc)
    rejects = RejectLog(None)
    usable, scored = model_scores(cfg, groups, pairs, on_error="skip", rejects=rejects, **kw)
    kept, result["rule_report"] = clean_preferences(usable, reward_fn=scored["reward_fn"], rejects=rejects)
    result["rule_rejects"] = rejects.records
    return result


def e2e_worker(groups, root, out, port):
    import contextlib
    import io
    import os
    import time

    from data_tools import clean_preferences, synth_preferences
    from hpa.config import write_resolved
    from hpa.distributed import set_seed
    from hpa.models import build_policy, build_reward
    from hpa.reward.model import write_reward_model_info
    from hpa.models.weights import save_model_weights
    from hpa.trainer.sft import run_sft

    timings = {}
    start = time.time()
    cfg = _config(root, out, [f"model.policy_path={out}/weak"])
    set_seed(0)
    save_model_weights(build_policy(cfg.model, cfg.parallel, groups), f"{out}/weak", groups)
    save_model_weights(build_reward(cfg.model, cfg.parallel, groups, num_heads=cfg.reward.num_heads), f"{out}/rm",
                       groups)
    write_reward_model_info(f"{out}/rm", num_heads=cfg.reward.num_heads, model=cfg.model)
    sft = run_sft(cfg, groups)
    strong = f"{out}/run/sft"
    timings["sft"] = time.time() - start

    # independent scores of every distinct (prompt, response) of the first demo pairs
    records = [json.loads(line) for line in open(f"{root}/preferences.jsonl")]
    items = sorted({(r["prompt"], r[k]) for r in records for k in ("chosen", "rejected")})
    texts = sorted({text for _, text in items})
    reward, log_prob, embedding = _independent_scores(groups, cfg, items, texts, f"{out}/rm", strong)
    # thresholds between neighbouring values, so that each rule drops some of the pairs it sees
    similarity = [_cosine(embedding[r["chosen"]], embedding[r["rejected"]]) for r in records]
    max_similarity = _split(similarity, 0.7)
    left = [r for r, s in zip(records, similarity) if s <= max_similarity]
    margins = [reward[(r["prompt"], r["chosen"])] - reward[(r["prompt"], r["rejected"])] for r in left]
    min_reward_margin = _split(margins, 0.4)
    left = [r for r, m in zip(left, margins) if m >= min_reward_margin]
    gaps = [abs(log_prob[(r["prompt"], r["chosen"])] - log_prob[(r["prompt"], r["rejected"])]) for r in left]
    max_logprob_gap = _split(gaps, 0.6)

    lines = open(f"{root}/prompts.jsonl").read().splitlines()[:NUM_SYNTH_PROMPTS]
    with open(f"{out}/synth_prompts.jsonl", "w") as f:
        f.write("\n".join(lines) + "\n")
    library = _library_checks(groups, root, out, strong, records)

    # the CLIs, in the environment torchrun gives its workers (the process group is already up)
    os.environ.update(RANK=str(groups.rank), WORLD_SIZE=str(groups.world_size), LOCAL_RANK=str(groups.local_rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    config_path = write_resolved(cfg, f"{out}/config")
    start = time.time()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = synth_preferences.main([
            "--config", str(config_path), "--strong", strong, "--weak", f"{out}/weak",
            "--prompts", f"{out}/synth_prompts.jsonl", "--output", f"{out}/synth.jsonl", "--batch-size", "4",
            "reward.rules=[exact_match]", f"reward.rule_weight={RULE_WEIGHT}", "reward.model_paths=[]"])
    timings["synth"] = time.time() - start
    synth_stdout = stdout.getvalue()

    start = time.time()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        report = clean_preferences.main([
            "--input", f"{root}/preferences.jsonl", "--output", f"{out}/clean.jsonl", "--config", str(config_path),
            "--similarity", "embedding", "--max-similarity", str(max_similarity),
            "--min-reward-margin", str(min_reward_margin), "--max-logprob-gap", str(max_logprob_gap),
            "--batch-size", "16", f"reward.model_paths=[{out}/rm]", "reward.rules=[]", f"model.policy_path={strong}"])
    timings["clean"] = time.time() - start
    return {"library": library, "sft": sft, "synth_code": code, "synth_stdout": synth_stdout, "report": report,
            "clean_stdout": stdout.getvalue(), "timings": timings,
            "thresholds": (max_similarity, min_reward_margin, max_logprob_gap),
            "reward": reward, "log_prob": log_prob, "embedding": embedding}


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    import time

    from multirank import free_port, run_ranks
    from reward.rm_pipeline import make_data

    start = time.time()
    root = tmp_path_factory.mktemp("synth")
    make_data(str(root / "data"))
    ranks = run_ranks(e2e_worker, dp=2, args=(str(root / "data"), str(root / "out"), free_port()))
    return {"ranks": ranks, "data": root / "data", "out": root / "out", "seconds": time.time() - start}


def _read(path):
    return [json.loads(line) for line in open(path).read().splitlines()]


@pytest.mark.multirank
def test_tp1_pp1_dp2_generator_keeps_right_strong_answers_over_wrong_weak_ones(e2e):
    from hpa.data.preferences import PreferenceDataset
    from hpa.data.tokenizer import build_tokenizer
    from hpa.reward.rules import exact_match_reward

    main, other = e2e["ranks"]
    assert main["synth_code"] == other["synth_code"] == 0 and other["synth_stdout"] == ""
    summary = json.loads(main["synth_stdout"])
    records = _read(e2e["out"] / "synth.jsonl")
    n, k = NUM_SYNTH_PROMPTS, 3
    assert (summary["num_prompts"], summary["num_samples"], summary["num_candidate_pairs"]) == (n, 2 * k * n, k * k * n)
    assert (summary["k"], summary["strong_temperature"], summary["weak_temperature"], summary["margin"]) == \
        (3, 0.7, 0.9, 1.0)
    assert summary["num_kept"] == len(records) > 0
    assert summary["num_candidate_pairs"] == summary["num_kept"] + sum(summary["dropped"].values())
    # the SFT policy is the better one under the reward
    assert summary["mean_reward_strong"] > summary["mean_reward_weak"] + 0.5
    assert len({(r["prompt"], r["chosen"], r["rejected"]) for r in records}) == len(records)
    for r in records:  # the rewards are the rule's, recomputed here; every kept pair clears the margin
        assert r["chosen_reward"] == RULE_WEIGHT * exact_match_reward(r["chosen"], r["ground_truth"]) == RULE_WEIGHT
        assert r["rejected_reward"] == RULE_WEIGHT * exact_match_reward(r["rejected"], r["ground_truth"]) == 0.0
        assert r["chosen_reward"] > r["rejected_reward"] + 1.0 and r["margin"] == RULE_WEIGHT
        assert r["confidence"] == pytest.approx(1 / (1 + math.exp(-RULE_WEIGHT)))
        assert (r["source"], r["chosen_source"], r["rejected_source"]) == ("synthetic", "strong", "weak")
        assert r["prompt"] == f"copy {r['ground_truth']} ="
    assert summary["mean_margin"] == pytest.approx(RULE_WEIGHT)
    tok = build_tokenizer("sentencepiece", str(e2e["data"] / "tok.model"))
    data = PreferenceDataset.load(str(e2e["out"] / "synth.jsonl"), tok, max_prompt_length=24, max_response_length=16)
    assert len(data) == len(records) and data.stats["num_rejected"] == 0


@pytest.mark.multirank
def test_tp1_pp1_dp2_cleaner_counts_match_independent_scores(e2e):
    main, other = e2e["ranks"]
    report = main["report"]
    assert json.loads(main["clean_stdout"]) == report and other["clean_stdout"] == ""
    assert other["report"]["rules"] == report["rules"]
    max_similarity, min_reward_margin, max_logprob_gap = main["thresholds"]
    reward, log_prob, embedding = main["reward"], main["log_prob"], main["embedding"]
    records = _read(e2e["data"] / "preferences.jsonl")
    expected = {rule: {"checked": 0, "dropped": 0} for rule in ("similarity", "reward_margin", "logprob_gap")}
    kept = []
    for r in records:
        c, j = (r["prompt"], r["chosen"]), (r["prompt"], r["rejected"])
        for rule, drops in (("similarity", _cosine(embedding[r["chosen"]], embedding[r["rejected"]]) > max_similarity),
                            ("reward_margin", reward[c] - reward[j] < min_reward_margin),
                            ("logprob_gap", abs(log_prob[c] - log_prob[j]) > max_logprob_gap)):
            expected[rule]["checked"] += 1
            if drops:
                expected[rule]["dropped"] += 1
                break
        else:
            kept.append(r)
    rules = report["rules"]
    for rule, counts in expected.items():
        assert rules[rule]["status"] == "applied"
        assert (rules[rule]["checked"], rules[rule]["dropped"]) == (counts["checked"], counts["dropped"]), rule
        assert 0 < counts["dropped"] < counts["checked"], rule  # every rule drops some pairs, not all
    assert rules["similarity"]["measure"] == "embedding_cosine"
    assert report["num_input"] == len(records) and report["num_kept"] == len(kept)
    assert _read(e2e["out"] / "clean.jsonl") == kept
    assert report["unscorable"] == {} and report["num_scored_items"] == len(reward)
    # the batched scores in the rejects file agree with the one-sequence forwards
    rejects = _read(e2e["out"] / "clean.rejects.jsonl")
    assert len(rejects) == len(records) - len(kept)
    for entry in rejects:
        r = entry["record"]
        c, j = (r["prompt"], r["chosen"]), (r["prompt"], r["rejected"])
        value = {"similarity": _cosine(embedding[r["chosen"]], embedding[r["rejected"]]),
                 "reward_margin": reward[c] - reward[j],
                 "logprob_gap": abs(log_prob[c] - log_prob[j])}[entry["rule"]]
        assert entry["value"] == pytest.approx(value, abs=1e-4)



@pytest.mark.multirank
def test_tp1_pp1_dp2_library_swapped_sides_keep_nothing_and_bad_input_is_named(e2e):
    library = e2e["ranks"][0]["library"]
    swapped = library["swapped"]
    # the random policy as the "strong" side never beats the SFT policy by the margin
    assert swapped["num_kept"] == 0 and (e2e["out"] / "swapped.jsonl").read_text() == ""
    assert swapped["mean_reward_strong"] < swapped["mean_reward_weak"]
    assert swapped["dropped"]["below_margin"] > 0
    assert swapped["num_candidate_pairs"] == sum(swapped["dropped"].values())
    errors = library["errors"]
    assert "--strong" in errors["missing_checkpoint"] and "missing" in errors["missing_checkpoint"]
    assert errors["prompt_without_truth"].startswith(f"{e2e['out'] / 'no_truth.jsonl'}:2: key 'ground_truth'")
    assert "reward.rules=[]" in errors["prompt_without_truth"]
    assert errors["pair_without_truth"].startswith("prefs.jsonl:1001: key 'ground_truth': is missing")


@pytest.mark.multirank
def test_tp1_pp1_dp2_cleaner_rule_reward_drops_exactly_the_flipped_pairs(e2e):
    library = e2e["ranks"][0]["library"]
    records = _read(e2e["data"] / "preferences.jsonl")
    flipped = sum(r["flipped"] for r in records)
    rules = library["rule_report"]["rules"]
    assert flipped > 0
    assert (rules["similarity"]["checked"], rules["similarity"]["dropped"]) == (len(records), 0)
    assert (rules["reward_margin"]["checked"], rules["reward_margin"]["dropped"]) == (len(records), flipped)
    assert library["rule_report"]["num_kept"] == len(records) - flipped
    rejects = library["rule_rejects"]
    assert (rejects[0]["location"], rejects[0]["reason"], rejects[0]["key"]) == ("prefs.jsonl:1001", "malformed",
                                                                                   "ground_truth")
    assert all(r["record"]["flipped"] and r["value"] == -RULE_WEIGHT for r in rejects[1:])


def test_cli_config_error_names_the_key(capsys):
    from data_tools.synth_preferences import main

    code = main(["--strong", "s", "--weak", "w", "--prompts", "p.jsonl", "--output", "o.jsonl", "reward.bogus=1"])
    assert code == 2 and "reward.bogus" in capsys.readouterr().err
