"""``RunState.restore`` over its parts (no model): what a checkpoint holds is loaded part by part."""

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
