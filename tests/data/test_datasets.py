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
