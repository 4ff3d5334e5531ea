"""Offline preference pairs (DPO) and SFT examples, tokenised with response masks.

A sequence is ``prompt_ids + response_ids``; ``response_mask[t] = 1`` exactly when token ``t`` is a
response token, so losses (DPO log-probs, SFT cross entropy) count only response tokens. The token
at position ``t`` is predicted from position ``t - 1``; shifting is the model side's job.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from hpa.data.prompts import (ExampleDataset, FieldSpec, SkipRecord, encode_prompt, fit_prompt, load_examples,
                              rejects_path_for)
from hpa.data.tokenizer import Tokenizer

RESPONSE_TRUNCATION_MODES = ("skip", "truncate_right")


def encode_response(tokenizer: Tokenizer, text: str, *, key: str, max_response_length: int,
                    response_truncation: str, append_eos: bool) -> List[int]:
    """Response ids (EOS appended when ``append_eos``), cut on the right or skipped when too long.

    A cut response gets no EOS: it did not end there.
    """
    ids = tokenizer.encode(text)
    if append_eos:
        ids = ids + [tokenizer.eos_id]
    if len(ids) <= max_response_length:
        return ids
    if response_truncation == "truncate_right":
        return ids[:max_response_length]
    if response_truncation == "skip":
        raise SkipRecord("response_too_long",
                         f"{key} has {len(ids)} tokens > max_response_length={max_response_length}", key=key)
    raise ValueError(f"response_truncation must be one of {RESPONSE_TRUNCATION_MODES}, got {response_truncation!r}")


def _response_mask(prompt_len: int, response_len: int) -> List[int]:
    return [0] * prompt_len + [1] * response_len


@dataclasses.dataclass(frozen=True)
class PreferenceExample:
    """One preference pair; ``chosen``/``rejected`` sequences share the prompt.

    Attributes:
        prompt_ids: ``[p]``.
        chosen_ids, rejected_ids: response ids ``[r_c]``, ``[r_r]`` (EOS included when appended).
        source: ``file:line`` of the record.
    """

    prompt_ids: List[int]
    chosen_ids: List[int]
    rejected_ids: List[int]
    prompt_truncated: bool = False
    source: str = ""

    @property
    def chosen_input_ids(self) -> List[int]:  # [p + r_c]
        return self.prompt_ids + self.chosen_ids

    @property
    def rejected_input_ids(self) -> List[int]:  # [p + r_r]
        return self.prompt_ids + self.rejected_ids

    @property
    def chosen_response_mask(self) -> List[int]:  # [p + r_c]
        return _response_mask(len(self.prompt_ids), len(self.chosen_ids))

    @property
    def rejected_response_mask(self) -> List[int]:  # [p + r_r]
        return _response_mask(len(self.prompt_ids), len(self.rejected_ids))


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One supervised example: ``prompt_ids`` ``[p]`` and ``response_ids`` ``[r]``."""

    prompt_ids: List[int]
    response_ids: List[int]
    prompt_truncated: bool = False
    source: str = ""

    @property
    def input_ids(self) -> List[int]:  # [p + r]
        return self.prompt_ids + self.response_ids

    @property
    def response_mask(self) -> List[int]:  # [p + r]
        return _response_mask(len(self.prompt_ids), len(self.response_ids))


PREFERENCE_FIELDS: FieldSpec = {"prompt": ((str,), True), "chosen": ((str,), True), "rejected": ((str,), True)}
SFT_FIELDS: FieldSpec = {"prompt": ((str,), True), "response": ((str,), True)}


class PreferenceDataset(ExampleDataset):
    """Tokenised ``{"prompt", "chosen", "rejected"}`` records. ``stats`` counts kept and rejected ones."""

    @classmethod
    def load(cls, path: str, tokenizer: Tokenizer, *, max_prompt_length: int, max_response_length: int,
             prompt_truncation: str = "truncate_left", response_truncation: str = "skip", on_error: str = "raise",
             rejects_path: Optional[str] = None, apply_chat_template: bool = False,
             append_eos: bool = True) -> "PreferenceDataset":
        def build(record):
            if record["chosen"] == record["rejected"]:
                raise SkipRecord("chosen_equals_rejected", "chosen and rejected are identical", key="rejected")
            prompt_ids, truncated = fit_prompt(encode_prompt(tokenizer, record["prompt"], apply_chat_template),
                                               max_prompt_length, prompt_truncation)
            responses = {key: encode_response(tokenizer, record[key], key=key, max_response_length=max_response_length,
                                              response_truncation=response_truncation, append_eos=append_eos)
                         for key in ("chosen", "rejected")}
            return PreferenceExample(prompt_ids=prompt_ids, chosen_ids=responses["chosen"],
                                     rejected_ids=responses["rejected"], prompt_truncated=truncated)

        examples, stats = load_examples(path, PREFERENCE_FIELDS, build, on_error=on_error, rejects_path=rejects_path)
        stats["num_prompt_truncated"] = sum(e.prompt_truncated for e in examples)
        return cls(examples, stats)

    @classmethod
    def from_config(cls, cfg, tokenizer: Tokenizer, *, rejects_dir: Optional[str],
                    split: str = "train") -> "PreferenceDataset":
        """Load ``cfg.preference_path`` of a ``DataConfig`` (``split="heldout"``: ``heldout_preference_path``)."""
        path = {"train": cfg.preference_path, "heldout": cfg.heldout_preference_path}[split]
        return cls.load(path, tokenizer, max_prompt_length=cfg.max_prompt_length,
                        max_response_length=cfg.max_response_length, prompt_truncation=cfg.prompt_truncation,
                        response_truncation=cfg.response_truncation, on_error=cfg.on_error,
                        rejects_path=rejects_path_for(rejects_dir, path),
                        apply_chat_template=cfg.apply_chat_template, append_eos=cfg.append_eos)


class SFTDataset(ExampleDataset):
    """Tokenised ``{"prompt", "response"}`` records."""

    @classmethod
    def load(cls, path: str, tokenizer: Tokenizer, *, max_prompt_length: int, max_response_length: int,
             prompt_truncation: str = "truncate_left", response_truncation: str = "skip", on_error: str = "raise",
             rejects_path: Optional[str] = None, apply_chat_template: bool = False,
             append_eos: bool = True) -> "SFTDataset":
        def build(record):
            prompt_ids, truncated = fit_prompt(encode_prompt(tokenizer, record["prompt"], apply_chat_template),
                                               max_prompt_length, prompt_truncation)
            response_ids = encode_response(tokenizer, record["response"], key="response",
                                           max_response_length=max_response_length,
                                           response_truncation=response_truncation, append_eos=append_eos)
            return SFTExample(prompt_ids=prompt_ids, response_ids=response_ids, prompt_truncated=truncated)

        examples, stats = load_examples(path, SFT_FIELDS, build, on_error=on_error, rejects_path=rejects_path)
        stats["num_prompt_truncated"] = sum(e.prompt_truncated for e in examples)
        return cls(examples, stats)

    @classmethod
    def from_config(cls, cfg, tokenizer: Tokenizer, *, rejects_dir: Optional[str]) -> "SFTDataset":
        """Load ``cfg.sft_path`` of a ``DataConfig``."""
        if cfg.sft_path is None:
            raise ValueError("data.sft_path is not set; set it to a {prompt, response} JSONL file for SFT")
        return cls.load(cfg.sft_path, tokenizer, max_prompt_length=cfg.max_prompt_length,
                        max_response_length=cfg.max_response_length, prompt_truncation=cfg.prompt_truncation,
                        response_truncation=cfg.response_truncation, on_error=cfg.on_error,
                        rejects_path=rejects_path_for(rejects_dir, cfg.sft_path),
                        apply_chat_template=cfg.apply_chat_template, append_eos=cfg.append_eos)
