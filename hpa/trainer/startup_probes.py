"""The start-up probes: what a run measures once of its start policy, before the first update, for the controllers
that trust the reward models (``algorithm.hpa.trust``), as one frozen record (``StartMeasures``).

``measure_start`` runs every probe the run's config asks for, on the start weights: the reward models' ceiling
on the held-out pairs (the trust gate's ``reward_ceiling``, ``sampled_ceiling`` and ``start_rollouts``
signals), the start policy's greedy and sampled responses to the held-out prompts (``sampled_ceiling``'s offset,
``start_rollouts``' headroom), its sampled rollouts on training prompts (``start_rollouts``' baseline) and its
skill on the demonstrations no pair covers (the coverage hold's ``hold_min_skill``). The record is saved with
the run state (``START_MEASURES``) and read back on resume instead of measured again
(``saved_start_measures``): a resumed run trusts the start it began from, and samples nothing to know it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hpa.algorithms.gate import GATE_BASELINE_PROMPTS
from hpa.config.algorithm import TrustConfig
from hpa.config.schema import RolloutConfig
from hpa.data.sampler import dp_share, evenly_spaced
from hpa.distributed import comm
from hpa.reward.coverage import CoverageEstimator
from hpa.reward.embeddings import greedy_and_sampled_reward, heldout_reward_ceiling, mean_learned_reward
from hpa.rollout.base import SamplingParams

logger = logging.getLogger("hpa")

# the run state's key of the record
START_MEASURES = "start_measures"
# the gate's signals that read the reward models' ceiling on the held-out pairs, and those that also read the
# start policy's greedy and sampled responses to the held-out prompts
CEILING_SIGNALS = ("reward_ceiling", "sampled_ceiling", "start_rollouts")
GREEDY_SIGNALS = ("sampled_ceiling", "start_rollouts")
# the start_rollouts baseline's generate calls: at most this many prompts each (rollout.n responses a prompt)
BASELINE_PROMPTS_PER_CALL = 64
# the start's skill (``trust.hold_min_skill``) is measured on at most this many demonstrations no pair covers,
# out of at most SKILL_CANDIDATES examples of data.sft_path (each an evenly spaced subset, the file's order):
# one greedy generate call of SKILL_EXAMPLES / DP rows a rank and one reward-model forward per candidate prompt,
# whatever the size of the SFT set
SKILL_EXAMPLES, SKILL_CANDIDATES = 512, 8192
# fewer far demonstrations than this decide nothing (a share of a handful is noise): the far rows stay held
SKILL_MIN_EXAMPLES = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartMeasures:
    """What a run measured of its start, once (None: not measured, the run's config asked for no such probe).

    Args:
        chosen_reward: the reward models' mean score of the held-out pairs' chosen responses (the gate's
            ceiling on the held-out prompts).
        margin: their mean margin over the rejected responses (the gate's unit).
        greedy_reward: the start policy's greedy responses to the held-out prompts, scored the same way.
        sampled_reward: its sampled responses (``rollout.*``) to the same prompts.
        baseline: the start policy's sampled rollouts on training prompts (``start_rollouts``' baseline).
        baseline_prompts: how many training prompts the baseline sampled.
        start_skill: the share of the demonstrations no pair covers that the start answers greedily as
            demonstrated (the coverage hold's ``hold_min_skill`` reads it).
        far_demonstrations: how many demonstrations ``start_skill`` was measured on.
    """

    chosen_reward: Optional[float] = None
    margin: Optional[float] = None
    greedy_reward: Optional[float] = None
    sampled_reward: Optional[float] = None
    baseline: Optional[float] = None
    baseline_prompts: int = 0
    start_skill: Optional[float] = None
    far_demonstrations: int = 0

    @property
    def offset(self) -> Optional[float]:
        """``sampled_ceiling``: how far the start's greedy responses out-score its sampled ones (lowers the ceiling)."""
        if self.greedy_reward is None or self.sampled_reward is None:
            return None
        return self.greedy_reward - self.sampled_reward

    @property
    def headroom(self) -> Optional[float]:
        """``start_rollouts``: what the held-out preferences support above the start, ``max(0, chosen - greedy)``."""
        if self.chosen_reward is None or self.greedy_reward is None:
            return None
        return max(0.0, self.chosen_reward - self.greedy_reward)

    def state_dict(self) -> Dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: Dict) -> "StartMeasures":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in names})


class SavedStartMeasures:
    """The record as a part of the run state: saved with every checkpoint. It is read back before the controllers
    are built (``saved_start_measures``); a restore (resume, rollback) finds the run's one record again."""

    def __init__(self, measures: StartMeasures):
        self.measures = measures

    def state_dict(self) -> Dict:
        return self.measures.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        restored = StartMeasures.from_state(state)
        if restored != self.measures:  # one record per run: a checkpoint of another start
            logger.warning("the checkpoint's start measures %s differ from this run's %s; the run keeps its own",
                           restored, self.measures)


def saved_start_measures(state: Optional[Dict]) -> Optional[StartMeasures]:
    """The record in a checkpoint's run state (``trainer_state.pt``); None without a checkpoint or in one saved
    before the record existed (the probes then measure the start again, as that run did at each start)."""
    if state is None or START_MEASURES not in state:
        return None
    return StartMeasures.from_state(state[START_MEASURES])


@dataclasses.dataclass(frozen=True)
class ProbeInputs:
    """What the probes read of the run.

    Args:
        groups: the run's parallel groups (each probe shards its prompts over DP and reduces the sums).
        generate: ``(prompt_ids, SamplingParams) -> RolloutBatch`` on the policy's current (start) weights.
        tokenizer: the run's tokenizer.
        pad_id: the tokenizer's pad id.
        model_reward: the reward-model ensemble, None without reward models.
        prompts: the training prompts (``data.prompt_path``).
        heldout_pairs: the held-out pairs (``data.heldout_preference_path``), None when the run reads none.
        demonstrations: the SFT examples of ``data.sft_path``, None when the run reads none.
        coverage: the coverage estimator (which demonstrations no pair covers), None when the coverage trust is off.
        skill_rule: the graded rule reward of ``reward.rules`` (``hpa.reward.rules.graded_rule``): the start's skill
            is then its mean over the greedy answers (``graded_skill_score``); None: the exact greedy match.
        timer: ``timer(name)`` adds a block's wall time to ``timing_s/<name>``.
    """

    groups: object
    generate: Callable
    tokenizer: object = None
    pad_id: int = 0
    model_reward: Optional[object] = None
    prompts: Sequence = ()
    heldout_pairs: Optional[Sequence] = None
    demonstrations: Optional[Sequence] = None
    coverage: Optional[CoverageEstimator] = None
    skill_rule: Optional[Callable[[str, str], float]] = None
    timer: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()


def measure_start(trust: TrustConfig, rollout: RolloutConfig, run: ProbeInputs, *, gate: bool,
                  baseline_prompts: int = GATE_BASELINE_PROMPTS) -> StartMeasures:
    """Every start-up probe the config asks for, on the start weights (on every rank: each is collective over DP).

    Args:
        trust: ``algorithm.hpa.trust``.
        rollout: the run's ``rollout`` section (the probes sample as the steps do).
        run: what the probes read.
        gate: whether the trust gate runs (``trust_gate_enabled``); the coverage probe runs when
            ``run.coverage`` is given.
        baseline_prompts: ``start_rollouts``' baseline samples this many training prompts (``GATE_BASELINE_PROMPTS``;
            0: the gate counts its baseline from the first updates' batches instead).
    """
    measures: Dict = {}
    baseline = gate and trust.signal == "start_rollouts"
    if baseline and baseline_prompts and not run.prompts:
        raise ValueError("the start_rollouts gate's baseline needs training prompts (data.prompt_path has none)")
    if gate and trust.signal in CEILING_SIGNALS:
        measures.update(_heldout_rewards(trust.signal, rollout, run))
    if run.coverage is not None and trust.kl_boost > 0 and trust.hold_min_skill is not None and run.demonstrations:
        measures.update(_start_skill(rollout, run))
    if baseline and baseline_prompts:
        measures.update(_baseline(rollout, run, baseline_prompts))
    elif baseline:
        logger.info("trust gate: the baseline is the first updates' rollouts")
    return StartMeasures(**measures)


def _heldout_rewards(signal: str, rollout: RolloutConfig, run: ProbeInputs) -> Dict:
    chosen, margin = heldout_reward_ceiling(run.model_reward, run.heldout_pairs, pad_id=run.pad_id)
    if signal not in GREEDY_SIGNALS:
        logger.info("trust gate: the held-out chosen responses' learned reward is %.4f, margin %.4f", chosen, margin)
        return {"chosen_reward": chosen, "margin": margin}
    greedy, sampled = greedy_and_sampled_reward(run.model_reward, run.tokenizer, run.heldout_pairs, run.generate,
                                                rollout, run.groups)
    logger.info("trust gate: on the held-out prompts the chosen responses' learned reward is %.4f (margin %.4f), "
                "the start policy's greedy responses' %.4f, its sampled ones' %.4f", chosen, margin, greedy, sampled)
    return {"chosen_reward": chosen, "margin": margin, "greedy_reward": greedy, "sampled_reward": sampled}


def _baseline(rollout: RolloutConfig, run: ProbeInputs, baseline_prompts: int) -> Dict:
    """The start policy's sampled rollouts on ``baseline_prompts`` training prompts (evenly spaced over the file),
    their mean learned reward."""
    prompts = [e.prompt_ids for e in evenly_spaced(run.prompts, baseline_prompts)]
    # the steps' seeds are rollout.seed + step * DP + rank: this stream lies far from them
    params = SamplingParams.from_config(rollout, seed=rollout.seed + 2_000_003 + run.groups.dp_rank)
    with run.timer("gate"):
        baseline = mean_learned_reward(run.model_reward, run.tokenizer, prompts, run.generate, params, run.groups,
                                       prompts_per_call=BASELINE_PROMPTS_PER_CALL)
    logger.info("trust gate: the start policy's sampled rollouts on %d training prompts score %.4f (the baseline)",
                len(prompts), baseline)
    return {"baseline": baseline, "baseline_prompts": len(prompts)}


def _start_skill(rollout: RolloutConfig, run: ProbeInputs) -> Dict:
    """The start's greedy match share on the demonstrations no pair covers (trust 0); fewer than
    ``SKILL_MIN_EXAMPLES`` of them: nothing measured."""
    examples = evenly_spaced(run.demonstrations, SKILL_CANDIDATES)
    prompt_trust = run.coverage.trust([e.prompt_ids for e in examples])  # [n]
    far = evenly_spaced([e for e, t in zip(examples, prompt_trust.tolist()) if t <= 0], SKILL_EXAMPLES)
    if len(far) < SKILL_MIN_EXAMPLES:
        logger.info("coverage trust: %d demonstrations (data.sft_path) lie where no pair covers, fewer than %d; "
                    "the start's skill there is not measured", len(far), SKILL_MIN_EXAMPLES)
        return {}
    score = graded_skill_score(run.skill_rule, run.tokenizer) if run.skill_rule is not None else None
    with run.timer("coverage"):
        skill, counted = greedy_match_share(far, run.generate, rollout, run.groups, eos_id=run.tokenizer.eos_id,
                                            score=score)
    measure = "scores %.3f on average (the graded rule, greedy) on" if score is not None else \
        "answers %.3f as demonstrated (greedy) of"
    logger.info("coverage trust: the start " + measure + " the %d demonstrations no pair covers", skill, counted)
    return {"start_skill": skill, "far_demonstrations": counted}


def without_final_eos(tokens: Sequence[int], eos_id: int) -> Tuple[int, ...]:
    """``tokens`` as a tuple, a final EOS dropped: an answer as demonstrated or as decoded."""
    tokens = tuple(tokens)
    return tokens[:-1] if tokens and tokens[-1] == eos_id else tokens


def demonstrated_answers(batch, eos_id: int) -> List[Optional[Tuple[int, ...]]]:
    """Each row's sampled response as token ids, without a final EOS (``RolloutBatch``: right-padded, the
    mask 1 on sampled tokens including the EOS); a row that did not stop (``length``) is None: it gave no
    answer."""
    ids, mask = batch.response_ids.cpu(), batch.response_mask.cpu()
    out = []
    for row, m, reason in zip(ids, mask, batch.finish_reasons):
        out.append(without_final_eos(row[m.bool()].tolist(), eos_id) if reason == "stop" else None)
    return out


def greedy_match_share(examples: Sequence, generate: Callable, rollout: RolloutConfig, groups, *,
                       eos_id: int, score: Optional[Callable[[Tuple[int, ...], Tuple[int, ...]], float]] = None
                       ) -> Tuple[float, int]:
    """The share of ``examples`` (SFT examples: ``prompt_ids``, ``response_ids``) whose response the policy
    decodes greedily, token for token (a final EOS on either side ignored; a response cut at
    ``rollout.max_new_tokens`` matches nothing), and how many were measured. The examples are sharded over DP
    (the same work on every rank) and the counts reduced, so every rank returns the same two numbers.
    ``generate``: ``(prompt_ids, SamplingParams) -> RolloutBatch`` on the policy's current weights.
    ``score``: ``(answer, demonstration) -> [0, 1]`` (token ids, final EOS dropped), a graded match in place of
    the exact one (``graded_skill_score``); the share is then the mean score (a cut response still scores 0)."""
    n = len(examples)
    if n == 0:
        return float("nan"), 0
    mine, counted = dp_share(examples, groups.dp_rank, groups.data_parallel_size)
    batch = generate([e.prompt_ids for e in mine], SamplingParams.from_config(rollout, n=1, temperature=0.0))
    answers = demonstrated_answers(batch, eos_id)
    hits = 0.0
    for row, answer in zip(batch.group_ids.tolist(), answers):
        if row < counted:
            shown = without_final_eos(mine[row].response_ids, eos_id)
            hits += (float(answer == shown) if score is None else
                     float(score(answer, shown)) if answer is not None else 0.0)
    sums = comm.all_reduce_sum(torch.tensor([hits, float(counted)], dtype=torch.float64), groups.dp_group)
    return float(sums[0] / sums[1]), int(sums[1])


def graded_skill_score(rule: Callable[[str, str], float], tokenizer) -> Callable:
    """The graded match of ``greedy_match_share``: ``rule`` (a graded rule reward, ``token_f1``) of the decoded
    answer against the decoded demonstration, so an answer worded otherwise than its demonstration still
    counts (on free text the exact match is ~0 whatever the policy can do)."""
    return lambda answer, shown: rule(tokenizer.decode(list(answer)), tokenizer.decode(list(shown)))
