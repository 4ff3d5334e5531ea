"""Tensor ops shared by the algorithms and the trainer: vocab-parallel softmax statistics and masked
reductions. Groups are arguments; nothing here reads global parallel state."""

from .masked import masked_mean, masked_sum, masked_var, masked_whiten, mean_pool
from .vocab_parallel import vocab_parallel_entropy, vocab_parallel_kl, vocab_parallel_log_probs

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten", "mean_pool", "vocab_parallel_entropy",
           "vocab_parallel_kl", "vocab_parallel_log_probs"]
