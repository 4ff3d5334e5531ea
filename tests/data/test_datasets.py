import json

import pytest

from data_tools.train_tokenizer import train_sentencepiece
from hpa.config.data import ON_ERROR_CHOICES, PROMPT_TRUNCATIONS, RESPONSE_TRUNCATIONS, DataConfig
from hpa.config.errors import ConfigError
from hpa.data.preferences import RESPONSE_TRUNCATION_MODES, PreferenceDataset, SFTDataset
from hpa.data.prompts import (ON_ERROR_MODES, PROMPT_TRUNCATION_MODES, PromptDataset, RecordError,
                              rejects_path_for)
from hpa.data.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    corpus = [f"add {a} {b} = {a + b}" for a in range(10) for b in range(10)] + ["copy a b c d e f g h = x y z"]
    path = train_sentencepiece(corpus, str(tmp_path_factory.mktemp("tok") / "tok"), vocab_size=256)
    return build_tokenizer("sentencepiece", path)


def write_lines(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return str(path)


def test_config_choices_match_implementation():
    assert ON_ERROR_CHOICES == ON_ERROR_MODES
    assert PROMPT_TRUNCATIONS == PROMPT_TRUNCATION_MODES
    assert RESPONSE_TRUNCATIONS == RESPONSE_TRUNCATION_MODES


def test_data_config_validation():
    cfg = DataConfig(tokenizer_kind="sentencepiece", tokenizer_path="t.model", prompt_path="p.jsonl",
                     preference_path="q.jsonl")
    assert cfg.on_error == "raise" and cfg.prompt_truncation == "truncate_left"
    with pytest.raises(ConfigError, match="on_error.*'ignore'.*raise, skip"):
        DataConfig(tokenizer_kind="hf", tokenizer_path="t", prompt_path="p", preference_path="q", on_error="ignore")
    with pytest.raises(ConfigError, match="max_prompt_length"):
        DataConfig(tokenizer_kind="hf", tokenizer_path="t", prompt_path="p", preference_path="q", max_prompt_length=0)
    with pytest.raises(ConfigError, match="prompt_path"):
        DataConfig(tokenizer_kind="hf", tokenizer_path="t", prompt_path="", preference_path="q")
    with pytest.raises(TypeError):
        DataConfig(tokenizer_kind="hf", tokenizer_path="t", prompt_path="p")  # preference_path is required


def test_prompts_load_and_truncate_left(tok, tmp_path):
    long_prompt = "add 1 2 = add 3 4 = add 5 6 ="
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "add 3 5 =", "ground_truth": "8"}, "",
                                              {"prompt": long_prompt}])
    ds = PromptDataset.load(path, tok, max_prompt_length=5)
    assert len(ds) == 2
    assert ds[0].prompt_ids == tok.encode("add 3 5 =") and ds[0].ground_truth == "8"
    assert ds[0].source == f"{path}:1" and ds[1].source == f"{path}:3"
    assert ds[1].truncated and ds[1].prompt_ids == tok.encode(long_prompt)[-5:] and ds[1].ground_truth is None
    assert ds.stats["num_truncated"] == 1 and ds.stats["num_blank_lines"] == 1 and ds.stats["num_rejected"] == 0


def test_prompts_skip_too_long_is_counted_and_written(tok, tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "add 3 5 ="}, {"prompt": "add 1 2 = add 3 4 = add 5 6 ="}])
    rejects = str(tmp_path / "rej" / "p.rejects.jsonl")
    ds = PromptDataset.load(path, tok, max_prompt_length=6, prompt_truncation="skip", rejects_path=rejects)
    assert len(ds) == 1 and ds.stats["rejected_by_reason"] == {"prompt_too_long": 1}
    rows = [json.loads(l) for l in open(rejects)]
    assert rows[0]["location"] == f"{path}:2" and rows[0]["reason"] == "prompt_too_long"


@pytest.mark.parametrize("line, key, what", [
    ('{"prompt": "add 1 2 =", oops}', None, "not valid JSON"),
    ('{"ground_truth": "3"}', "prompt", "missing"),
    ('{"prompt": "   "}', "prompt", "empty"),
    ('{"prompt": 5}', "prompt", "has type int, expected str"),
    ('{"prompt": "add 1 2 =", "ground_truth": 3}', "ground_truth", "has type int"),
    ('["add 1 2 ="]', None, "is a JSON list"),
])
def test_malformed_line_names_file_line_and_key(tok, tmp_path, line, key, what):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "add 3 5 ="}, line])
    with pytest.raises(RecordError) as err:
        PromptDataset.load(path, tok, max_prompt_length=8)
    message = str(err.value)
    assert f"{path}:2: " in message and what in message and "on_error=skip" in message
    assert err.value.key == key
    if key:
        assert f"key {key!r}" in message


def test_skip_mode_counts_and_writes_rejects(tok, tmp_path):
    path = write_lines(tmp_path / "prefs.jsonl", [
        {"prompt": "add 3 5 =", "chosen": "8", "rejected": "9"},
        "{broken",
        {"prompt": "add 1 1 =", "chosen": "2"},
        {"prompt": "add 1 1 =", "chosen": "2", "rejected": "2"},
        {"prompt": "add 2 2 =", "chosen": "4", "rejected": "5"},
    ])
    cfg = DataConfig(tokenizer_kind="sentencepiece", tokenizer_path="unused", prompt_path="unused",
                     preference_path=path, on_error="skip", max_prompt_length=16, max_response_length=4)
    ds = PreferenceDataset.from_config(cfg, tok, rejects_dir=str(tmp_path / "run" / "rejects"))
    assert len(ds) == 2
    assert ds.stats["num_read"] == 5 and ds.stats["num_rejected"] == 3
    assert ds.stats["rejected_by_reason"] == {"malformed": 2, "chosen_equals_rejected": 1}
    rejects_file = tmp_path / "run" / "rejects" / "prefs.rejects.jsonl"
    assert ds.stats["rejects_path"] == str(rejects_file) == rejects_path_for(str(tmp_path / "run" / "rejects"), path)
    rows = [json.loads(l) for l in rejects_file.read_text().splitlines()]
    assert [r["location"] for r in rows] == [f"{path}:2", f"{path}:3", f"{path}:4"]
    assert rows[0]["record"] == "{broken" and rows[1]["key"] == "rejected"


def test_preference_masks_cover_only_response_and_eos(tok, tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "add 3 5 =", "chosen": "8", "rejected": "1 9"}])
    ex = PreferenceDataset.load(path, tok, max_prompt_length=16, max_response_length=8)[0]
    p = tok.encode("add 3 5 =")
    assert ex.chosen_input_ids == p + tok.encode("8") + [tok.eos_id]
    assert ex.rejected_input_ids == p + tok.encode("1 9") + [tok.eos_id]
    assert ex.chosen_response_mask == [0] * len(p) + [1] * (len(tok.encode("8")) + 1)
    assert sum(ex.rejected_response_mask) == len(tok.encode("1 9")) + 1


def test_response_length_policies(tok, tmp_path):
    long = "1 2 3 4 5 6 7 8 9"
    path = write_lines(tmp_path / "s.jsonl", [{"prompt": "add 3 5 =", "response": "8"},
                                              {"prompt": "add 3 5 =", "response": long}])
    ds = SFTDataset.load(path, tok, max_prompt_length=16, max_response_length=4, rejects_path=str(tmp_path / "r.jsonl"))
    assert len(ds) == 1 and ds.stats["rejected_by_reason"] == {"response_too_long": 1}
    ds = SFTDataset.load(path, tok, max_prompt_length=16, max_response_length=4, response_truncation="truncate_right")
    assert len(ds) == 2
    assert ds[1].response_ids == tok.encode(long)[:4]  # cut: no EOS
    assert ds[0].response_ids[-1] == tok.eos_id
    assert ds[0].response_mask == [0] * len(ds[0].prompt_ids) + [1] * len(ds[0].response_ids)


def test_parquet_rows_are_located(tok, tmp_path):
    import datasets

    path = str(tmp_path / "p.parquet")
    datasets.Dataset.from_list([{"prompt": "add 3 5 =", "ground_truth": "8"},
                                {"prompt": "", "ground_truth": "1"}]).to_parquet(path)
    with pytest.raises(RecordError, match=r"p\.parquet\[row 2\]: key 'prompt': is empty"):
        PromptDataset.load(path, tok, max_prompt_length=8)
    ds = PromptDataset.load(path, tok, max_prompt_length=8, on_error="skip", rejects_path=str(tmp_path / "r.jsonl"))
    assert len(ds) == 1 and ds[0].ground_truth == "8" and ds.stats["num_rejected"] == 1


def test_chat_template_wraps_prompt(tok, tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "add 3 5 ="}])
    ds = PromptDataset.load(path, tok, max_prompt_length=64, apply_chat_template=True)
    assert ds[0].prompt_ids == tok.encode("user: add 3 5 =\nassistant:")


def write_bytes(path, lines):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


BAD_BYTES = [
    b'{"prompt": "add 3 5 ="}',
    b'{"prompt": "add \xff 5 ="}',  # not UTF-8
    '{"prompt": "add 2 2 ="}'.encode("latin-1") + b' \xe9',  # Latin-1 text after the object
    b'{"prompt": "add\x00 1 1 ="}',  # NUL inside a string
    b'\x00\x00\x00',  # NUL bytes only
    b'{"prompt": "add \xe2\x82 1 ="}',  # a UTF-8 sequence cut short
    b'{"prompt": "add 4 4 =", "ground_truth": "8"}',
]


def test_invalid_utf8_and_nul_bytes_are_malformed_records(tok, tmp_path):
    path = write_bytes(tmp_path / "p.jsonl", BAD_BYTES)
    rejects = tmp_path / "rej.jsonl"
    ds = PromptDataset.load(path, tok, max_prompt_length=8, on_error="skip", rejects_path=str(rejects))
    assert [e.source for e in ds] == [f"{path}:1", f"{path}:7"] and ds[1].ground_truth == "8"
    assert ds.stats["num_read"] == 7 and ds.stats["rejected_by_reason"] == {"malformed": 5}
    rows = [json.loads(line) for line in rejects.read_text(encoding="utf-8").splitlines()]
    assert [r["location"] for r in rows] == [f"{path}:{n}" for n in (2, 3, 4, 5, 6)]
    assert rows[0]["message"] == "is not valid UTF-8 (byte 0xff at column 17)"
    assert rows[0]["record"] == '{"prompt": "add \\xff 5 ="}'  # the raw bytes, shown as escapes
    assert rows[1]["message"] == "is not valid UTF-8 (byte 0xe9 at column 25)"
    assert rows[2]["message"] == "has a NUL byte at column 16" and rows[2]["record"] == '{"prompt": "add\\x00 1 1 ="}'
    assert rows[3]["message"] == "has a NUL byte at column 1" and rows[3]["record"] == "\\x00\\x00\\x00"
    assert rows[4]["message"].startswith("is not valid UTF-8 (byte 0xe2 at column 17)")


def test_invalid_utf8_raises_naming_file_and_line(tok, tmp_path):
    path = write_bytes(tmp_path / "p.jsonl", BAD_BYTES)
    with pytest.raises(RecordError) as err:
        PromptDataset.load(path, tok, max_prompt_length=8)
    assert str(err.value).startswith(f"{path}:2: is not valid UTF-8 (byte 0xff at column 17)")
    path = write_bytes(tmp_path / "q.jsonl", [BAD_BYTES[0], BAD_BYTES[4]])
    with pytest.raises(RecordError, match=r"q\.jsonl:2: has a NUL byte at column 1 \(fix the record"):
        PromptDataset.load(path, tok, max_prompt_length=8)


def parquet_file(path, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return str(path)


def test_truncated_parquet_is_a_clear_error_naming_the_file(tok, tmp_path):
    from hpa.data.prompts import DataFileError

    path = parquet_file(tmp_path / "p.parquet", {"prompt": ["add 3 5 ="] * 50, "ground_truth": ["8"] * 50})
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    for on_error in ("raise", "skip"):
        with pytest.raises(DataFileError) as err:
            PromptDataset.load(path, tok, max_prompt_length=8, on_error=on_error, rejects_path=str(tmp_path / "r"))
        assert str(err.value).startswith(f"{path}: is not a readable Parquet file")
        assert "truncated" in str(err.value)
        assert err.value.__cause__ is None and err.value.__suppress_context__  # no pyarrow traceback chained


def test_parquet_with_corrupt_data_pages_names_the_file(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hpa.data.prompts import DataFileError

    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"prompt": [f"add {i} {i} =" for i in range(200)]}), path, compression="snappy")
    data = bytearray(open(path, "rb").read())
    data[8:60] = b"\x00" * 52  # the first data page, the footer intact
    open(path, "wb").write(bytes(data))
    with pytest.raises(DataFileError, match=r"p\.parquet: cannot be read after row 0 .*corrupt") as err:
        PromptDataset.load(path, tok, max_prompt_length=8)
    assert err.value.__cause__ is None and err.value.__suppress_context__


@pytest.mark.parametrize("columns, column, what", [
    ({"prompt": [1, 2]}, "prompt", "has Parquet type int64, expected str"),
    ({"prompt": ["add 3 5 =", "add 1 1 ="], "ground_truth": [8.0, 2.0]}, "ground_truth",
     "has Parquet type double, expected str"),
    ({"prompt": [None, None]}, "prompt", "holds only nulls, expected str"),
    ({"question": ["add 3 5 ="]}, "prompt", "is missing; the file has columns ['question']"),
])
def test_parquet_column_of_the_wrong_type_names_file_and_column(tok, tmp_path, columns, column, what):
    from hpa.data.prompts import DataFileError

    path = parquet_file(tmp_path / "p.parquet", columns)
    with pytest.raises(DataFileError) as err:
        PromptDataset.load(path, tok, max_prompt_length=8, on_error="skip", rejects_path=str(tmp_path / "r"))
    assert str(err.value).startswith(f"{path}: column {column!r}: {what}")
    assert err.value.column == column


def test_parquet_optional_column_of_nulls_and_int_for_float_are_fine(tmp_path):
    from hpa.data.prompts import RejectLog, read_records

    path = parquet_file(tmp_path / "p.parquet", {"prompt": ["a", "b"], "ground_truth": [None, None],
                                                 "score": [1, 2]})
    fields = {"prompt": ((str,), True), "ground_truth": ((str,), False), "score": ((int, float), True)}
    records = list(read_records(path, fields, on_error="raise", rejects=RejectLog(None)))
    assert [r for _, r in records] == [{"prompt": "a", "ground_truth": None, "score": 1},
                                       {"prompt": "b", "ground_truth": None, "score": 2}]
    assert [loc for loc, _ in records] == [f"{path}[row 1]", f"{path}[row 2]"]
