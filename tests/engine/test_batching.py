"""``Batching``: one value from the trainer section and the pad id."""

import pytest

from hpa.config import load_config
from hpa.engine.batching import Batching


def test_batching_takes_the_trainer_keys_and_the_pad_id():
    t = load_config(None, ["trainer.micro_batch_size=3", "trainer.sequence_packing=true",
                           "trainer.log_prob_max_token_len_per_rank=512", "trainer.ppo_max_token_len_per_rank=256"]).trainer
    assert Batching.from_config(t, pad_id=7) == Batching(micro_batch_size=3, pad_id=7, packed=True,
                                                         forward_token_budget=512, update_token_budget=256)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1, got 0"):
        Batching(micro_batch_size=0, pad_id=0)
