"""Phases of an HPA step called alone (no model): each reads the step's RolloutBatch and writes its results
back to it, against hand-computed values. One process, except the coverage step's DP reduction
(``test_the_coverage_metrics_over_dp_ranks_are_one_ranks_over_the_whole_batch``, two gloo ranks, multirank)."""

import logging
import types

import pytest
import torch

from hpa.config import load_config
from hpa.config.schema import RolloutConfig
from hpa.rollout.base import RolloutBatch
from hpa.trainer import phases

# one process: no DP group, DP size 1
GROUPS = types.SimpleNamespace(dp_group=None, data_parallel_size=1)
ROLLOUT = RolloutConfig()  # the coverage trust's sampling for the start's skill (greedy)


def _run_inputs(**fields):
    """What a run builds the coverage trust from (its parts): the reward model, the pairs, and for the start's
    skill the tokenizer, the policy's ``generate`` and the demonstrations."""
    return types.SimpleNamespace(**{"tokenizer": None, "generate": None, "demonstrations": None, **fields})


def _coverage(trust, run, rollout, *, space="prompt", kl_boost_shape=None, kl_boost_target=None, skill_rule=None):
    """The coverage controller on the scripted six-pair bank with k = 2 neighbours (``COVERAGE_K``'s 5 would
    average over most of it), built as a run builds it: the estimator, the start-up probes (the start's skill,
    where ``run`` has a ``generate``), the controller; ``space``, ``kl_boost_shape`` (kept on the controller for
    ``_update``) and ``kl_boost_target``: the ``hpa.algorithms.coverage`` constants to override; ``skill_rule``:
    the graded rule the start's skill is measured with (None: the exact match)."""
    from hpa.algorithms.coverage import KL_BOOST_SHAPE
    from hpa.reward.coverage import CoverageEstimator
    from hpa.trainer.objective.controllers import ControllerInputs, CoverageTrust
    from hpa.trainer.startup_probes import ProbeInputs, StartMeasures, measure_start

    estimator = CoverageEstimator(run.model_reward, run.pairs, run.heldout_pairs, pad_id=run.pad_id,
                                  margin=trust.margin, space=space, k=2)
    start = StartMeasures()
    if run.generate is not None:
        start = measure_start(trust, rollout, ProbeInputs(
            groups=run.groups, generate=run.generate, tokenizer=run.tokenizer, pad_id=run.pad_id,
            model_reward=run.model_reward, demonstrations=run.demonstrations, coverage=estimator,
            skill_rule=skill_rule), gate=False)
    coverage = CoverageTrust(trust, ControllerInputs(groups=run.groups, start=start, coverage=estimator),
                             kl_boost_target=kl_boost_target)
    coverage.kl_boost_shape = kl_boost_shape or KL_BOOST_SHAPE
    return coverage


def _update(coverage, batch):
    """The coverage controller's update on a step's rollouts, then its factors on their rows as the trainer
    applies them (``phases.apply_row_factors``): the update's metrics."""
    from hpa.trainer.objective import StepFactors, StepSignals

    metrics = coverage.update(StepSignals(batch=batch))
    phases.apply_row_factors(batch, coverage.act(StepFactors()), kl_boost_shape=coverage.kl_boost_shape)
    return metrics


def _ctx(*overrides):
    cfg = load_config(None, ["trainer.micro_batch_size=2", "rollout.temperature=1.0", *overrides])
    return phases.StepContext.from_config(cfg, GROUPS, vocab_size=32, pad_id=0)


def _batch(response_mask, group_ids):
    b, r = response_mask.shape
    return RolloutBatch(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                        response_ids=torch.ones(b, r, dtype=torch.long), response_mask=response_mask,
                        log_probs=torch.zeros(b, r), finish_reasons=["stop"] * b, group_ids=torch.tensor(group_ids))


def test_a_masked_out_row_moves_no_group_baseline():
    """GRPO without std: advantage = score - mean of the group's scores, over the rows still in the loss.
    Row 2 (group 0) is masked out (a non-finite or filtered reward): its large score must not enter
    group 0's mean, and its advantages are 0."""
    ctx = _ctx("algorithm.advantage.estimator=grpo", "algorithm.advantage.norm_by_std=false",
               "algorithm.kl.use_kl_in_reward=false")
    response_mask = torch.tensor([[1., 1., 0.], [1., 1., 1.], [1., 0., 0.], [1., 1., 0.], [1., 0., 0.]])
    batch = _batch(response_mask, [0, 0, 0, 0, 1])
    scores = torch.tensor([1.0, 0.0, 9.0, 0.5, 2.0])
    last = response_mask.sum(dim=1).long() - 1
    token_scores = torch.zeros(5, 3)
    token_scores[torch.arange(5), last] = scores
    mask = response_mask.clone()
    mask[2] = 0.0
    batch.set("mask", mask).set("token_scores", token_scores)

    assert phases.compute_advantages(batch, ctx, reward_kl_coef=0.0) == {}
    # group 0: minus the mean of 1, 0 and 0.5; group 1 has one row, whose baseline is 0 (as verl's GRPO)
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0, 2.0])
    torch.testing.assert_close(batch.get("advantages"), expected[:, None] * mask)


def test_the_in_reward_kl_is_subtracted_before_the_advantages():
    """With ``use_kl_in_reward`` (k1), each token's reward loses coef x (old - ref log-prob) before the
    advantages: the row that drifted from the reference gets the lower advantage."""
    ctx = _ctx("algorithm.advantage.estimator=grpo", "algorithm.advantage.norm_by_std=false",
               "algorithm.kl.use_kl_in_reward=true", "algorithm.kl.reward_estimator=k1")
    response_mask = torch.ones(2, 2)
    batch = _batch(response_mask, [0, 0])
    batch.set("mask", response_mask).set("token_scores", torch.tensor([[0.0, 1.0], [0.0, 1.0]]))
    # row 0 drifted from the reference by 0.5 nats per token, row 1 not at all
    batch.set("old_log_probs", torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]))
    batch.set("ref_log_probs", torch.tensor([[-1.5, -1.5], [-1.0, -1.0]]))
    phases.compute_advantages(batch, ctx, reward_kl_coef=0.2)
    # scores (sum of token rewards): row 0: 1 - 0.2 x 0.5 x 2 = 0.8, row 1: 1.0; mean 0.9
    torch.testing.assert_close(batch.get("advantages"), torch.tensor([[-0.1, -0.1], [0.1, 0.1]]))


def test_the_kl_controller_follows_the_masked_mean_k1_kl():
    ctx = _ctx("algorithm.kl.reward_estimator=k1")
    batch = _batch(torch.ones(2, 3), [0, 1])
    batch.set("mask", torch.tensor([[1., 1., 0.], [1., 0., 0.]]))
    batch.set("old_log_probs", torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -9.0, -9.0]]))
    batch.set("ref_log_probs", torch.tensor([[-1.5, -1.0, 0.0], [-1.3, 0.0, 0.0]]))
    seen = []
    ctrl = types.SimpleNamespace(update=lambda kl, n: seen.append((kl, n)))
    weights = types.SimpleNamespace(reward_kl_coef=0.05)
    from hpa.trainer.objective.controllers import KLCoefficient, StepSignals

    kl_ctrl = KLCoefficient(ctx.algorithm.kl, GROUPS)
    kl_ctrl.controller = ctrl
    metrics = kl_ctrl.update(StepSignals(batch=batch, weights=weights))
    kl = (0.5 + -1.0 + 0.3) / 3  # masked mean of old - ref over the three tokens in the loss
    assert seen == [(pytest.approx(kl), 2)]
    assert metrics == {"actor/kl_coef": 0.05, "actor/reward_kl": pytest.approx(kl)}


@pytest.mark.parametrize("packed", [False, True])
def test_tokens_computed_counts_real_tokens_and_the_positions_the_update_computes(packed):
    """Rows of 2 + 2 and 2 + 1 tokens in one rollout micro-batch (padded: 2 x 4 positions), a pair of
    3 + 1 tokens (padded: 2 x 3); packed, no pad is computed."""
    from hpa.engine.batching import Batching
    from hpa.trainer import micro_batches

    ctx = _ctx()
    batch = _batch(torch.tensor([[1., 1., 0.], [1., 0., 0.]]), [0, 1])
    for k in micro_batches.ROLLOUT_ROW_KEYS:
        if k not in micro_batches.OPTIONAL_ROW_KEYS:
            batch.set(k, torch.zeros(2, 3) if k != "ref_pooled" else torch.zeros(2, 4))
    rollout = micro_batches.rollout_micro_batches(batch, [0, 1], Batching(micro_batch_size=2, pad_id=0, packed=packed),
                                                  None)
    pair = types.SimpleNamespace(chosen_input_ids=[5, 6, 4], chosen_response_mask=[0, 1, 1],
                                 rejected_input_ids=[7], rejected_response_mask=[0])
    pairs = micro_batches.preference_micro_batches([pair], Batching(micro_batch_size=1, pad_id=ctx.batching.pad_id,
                                                                    packed=packed))
    real = 4 + 3 + 3 + 1
    assert phases.tokens_computed(rollout + pairs) == (real, real if packed else 2 * 4 + 2 * 3)


def _component_batch(rule, learned, group_ids):
    b = len(rule)
    response_mask = torch.ones(b, 2)
    batch = _batch(response_mask, group_ids)
    token_scores = torch.zeros(b, 2)
    token_scores[:, 1] = torch.tensor(rule) + torch.tensor(learned)
    batch.set("mask", response_mask).set("token_scores", token_scores).set("rule_scores", torch.tensor(rule))
    # the step's forwards: the sampling policy and the reference agree (no drift)
    batch.set("old_log_probs", torch.full((b, 2), -1.0)).set("ref_log_probs", torch.full((b, 2), -1.0))
    return batch


def test_per_component_advantages_gate_the_learned_part_and_never_the_rule():
    """Rule 4x (share 0.8) and one reward model (share 0.2). A closed gate (learned weight 0) leaves
    exactly the rule's normalised advantage; a group where the rule abstains then gets 0."""
    ctx = _ctx("algorithm.advantage.estimator=grpo", "algorithm.advantage.per_component=true",
               "algorithm.kl.use_kl_in_reward=false", "reward.rule_weight=4.0", "reward.model_paths=[rm]")
    rule, learned = [4.0, 0.0, 0.0, 0.0], [0.2, 0.9, 1.3, 0.1]
    closed = _component_batch(rule, learned, [0, 0, 1, 1])
    metrics = phases.compute_advantages(closed, ctx, reward_kl_coef=0.0, learned_weight=0.0)
    assert metrics["hpa/learned_share"] == 0.0
    a_rule = 2.0 / (4.0 / 2 ** 0.5 + 1e-6)  # (4 - 2) / unbiased std of {4, 0}
    torch.testing.assert_close(closed.get("advantages")[:, 0], torch.tensor([0.8 * a_rule, -0.8 * a_rule, 0.0, 0.0]))
    opened = _component_batch(rule, learned, [0, 0, 1, 1])
    phases.compute_advantages(opened, ctx, reward_kl_coef=0.0, learned_weight=1.0)
    half = _component_batch(rule, learned, [0, 0, 1, 1])
    phases.compute_advantages(half, ctx, reward_kl_coef=0.0, learned_weight=0.5)
    # the rule part is the same whatever the gate; the learned part scales with it
    learned_part = opened.get("advantages") - closed.get("advantages")
    torch.testing.assert_close(half.get("advantages") - closed.get("advantages"), 0.5 * learned_part)
    assert learned_part.abs().max() > 0


def test_component_shares_follow_the_configured_reward_sources():
    def shares(*overrides):
        return phases.component_shares(load_config(None, list(overrides)).reward)

    assert shares("reward.rule_weight=4.0", "reward.model_paths=[rm]") == {"rule": 0.8, "learned": 0.2}
    assert shares("reward.rules=[]", "reward.model_paths=[rm]") == {"rule": 0.0, "learned": 1.0}
    # rules alone: the rule is the whole advantage (the shaping terms have no share)
    assert shares("reward.rule_weight=4.0") == {"rule": 1.0, "learned": 0.0}


class _ScriptedEmbedder:
    """A reward model's pooled embedding, scripted: the one-hot of the prompt's last token plus 0.05 x the
    response length on the last axis (prompts are left-padded, so the last token is real); a prompt alone
    (right-padded, no response: the prompt space) gives the one-hot of its last token plus 0.05 x its length."""

    def sequence_embeddings(self, response_ids, response_mask, prompt_ids=None, prompt_mask=None):
        if prompt_ids is None:
            lengths = response_mask.sum(1)
            e = torch.nn.functional.one_hot(response_ids.gather(1, (lengths - 1)[:, None])[:, 0], 8).float()
            e[:, 7] += 0.05 * lengths.float()
            return e
        e = torch.nn.functional.one_hot(prompt_ids[:, -1], 8).float()
        e[:, 7] += 0.05 * response_mask.sum(1).float()
        return e


@pytest.mark.parametrize("space", ["prompt", "sequence"])
def test_coverage_trust_weights_the_learned_part_of_far_rows_to_zero_and_never_the_rule(space):
    """The coverage controller on scripted embeddings, in both spaces: the pairs and the held-out pairs ask
    about prompts ending in 1 or 2; rollouts on prompt 1 keep their learned advantage, rollouts on prompt 3
    (orthogonal: no pair covers it) get none of it, and the rule part of every row is the same as without
    the option."""
    from hpa.data.preferences import PreferenceExample

    overrides = ("algorithm.advantage.estimator=grpo", "algorithm.advantage.per_component=true",
                 "algorithm.kl.use_kl_in_reward=false", "reward.rule_weight=1.0", "reward.model_paths=[rm]",
                 "data.heldout_preference_path=h.jsonl", "algorithm.hpa.trust.regime=coverage")
    ctx = _ctx(*overrides)
    prompts = [[1], [2], [4, 1], [4, 2], [4, 4, 1], [4, 4, 2]]
    pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9]) for n, p in enumerate(prompts, 1)]
    heldout_pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9])
                     for n, p in ((2, [2, 1]), (3, [4, 2]), (4, [1]), (5, [4, 4, 2]))]
    run = _run_inputs(groups=GROUPS, pad_id=0, model_reward=_ScriptedEmbedder(), pairs=pairs,
                           heldout_pairs=heldout_pairs)
    coverage = _coverage(ctx.algorithm.hpa.trust, run, ROLLOUT, space=space)
    assert 0 <= coverage.low < coverage.high
    rule, learned = [1.0, 0.0, 1.0, 0.0], [0.2, 0.9, 1.3, 0.1]
    batch = _component_batch(rule, learned, [0, 0, 1, 1])
    batch.prompt_ids = torch.tensor([[1, 1], [1, 1], [3, 3], [3, 3]])
    batch.set("raw_rewards", torch.tensor(rule) + torch.tensor(learned))
    metrics = _update(coverage, batch)
    trust = batch.get("learned_trust")
    assert trust[2:].tolist() == [0.0, 0.0] and bool((trust[:2] > 0.5).all()) and trust[0] == trust[1]
    # the covered rows' learned reward (what the gate then reads): the two rows on prompt 1, equal trust
    assert metrics["coverage/learned_reward"] == pytest.approx((0.2 + 0.9) / 2)
    assert metrics["coverage/trust_mean"] == pytest.approx(float(trust.mean()))
    assert metrics["coverage/far_share"] == pytest.approx(0.5) and metrics["coverage/trust_p10"] == 0.0
    phases.compute_advantages(batch, ctx, reward_kl_coef=0.0)
    plain = _component_batch(rule, learned, [0, 0, 1, 1])
    phases.compute_advantages(plain, ctx, reward_kl_coef=0.0)
    rule_only = _component_batch(rule, learned, [0, 0, 1, 1])
    phases.compute_advantages(rule_only, ctx, reward_kl_coef=0.0, learned_weight=0.0)
    # each row: its rule part untouched plus its trust times its learned part; far rows: the rule part alone
    learned_part = plain.get("advantages") - rule_only.get("advantages")
    torch.testing.assert_close(batch.get("advantages"), rule_only.get("advantages") + trust[:, None] * learned_part)
    torch.testing.assert_close(batch.get("advantages")[2:], rule_only.get("advantages")[2:], atol=0, rtol=0)
    assert (plain.get("advantages")[2:] - rule_only.get("advantages")[2:]).abs().max() > 0
    # the calibration constants are the controller's state; a restore keeps the saved ones
    state = coverage.state_dict()
    fresh = _coverage(ctx.algorithm.hpa.trust, _run_inputs(
        groups=GROUPS, pad_id=0, model_reward=_ScriptedEmbedder(), pairs=pairs, heldout_pairs=heldout_pairs[:2]),
        ROLLOUT, space=space)
    assert (fresh.low, fresh.high) != (state["low"], state["high"])
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


class _CountingEmbedder(_ScriptedEmbedder):
    def __init__(self):
        self.prompts_embedded = 0

    def sequence_embeddings(self, response_ids, response_mask, prompt_ids=None, prompt_mask=None):
        if prompt_ids is None:
            self.prompts_embedded += response_ids.shape[0]
        return super().sequence_embeddings(response_ids, response_mask, prompt_ids, prompt_mask)


def test_the_default_abstains_on_a_far_prompt_and_holds_it_to_the_reference():
    """Defaults (2026-11-27) on a hackable-like run (reward models alone, held-out pairs): the coverage
    trust is on without being asked for; a prompt no pair covers gets no learned advantage whatever its
    learned rewards are (they move nothing), and its rows' KL to the reference weighs ``1 + kl_boost``
    (101 by default); a prompt seen before is not embedded again."""
    from hpa.data.preferences import PreferenceExample
    from hpa.trainer.objective.controllers import CONTROLLERS

    base = ("algorithm.advantage.estimator=grpo", "reward.rules=[]", "reward.model_paths=[rm]",
            "data.heldout_preference_path=h.jsonl", "algorithm.kl.use_kl_in_reward=false")
    ctx, cfg = _ctx(*base), load_config(None, list(base))
    assert CONTROLLERS["coverage"].enabled(cfg) and CONTROLLERS["trust_gate"].enabled(cfg)
    assert cfg.algorithm.hpa.trust.signal == "start_rollouts"
    prompts = [[1], [2], [4, 1], [4, 2], [4, 4, 1], [4, 4, 2]]
    pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9]) for n, p in enumerate(prompts, 1)]
    heldout_pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9])
                     for n, p in ((2, [2, 1]), (3, [4, 2]), (4, [1]), (5, [4, 4, 2]))]

    def advantages(learned, boost_ctx, coverage):
        batch = _component_batch([0.0] * 4, learned, [0, 0, 1, 1])
        batch.prompt_ids = torch.tensor([[1, 1], [1, 1], [3, 3], [3, 3]])  # prompt 1 covered, prompt 3 far
        batch.set("raw_rewards", torch.tensor(learned))
        _update(coverage, batch)
        phases.compute_advantages(batch, boost_ctx, reward_kl_coef=0.0)
        return batch

    embedder = _CountingEmbedder()
    run = _run_inputs(groups=GROUPS, pad_id=0, model_reward=embedder, pairs=pairs, heldout_pairs=heldout_pairs)
    coverage = _coverage(ctx.algorithm.hpa.trust, run, ROLLOUT)
    start = embedder.prompts_embedded
    a = advantages([0.2, 0.9, 1.3, 0.1], ctx, coverage)
    assert embedder.prompts_embedded == start + 2  # prompts 1 and 3, once each
    b = advantages([0.2, 0.9, -7.0, 5.0], ctx, coverage)  # the far prompt's learned rewards changed
    assert embedder.prompts_embedded == start + 2  # both seen: no forward
    torch.testing.assert_close(a.get("advantages"), b.get("advantages"), atol=0, rtol=0)
    assert a.get("advantages")[2:].abs().max() == 0 and a.get("advantages")[:2].abs().max() > 0
    # the KL boost: far rows' hierarchical KL counts 1 + kl_boost times, covered rows' 1 + kl_boost (1 - trust)
    boosted = _ctx(*base, "algorithm.hpa.trust.kl_boost=4")
    c = advantages([0.2, 0.9, 1.3, 0.1], boosted, _coverage(boosted.algorithm.hpa.trust, run, ROLLOUT,
                                                            kl_boost_shape="linear"))
    trust = c.get("learned_trust")
    torch.testing.assert_close(c.get("kl_weights"), 1 + 4 * (1 - trust))
    assert c.get("kl_weights")[2:].tolist() == [5.0, 5.0]
    # shape far: only the rows without support (trust 0) are held; a covered row keeps 1. The boost is large
    # so that the covered prompt's small distrust (trust just under 1) would be plain under linear
    far = _ctx(*base, "algorithm.hpa.trust.kl_boost=100000")
    f = advantages([0.2, 0.9, 1.3, 0.1], far, _coverage(far.algorithm.hpa.trust, run, ROLLOUT))
    trust = f.get("learned_trust")
    assert trust[2:].tolist() == [0.0, 0.0] and 0 < trust[:2].min() and trust[:2].max() < 1
    assert f.get("kl_weights").tolist() == [1.0, 1.0, 100001.0, 100001.0]
    assert (1 + 100000 * (1 - trust[:2])).min() > 2  # what linear would give the covered rows
    # the default boost (100, shape far, since 2026-11-27): the far prompt's KL counts 101 times (no rule
    # judges it here), the covered prompt's once
    assert cfg.algorithm.hpa.trust.kl_boost == 100.0 and coverage.kl_boost_shape == "far"
    assert a.get("kl_weights").tolist() == [1.0, 1.0, 101.0, 101.0]


def test_the_adaptive_boost_follows_the_far_rows_kl_and_resumes():
    """``kl_boost_target`` (``KL_BOOST_TARGET``, a probe): the far rows' KL (k3 per sampled token of the policy that sampled them,
    the covered rows' drift left out) above the target grows the boost by e^0.2 before the weights are
    written, below it shrinks it; the adapted boost is saved, and a checkpoint without it resumes at
    ``kl_boost``. Without a target the boost is constant and a saved one is ignored."""
    import math

    from hpa.data.preferences import PreferenceExample
    from hpa.trainer.objective.weights import StepFactors

    base = ("algorithm.advantage.estimator=grpo", "reward.rules=[]", "reward.model_paths=[rm]",
            "data.heldout_preference_path=h.jsonl", "algorithm.kl.use_kl_in_reward=false")
    prompts = [[1], [2], [4, 1], [4, 2], [4, 4, 1], [4, 4, 2]]
    pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9]) for n, p in enumerate(prompts, 1)]
    heldout = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9])
               for n, p in ((2, [2, 1]), (3, [4, 2]), (4, [1]), (5, [4, 4, 2]))]
    run = _run_inputs(groups=GROUPS, pad_id=0, model_reward=_ScriptedEmbedder(), pairs=pairs, heldout_pairs=heldout)

    def observe(coverage, far_drift, judged=False):
        batch = _component_batch([0.0] * 4, [0.2, 0.9, 1.3, 0.1], [0, 0, 1, 1])
        batch.prompt_ids = torch.tensor([[1, 1], [1, 1], [3, 3], [3, 3]])  # prompt 1 covered, prompt 3 far
        batch.set("raw_rewards", torch.tensor([0.2, 0.9, 1.3, 0.1]))
        if judged:  # a rule judges every row: none is far
            batch.set("rule_judged", torch.ones(4, dtype=torch.bool))
        old = torch.full((4, 2), -1.0)
        batch.set("old_log_probs", old).set("ref_log_probs", old + torch.tensor([[3.0], [3.0], [far_drift], [far_drift]]))
        return batch, _update(coverage, batch)

    adaptive = _ctx(*base).algorithm.hpa.trust
    cov = _coverage(adaptive, run, ROLLOUT, kl_boost_target=0.02)
    batch, m = observe(cov, math.log(2.0))  # far rows' k3 = 1 - ln 2 = 0.31 > 0.02: the error clips at +1
    grown = 100.0 * math.exp(0.2)
    assert m["coverage/far_kl"] == pytest.approx(1 - math.log(2.0)) and m["coverage/kl_boost"] == pytest.approx(grown)
    torch.testing.assert_close(batch.get("kl_weights"), torch.tensor([1.0, 1.0, 1 + grown, 1 + grown]))
    batch, m = observe(cov, 0.0)  # no drift: back to 100
    assert m["coverage/far_kl"] == 0.0 and m["coverage/kl_boost"] == pytest.approx(100.0)
    batch, m = observe(cov, 0.0)
    shrunk = 100.0 * math.exp(-0.2)
    assert m["coverage/kl_boost"] == pytest.approx(shrunk)
    torch.testing.assert_close(batch.get("kl_weights"), torch.tensor([1.0, 1.0, 1 + shrunk, 1 + shrunk]))
    # resumed: the adapted boost; a checkpoint from before the option: the configured one
    state = cov.state_dict()
    resumed = _coverage(adaptive, run, ROLLOUT, kl_boost_target=0.02)
    resumed.load_state_dict(state)
    assert resumed.kl_boost == pytest.approx(shrunk) and observe(resumed, 0.0)[1]["coverage/kl_boost"] == \
        pytest.approx(shrunk * math.exp(-0.2))
    # a step with no far row: no far_kl logged, the boost left as it is
    batch, m = observe(resumed, math.log(2.0), judged=True)
    assert "coverage/far_kl" not in m and m["coverage/kl_boost"] == pytest.approx(shrunk * math.exp(-0.2))
    assert batch.get("kl_weights").tolist() == [1.0, 1.0, 1.0, 1.0]
    old_checkpoint = _coverage(adaptive, run, ROLLOUT, kl_boost_target=0.02)
    old_checkpoint.load_state_dict({"low": state["low"], "high": state["high"]})
    assert old_checkpoint.kl_boost == 100.0
    # the default: constant, whatever the drift or a saved boost, and not saved (it is the config's)
    constant = _coverage(_ctx(*base).algorithm.hpa.trust, run, ROLLOUT)
    constant.load_state_dict(state)
    assert "kl_boost" in state and constant.state_dict() == {"low": state["low"], "high": state["high"]}
    batch, m = observe(constant, math.log(2.0))
    assert m["coverage/kl_boost"] == 100.0 and batch.get("kl_weights").tolist() == [1.0, 1.0, 101.0, 101.0]
    assert m["coverage/far_kl"] == pytest.approx(1 - math.log(2.0))


def _greedy_generate(answers, eos=2, width=4):
    """A scripted ``generate``: each prompt (by its last token) answered with ``answers[last token]`` then EOS
    (``None``: cut at ``width`` tokens without one, finish ``length``); records the sampling params."""
    calls = []

    def generate(prompts, params):
        calls.append((list(prompts), params))
        rows = []
        for p in prompts:
            answer = answers.get(p[-1], [])
            rows.append((list(answer) + [eos], "stop") if answer is not None else ([5] * width, "length"))
        r = max(len(t) for t, _ in rows)
        ids = torch.tensor([t + [0] * (r - len(t)) for t, _ in rows])
        mask = torch.tensor([[1.0] * len(t) + [0.0] * (r - len(t)) for t, _ in rows])
        p_ids = torch.tensor([[p[-1]] for p in prompts])
        return RolloutBatch(p_ids, torch.ones_like(p_ids), ids, mask, torch.zeros_like(mask),
                            [f for _, f in rows], torch.arange(len(prompts)))

    generate.calls = calls
    return generate


def test_greedy_match_share_counts_answers_as_demonstrated():
    """The start's skill on demonstrations: the share of examples whose response it decodes greedily token for
    token; a final EOS on either side does not count, a longer or shorter answer misses, a response cut at
    ``max_new_tokens`` (no EOS) matches nothing. Sampled greedily (temperature 0, one each)."""
    from hpa.data.preferences import SFTExample
    from hpa.trainer.startup_probes import greedy_match_share

    groups = types.SimpleNamespace(dp_group=None, data_parallel_size=1, dp_rank=0)
    rollout = load_config(None, []).rollout
    demos = [SFTExample(prompt_ids=[1], response_ids=[6, 7, 2]),  # answered [6, 7] + EOS: a match
             SFTExample(prompt_ids=[3], response_ids=[6, 7]),  # demonstrated without an EOS: still a match
             SFTExample(prompt_ids=[4], response_ids=[6, 2]),  # answered [6, 7]: too long
             SFTExample(prompt_ids=[5], response_ids=[5, 5, 5, 5]),  # cut at the length: no answer
             SFTExample(prompt_ids=[6], response_ids=[7, 2])]  # answered [6]: wrong
    generate = _greedy_generate({1: [6, 7], 3: [6, 7], 4: [6, 7], 5: None, 6: [6]})
    share, n = greedy_match_share(demos, generate, rollout, groups, eos_id=2)
    assert (share, n) == (pytest.approx(2 / 5), 5)
    (prompts, params), = generate.calls
    assert prompts == [[1], [3], [4], [5], [6]] and params.temperature == 0.0 and params.n == 1
    # DP rank 1 of 2 answers every other example, padded to the same count as rank 0 (the pad not counted)
    rank1 = types.SimpleNamespace(dp_group=None, data_parallel_size=2, dp_rank=1)
    generate = _greedy_generate({1: [6, 7], 3: [6, 7], 4: [6, 7], 5: None, 6: [6]})
    share, n = greedy_match_share(demos, generate, rollout, rank1, eos_id=2)
    assert (share, n) == (pytest.approx(1 / 2), 2) and generate.calls[0][0] == [[3], [5], [1]]
    assert greedy_match_share([], generate, rollout, groups, eos_id=2)[1] == 0


def test_greedy_match_share_graded_scores_answers_worded_otherwise():
    """With a graded rule (``token_f1``) the start's skill is the mean score of its greedy answers against the
    demonstrations, decoded: an answer worded otherwise than its demonstration (another order, an article)
    scores 1, where the exact match gives 0; half an answer scores its F1; a cut answer 0. Without a score the
    exact match is unchanged (the same examples: 0 of 4)."""
    from hpa.data.preferences import SFTExample
    from hpa.reward.rules import token_f1_reward
    from hpa.trainer.startup_probes import graded_skill_score, greedy_match_share

    words = {6: "cat", 7: "owl", 8: "the", 9: "dog"}
    tokenizer = types.SimpleNamespace(decode=lambda ids: " ".join(words[i] for i in ids), eos_id=2)
    groups = types.SimpleNamespace(dp_group=None, data_parallel_size=1, dp_rank=0)
    rollout = load_config(None, []).rollout
    demos = [SFTExample(prompt_ids=[1], response_ids=[6, 7, 2]),  # "cat owl"; answered "the owl cat": 1
             SFTExample(prompt_ids=[3], response_ids=[6, 7, 2]),  # answered "cat": P 1, R 1/2, F1 2/3
             SFTExample(prompt_ids=[4], response_ids=[6, 2]),  # answered "dog": 0
             SFTExample(prompt_ids=[5], response_ids=[6, 2])]  # cut at the length: 0
    answers = {1: [8, 7, 6], 3: [6], 4: [9], 5: None}
    score = graded_skill_score(token_f1_reward, tokenizer)
    share, n = greedy_match_share(demos, _greedy_generate(answers), rollout, groups, eos_id=2, score=score)
    assert (share, n) == (pytest.approx((1 + 2 / 3 + 0 + 0) / 4), 4)
    assert greedy_match_share(demos, _greedy_generate(answers), rollout, groups, eos_id=2) == (0.0, 4)


def test_the_start_s_skill_is_graded_where_the_gold_rule_is(monkeypatch, caplog):
    """``reward.rules`` with a graded rule (``token_f1``): the far demonstrations answered in other words hold
    the far rows (skill 1); the same answers under the exact match (``exact_match``, the exact families, whose
    numbers stay as they were) release them (skill 0), and the release is a WARNING naming the numbers."""
    import logging

    from hpa.data.preferences import PreferenceExample, SFTExample

    prompts = [[1], [2], [4, 1], [4, 2], [4, 4, 1], [4, 4, 2]]
    pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9]) for n, p in enumerate(prompts, 1)]
    heldout = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9])
               for n, p in ((2, [2, 1]), (3, [4, 2]), (4, [1]), (5, [4, 4, 2]))]
    demos = [SFTExample(prompt_ids=[3], response_ids=[6, 7, 2]) for _ in range(40)]  # far: prompt 3, no pair
    words = {6: "cat", 7: "owl", 8: "the"}
    tokenizer = types.SimpleNamespace(decode=lambda ids: " ".join(words[i] for i in ids), eos_id=2)
    groups = types.SimpleNamespace(dp_group=None, data_parallel_size=1, dp_rank=0)
    base = ["algorithm.advantage.estimator=grpo", "reward.model_paths=[rm]", "data.heldout_preference_path=h.jsonl",
            "algorithm.kl.use_kl_in_reward=false"]

    def controller(rules):
        from hpa.reward.rules import graded_rule

        cfg = load_config(None, [*base, f"reward.rules=[{rules}]"])
        run = _run_inputs(groups=groups, pad_id=0, model_reward=_ScriptedEmbedder(), pairs=pairs,
                          heldout_pairs=heldout, tokenizer=tokenizer, generate=_greedy_generate({3: [8, 7, 6]}),
                          demonstrations=demos)
        return _coverage(cfg.algorithm.hpa.trust, run, cfg.rollout, skill_rule=graded_rule(cfg.reward.rules))

    caplog.set_level(logging.INFO, logger="hpa")
    graded, exact = controller("token_f1"), controller("exact_match")
    assert graded.start_skill == 1.0 and graded.kl_boost == 100.0 and graded.holds()
    assert exact.start_skill == 0.0 and exact.kl_boost == 0.0 and not exact.holds()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "0.000" in warnings[0] and "40 demonstrations" in warnings[0]
    assert "below 0.6" in warnings[0] and "0.25" in warnings[0]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "start scores" in r.getMessage()]
    assert len(infos) == 1 and "1.000" in infos[0]
    # the run hands the probes the graded rule of reward.rules (None for the exact rules)
    from hpa.reward.rules import graded_rule, token_f1_reward

    assert graded_rule(["token_f1"]) is token_f1_reward and graded_rule(["exact_match"]) is None


def test_the_far_rows_are_held_only_where_the_start_did_well():
    """``coverage.hold_min_skill`` (default 0.6): at start-up the start answers the demonstrations whose prompts
    no pair covers (trust 0; a covered prompt's demonstration is not asked); below the share the boost is 0
    for the run (the far rows' KL weighs 1, as a covered row's), at or above it the far rows are held with
    ``1 + kl_boost``. The skill and the boost are logged; the skill is saved, and a restore decides from the
    saved one (the start as measured when the run began); a checkpoint from before keeps what start-up
    measured. Without demonstrations nothing is measured and the far rows are held."""
    from hpa.data.preferences import PreferenceExample, SFTExample
    from hpa.trainer.objective.weights import StepFactors

    base = ("algorithm.advantage.estimator=grpo", "reward.rules=[]", "reward.model_paths=[rm]",
            "data.heldout_preference_path=h.jsonl", "algorithm.kl.use_kl_in_reward=false")
    cfg = load_config(None, list(base))
    assert cfg.algorithm.hpa.trust.hold_min_skill == 0.6
    prompts = [[1], [2], [4, 1], [4, 2], [4, 4, 1], [4, 4, 2]]
    pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9]) for n, p in enumerate(prompts, 1)]
    heldout = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9])
               for n, p in ((2, [2, 1]), (3, [4, 2]), (4, [1]), (5, [4, 4, 2]))]
    # forty far demonstrations (prompt 3, no pair) and one on the covered prompt 1, which the start gets wrong
    demos = [SFTExample(prompt_ids=[3], response_ids=[6, 2]) for _ in range(40)] + \
        [SFTExample(prompt_ids=[1], response_ids=[7, 7, 2])]
    tokenizer = types.SimpleNamespace(eos_id=2)
    groups = types.SimpleNamespace(dp_group=None, data_parallel_size=1, dp_rank=0)

    def controller(answers, demonstrations=demos, config=cfg):
        generate = _greedy_generate(answers)
        run = _run_inputs(groups=groups, pad_id=0, model_reward=_ScriptedEmbedder(), pairs=pairs,
                               heldout_pairs=heldout, tokenizer=tokenizer, generate=generate,
                               demonstrations=demonstrations)
        return _coverage(config.algorithm.hpa.trust, run, config.rollout), generate

    def observe(coverage):
        batch = _component_batch([0.0] * 4, [0.2, 0.9, 1.3, 0.1], [0, 0, 1, 1])
        batch.prompt_ids = torch.tensor([[1, 1], [1, 1], [3, 3], [3, 3]])  # prompt 1 covered, prompt 3 far
        batch.set("raw_rewards", torch.tensor([0.2, 0.9, 1.3, 0.1]))
        return batch, _update(coverage, batch)

    skilled, generate = controller({3: [6], 1: [8]})  # every far demonstration answered as shown
    assert [p for p, _ in generate.calls] == [[[3]] * 40]  # only the far ones asked
    batch, m = observe(skilled)
    assert m["coverage/start_skill"] == 1.0 and m["coverage/kl_boost"] == 100.0
    assert batch.get("kl_weights").tolist() == [1.0, 1.0, 101.0, 101.0]
    unskilled, _ = controller({3: [8], 1: [7, 7]})  # none of them
    batch, m = observe(unskilled)
    assert m["coverage/start_skill"] == 0.0 and m["coverage/kl_boost"] == 0.0
    # released: every row's KL weighs coverage.released_kl (default 0.25), the covered rows' too: the step's
    # KL factor, no per-row column
    assert cfg.algorithm.hpa.trust.released_kl == 0.25
    assert "kl_weights" not in batch.extras and unskilled.act(StepFactors()).kl == 0.25
    assert skilled.act(StepFactors()).kl == 1.0
    assert batch.get("learned_trust")[2:].tolist() == [0.0, 0.0]  # the far rows still get no learned advantage
    full = load_config(None, [*base, "algorithm.hpa.trust.released_kl=1"])  # 1: the KL as everywhere else
    batch, m = observe(unheld := controller({3: [8]}, config=full)[0])
    assert m["coverage/kl_boost"] == 0.0 and "kl_weights" not in batch.extras and unheld.act(StepFactors()).kl == 1.0
    # released: the pair stream weighs coverage.released_pairs times the balance's factor; held: as the balance set
    released_pairs = cfg.algorithm.hpa.trust.released_pairs
    assert released_pairs == 2.0  # the default since 2026-12-06
    assert unskilled.act(StepFactors(pairs=0.5)).pairs == pytest.approx(0.5 * released_pairs)
    assert skilled.act(StepFactors(pairs=0.5)).pairs == 0.5
    tripled = load_config(None, [*base, "algorithm.hpa.trust.released_pairs=3"])
    assert controller({3: [8]}, config=tripled)[0].act(StepFactors(pairs=0.5)).pairs == pytest.approx(1.5)
    assert controller({3: [6]}, config=tripled)[0].act(StepFactors(pairs=0.5)).pairs == 0.5
    # 24 of 40: 0.6, held (at the share); 23 of 40: not
    wrong = SFTExample(prompt_ids=[3], response_ids=[9, 2])
    assert controller({3: [6]}, demos[:24] + [wrong] * 16)[0].kl_boost == 100.0
    assert controller({3: [6]}, demos[:23] + [wrong] * 17)[0].kl_boost == 0.0
    # fewer than SKILL_MIN_EXAMPLES far demonstrations decide nothing: held, whatever the start answers
    few, generate = controller({3: [8]}, demos[:31])
    assert few.kl_boost == 100.0 and generate.calls == [] and "start_skill" not in few.state_dict()
    # the skill is the start-up record's (saved apart), not the controller's state; a checkpoint from before the
    # record kept it in the controller's state, and a restore decides from that one (the start as measured when
    # the run began); without it the record's decision stands
    state = unskilled.state_dict()
    assert "start_skill" not in state and "kl_boost" not in state
    restored, _ = controller({3: [6]})
    assert restored.kl_boost == 100.0
    restored.load_state_dict({**state, "start_skill": 0.0})
    batch, m = observe(restored)
    assert restored.kl_boost == 0.0 and m["coverage/start_skill"] == 0.0
    assert "kl_weights" not in batch.extras  # the saved skill releases the restored run too
    assert restored.act(StepFactors()).pairs == pytest.approx(released_pairs) and restored.act(StepFactors()).kl == 0.25
    back, _ = controller({3: [8]})
    back.load_state_dict({**skilled.state_dict(), "start_skill": 1.0})
    assert back.kl_boost == 100.0 and back.act(StepFactors()).kl == 1.0
    old, _ = controller({3: [8]})
    old.load_state_dict({"low": state["low"], "high": state["high"]})
    assert old.kl_boost == 0.0 and "kl_weights" not in observe(old)[0].extras
    assert old.act(StepFactors()).pairs == pytest.approx(released_pairs) and old.act(StepFactors()).kl == 0.25
    # no demonstrations, or none far, or the option off: nothing measured, the far rows held
    for run_demos in (None, demos[40:]):
        plain, generate = controller({3: [8]}, run_demos)
        batch, m = observe(plain)
        assert generate.calls == [] and "coverage/start_skill" not in m and "start_skill" not in plain.state_dict()
        assert batch.get("kl_weights").tolist() == [1.0, 1.0, 101.0, 101.0]
    # a large SFT set: at most SKILL_EXAMPLES far demonstrations are asked, in one call, evenly spaced
    from hpa.trainer.startup_probes import SKILL_EXAMPLES
    many = [SFTExample(prompt_ids=[3], response_ids=[6 if i % 2 else 9, 2]) for i in range(SKILL_EXAMPLES + 300)]
    large, generate = controller({3: [6]}, many)
    assert [len(p) for p, _ in generate.calls] == [SKILL_EXAMPLES] and large.far_demonstrations == SKILL_EXAMPLES
    assert 0.4 < large.start_skill < 0.6
    off = load_config(None, [*base, "algorithm.hpa.trust.hold_min_skill=null"])
    assert controller({3: [8]}, config=off)[0].kl_boost == 100.0


def _hold_controllers():
    """The coverage trust of ``test_the_far_rows_are_held_only_where_the_start_did_well`` at the defaults, held
    (the start answers every far demonstration) and released (none): ``(cfg, held, released)``."""
    from hpa.data.preferences import PreferenceExample, SFTExample

    cfg = load_config(None, ["algorithm.advantage.estimator=grpo", "reward.rules=[]", "reward.model_paths=[rm]",
                             "data.heldout_preference_path=h.jsonl",
                             "algorithm.kl.use_kl_in_reward=false"])
    prompts = [[1], [2], [4, 1], [4, 2], [4, 4, 1], [4, 4, 2]]
    pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9]) for n, p in enumerate(prompts, 1)]
    heldout = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9])
               for n, p in ((2, [2, 1]), (3, [4, 2]), (4, [1]), (5, [4, 4, 2]))]
    demos = [SFTExample(prompt_ids=[3], response_ids=[6, 2]) for _ in range(40)]
    groups = types.SimpleNamespace(dp_group=None, data_parallel_size=1, dp_rank=0)

    def controller(answer):
        run = _run_inputs(groups=groups, pad_id=0, model_reward=_ScriptedEmbedder(), pairs=pairs,
                               heldout_pairs=heldout, tokenizer=types.SimpleNamespace(eos_id=2),
                               generate=_greedy_generate({3: answer}), demonstrations=demos)
        return _coverage(cfg.algorithm.hpa.trust, run, cfg.rollout)

    return cfg, controller([6]), controller([8])


def test_releasing_the_hold_is_a_warning_with_the_numbers_that_decided_it(caplog):
    """The start below ``hold_min_skill`` releases the far rows (a change of regime for the run): a WARNING with
    the skill, the demonstrations it was measured on, the threshold, the boost dropped and the released factors;
    a start that keeps the hold logs no warning."""
    with caplog.at_level(logging.INFO, logger="hpa"):
        _hold_controllers()
    (released,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = released.getMessage()
    assert "the hold is released" in message and "the 40 demonstrations no pair covers is 0.000" in message
    assert "below 0.6 (trust.hold_min_skill)" in message and "boost 100 -> 0" in message
    assert "weighs 0.25 (trust.released_kl)" in message and "2 times as much (trust.released_pairs)" in message
    assert any("40 demonstrations no pair covers is 1.000" in r.getMessage() and "held" in r.getMessage() for r in caplog.records
               if r.levelno == logging.INFO)


def _observed(coverage):
    """A step's rollouts (prompt 1 covered, prompt 3 far) after the coverage trust's update."""

    batch = _component_batch([0.0] * 4, [0.2, 0.9, 1.3, 0.1], [0, 0, 1, 1])
    batch.prompt_ids = torch.tensor([[1, 1], [1, 1], [3, 3], [3, 3]])
    batch.set("raw_rewards", torch.tensor([0.2, 0.9, 1.3, 0.1]))
    _update(coverage, batch)
    return batch


def _kl_loss(batch, cfg, factors):
    """The hierarchical-KL term of the loss on ``batch``'s rows as an update computes it (``hier_kl_term`` on a
    micro-batch that carries the batch's per-row columns, then ``hpa_objective`` with the step's factors), on
    fixed log-probs and pooled states: ``(loss, the unweighted KL (kl/hier), d loss / d log-probs,
    d loss / d pooled, the step weights)``."""
    from hpa.trainer.objective import StepWeights, hpa_objective
    from hpa.trainer.objective.loss import _aggregation
    from hpa.trainer.objective.streams import GlobalCounts, LossInputs
    from hpa.trainer.objective.terms import hier_kl_term

    g = torch.Generator().manual_seed(0)
    mask = batch.get("mask")
    b, r = mask.shape
    rows = {"mask": mask, "ref_log_probs": -torch.rand(b, r, generator=g), "ref_pooled": torch.randn(b, 3, generator=g)}
    if "kl_weights" in batch.extras:  # as micro_batches.rollout_micro_batches carries an optional column
        rows["kl_weights"] = batch.get("kl_weights")
    log_probs = (-torch.rand(b, r, generator=g)).requires_grad_()
    pooled = torch.randn(b, 3, generator=g).requires_grad_()
    algo = cfg.algorithm
    weights = StepWeights(w_ppo=0.4, w_dpo=0.4, w_kl=0.2, lambda_token=1.0, lambda_semantic=0.2, entropy_coef=0.0,
                          reward_kl_coef=0.0, factors=factors)
    counts = GlobalCounts(tokens=float(mask.sum()), sequences=float(b), pairs=1.0)
    value, m = hier_kl_term(rows, {"log_probs": log_probs, "pooled": pooled},
                            LossInputs(algo=algo, weights=weights, counts=counts, aggregation=_aggregation(algo, counts)))
    total, _ = hpa_objective({"hier_kl": value}, weights.scheduled(), factors=factors.scales())
    total.backward()
    return total.detach(), m["kl/hier"], log_probs.grad, pooled.grad, weights


def test_the_logged_kl_weight_is_the_one_the_loss_applies_where_the_hold_is_released():
    """Released (the start below ``hold_min_skill``), every row's KL weighs ``coverage.released_kl`` (0.25): the
    objective table logged at the start of the run and the step's ``hpa/`` metrics show the KL weight the loss
    multiplies the unweighted KL by (``w_kl`` 0.2 times 0.25), not the scheduled 0.2."""
    import re

    from hpa.trainer.objective import describe
    from hpa.trainer.objective.weights import StepFactors, WeightSchedules

    cfg, _, released = _hold_controllers()
    assert cfg.algorithm.hpa.trust.released_kl == 0.25
    batch = _observed(released)
    factors = released.act(StepFactors())
    loss, kl, _, _, weights = _kl_loss(batch, cfg, factors)
    applied = loss.item() / kl.item()
    assert applied == pytest.approx(0.2 * 0.25, rel=1e-6)
    table = describe(weights.scheduled(), factors.scales())
    logged = float(re.search(r"\| hier_kl \| rollout \| w_kl = ([-0-9.e]+) \|", table).group(1))
    assert logged == pytest.approx(applied, rel=1e-6)
    metrics = WeightSchedules(cfg.algorithm).metrics(weights)
    assert metrics["hpa/w_kl"] * metrics.get("hpa/kl_factor", 1.0) == pytest.approx(applied, rel=1e-6)


def test_the_released_kl_as_a_step_factor_is_the_per_row_weight_bit_for_bit():
    """The released KL scales the step's KL weight (``StepFactors.kl``) where it was a column of 0.25 on every
    row: the loss and its gradients are the same bits (fp32, CPU). Held, the far rows' column (1 + kl_boost)
    stays and the factor is 1: the same bits as the column alone."""
    from hpa.trainer.objective.weights import StepFactors

    cfg, held, released = _hold_controllers()
    for coverage, before in ((released, [0.25] * 4), (held, [1.0, 1.0, 101.0, 101.0])):
        batch = _observed(coverage)
        factors = coverage.act(StepFactors())
        now = _kl_loss(batch, cfg, factors)
        as_before = _component_batch([0.0] * 4, [0.2, 0.9, 1.3, 0.1], [0, 0, 1, 1])
        as_before.set("kl_weights", torch.tensor(before))  # every row's weight a column, no KL factor
        then = _kl_loss(as_before, cfg, StepFactors(pairs=factors.pairs))
        for a, b in zip(now[:4], then[:4]):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_the_kl_boost_leaves_far_rows_a_rule_judges_alone():
    """A split-like run (a rule and a reward model): ``score`` marks the rows whose prompt has a ground truth
    (``rule_judged``), and the coverage trust's KL boost leaves those rows at weight 1 even where no pair
    covers their prompt (the rule says what to do there); a far row without a ground truth gets 1 + boost."""
    from hpa.data.preferences import PreferenceExample
    from hpa.reward.rules import RuleReward
    from hpa.reward.shaping import BaseRewardOutput, CombinedReward, UncertaintyAwareReward

    overrides = ("algorithm.advantage.estimator=grpo", "reward.rules=[exact_match]", "reward.model_paths=[rm]",
                 "data.heldout_preference_path=h.jsonl",
                 "algorithm.kl.use_kl_in_reward=false", "algorithm.hpa.trust.kl_boost=4",
                 "reward.shaping.alpha=0.0", "reward.shaping.beta=0.0")
    ctx, cfg = _ctx(*overrides), load_config(None, list(overrides))
    prompts = [[1], [2], [4, 1], [4, 2], [4, 4, 1], [4, 4, 2]]
    pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9]) for n, p in enumerate(prompts, 1)]
    heldout = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9])
               for n, p in ((2, [2, 1]), (3, [4, 2]), (4, [1]), (5, [4, 4, 2]))]

    class Tok:
        eos_id = 0

        def decode(self, ids):
            return " ".join(map(str, ids))

    class RuleFree:  # the learned part: a constant reward, one head
        def __call__(self, inputs):
            return BaseRewardOutput(rewards=torch.zeros(inputs.response_ids.shape[0], 1))

    reward = UncertaintyAwareReward.from_config(cfg.reward.shaping, CombinedReward(
        [RuleFree(), RuleReward.from_names(["exact_match"], 4.0)]))
    batch = _batch(torch.ones(4, 2), [0, 0, 1, 1])
    batch.prompt_ids = torch.tensor([[3, 3], [3, 3], [3, 3], [3, 3]])  # every prompt far from the pairs
    batch.set("old_pooled", torch.zeros(4, 2))
    batch.set("old_log_probs", torch.zeros(4, 2)).set("ref_log_probs", torch.zeros(4, 2))
    phases.score(batch, ["1 1", "2 2", None, None], reward, Tok(), ctx)
    assert batch.get("rule_judged").tolist() == [True, True, False, False]
    coverage = _coverage(ctx.algorithm.hpa.trust, _run_inputs(
        groups=GROUPS, pad_id=0, model_reward=_ScriptedEmbedder(), pairs=pairs, heldout_pairs=heldout), ROLLOUT)
    metrics = _update(coverage, batch)
    assert batch.get("learned_trust").tolist() == [0.0] * 4
    assert batch.get("kl_weights").tolist() == [1.0, 1.0, 5.0, 5.0]
    # the far share counts the rows the boost holds, as the far rows' KL does: not the two a rule judges
    assert metrics["coverage/far_share"] == pytest.approx(0.5)


class _DeviceEmbedder(_ScriptedEmbedder):
    """``_ScriptedEmbedder`` as a model on the test device: it takes and returns device tensors."""

    def sequence_embeddings(self, response_ids, response_mask, prompt_ids=None, prompt_mask=None):
        from hpa.distributed.device_mode import on_device, on_host

        host = [None if t is None else on_host(t) for t in (response_ids, response_mask, prompt_ids, prompt_mask)]
        return on_device(super().sequence_embeddings(*host))


@pytest.mark.parametrize("target", [None, 0.02])
def test_the_coverage_update_reads_the_device_once_for_its_metrics(target):
    """The coverage controller's step on a rollout batch that lives on the device (the test device mode,
    ``hpa.distributed.sync_ops``): the trust's prompt cache reads the prompts once, and every logged number
    (trust quantiles, far share, covered learned reward, far rows' KL) and the adaptive boost come back in
    one more read, whatever ``kl_boost_target`` is. The metrics are the host computation's."""
    import math

    from hpa.data.preferences import PreferenceExample
    from hpa.distributed.device_mode import StrictDeviceMode, on_device
    from hpa.distributed.sync_ops import SyncOps
    from hpa.trainer.objective.controllers import StepSignals

    base = ["algorithm.advantage.estimator=grpo", "reward.rules=[]", "reward.model_paths=[rm]",
            "data.heldout_preference_path=h.jsonl", "algorithm.kl.use_kl_in_reward=false"]
    prompts = [[1], [2], [4, 1], [4, 2], [4, 4, 1], [4, 4, 2]]
    pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9]) for n, p in enumerate(prompts, 1)]
    heldout = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9])
               for n, p in ((2, [2, 1]), (3, [4, 2]), (4, [1]), (5, [4, 4, 2]))]
    config = _ctx(*base).algorithm.hpa.trust
    device = torch.device("lazy", 0)

    def batch(on_dev):
        b = _component_batch([0.0] * 5, [0.2, 0.9, 1.3, 0.1, 5.0], [0, 0, 1, 1, 2])
        b.prompt_ids = torch.tensor([[1, 1], [1, 1], [3, 3], [3, 3], [1, 1]])  # prompt 1 covered, prompt 3 far
        b.set("raw_rewards", torch.tensor([0.2, 0.9, 1.3, 0.1, 5.0]))
        b.get("mask")[4] = 0  # a row the filter dropped: in no metric
        old = torch.full((5, 2), -1.0)
        b.set("old_log_probs", old).set("ref_log_probs", old + math.log(2.0))
        if on_dev:
            for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
                setattr(b, name, on_device(getattr(b, name)))
            for name in ("mask", "token_scores", "rule_scores", "raw_rewards", "old_log_probs", "ref_log_probs"):
                b.set(name, on_device(b.get(name)))
        return b

    host = _coverage(config, _run_inputs(groups=GROUPS, pad_id=0, model_reward=_ScriptedEmbedder(),
                                              pairs=pairs, heldout_pairs=heldout), ROLLOUT, kl_boost_target=target)
    expected = host.update(StepSignals(batch=batch(False)))
    with StrictDeviceMode(device):
        coverage = _coverage(config, _run_inputs(groups=GROUPS, pad_id=0, model_reward=_DeviceEmbedder(),
                                                      pairs=pairs, heldout_pairs=heldout), ROLLOUT,
                             kl_boost_target=target)
        on_dev = batch(True)
        with SyncOps() as syncs:
            metrics = _update(coverage, on_dev)
        assert on_dev.get("kl_weights").device == device and on_dev.get("learned_trust").device == device
    assert syncs.count == 2, syncs.by_site
    assert metrics.keys() == expected.keys() and metrics["coverage/far_kl"] == pytest.approx(1 - math.log(2.0))
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    assert expected["coverage/far_share"] == pytest.approx(0.5)  # the dropped row counts in no metric
    assert expected["coverage/learned_reward"] == pytest.approx((0.2 + 0.9) / 2)


def _dp_coverage_worker(groups):
    """One DP rank's coverage step on its share of a six-row batch (all of it on one rank; rows 0-2 and 3-5
    on two): the metrics it logs."""
    import math

    from hpa.data.preferences import PreferenceExample

    prompts = [[1], [2], [4, 1], [4, 2], [4, 4, 1], [4, 4, 2]]
    pairs = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9]) for n, p in enumerate(prompts, 1)]
    heldout = [PreferenceExample(prompt_ids=p, chosen_ids=[7] * n, rejected_ids=[9])
               for n, p in ((2, [2, 1]), (3, [4, 2]), (4, [1]), (5, [4, 4, 2]))]
    config = _ctx("algorithm.advantage.estimator=grpo", "reward.rules=[]", "reward.model_paths=[rm]",
                  "data.heldout_preference_path=h.jsonl",
                  "algorithm.kl.use_kl_in_reward=false").algorithm.hpa.trust
    share = 6 // groups.data_parallel_size
    rows = list(range(groups.dp_rank * share, (groups.dp_rank + 1) * share))
    learned = torch.tensor([0.2, 0.9, 1.3, 0.1, 5.0, -0.4])[rows]
    batch = _component_batch([0.0] * share, learned.tolist(), list(range(share)))
    batch.prompt_ids = torch.tensor([[1, 1], [3, 3], [3, 3], [1, 1], [3, 3], [2, 2]])[rows]  # 1, 2 covered; 3 far
    batch.set("raw_rewards", learned)
    batch.get("mask")[:] = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0],
                                         [1.0, 1.0]])[rows]  # row 4 dropped by the filter
    drift = torch.tensor([0.0, math.log(2.0), math.log(3.0), 0.5, 9.0, 0.0])[rows]  # ref - old, per row
    batch.set("ref_log_probs", batch.get("old_log_probs") + drift[:, None])
    coverage = _coverage(config, _run_inputs(groups=groups, pad_id=0, model_reward=_ScriptedEmbedder(),
                                                      pairs=pairs, heldout_pairs=heldout), ROLLOUT)
    return _update(coverage, batch), batch.get("learned_trust").tolist()


@pytest.mark.multirank
def test_the_coverage_metrics_over_dp_ranks_are_one_ranks_over_the_whole_batch():
    """The coverage step's fused reduction over DP: two ranks with three rows each log what one rank logs
    on all six. By hand: the far rows' KL is token-weighted across ranks (row 1's one token, row 2's two;
    the dropped row 4 nowhere), the covered learned reward trust-weighted over rows 0, 3 and 5."""
    import math

    from multirank import run_ranks

    (whole, trust), = run_ranks(_dp_coverage_worker)
    split = run_ranks(_dp_coverage_worker, dp=2)
    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731  (kl_k3 of the log-ratio d = ref - old)
    assert trust[1] == trust[2] == trust[4] == 0 and min(trust[0], trust[3], trust[5]) > 0
    assert whole["coverage/far_kl"] == pytest.approx((k3(math.log(2.0)) + 2 * k3(math.log(3.0))) / 3)
    assert whole["coverage/far_share"] == pytest.approx(2 / 5)
    covered = [(trust[i], r) for i, r in ((0, 0.2), (3, 0.1), (5, -0.4))]
    assert whole["coverage/learned_reward"] == pytest.approx(sum(t * r for t, r in covered) /
                                                             sum(t for t, _ in covered))
    for metrics, _ in split:
        assert metrics.keys() == whole.keys()
        for key, value in whole.items():
            if key != "perf/coverage_cached_prompts":  # each rank's own cache
                assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
