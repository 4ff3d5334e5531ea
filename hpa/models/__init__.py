"""Model specs, heads and builders (megatron GPTModel, Llama style)."""

from .builders import (build_policy, build_reference, build_reward, build_value, padded_vocab_size,
                       transformer_config)
from .heads import ScalarHead, capture_final_hidden, unwrap

__all__ = ["build_policy", "build_reference", "build_reward", "build_value", "padded_vocab_size",
           "transformer_config", "ScalarHead", "capture_final_hidden", "unwrap"]
