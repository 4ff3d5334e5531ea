"""The trust-gate controller's start-up work (``algorithm.hpa.trust``, signal ``start_rollouts``): the baseline,
the start policy's sampled rollouts on ``baseline_prompts`` training prompts, is measured at the first update
when the run state holds none, so a resumed run, whose saved baseline wins, samples no baseline rollouts."""

import types

import pytest
import torch

from hpa.config.algorithm import TrustConfig
from hpa.config.schema import RolloutConfig
from hpa.data.preferences import PreferenceExample
from hpa.rollout.base import RolloutBatch
from hpa.trainer.objective.controllers.base import ControllerInputs, StepSignals
from hpa.trainer.objective.controllers.trust_gate import TrustGateController

ONE_RANK = types.SimpleNamespace(dp_group=None, data_parallel_size=1, dp_rank=0)
TOKENIZER = types.SimpleNamespace(eos_id=99, decode=lambda ids: " ".join(map(str, ids)))
ROLLOUT = RolloutConfig(n=2, seed=5)


def _reward(inputs):
    """Two heads: the response's first token and that + 1 (the ensemble mean: the token + 0.5)."""
    t = inputs.response_ids[:, 0].double()
    return types.SimpleNamespace(rewards=torch.stack([t, t + 1], dim=1))


def _run(calls):
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
    return ControllerInputs(groups=ONE_RANK, pad_id=0, tokenizer=TOKENIZER, prompts=prompts, heldout_pairs=heldout,
                            model_reward=_reward, generate=generate)


def _baseline_calls(calls):
    return [c for c in calls if c.seed == ROLLOUT.seed + 2_000_003]


def _step(learned):
    return StepSignals(metrics={"reward/learned_mean": learned})


def test_the_baseline_is_measured_at_the_first_update_of_a_fresh_run():
    calls = []
    c = TrustGateController(TrustConfig(), ROLLOUT, _run(calls), baseline_prompts=4)
    # held out: chosen 3 and 5 (mean 4.5), greedy answers 1 and 2 (mean 2.0): headroom 2.5
    assert c.gate.headroom == pytest.approx(2.5)
    out = c.update(_step(25.0))
    assert len(_baseline_calls(calls)) == 1
    baseline = (11 + 21 + 31 + 41) / 4 + 0.5  # the sampled answers (token + 1), the heads' mean (+ 0.5)
    assert out["gate/baseline"] == pytest.approx(baseline)
    assert out["gate/ceiling"] == pytest.approx(baseline + 2.5)
    assert out["gate/reward_ema"] == pytest.approx(0.9 * baseline + 0.1 * 25.0)
    c.update(_step(26.0))
    assert len(_baseline_calls(calls)) == 1  # once


def test_a_resumed_run_samples_no_baseline_rollouts():
    calls = []
    first = TrustGateController(TrustConfig(), ROLLOUT, _run(calls), baseline_prompts=4)
    first.update(_step(25.0))
    saved = first.state_dict()
    calls.clear()
    resumed = TrustGateController(TrustConfig(), ROLLOUT, _run(calls), baseline_prompts=4)
    resumed.load_state_dict(saved)
    out = resumed.update(_step(27.0))
    assert _baseline_calls(calls) == []
    assert out["gate/baseline"] == saved["baseline"]


def test_a_run_saved_while_counting_the_old_baseline_keeps_counting():
    """A checkpoint of ``baseline_prompts=0`` saved before its ``baseline_steps`` batches were counted: the
    resumed run counts on (no start-up measurement replaces the batches already counted)."""
    calls = []
    old = TrustGateController(TrustConfig(), ROLLOUT, _run(calls), baseline_prompts=0, baseline_steps=2)
    old.update(_step(24.0))
    saved = old.state_dict()
    resumed = TrustGateController(TrustConfig(), ROLLOUT, _run(calls), baseline_prompts=4, baseline_steps=2)
    resumed.load_state_dict(saved)
    out = resumed.update(_step(26.0))
    assert _baseline_calls(calls) == []
    assert out["gate/baseline"] == pytest.approx(25.0)
