"""Datasets, tokenizers, sampling and collation for hpa.

The data layer knows no process groups: DP rank and size are plain ints passed to the sampler.
"""

from hpa.data.collate import balanced_micro_batches, pad_left, pad_right, token_budget_micro_batches
from hpa.data.preferences import PreferenceDataset, PreferenceExample, SFTDataset, SFTExample
from hpa.data.prompts import DataFileError, PromptDataset, PromptExample, RecordError, RejectLog, read_records
from hpa.data.sampler import DistributedBatchSampler
from hpa.data.tokenizer import TOKENIZERS, Tokenizer, build_tokenizer

__all__ = [
    "balanced_micro_batches", "pad_left", "pad_right",
    "token_budget_micro_batches",
    "PreferenceDataset", "PreferenceExample", "SFTDataset", "SFTExample", "PromptDataset", "PromptExample",
    "DataFileError", "RecordError", "RejectLog", "read_records", "DistributedBatchSampler", "TOKENIZERS", "Tokenizer",
    "build_tokenizer",
]
