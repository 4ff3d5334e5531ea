"""Config of the ``data`` YAML section: tokenizer, datasets, length limits and bad-record policy.

Paths are plain strings. A relative path is relative to the directory of the config file it was
written in; the config loader resolves it, this module never touches the file system.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from hpa.config.errors import ConfigError, check_choice, check_range

# Name choices; tests assert they equal the registry / implementation names in hpa.data.
TOKENIZER_KINDS = ("hf", "sentencepiece")
PROMPT_TRUNCATIONS = ("skip", "truncate_left")
RESPONSE_TRUNCATIONS = ("skip", "truncate_right")
ON_ERROR_CHOICES = ("raise", "skip")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Datasets and tokenizer of a run.

    Args:
        tokenizer_kind: ``sentencepiece`` (a ``.model`` file) or ``hf`` (a local Hugging Face
            tokenizer directory; nothing is downloaded).
        tokenizer_path: the ``.model`` file or the tokenizer directory.
        prompt_path: JSONL or Parquet of ``{"prompt": str, "ground_truth"?: str}`` for rollouts.
        preference_path: JSONL or Parquet of ``{"prompt", "chosen", "rejected"}`` (all str) for DPO.
        eval_prompt_path: held-out prompts in the prompt format; None: no evaluation set.
        adversarial_prompt_path: the reward-hacking monitor's held-out adversarial validation set,
            prompts in the prompt format with ground truths (prompts that invite copying or
            padding); None: no monitor.
        sft_path: JSONL or Parquet of ``{"prompt", "response"}`` for ``hpa sft``; None: unused.
        heldout_preference_path: held-out preference pairs in the preference format, never trained on
            (keep them out of ``preference_path`` and out of the reward model's training pairs): the
            trust gate (``algorithm.hpa.trust``) reads the policy's NLL of their chosen responses.
        max_prompt_length: prompt tokens kept; longer prompts follow ``prompt_truncation``.
        max_response_length: response tokens (EOS included) for generation and offline data;
            longer offline responses follow ``response_truncation``.
        prompt_truncation: ``truncate_left`` keeps the last tokens (next to the response);
            ``skip`` drops the record, counts it and writes it to the rejects file.
        response_truncation: ``truncate_right`` cuts preference / SFT responses (no EOS appended
            then); ``skip`` drops the pair, counted and written to the rejects file.
        on_error: a malformed record (bad JSON, missing or empty key, wrong type): ``raise`` stops
            with file, line and key; ``skip`` counts it and writes it to the rejects file.
        rejects_dir: where ``<dataset name>.rejects.jsonl`` files go; None: ``<trainer.run_dir>/rejects``.
        apply_chat_template: wrap each prompt as one user message and render it with the
            tokenizer's chat template (the documented fallback template when it has none).
        append_eos: end preference and SFT responses with the EOS token so the policy learns to stop.
        shuffle: reshuffle the sampler's order every epoch.
        seed: sampler seed; None: use ``trainer.seed``.
        cache_reference_log_probs: compute the reference's summed response log-probs of every preference
            pair once, under ``<trainer.run_dir>/reference_log_probs`` (one checksummed shard per DP rank),
            and reuse them in every step, epoch and resume instead of a reference forward over the step's
            pairs; rebuilt when the pairs, the reference weights, the model or the TP/PP layout change. The
            values equal the live forward's bit for bit (``hpa.trainer.reference_cache``).
    """

    tokenizer_kind: str
    tokenizer_path: str
    prompt_path: str
    preference_path: str
    eval_prompt_path: Optional[str] = None
    adversarial_prompt_path: Optional[str] = None
    sft_path: Optional[str] = None
    heldout_preference_path: Optional[str] = None
    max_prompt_length: int = 256
    max_response_length: int = 256
    prompt_truncation: str = "truncate_left"
    response_truncation: str = "skip"
    on_error: str = "raise"
    rejects_dir: Optional[str] = None
    apply_chat_template: bool = False
    append_eos: bool = True
    shuffle: bool = True
    seed: Optional[int] = None
    cache_reference_log_probs: bool = True

    def __post_init__(self):
        check_choice("tokenizer_kind", self.tokenizer_kind, TOKENIZER_KINDS)
        for key in ("tokenizer_path", "prompt_path", "preference_path"):
            if not getattr(self, key):
                raise ConfigError(key, "is empty; give a file or directory path "
                                       "(relative paths are relative to the config file)")
        for key in ("eval_prompt_path", "adversarial_prompt_path", "sft_path", "heldout_preference_path",
                    "rejects_dir"):
            if getattr(self, key) == "":
                raise ConfigError(key, "is an empty string; leave it out (null) or give a path")
        check_range("max_prompt_length", self.max_prompt_length, low=1)
        check_range("max_response_length", self.max_response_length, low=1)
        check_choice("prompt_truncation", self.prompt_truncation, PROMPT_TRUNCATIONS)
        check_choice("response_truncation", self.response_truncation, RESPONSE_TRUNCATIONS)
        check_choice("on_error", self.on_error, ON_ERROR_CHOICES)
        if self.seed is not None:
            check_range("seed", self.seed, low=0)
