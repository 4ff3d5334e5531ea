"""Tensor ops shared by the trainer, rollout and reward code: vocab-parallel softmax statistics, and the
chunked log-prob + entropy heads (on logits, and from hidden states and the output weight).
Groups are arguments; nothing here reads global parallel state. (Masked reductions are in
``hpa.algorithms.masked``.)"""

from .fused_head import fused_log_probs_entropy
from .linear_head import linear_log_probs_entropy
from .vocab_parallel import vocab_parallel_entropy, vocab_parallel_kl, vocab_parallel_log_probs

__all__ = ["fused_log_probs_entropy", "linear_log_probs_entropy", "vocab_parallel_entropy", "vocab_parallel_kl",
           "vocab_parallel_log_probs"]
