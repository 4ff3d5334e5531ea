"""Tokenizers behind one small interface, chosen by name from ``TOKENIZERS``.

Backends:
    ``sentencepiece``: a SentencePiece ``.model`` file (e.g. from ``data_tools.train_tokenizer``).
    ``hf``: a Hugging Face tokenizer directory loaded with ``local_files_only=True`` (never downloads).

``encode`` never adds BOS/EOS: the data layer appends EOS to responses itself, so the ids a model
is trained on do not depend on backend defaults.
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, List, Optional, Sequence

from hpa.config.errors import ConfigError, UserError
from hpa.registry import Registry

TOKENIZERS = Registry("tokenizer")


def fallback_chat_template(messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The template used when a tokenizer has none.

    Each message becomes ``"<role>: <content>\\n"``; with ``add_generation_prompt`` the text ends
    with ``"assistant:"`` so generation continues as the assistant. Example::

        user: add 3 5 =
        assistant:
    """
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got {message!r}")
        parts.append(f"{message['role']}: {message['content']}\n")
    if add_generation_prompt:
        parts.append("assistant:")
    return "".join(parts)


class Tokenizer:
    """The interface every backend implements.

    Attributes:
        vocab_size: number of ids (the model's embedding rows must be at least this).
        eos_id: end-of-sequence id; generation stops on it.
        pad_id: id used for padding (masked out; the EOS id when the tokenizer has no pad token).
        bos_id: beginning-of-sequence id, or None when the tokenizer has none.
        kind: the backend's name in ``TOKENIZERS``.
    """

    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: Optional[int]
    kind: str = ""

    def encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat messages to prompt text (tokenise it with ``encode``)."""
        return fallback_chat_template(messages, add_generation_prompt)

    def pieces(self) -> List[str]:
        """The text of every id, in id order (what the fingerprint hashes)."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """sha256 of the id -> piece table and the special ids: equal exactly when two tokenizers map every
        id to the same piece, wherever their files lie (a copied tokenizer file keeps its fingerprint)."""
        digest = hashlib.sha256()
        for piece in self.pieces():
            digest.update(piece.encode("utf-8", "surrogatepass") + b"\x00")
        digest.update(repr((self.eos_id, self.pad_id, self.bos_id)).encode())
        return digest.hexdigest()


@TOKENIZERS.register("sentencepiece")
class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file. A model trained without a pad piece pads with EOS."""

    kind = "sentencepiece"

    def __init__(self, path: str):
        import sentencepiece as spm

        if not os.path.isfile(path):
            raise UserError(f"sentencepiece model {path!r} does not exist; train one with "
                                    f"'python -m data_tools.train_tokenizer' or fix data.tokenizer_path")
        self.path = path
        self._sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.get_piece_size()
        if self._sp.eos_id() < 0:
            raise UserError(f"sentencepiece model {path!r} has no EOS piece; retrain it with eos_id >= 0")
        self.eos_id = self._sp.eos_id()
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    def encode(self, text: str) -> List[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def pieces(self) -> List[str]:
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]


@TOKENIZERS.register("hf")
class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer from a local directory; uses its chat template when it has one."""

    kind = "hf"

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise UserError(f"HF tokenizer directory {path!r} does not exist; nothing is downloaded, "
                        f"save the tokenizer there first or fix data.tokenizer_path")
        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)
        if self._tok.eos_token_id is None:
            raise ValueError(f"HF tokenizer {path!r} has no eos_token; set one in its tokenizer_config.json")
        self.eos_id = int(self._tok.eos_token_id)
        pad = self._tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.bos_id = int(self._tok.bos_token_id) if self._tok.bos_token_id is not None else None

    def encode(self, text: str) -> List[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def pieces(self) -> List[str]:
        table = [""] * self.vocab_size
        for piece, i in self._tok.get_vocab().items():
            if 0 <= i < self.vocab_size:
                table[i] = piece
        return table

    def apply_chat_template(self, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        if getattr(self._tok, "chat_template", None):
            return self._tok.apply_chat_template(list(messages), tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        return fallback_chat_template(messages, add_generation_prompt)


def check_model_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """A model must have an embedding row for every id the tokenizer can produce.

    Raises:
        ConfigError: naming ``model.vocab_size`` and the value to set.
    """
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError("model.vocab_size", f"{model_vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} ids (data.tokenizer_path); set model.vocab_size: "
                          f"{tokenizer.vocab_size} or more")


def build_tokenizer(kind: str, path: str, *, model_vocab_size: Optional[int] = None) -> Tokenizer:
    """Build the tokenizer ``kind`` (a name in ``TOKENIZERS``) from ``path``; with ``model_vocab_size``,
    check that the model can embed every id (``check_model_vocab``)."""
    backend = TOKENIZERS.get(kind)
    try:
        tokenizer = backend(path)
    except (OSError, RuntimeError, ValueError) as exc:  # the backend's own parse errors: a user's file, not a bug
        if isinstance(exc, UserError):
            raise
        reason = " ".join(str(exc).split())[:200]
        raise UserError(f"{path} cannot be read as a {kind} tokenizer ({type(exc).__name__}: {reason}); check "
                        f"data.tokenizer_path and data.tokenizer_kind") from None
    if model_vocab_size is not None:
        check_model_vocab(tokenizer, model_vocab_size)
    return tokenizer
