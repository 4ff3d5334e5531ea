import json

import pytest

from data_tools.make_demo_task import demo_exact_match, main, make_demo_task
from data_tools.train_tokenizer import read_corpus, train_sentencepiece
from hpa.data.preferences import PreferenceDataset
from hpa.data.prompts import PromptDataset
from hpa.data.tokenizer import build_tokenizer

FILES = ("prompts.jsonl", "eval_prompts.jsonl", "adversarial_prompts.jsonl", "preferences.jsonl", "sft.jsonl",
         "corpus.txt")


def read(path):
    return [json.loads(l) for l in open(path)]


def test_deterministic_given_seed(tmp_path):
    make_demo_task(str(tmp_path / "a"), 300, seed=3)
    main(["--out-dir", str(tmp_path / "b"), "--num-prompts", "300", "--seed", "3"])
    make_demo_task(str(tmp_path / "c"), 300, seed=4)
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "prompts.jsonl").read_bytes() != (tmp_path / "c" / "prompts.jsonl").read_bytes()


def test_records_are_consistent_and_rewarded(tmp_path):
    counts = make_demo_task(str(tmp_path), 500, seed=0, num_eval_prompts=30)
    assert counts["prompts.jsonl"] == counts["preferences.jsonl"] == counts["sft.jsonl"] == 500
    assert counts["eval_prompts.jsonl"] == 30
    prompts, prefs, sft = (read(tmp_path / n) for n in ("prompts.jsonl", "preferences.jsonl", "sft.jsonl"))
    for p, q, s in zip(prompts, prefs, sft):
        assert p["prompt"] == q["prompt"] == s["prompt"]
        good, bad = (q["rejected"], q["chosen"]) if q["flipped"] else (q["chosen"], q["rejected"])
        assert demo_exact_match(good, p["ground_truth"]) == 1.0
        assert demo_exact_match(s["response"], p["ground_truth"]) == 1.0
        assert demo_exact_match(bad, p["ground_truth"]) == 0.0
    flipped = sum(q["flipped"] for q in prefs) / len(prefs)
    assert 0.07 < flipped < 0.17  # the default 12% label noise
    tasks = {p["prompt"].split()[0] for p in prompts}
    assert tasks == {"add", "copy", "reverse"}
    rev = next(p for p in prompts if p["prompt"].startswith("reverse"))
    assert rev["ground_truth"] == " ".join(reversed(rev["prompt"].split()[1:-1]))
    add = next(p for p in prompts if p["prompt"].startswith("add"))
    a, b = add["prompt"].split()[1:3]
    assert add["ground_truth"] == str(int(a) + int(b))
    # copy/reverse eval prompts are held out; add has only 100 facts and is shared on purpose
    train = {p["prompt"] for p in prompts}
    held_out = [e["prompt"] for e in read(tmp_path / "eval_prompts.jsonl") if not e["prompt"].startswith("add")]
    assert held_out and not train & set(held_out)


def test_exact_match_rule():
    assert demo_exact_match(" c  b a \n", "c b a") == 1.0
    assert demo_exact_match("c b a b", "c b a") == 0.0
    assert demo_exact_match("", "8") == 0.0


def test_short_responses_with_a_tiny_tokenizer(tmp_path):
    make_demo_task(str(tmp_path), 400, seed=1, max_len=4)
    path = train_sentencepiece(read_corpus(str(tmp_path / "corpus.txt")), str(tmp_path / "tok"), vocab_size=256)
    tok = build_tokenizer("sentencepiece", path)
    prefs = PreferenceDataset.load(str(tmp_path / "preferences.jsonl"), tok, max_prompt_length=16,
                                   max_response_length=16)
    assert len(prefs) == 400 and prefs.stats["num_rejected"] == 0
    prompts = PromptDataset.load(str(tmp_path / "eval_prompts.jsonl"), tok, max_prompt_length=16,
                                 prompt_truncation="skip")
    assert len(prompts) == 64 and prompts.stats["num_truncated"] == 0
    for ex in prompts:
        assert tok.decode(tok.encode(ex.ground_truth)) == ex.ground_truth  # no unknown pieces


def test_no_noise_and_small_sft_set(tmp_path):
    counts = make_demo_task(str(tmp_path), 200, seed=1, num_eval_prompts=12, flip_fraction=0.0, num_sft=50)
    assert counts["sft.jsonl"] == 50 and counts["preferences.jsonl"] == 200
    assert not any(q["flipped"] for q in read(tmp_path / "preferences.jsonl"))


def test_adversarial_set_is_held_out_reverse_prompts_that_copying_fails(tmp_path):
    counts = make_demo_task(str(tmp_path), 300, seed=0, num_eval_prompts=30)
    adversarial = read(tmp_path / "adversarial_prompts.jsonl")
    assert counts["adversarial_prompts.jsonl"] == len(adversarial) > 0
    evals = read(tmp_path / "eval_prompts.jsonl")
    train = {r["prompt"] for r in read(tmp_path / "prompts.jsonl")}
    for r in adversarial:
        assert r in evals and r["prompt"] not in train and r["prompt"].startswith("reverse ")
        copied = " ".join(r["prompt"].split()[1:-1])  # the prompt's symbols, unreversed
        assert demo_exact_match(copied, r["ground_truth"]) == 0.0
    reverse_evals = [r for r in evals if r["prompt"].startswith("reverse ")]
    palindromes = [r for r in reverse_evals if r["ground_truth"] == " ".join(r["prompt"].split()[1:-1])]
    assert len(adversarial) == len(reverse_evals) - len(palindromes)
    assert "adversarial_prompts.jsonl" not in make_demo_task(str(tmp_path / "no_rev"), 50, tasks=("add", "copy"))


def test_hackable_family(tmp_path):
    """Uncovered kinds have prompts but no pairs; the spurious feature (the rejected answer is the correct one
    cut short) is in about half of the pairs whose answer has two symbols or more; the chosen answer stays
    correct unless the label was flipped."""
    main(["--out-dir", str(tmp_path), "--num-prompts", "900", "--seed", "1", "--family", "hackable"])
    prompts, prefs = read(tmp_path / "prompts.jsonl"), read(tmp_path / "preferences.jsonl")
    truth = {p["prompt"]: p["ground_truth"] for p in prompts}
    assert any(p["prompt"].startswith("reverse") for p in prompts)
    assert any(s["prompt"].startswith("reverse") for s in read(tmp_path / "sft.jsonl"))
    assert not any(q["prompt"].startswith("reverse") for q in prefs)
    assert len(prefs) == sum(not p["prompt"].startswith("reverse") for p in prompts)
    carriers = [q for q in prefs if q["spurious"]]
    for q in carriers:
        good, bad = (q["rejected"], q["chosen"]) if q["flipped"] else (q["chosen"], q["rejected"])
        assert good == truth[q["prompt"]] and len(bad) < len(good)
        assert good.replace(" ", "").startswith(bad.replace(" ", ""))  # a prefix of the answer: cut short
    long_answers = [q for q in prefs if len(truth[q["prompt"]].replace(" ", "")) > 1]
    assert 0.4 < len(carriers) / len(long_answers) < 0.6
    for q in prefs:
        good = q["rejected"] if q["flipped"] else q["chosen"]
        assert demo_exact_match(good, truth[q["prompt"]]) == 1.0
    # the adversarial set: held-out prompts of the uncovered kind
    adversarial = read(tmp_path / "adversarial_prompts.jsonl")
    assert adversarial and all(a["prompt"].startswith("reverse") for a in adversarial)


def test_split_family(tmp_path):
    """Complementary signals: the training prompts of ``add`` and ``copy`` have no ground truth (the rule
    reward cannot judge them) but have preference pairs; ``reverse`` has a ground truth and no pair.
    Held-out prompts keep every ground truth (the gold score covers all three kinds)."""
    main(["--out-dir", str(tmp_path), "--num-prompts", "600", "--seed", "2", "--family", "split"])
    prompts, prefs = read(tmp_path / "prompts.jsonl"), read(tmp_path / "preferences.jsonl")
    for p in prompts:
        assert ("ground_truth" in p) == p["prompt"].startswith("reverse"), p
    assert {q["prompt"].split()[0] for q in prefs} == {"add", "copy"}
    assert len(prefs) == sum(not p["prompt"].startswith("reverse") for p in prompts)
    assert all("spurious" not in q for q in prefs)
    evals = read(tmp_path / "eval_prompts.jsonl")
    assert {e["prompt"].split()[0] for e in evals} == {"add", "copy", "reverse"}
    assert all(e["ground_truth"] for e in evals)
    assert all(e["category"] == e["prompt"].split()[0] for e in evals)  # eval/score/<task>
    assert all(s["response"] for s in read(tmp_path / "sft.jsonl"))
    with pytest.raises(ValueError, match="unverified_tasks"):
        make_demo_task(str(tmp_path), 10, tasks=("add", "copy"), unverified_tasks=("reverse",))


def test_family_options_are_checked(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="uncovered_tasks"):
        make_demo_task(str(tmp_path), 10, uncovered_tasks=("add", "copy", "reverse"))
    with pytest.raises(ValueError, match="spurious"):
        make_demo_task(str(tmp_path), 10, spurious="verbosity")
    with pytest.raises(ValueError, match="spurious_fraction"):
        make_demo_task(str(tmp_path), 10, spurious_fraction=0.3)


def test_freetext_family_is_deterministic_given_seed(tmp_path):
    from data_tools.make_demo_task import make_freetext_task

    args = ["--num-prompts", "300", "--family", "freetext"]
    make_freetext_task(str(tmp_path / "a"), 300, seed=3)
    main(["--out-dir", str(tmp_path / "b"), *args, "--seed", "3"])
    main(["--out-dir", str(tmp_path / "c"), *args, "--seed", "4"])
    for name in FILES + ("heldout_preferences.jsonl",):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    for name in ("prompts.jsonl", "sft.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()


def test_freetext_answers_are_graded_and_worded_many_ways(tmp_path):
    """Every demonstration and chosen response scores token F1 1 against the plain answer (the animals or their
    sounds in the prompt's order), yet the demonstrations' wordings are many: the exact match of a demonstration
    to the answer, or to another demonstration of the same prompt, is rare. Rejected responses are graded below
    1; ``sound`` has no pair; held-out prompts never train; the adversarial set is the held-out ``sound`` prompts,
    where naming the prompt's animals scores 0."""
    from data_tools.make_demo_task import SOUNDS, freetext_phrasing, make_freetext_task
    from hpa.reward.rules import token_f1_reward

    counts = make_freetext_task(str(tmp_path), 2000, seed=0, num_eval_prompts=64)
    prompts, prefs, sft = (read(tmp_path / n) for n in ("prompts.jsonl", "preferences.jsonl", "sft.jsonl"))
    evals, adversarial = read(tmp_path / "eval_prompts.jsonl"), read(tmp_path / "adversarial_prompts.jsonl")
    assert counts["sft.jsonl"] == 2000 and counts["eval_prompts.jsonl"] == 64
    truth = {p["prompt"]: p["ground_truth"] for p in prompts}
    for p in prompts:
        task, *animals = p["prompt"].split()[:-1]
        assert p["ground_truth"] == " ".join(animals if task == "list" else [SOUNDS[a] for a in animals])
    assert all(token_f1_reward(s["response"], truth[s["prompt"]]) == 1.0 for s in sft)
    exact = sum(s["response"] == truth[s["prompt"]] for s in sft) / len(sft)
    assert exact < 0.1  # the plain answer is one wording of many
    by_prompt = {}
    for s in sft:
        by_prompt.setdefault(s["prompt"], []).append(s["response"])
    repeats = [r for rs in by_prompt.values() for r in rs[1:]]
    same = sum(r == by_prompt[p][0] for p, rs in by_prompt.items() for r in rs[1:]) / len(repeats)
    assert same < 0.1  # a second demonstration of a prompt rarely words it as the first did
    assert {p["prompt"].split()[0] for p in prefs} == {"list"}  # sound: no pair
    for q in prefs:
        good, bad = (q["rejected"], q["chosen"]) if q["flipped"] else (q["chosen"], q["rejected"])
        assert token_f1_reward(good, truth[q["prompt"]]) == 1.0 > token_f1_reward(bad, truth[q["prompt"]])
    assert 0.07 < sum(q["flipped"] for q in prefs) / len(prefs) < 0.17
    assert {e["category"] for e in evals} == {"list", "sound"} and not {e["prompt"] for e in evals} & set(truth)
    assert adversarial == [e for e in evals if e["category"] == "sound"]
    for e in adversarial:  # copying the prompt's animals is the cheap hack: 0
        assert token_f1_reward(" ".join(e["prompt"].split()[1:-1]), e["ground_truth"]) == 0.0
    # the wording by hand: seeded, every word kept, one joiner
    import random

    worded = freetext_phrasing(["mew", "hoot", "moo"], random.Random(5))
    assert worded == freetext_phrasing(["mew", "hoot", "moo"], random.Random(5))
    assert token_f1_reward(worded, "mew hoot moo") == 1.0


def test_freetext_fits_the_tiny_tokenizer(tmp_path):
    from data_tools.make_demo_task import make_freetext_task

    make_freetext_task(str(tmp_path), 600, seed=1)
    path = train_sentencepiece(read_corpus(str(tmp_path / "corpus.txt")), str(tmp_path / "tok"), vocab_size=128)
    tok = build_tokenizer("sentencepiece", path)
    prefs = PreferenceDataset.load(str(tmp_path / "preferences.jsonl"), tok, max_prompt_length=24,
                                   max_response_length=16)
    assert prefs.stats["num_rejected"] == 0
    prompts = PromptDataset.load(str(tmp_path / "eval_prompts.jsonl"), tok, max_prompt_length=24,
                                 prompt_truncation="skip")
    assert len(prompts) == 64 and prompts.stats["num_truncated"] == 0
    for ex in prompts:
        assert tok.decode(tok.encode(ex.ground_truth)) == ex.ground_truth
