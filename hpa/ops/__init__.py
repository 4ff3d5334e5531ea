"""Tensor ops shared by the trainer, rollout and reward code: vocab-parallel softmax statistics.
Groups are arguments; nothing here reads global parallel state. (Masked reductions are in
``hpa.algorithms.masked``.)"""

from .vocab_parallel import vocab_parallel_entropy, vocab_parallel_kl, vocab_parallel_log_probs

__all__ = ["vocab_parallel_entropy", "vocab_parallel_kl", "vocab_parallel_log_probs"]
