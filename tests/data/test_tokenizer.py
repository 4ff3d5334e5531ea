import json

import pytest

from data_tools.train_tokenizer import main as train_main, read_corpus, train_sentencepiece
from hpa.config.data import TOKENIZER_KINDS
from hpa.data.tokenizer import TOKENIZERS, build_tokenizer, fallback_chat_template
from hpa.registry import UnknownNameError

CORPUS = [f"add {a} {b} = {a + b}" for a in range(10) for b in range(10)] + [
    "copy a b c = a b c", "reverse a b c = c b a", "Hello world, this is a tiny corpus."]


def test_config_choices_equal_registry_names():
    assert tuple(sorted(TOKENIZER_KINDS)) == TOKENIZERS.names()


def test_unknown_kind_lists_valid_names():
    with pytest.raises(UnknownNameError, match="sentencepiece"):
        build_tokenizer("sentencepeice", "x")


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
@pytest.mark.parametrize("vocab_size", [256, 512])
def test_sentencepiece_train_round_trip(tmp_path, model_type, vocab_size):
    path = train_sentencepiece(CORPUS, str(tmp_path / "tok"), vocab_size=vocab_size, model_type=model_type)
    tok = build_tokenizer("sentencepiece", path)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    assert tok.vocab_size <= vocab_size
    for text in CORPUS[:5] + ["reverse a b c = c b a"]:
        ids = tok.encode(text)
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eos_id not in ids and tok.bos_id not in ids  # encode adds no specials
        assert tok.decode(ids) == text


def test_byte_fallback_round_trips_unseen_characters(tmp_path):
    path = train_sentencepiece(CORPUS, str(tmp_path / "tok"), vocab_size=512)
    tok = build_tokenizer("sentencepiece", path)
    assert tok.decode(tok.encode("xyz! ü")) == "xyz! ü"


def test_train_tokenizer_cli_on_jsonl(tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"add {a} 1 =", "response": str(a + 1), "n": a}) + "\n"
                            for a in range(10)))
    assert read_corpus(str(data), ["prompt"]) == [f"add {a} 1 =" for a in range(10)]
    train_main(["--input", str(data), "--model-prefix", str(tmp_path / "t"), "--vocab-size", "256"])
    out = json.loads(capsys.readouterr().out)
    tok = build_tokenizer("sentencepiece", out["model"])
    assert tok.decode(tok.encode("add 7 1 = 8")) == "add 7 1 = 8"


def test_read_corpus_names_bad_line(tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:2"):
        read_corpus(str(data))


@pytest.mark.parametrize("name", ["c.jsonl", "c.txt"])
def test_read_corpus_names_a_line_that_is_not_utf8(tmp_path, name):
    data = tmp_path / name
    data.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"c\.(jsonl|txt):2: is not valid UTF-8 \(byte 0xff at column 13\) "
                                         r"\(\{\"prompt\": \"\\xff\"\}\)"):
        read_corpus(str(data))


def test_missing_tokenizer_file_says_what_to_do(tmp_path):
    from hpa.config import UserError

    with pytest.raises(UserError, match="train_tokenizer"):
        build_tokenizer("sentencepiece", str(tmp_path / "nope.model"))


def _save_hf_tokenizer(directory, chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS, trainer=trainer)
    from tokenizers import decoders

    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(directory))


def test_hf_tokenizer_from_local_directory(tmp_path):
    _save_hf_tokenizer(tmp_path / "hf")
    tok = build_tokenizer("hf", str(tmp_path / "hf"))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    ids = tok.encode("add 3 5 = 8")
    assert tok.eos_id not in ids
    assert tok.decode(ids) == "add 3 5 = 8"
    messages = [{"role": "user", "content": "add 3 5 ="}]
    assert tok.apply_chat_template(messages) == "user: add 3 5 =\nassistant:" == fallback_chat_template(messages)


def test_hf_tokenizer_uses_its_chat_template(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"
    _save_hf_tokenizer(tmp_path / "hf", chat_template=template)
    tok = build_tokenizer("hf", str(tmp_path / "hf"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"


def test_model_vocab_smaller_than_the_tokenizer_names_the_key(tmp_path):
    from hpa.config.errors import ConfigError

    path = train_sentencepiece(CORPUS, str(tmp_path / "tok"), vocab_size=256)
    n = build_tokenizer("sentencepiece", path).vocab_size
    assert build_tokenizer("sentencepiece", path, model_vocab_size=n).vocab_size == n
    with pytest.raises(ConfigError, match=rf"model\.vocab_size.*{n - 1} is smaller than the tokenizer's {n} ids"):
        build_tokenizer("sentencepiece", path, model_vocab_size=n - 1)


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_a_file_that_is_not_a_tokenizer_is_a_user_error_naming_it(tmp_path, kind):
    """A corrupt or wrong tokenizer file ended in the backend's traceback (sentencepiece: 'could not parse
    ModelProto'); it is a user's mistake with a message naming the file and the keys to fix."""
    from hpa.config import UserError

    bad = tmp_path / ("bad.model" if kind == "sentencepiece" else "badtok")
    if kind == "sentencepiece":
        bad.write_text("junk")
    else:
        bad.mkdir()
        (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match=r"(?s)bad.*data.tokenizer_path.*data.tokenizer_kind"):
        build_tokenizer(kind, str(bad))
