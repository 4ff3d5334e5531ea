import json

import pytest

from data_tools import prepare_gsm8k, prepare_hh_rlhf, prepare_ultrafeedback
from data_tools.train_tokenizer import train_sentencepiece
from hpa.data.prompts import RecordError


def write_lines(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return str(path)


def read(path):
    return [json.loads(l) for l in open(path)]


def hh(q, a):
    return f"\n\nHuman: {q}\n\nAssistant: {a}"


def test_hh_rlhf_split_dedup_and_rejects(tmp_path, capsys):
    multi = hh("hi", "hello") + "\n\nHuman: what is 2+2?\n\nAssistant:"
    src = write_lines(tmp_path / "hh.jsonl", [
        {"chosen": hh("What is 2+2?", "4."), "rejected": hh("What is 2+2?", "5.")},
        {"chosen": multi + " It is 4.", "rejected": multi + " Fish."},
        "{not json",
        {"chosen": hh("What is 2+2?", "4."), "rejected": hh("What is 2+2?", "5.")},  # duplicate of line 1
        {"chosen": "no turns", "rejected": "at all"},
        {"chosen": hh("x", "same"), "rejected": hh("x", "same")},
    ])
    out = str(tmp_path / "out" / "hh_clean.jsonl")
    stats = prepare_hh_rlhf.main(["--input", src, "--output", out, "--on-error", "skip"])
    assert json.loads(capsys.readouterr().out) == stats
    rows = read(out)
    assert rows[0] == {"prompt": "\n\nHuman: What is 2+2?\n\nAssistant:", "chosen": " 4.", "rejected": " 5."}
    assert rows[1]["prompt"] == multi and rows[1]["chosen"] == " It is 4."
    assert stats["num_read"] == 6 and stats["num_written"] == 2
    assert stats["rejected_by_reason"] == {"duplicate": 1, "malformed": 3}
    rejects = read(tmp_path / "out" / "hh_clean.rejects.jsonl")
    assert [r["location"].rsplit(":", 1)[1] for r in rejects] == ["3", "4", "5", "6"]
    assert f"{src}:1" in rejects[1]["message"]


def test_malformed_record_raises_with_file_and_line(tmp_path):
    src = write_lines(tmp_path / "hh.jsonl", [{"chosen": hh("q", "a"), "rejected": hh("q", "b")},
                                              {"chosen": hh("q", "a")}])
    with pytest.raises(RecordError, match=r"hh\.jsonl:2: key 'rejected': is missing"):
        prepare_hh_rlhf.main(["--input", src, "--output", str(tmp_path / "o.jsonl")])


def uf(prompt, good, bad, sc=8.0, sr=3.0):
    return {"prompt": prompt, "chosen": [{"role": "user", "content": prompt}, {"role": "assistant", "content": good}],
            "rejected": [{"role": "user", "content": prompt}, {"role": "assistant", "content": bad}],
            "score_chosen": sc, "score_rejected": sr}


def test_ultrafeedback_from_parquet_with_length_filter(tmp_path, capsys):
    import datasets

    tok_path = train_sentencepiece(["tell me a joke", "why did the chicken cross the road", "no"],
                                   str(tmp_path / "tok"), vocab_size=256)
    records = [uf("tell me a joke", "why did the chicken cross", "no"),
               uf("tell me a joke", "why did the chicken cross", "no"),  # duplicate
               uf("joke", "why did the chicken cross the road " * 10, "no"),  # response too long
               {**uf("q", "a", "b"), "chosen": [{"role": "user", "content": "q"}]}]  # last turn not assistant
    src = str(tmp_path / "uf.parquet")
    datasets.Dataset.from_list(records).to_parquet(src)
    out = str(tmp_path / "uf.jsonl")
    stats = prepare_ultrafeedback.main(["--input", src, "--output", out, "--tokenizer", tok_path,
                                        "--max-response-length", "40", "--on-error", "skip"])
    capsys.readouterr()
    assert read(out) == [{"prompt": "tell me a joke", "chosen": "why did the chicken cross", "rejected": "no",
                          "score_chosen": 8.0, "score_rejected": 3.0}]
    assert stats["rejected_by_reason"] == {"chosen_too_long": 1, "duplicate": 1, "malformed": 1}
    assert stats["token_lengths"]["chosen"]["max"] > 0
    rejects = read(tmp_path / "uf.rejects.jsonl")
    assert rejects[-1]["location"] == f"{src}[row 4]" and "expected 'assistant'" in rejects[-1]["message"]


def test_gsm8k_ground_truth_template_and_dedup(tmp_path, capsys):
    src = write_lines(tmp_path / "gsm.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A farm has 1,200 hens. Double?", "answer": "1200*2=2400\n#### 2,400"},
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "#### 7"},
        {"question": "No marker?", "answer": "42"},
        "",
    ])
    out = str(tmp_path / "gsm_out.jsonl")
    stats = prepare_gsm8k.main(["--input", src, "--output", out, "--on-error", "skip",
                                "--template", "Q: {question}\nA:"])
    capsys.readouterr()
    rows = read(out)
    assert [r["ground_truth"] for r in rows] == ["7", "2400"]
    assert rows[0]["prompt"] == "Q: Tom has 3 apples and buys 4. How many?\nA:"
    assert rows[0]["solution"].endswith("#### 7")
    assert stats["rejected_by_reason"] == {"duplicate": 1, "malformed": 1} and stats["num_blank_lines"] == 1
    with pytest.raises(RecordError, match=r"gsm\.jsonl:4: .*'#### <final answer>'"):
        prepare_gsm8k.main(["--input", src, "--output", out])


def test_lines_with_invalid_utf8_or_nul_bytes_are_malformed_records(tmp_path, capsys):
    good = json.dumps({"chosen": hh("q", "a"), "rejected": hh("q", "b")}).encode()
    src = tmp_path / "hh.jsonl"
    src.write_bytes(b"\n".join([good, b'{"chosen": "\xc3\x28", "rejected": "x"}', b"\x00" * 4,
                                json.dumps({"chosen": hh("r", "a"), "rejected": hh("r", "b")}).encode()]) + b"\n")
    out = tmp_path / "o.jsonl"
    stats = prepare_hh_rlhf.main(["--input", str(src), "--output", str(out), "--on-error", "skip"])
    capsys.readouterr()
    assert stats["num_read"] == 4 and stats["num_written"] == 2 and stats["rejected_by_reason"] == {"malformed": 2}
    rejects = read(tmp_path / "o.rejects.jsonl")
    assert [r["location"] for r in rejects] == [f"{src}:2", f"{src}:3"]
    assert rejects[0]["message"] == "is not valid UTF-8 (byte 0xc3 at column 13)"
    assert rejects[1]["record"] == "\\x00" * 4
    with pytest.raises(RecordError, match=r"hh\.jsonl:2: is not valid UTF-8 \(byte 0xc3 at column 13\)"):
        prepare_hh_rlhf.main(["--input", str(src), "--output", str(out)])


def test_truncated_or_mistyped_parquet_names_the_file_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hpa.data.prompts import DataFileError

    src = str(tmp_path / "uf.parquet")
    pq.write_table(pa.table({"prompt": ["q"] * 20, "chosen": [[{"role": "assistant", "content": "a"}]] * 20,
                             "rejected": [[{"role": "assistant", "content": "b"}]] * 20}), src)
    data = open(src, "rb").read()
    open(src, "wb").write(data[:-20])
    args = ["--input", src, "--output", str(tmp_path / "o.jsonl"), "--on-error", "skip"]
    with pytest.raises(DataFileError, match=rf"^{src}: is not a readable Parquet file"):
        prepare_ultrafeedback.main(args)
    pq.write_table(pa.table({"prompt": ["q"], "chosen": ["a"], "rejected": ["b"]}), src)  # strings, not messages
    with pytest.raises(DataFileError, match=rf"^{src}: column 'chosen': has Parquet type string, expected list"):
        prepare_ultrafeedback.main(args)
