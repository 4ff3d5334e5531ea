"""The training forward's log-probs of a rollout's tokens, the reference the rollout engines' tests compare with."""

import torch

from hpa.engine.step import forward_backward
from hpa.ops.vocab_parallel import vocab_parallel_log_probs


def training_log_probs(model, groups, batch, temperature, vocab_size):
    """Log-probs of the rollout's tokens from the training forward, ``[b, r]`` (last stage) or None."""
    seq = batch.training_sequences()

    def loss_fn(mb, logits, hidden):
        logp = vocab_parallel_log_probs(logits, mb["labels"], groups.tp_group, vocab_size, temperature=temperature)
        return logits.sum() * 0, {"logp": logp.detach()}

    with torch.no_grad():
        out = forward_backward(model, [seq.micro_batch()], loss_fn, groups, forward_only=True)
    return seq.to_response(out[0]["logp"]) if groups.is_last_stage else None
