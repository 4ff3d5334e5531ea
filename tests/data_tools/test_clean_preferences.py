import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_tools.clean_preferences import (clean_preferences, edit_similarity, levenshtein,
                                          main)
from hpa.data.prompts import RecordError, RejectLog


def reference_levenshtein(a, b):
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


@settings(max_examples=200, deadline=None)
@given(a=st.text("abc", max_size=12), b=st.text("abc", max_size=12), k=st.integers(0, 12))
def test_banded_levenshtein_matches_reference(a, b, k):
    d = reference_levenshtein(a, b)
    assert levenshtein(a, b) == d
    assert levenshtein(a, b, k) == (d if d <= k else k + 1)


def test_edit_similarity():
    assert edit_similarity("abcdefghij", "abcdefghiX") == 0.9
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("abc", "xyz", min_similarity=0.9) < 0.9


PAIRS = [
    ("p1", "The answer is 4.", "The answer is 5."),          # similarity 0.9375 > 0.9 -> dropped
    ("p2", "four", "a totally different thing"),             # reward margin 0.2 < 0.5 -> dropped
    ("p3", "good answer", "bad reply"),                     # margin 3, |dlogp| 5 > 2 -> dropped
    ("p4", "fine answer", "poor reply"),                    # margin 1, |dlogp| 1 -> kept
    ("p5", "ok answer here", "nope"),                       # margin -1 (mislabelled) -> dropped
]
REWARD = {"The answer is 4.": 1.0, "The answer is 5.": 0.0, "four": 1.2, "a totally different thing": 1.0, "good answer": 3.0, "bad reply": 0.0,
          "fine answer": 1.0, "poor reply": 0.0, "ok answer here": 0.0, "nope": 1.0}
LOGP = {"good answer": -1.0, "bad reply": -6.0, "fine answer": -2.0, "poor reply": -3.0,
        "ok answer here": -1.0, "nope": -1.5}


def records():
    return [(f"f.jsonl:{i}", {"prompt": p, "chosen": c, "rejected": r}) for i, (p, c, r) in enumerate(PAIRS, 1)]


def test_rules_counts_with_fake_scorers():
    rejects = RejectLog(None)
    kept, report = clean_preferences(records(), reward_fn=lambda p, r: REWARD[r], logprob_fn=lambda p, r: LOGP[r],
                                     rejects=rejects)
    assert [r["prompt"] for r in kept] == ["p4"]
    rules = report["rules"]
    assert (rules["similarity"]["checked"], rules["similarity"]["dropped"]) == (5, 1)
    assert (rules["reward_margin"]["checked"], rules["reward_margin"]["dropped"]) == (4, 2)
    assert (rules["logprob_gap"]["checked"], rules["logprob_gap"]["dropped"]) == (2, 1)
    assert rules["similarity"]["measure"] == "edit_similarity"
    assert [(r["location"], r["rule"]) for r in rejects.records] == [
        ("f.jsonl:1", "similarity"), ("f.jsonl:2", "reward_margin"), ("f.jsonl:3", "logprob_gap"),
        ("f.jsonl:5", "reward_margin")]
    assert rejects.records[3]["value"] == -1.0


def test_absent_scorers_are_reported_as_skipped_and_thresholds_configurable():
    kept, report = clean_preferences(records(), max_similarity=0.95)
    assert len(kept) == 5
    assert report["rules"]["reward_margin"]["status"].startswith("skipped")
    assert report["rules"]["logprob_gap"]["status"].startswith("skipped")
    assert report["rules"]["similarity"]["threshold"] == 0.95


def test_embedding_cosine_when_embed_fn_given():
    embed = {"The answer is 4.": [1.0, 0.0], "The answer is 5.": [0.0, 1.0]}
    kept, report = clean_preferences(records()[:1], embed_fn=lambda t: embed[t])
    assert len(kept) == 1 and report["rules"]["similarity"]["measure"] == "embedding_cosine"


def test_cli_edit_similarity_and_score_keys(tmp_path, capsys):
    src = tmp_path / "prefs.jsonl"
    rows = [{"prompt": p, "chosen": c, "rejected": r, "sc": REWARD[c], "sr": REWARD[r]} for p, c, r in PAIRS]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{bad\n")
    out = tmp_path / "clean.jsonl"
    report = main(["--input", str(src), "--output", str(out), "--on-error", "skip"])
    assert json.loads(capsys.readouterr().out) == report
    assert report["num_kept"] == 4 and report["num_malformed"] == 1
    rejects = [json.loads(l) for l in open(tmp_path / "clean.rejects.jsonl")]
    assert [r["reason"] for r in rejects] == ["malformed", "similarity"]
    report = main(["--input", str(src), "--output", str(out), "--on-error", "skip", "--score-keys", "sc", "sr"])
    assert report["num_kept"] == 2 and report["rules"]["reward_margin"]["dropped"] == 2
    assert [r["prompt"] for r in map(json.loads, open(out))] == ["p3", "p4"]


def test_cli_model_options_need_a_config(tmp_path, capsys):
    from hpa.config.load import default_config_path

    src = tmp_path / "prefs.jsonl"
    src.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b", "sc": 1, "sr": 0}) + "\n")
    base = ["--input", str(src), "--output", str(tmp_path / "clean.jsonl")]
    with pytest.raises(SystemExit):
        main(base + ["--similarity", "embedding"])
    assert "--similarity embedding reads a reward model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["reward.rules=[]"])
    assert "need --config" in capsys.readouterr().err
    # the embedded config scores with the exact_match rule: that and stored scores both define the margin
    with pytest.raises(SystemExit, match="--score-keys and the config's reward"):
        main(base + ["--config", str(default_config_path()), "--score-keys", "sc", "sr"])
    with pytest.raises(SystemExit, match="reward.bogus"):
        main(base + ["--config", str(default_config_path()), "reward.bogus=1"])


def test_cli_lines_with_invalid_utf8_or_nul_bytes_are_malformed_records(tmp_path, capsys):
    src = tmp_path / "prefs.jsonl"
    good = [json.dumps({"prompt": p, "chosen": c, "rejected": r}).encode() for p, c, r in PAIRS]
    src.write_bytes(b"\n".join([good[0], b'{"prompt": "p", "chosen": "\xff\xfe", "rejected": "no"}',
                                b'{"prompt": "p", "chosen": "a\x00", "rejected": "no"}', *good[1:]]) + b"\n")
    out = tmp_path / "clean.jsonl"
    report = main(["--input", str(src), "--output", str(out), "--on-error", "skip"])
    capsys.readouterr()
    assert report["num_input"] == len(PAIRS) and report["num_malformed"] == 2
    rejects = [json.loads(l) for l in open(tmp_path / "clean.rejects.jsonl", encoding="utf-8")]
    assert [(r["location"], r["reason"]) for r in rejects[:2]] == [(f"{src}:2", "malformed"), (f"{src}:3", "malformed")]
    assert "not valid UTF-8 (byte 0xff at column 28)" in rejects[0]["message"] and "\\xff\\xfe" in rejects[0]["record"]
    assert "NUL byte at column 29" in rejects[1]["message"]
    with pytest.raises(RecordError, match=rf"{src.name}:2: is not valid UTF-8"):
        main(["--input", str(src), "--output", str(out)])
