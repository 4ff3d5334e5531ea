"""The trust-gate controller and its start-up probes (``algorithm.hpa.trust``, signal ``start_rollouts``): the
probes measure the headroom and the baseline (the start policy's sampled rollouts on ``baseline_prompts``
training prompts) once, before the first update, into the record the controller is built from; a change of
the gate's regime during a run (closing, open again) is a WARNING with the numbers that caused it."""

import logging
import types

import pytest
import torch

from hpa.config.algorithm import TrustConfig
from hpa.config.schema import RolloutConfig
from hpa.data.preferences import PreferenceExample
from hpa.rollout.base import RolloutBatch
from hpa.trainer.objective.controllers.base import ControllerInputs, StepSignals
from hpa.trainer.objective.controllers.trust_gate import TrustGateController
from hpa.trainer.startup_probes import ProbeInputs, StartMeasures, measure_start, saved_start_measures

ONE_RANK = types.SimpleNamespace(dp_group=None, data_parallel_size=1, dp_rank=0)
TOKENIZER = types.SimpleNamespace(eos_id=99, decode=lambda ids: " ".join(map(str, ids)))
ROLLOUT = RolloutConfig(n=2, seed=5)


def _reward(inputs):
    """Two heads: the response's first token and that + 1 (the ensemble mean: the token + 0.5)."""
    t = inputs.response_ids[:, 0].double()
    return types.SimpleNamespace(rewards=torch.stack([t, t + 1], dim=1))


def _probes(calls):
    """Training prompts whose last token is 10, 20, 30, 40; held-out pairs on prompts ending in 1 and 2. The
    scripted policy answers a prompt with its last token (greedy) or that + 1 (sampled)."""

    def generate(prompts, params):
        calls.append(params)
        rows = [p[-1] + (params.temperature > 0) for p in prompts for _ in range(params.n)]
        ids = torch.tensor([[t] for t in rows])
        mask = torch.ones(len(rows), 1)
        return RolloutBatch(ids, torch.ones_like(ids), ids, mask, torch.zeros_like(mask), ["stop"] * len(rows),
                            torch.arange(len(prompts)).repeat_interleave(params.n))

    prompts = [types.SimpleNamespace(prompt_ids=[7, t]) for t in (10, 20, 30, 40)]
    heldout = [PreferenceExample(prompt_ids=[7, p], chosen_ids=[c], rejected_ids=[c - 1])
               for p, c in ((1, 3), (2, 5))]
    return ProbeInputs(groups=ONE_RANK, generate=generate, tokenizer=TOKENIZER, prompts=prompts,
                       heldout_pairs=heldout, model_reward=_reward)


def _baseline_calls(calls):
    return [c for c in calls if c.seed == ROLLOUT.seed + 2_000_003]


def _step(learned):
    return StepSignals(metrics={"reward/learned_mean": learned})


def _gate(start, **kwargs):
    return TrustGateController(TrustConfig(), ControllerInputs(groups=ONE_RANK, start=start), **kwargs)


def test_the_probes_measure_the_headroom_and_the_baseline_before_the_first_update():
    calls = []
    start = measure_start(TrustConfig(), ROLLOUT, _probes(calls), gate=True, baseline_prompts=4)
    # held out (each score the token + 0.5): chosen 3 and 5 (4.5), rejected 2 and 4 (margin 1), greedy answers 1
    # and 2 (2.0): headroom 2.5; sampled answers 2 and 3 (3.0): offset greedy - sampled = -1
    assert (start.chosen_reward, start.greedy_reward) == (pytest.approx(4.5), pytest.approx(2.0))
    assert start.margin == pytest.approx(1.0) and start.headroom == pytest.approx(2.5)
    assert start.sampled_reward == pytest.approx(3.0) and start.offset == pytest.approx(-1.0)
    baseline = (11 + 21 + 31 + 41) / 4 + 0.5  # the sampled answers (token + 1), the heads' mean (+ 0.5)
    assert start.baseline == pytest.approx(baseline) and start.baseline_prompts == 4
    assert len(_baseline_calls(calls)) == 1 and start.start_skill is None  # no coverage estimator: no skill
    c = _gate(start)
    assert c.gate.headroom == pytest.approx(2.5) and c.gate.ceiling == pytest.approx(baseline + 2.5)
    out = c.update(_step(25.0))
    assert out["gate/baseline"] == pytest.approx(baseline)
    assert out["gate/ceiling"] == pytest.approx(baseline + 2.5)
    assert out["gate/reward_ema"] == pytest.approx(0.9 * baseline + 0.1 * 25.0)


def test_the_record_round_trips_through_the_run_state_and_a_resumed_gate_equals_the_uninterrupted_one():
    calls = []
    start = measure_start(TrustConfig(), ROLLOUT, _probes(calls), gate=True, baseline_prompts=4)
    first = _gate(start)
    first.update(_step(25.0))
    saved = {"start_measures": start.state_dict(), "trust_gate": first.state_dict()}
    assert saved_start_measures(saved) == start and saved_start_measures({"step": 3}) is None
    resumed = _gate(saved_start_measures(saved))
    resumed.load_state_dict(saved["trust_gate"])
    assert resumed.update(_step(27.0)) == first.update(_step(27.0))


def test_a_run_saved_while_counting_the_old_baseline_keeps_counting():
    """A checkpoint of ``baseline_prompts=0`` saved before its ``baseline_steps`` batches were counted: the
    resumed run counts on (the record's baseline does not replace the batches already counted)."""
    old = _gate(measure_start(TrustConfig(), ROLLOUT, _probes([]), gate=True, baseline_prompts=0), baseline_steps=2)
    assert old.gate.baseline is None
    old.update(_step(24.0))
    saved = old.state_dict()
    resumed = _gate(measure_start(TrustConfig(), ROLLOUT, _probes([]), gate=True, baseline_prompts=4),
                    baseline_steps=2)
    resumed.load_state_dict(saved)
    out = resumed.update(_step(26.0))
    assert out["gate/baseline"] == pytest.approx(25.0)


def test_a_gate_without_its_probes_is_refused():
    with pytest.raises(ValueError, match="start_rollouts trust gate needs the start-up probes"):
        _gate(StartMeasures())


def test_the_gate_closing_and_opening_again_are_warnings_with_their_numbers(caplog):
    """``reward_ceiling`` at ceiling 1, margin 0.5, slack 0.02: a learned reward at the ceiling keeps the gate open
    (no warning); one 0.5 above it (EMA 1.05: excess 0.1, error 0.08) closes it: lambda = 10·0.08 + 0.08 = 0.88,
    a WARNING with the excess and the ceiling; far below it the integral drains and the gate opens again, a
    second WARNING. A step that leaves the regime as it was logs nothing."""
    c = TrustGateController(TrustConfig(signal="reward_ceiling"), ControllerInputs(
        groups=ONE_RANK, start=StartMeasures(chosen_reward=1.0, margin=0.5)))
    with caplog.at_level(logging.WARNING, logger="hpa"):
        c.update(_step(0.5))
        assert c.gate.gate == 1.0 and not caplog.records
        c.update(_step(6.0))  # EMA 0.9·0.5 + 0.1·6 = 1.05
        assert c.gate.lam == pytest.approx(0.88)
        (closing,) = caplog.records
        assert closing.levelno == logging.WARNING and "trust gate: closing" in closing.getMessage()
        assert "excess 0.1," in closing.getMessage() and "ceiling 1," in closing.getMessage()
        assert "lambda 0.88" in closing.getMessage()
        c.update(_step(6.0))  # still closing: no new warning
        assert len(caplog.records) == 1 and c.gate.lam > 0.88
        for _ in range(20):
            c.update(_step(-20.0))
            if c.gate.lam == 0:
                break
        assert c.gate.gate == 1.0
        assert len(caplog.records) == 2 and "trust gate: open again" in caplog.records[1].getMessage()
        assert "error -" in caplog.records[1].getMessage()
