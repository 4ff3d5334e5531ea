"""A run's state without a model: ``RunState.restore`` loads what a checkpoint holds part by part, and the
samplers ``hpa.trainer.setup`` builds name the key and the file of a dataset too small for its batch."""

import logging
import types

import pytest

from hpa.config import load_config
from hpa.trainer.state import RunState


class _Part:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _state(tmp_path, parts, saved):
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}"])
    groups = types.SimpleNamespace(rank=0, is_main=True, layout="tp1_pp1_dp1", data_parallel_size=1)
    state = RunState(cfg, groups, {}, parts, guard=None)
    state.ckpt = types.SimpleNamespace(load=lambda path, models: {"step": 3, "last_eval": None, **saved})
    return state


def test_a_part_the_checkpoint_lacks_starts_fresh_and_is_named(tmp_path, caplog):
    """A run resumed with a feature its checkpoint's run did not have (the SFT replay's sampler, a controller
    turned on) loads every part the checkpoint holds and starts the new one fresh, with a warning naming it;
    it once stopped with a KeyError."""
    sampler, replay = _Part(1), _Part(0)
    state = _state(tmp_path, {"pair_sampler": sampler, "replay_sampler": replay}, {"pair_sampler": {"value": 7}})
    with caplog.at_level(logging.WARNING, logger="hpa"):
        state.restore(tmp_path / "step_3")
    assert state.step == 3 and sampler.value == 7 and replay.value == 0
    assert "replay_sampler" in caplog.text and "starts fresh" in caplog.text


def test_every_part_the_checkpoint_holds_is_restored(tmp_path, caplog):
    a, b = _Part(1), _Part(2)
    state = _state(tmp_path, {"a": a, "b": b}, {"a": {"value": 5}, "b": {"value": 6}})
    with caplog.at_level(logging.WARNING, logger="hpa"):
        state.restore(tmp_path / "step_3")
    assert (a.value, b.value) == (5, 6) and "starts fresh" not in caplog.text


@pytest.mark.parametrize("key", ["trainer.global_batch_size", "trainer.preference_batch_size",
                                 "trainer.replay_batch_size"])
def test_a_dataset_smaller_than_its_batch_names_the_key_and_the_file(key):
    """A run's samplers name the batch-size key and the file when the data cannot fill one batch (the sampler's
    own message named neither)."""
    from hpa.config import ConfigError
    from hpa.trainer.setup import make_sampler

    groups = types.SimpleNamespace(dp_rank=0, data_parallel_size=1)
    with pytest.raises(ConfigError, match=r"2 samples, fewer than one global batch of 4.*data/x\.jsonl") as err:
        make_sampler(2, 4, 0, groups, shuffle=True, key=key, path="data/x.jsonl")
    assert err.value.key == key
    with pytest.raises(ConfigError, match=r"0 samples"):  # a file with no example kept (all rejected)
        make_sampler(0, 4, 0, groups, shuffle=True, key=key, path="data/x.jsonl")
    assert make_sampler(4, 4, 0, groups, shuffle=True, key=key, path="data/x.jsonl").next_batch() is not None
