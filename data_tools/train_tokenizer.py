"""Train a SentencePiece tokenizer on a text or JSONL file.

Small vocabularies (256-512) work on tiny corpora: ``hard_vocab_limit=False`` lets the trainer stop
below ``vocab_size`` when the corpus has fewer pieces, and ``character_coverage=1.0`` keeps every
character seen. Byte fallback (unknown characters become byte pieces instead of ``<unk>``) needs
256 byte pieces of room, so by default it is on only when ``vocab_size`` leaves that room.

Special ids: pad 0, unk 1, bos 2, eos 3.

Usage::

    python -m data_tools.train_tokenizer --input corpus.txt --model-prefix out/tok --vocab-size 256
    python -m data_tools.train_tokenizer --input sft.jsonl --keys prompt response --model-prefix out/tok
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Iterable, List, Optional, Sequence

from hpa.data.prompts import decode_line

MODEL_TYPES = ("bpe", "unigram", "char", "word")
NUM_SPECIAL = 4  # pad, unk, bos, eos


def read_corpus(path: str, keys: Optional[Sequence[str]] = None) -> List[str]:
    """Lines of a text file, or the string values of a JSONL file (``keys``: which fields; default all)."""
    lines: List[str] = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            line, problem = decode_line(raw.rstrip(b"\r\n"))
            if problem is not None:
                raise ValueError(f"{path}:{line_no}: {problem} ({line[:200]}); fix or remove the line")
            if not path.endswith(".jsonl"):
                lines.append(line)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg}); fix or remove the line") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object")
            for key in keys or record.keys():
                if key not in record:
                    raise ValueError(f"{path}:{line_no}: key {key!r} is missing; drop it from --keys or fix the record")
                if isinstance(record[key], str):
                    lines.extend(l for l in record[key].split("\n") if l.strip())
    if not lines:
        raise ValueError(f"{path}: no text to train on")
    return lines


def train_sentencepiece(lines: Iterable[str], model_prefix: str, *, vocab_size: int = 256, model_type: str = "bpe",
                        byte_fallback: Optional[bool] = None) -> str:
    """Train on ``lines`` and write ``<model_prefix>.model``; returns that path.

    Args:
        byte_fallback: None picks it automatically (on when ``vocab_size`` has room for 256 byte pieces
            next to the corpus' characters and the special pieces).
    """
    import sentencepiece as spm

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    lines = list(lines)
    if byte_fallback is None:
        num_chars = len(set("".join(lines)))
        byte_fallback = vocab_size >= 256 + num_chars + NUM_SPECIAL + 1
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    with open(model_prefix + ".model", "wb") as model_file:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model_file, vocab_size=vocab_size, model_type=model_type,
            byte_fallback=byte_fallback, hard_vocab_limit=False, character_coverage=1.0,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2, num_threads=1)
    return model_prefix + ".model"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="a text file (one sentence a line) or a .jsonl file")
    parser.add_argument("--keys", nargs="*", default=None, help="JSONL fields to train on (default: all string fields)")
    parser.add_argument("--model-prefix", required=True, help="writes <prefix>.model")
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    parser.add_argument("--byte-fallback", choices=("auto", "on", "off"), default="auto")
    args = parser.parse_args(argv)
    byte_fallback = {"auto": None, "on": True, "off": False}[args.byte_fallback]
    path = train_sentencepiece(read_corpus(args.input, args.keys), args.model_prefix, vocab_size=args.vocab_size,
                               model_type=args.model_type, byte_fallback=byte_fallback)
    import sentencepiece as spm

    print(json.dumps({"model": path, "vocab_size": spm.SentencePieceProcessor(model_file=path).get_piece_size()}))


if __name__ == "__main__":
    main()
