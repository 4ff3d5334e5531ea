"""The start-up probes as a run uses them (``HPATrainer._controllers``): a fresh run measures its start once into
the record the controllers are built from and saves it with the run state; a resumed run reads the record back
from the checkpoint, runs no probe (no ``generate`` call) and builds the same controllers; a checkpoint saved
before the record existed measures the start again. One process, scripted models."""

import contextlib
import types

import pytest
import torch

from hpa.config import load_config
from hpa.data.preferences import PreferenceExample, SFTExample
from hpa.rollout.base import RolloutBatch
from hpa.trainer.loop import HPATrainer
from hpa.trainer.startup_probes import START_MEASURES, StartMeasures
from hpa.trainer.state import RunState

GROUPS = types.SimpleNamespace(rank=0, is_main=True, layout="tp1_pp1_dp1", data_parallel_size=1, dp_rank=0,
                               dp_group=None)
EOS = 2


class _RewardModel:
    """Scores a response by its first token (two heads: that and that + 1); embeds a prompt alone as the one-hot
    of its last token plus 0.05 x its length (the coverage trust's prompt space)."""

    def __call__(self, inputs):
        t = inputs.response_ids[:, 0].double()
        return types.SimpleNamespace(rewards=torch.stack([t, t + 1], dim=1))

    def sequence_embeddings(self, ids, mask, prompt_ids=None, prompt_mask=None):
        lengths = mask.sum(1)
        e = torch.nn.functional.one_hot(ids.gather(1, (lengths - 1)[:, None])[:, 0], 8).float()
        e[:, 7] += 0.05 * lengths.float()
        return e


def _parts():
    covered = [[1], [2], [4, 1], [4, 2], [4, 4, 1], [4, 4, 2]]
    return types.SimpleNamespace(
        model_reward=_RewardModel(), tokenizer=types.SimpleNamespace(pad_id=0, eos_id=EOS, decode=str),
        # five pairs a prompt: COVERAGE_K (5) neighbours of a held-out prompt are its own prompt's
        pairs=[PreferenceExample(prompt_ids=p, chosen_ids=[7], rejected_ids=[5]) for p in covered for _ in range(5)],
        heldout_pairs=[PreferenceExample(prompt_ids=p, chosen_ids=[7], rejected_ids=[5])
                       for p in ([2, 1], [4, 2], [1], [4, 4, 2])],
        prompts=[types.SimpleNamespace(prompt_ids=[5, t]) for t in (1, 2, 3)],
        demonstrations=[SFTExample(prompt_ids=[3], response_ids=[6, EOS])] * 40)  # prompt 3: no pair covers it


def _trainer(tmp_path, calls):
    """What ``HPATrainer._controllers`` reads of a trainer; the policy answers a prompt ending in t with t + 3
    (greedy) or t + 4 (sampled), then EOS, and each call is counted."""

    def generate(prompts, params):
        calls.append(params)
        rows = [[p[-1] + 3 + (params.temperature > 0), EOS] for p in prompts for _ in range(params.n)]
        ids = torch.tensor(rows)
        mask = torch.ones(len(rows), 2)
        return RolloutBatch(ids, torch.ones_like(ids), ids, mask, torch.zeros_like(mask), ["stop"] * len(rows),
                            torch.arange(len(prompts)).repeat_interleave(params.n))

    cfg = load_config(None, ["algorithm.advantage.estimator=grpo", "reward.rules=[]", "reward.model_paths=[rm]",
                             "data.heldout_preference_path=h.jsonl", "algorithm.kl.use_kl_in_reward=false",
                             f"trainer.run_dir={tmp_path}"])
    return types.SimpleNamespace(cfg=cfg, groups=GROUPS, generate=generate, timer=lambda name: contextlib.nullcontext(),
                                 state=RunState(cfg, GROUPS, {}, {}, guard=None))


def _build(trainer, saved):
    controllers = HPATrainer._controllers(trainer, _parts(), saved)
    trainer.state.add_parts(controllers.state_parts())
    return controllers


def test_a_resumed_run_reads_its_start_measures_back_and_probes_nothing(tmp_path):
    calls = []
    fresh = _trainer(tmp_path, calls)
    controllers = _build(fresh, None)
    record = fresh.state.parts[START_MEASURES].measures
    # held out: chosen 7 (7.5), greedy answers 1 + 3, 2 + 3 ... (the prompts' last tokens 1, 2, 1, 2: 5.0 on
    # average): headroom 2.5; the start answers the 40 far demonstrations [6] + EOS as shown: skill 1
    assert record.chosen_reward == pytest.approx(7.5) and record.margin == pytest.approx(2.0)
    assert record.greedy_reward == pytest.approx(5.0) and record.headroom == pytest.approx(2.5)
    assert (record.start_skill, record.far_demonstrations) == (1.0, 40)
    # the baseline: sampled answers t + 4 to the training prompts 1, 2, 3: (5 + 6 + 7) / 3 + 0.5
    assert record.baseline == pytest.approx(6.5) and record.baseline_prompts == 3
    gate = {c.name: c for c in controllers}["trust_gate"].gate
    assert gate.ceiling == pytest.approx(6.5 + 2.5)
    assert len(calls) == 4  # greedy and sampled on the held-out prompts, the skill, the baseline
    path = tmp_path / "step_00000003"
    path.mkdir()
    torch.save(fresh.state.state_dict(), path / "trainer_state.pt")

    calls.clear()
    resumed = _trainer(tmp_path, calls)
    again = _build(resumed, RunState.saved_state(path))
    assert calls == []  # no probe runs on resume
    assert resumed.state.parts[START_MEASURES].measures == record
    assert [c.state_dict() for c in again] == [c.state_dict() for c in controllers]
    assert resumed.state.state_dict() == fresh.state.state_dict()


def test_a_checkpoint_from_before_the_record_measures_the_start_again(tmp_path):
    calls = []
    fresh = _trainer(tmp_path, calls)
    _build(fresh, None)
    saved = {k: v for k, v in fresh.state.state_dict().items() if k != START_MEASURES}
    calls.clear()
    old = _trainer(tmp_path, calls)
    _build(old, saved)
    assert len(calls) == 4 and old.state.parts[START_MEASURES].measures == fresh.state.parts[START_MEASURES].measures


def test_the_record_is_plain_numbers_and_round_trips():
    record = StartMeasures(chosen_reward=1.0, margin=0.5, greedy_reward=0.75, sampled_reward=0.25, baseline=0.1,
                           baseline_prompts=8, start_skill=0.5, far_demonstrations=40)
    assert record.offset == 0.5 and record.headroom == 0.25
    assert StartMeasures.from_state(record.state_dict()) == record
    assert StartMeasures(chosen_reward=1.0, greedy_reward=2.0).headroom == 0.0  # never below 0
    assert StartMeasures().offset is None and StartMeasures().headroom is None
