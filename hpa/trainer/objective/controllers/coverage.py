"""The coverage trust (``algorithm.hpa.trust``, ``hpa.algorithms.coverage``) as a controller."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hpa.algorithms.coverage import (COVERAGE_HIGH_QUANTILE, COVERAGE_K, COVERAGE_LOW_QUANTILE, COVERAGE_SPACE,
                                     KL_BOOST_SHAPE, KL_BOOST_TARGET, TRUST_METRICS, EmbeddingCache,
                                     abstention_kl_weights, adapt_kl_boost, bank_center, calibrate, coverage_trust,
                                     far_kl_sums, far_rows, knn_distance, trust_stats, unique_rows)
from hpa.config.algorithm import TrustConfig
from hpa.config.schema import RolloutConfig
from hpa.data.sampler import dp_share, evenly_spaced
from hpa.distributed import comm
from hpa.reward.embeddings import chosen_embeddings, prompt_embeddings
from hpa.rollout.base import SamplingParams
from hpa.trainer.objective.controllers.base import Controller, ControllerInputs, StepSignals
from hpa.trainer.objective.weights import StepFactors


# the start's skill (``trust.hold_min_skill``) is measured on at most this many demonstrations no pair covers,
# out of at most SKILL_CANDIDATES examples of data.sft_path (each an evenly spaced subset, the file's order):
# one greedy generate call of SKILL_EXAMPLES / DP rows a rank and one reward-model forward per candidate prompt,
# whatever the size of the SFT set
SKILL_EXAMPLES, SKILL_CANDIDATES = 512, 8192
# fewer far demonstrations than this decide nothing (a share of a handful is noise): the far rows stay held
SKILL_MIN_EXAMPLES = 32


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


def covered_reward_sums(batch, trust: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The learned part of the rollouts' reward (r̂ minus the rule) summed with each row's coverage trust
    as its weight over the rows that train (``valid``), and the weights' sum: ``[sum, weight]`` (float64,
    to be summed over DP ranks). Their ratio is ``coverage/learned_reward`` (logged; NaN when no row is
    covered). Not the gate's input: measured as one, it kept the gate open where every row's learned
    reward closed it (docs/objective.md). # [b], [b] bool -> [2]"""
    learned = torch.where(valid, batch.get("raw_rewards").double() - batch.get("rule_scores").double(),
                          torch.zeros((), dtype=torch.float64))  # [b]
    weight = trust.double() * valid.double()  # [b]
    return torch.stack([(weight * learned).sum(), weight.sum()])


class CoverageTrust(Controller):
    """Each rollout row's weight of the learned advantage component, written to the batch as
    ``learned_trust`` ``[b]`` (and, as the factor ``learned_trust``, a function the evaluation reads).

    At start-up the bank is the first reward model's embeddings of ``data.preference_path`` (the pairs the
    reward models were trained on): of each pair's prompt (``space: prompt``) or chosen sequence
    (``space: sequence``), centred on the bank's mean; the held-out pairs' distances to it give the trust
    ramp's ``low`` and ``high``. The bank is recomputed at every start (frozen reward model, fixed file:
    the same rows; too large for the run state); the two constants are saved, and a restore keeps the
    saved ones, so a resumed run is the uninterrupted one even where a new layout rounds the start-up
    forwards differently. Costs, once, a forward of the first reward model over both pair files and, in
    prompt space, one over each prompt the first time a step (or an evaluation) draws it (the reward model
    is frozen: a prompt's embedding is kept, ``EmbeddingCache``); in sequence space one over the rollouts.
    With ``kl_boost`` > 0 it also writes ``kl_weights`` ``[b]``, each row's weight of the hierarchical KL
    (``abstention_kl_weights``; a row a rule judges, ``rule_judged``, keeps weight 1), and logs the far
    rows' KL to the reference (``coverage/far_kl``, in a step that has far rows) and the boost
    (``coverage/kl_boost``). With
    ``kl_boost_target`` the boost adapts to that KL each step before the weights are written
    (``adapt_kl_boost``); it is then run state (saved; a checkpoint without it resumes at ``kl_boost``).
    With ``hold_min_skill`` and demonstrations (``data.sft_path``), the start's skill where no pair covers a
    prompt is measured once at start-up (``greedy_match_share`` over the examples whose prompts have trust 0:
    the exact greedy match, or with ``skill_rule``, the run's graded rule reward, the mean graded match
    ``graded_skill_score``) and the boost is 0 for the run where it falls below (a WARNING with the numbers);
    the KL's weight is then ``w_kl`` times ``released_kl`` (the step factor ``kl``, which the objective table
    and ``hpa/kl_factor`` show) and the pair stream's times ``released_pairs`` (``act``); both are run state
    (saved; a checkpoint without them keeps what start-up measured, which is the same start).

    ``margin``, ``kl_boost``, ``hold_min_skill``, ``released_kl`` and ``released_pairs`` are
    ``algorithm.hpa.trust``'s; ``space``, ``k``, ``kl_boost_shape`` and ``kl_boost_target`` are
    ``hpa.algorithms.coverage``'s constants, arguments here for the tests and probes; ``skill_rule`` is the
    graded rule of ``reward.rules`` (``hpa.reward.rules.graded_rule``), None for exact-answer rules.
    """

    name, observes = "coverage", "rollouts"

    def __init__(self, c: TrustConfig, run: ControllerInputs, rollout: RolloutConfig, *, space: str = COVERAGE_SPACE,
                 k: int = COVERAGE_K, kl_boost_shape: str = KL_BOOST_SHAPE,
                 kl_boost_target: Optional[float] = KL_BOOST_TARGET, skill_rule: Optional[Callable] = None):
        self.k, self.space, self.model_reward, self.pad_id = k, space, run.model_reward, run.pad_id
        self.dp_group, self.timer = run.groups.dp_group, run.timer
        self.kl_boost, self.kl_boost_shape, self.cache = c.kl_boost, kl_boost_shape, EmbeddingCache()
        self.kl_boost_target, self.kl_boost_ceiling = kl_boost_target, 10.0 * c.kl_boost
        self.bank = self._embed_pairs(run.pairs)  # [m, h]
        self.center = bank_center(self.bank)  # [h]
        held = knn_distance(self._embed_pairs(run.heldout_pairs), self.bank, self.k, center=self.center)  # [n]
        self.low, self.high = calibrate(held, low_quantile=COVERAGE_LOW_QUANTILE,
                                        high_quantile=COVERAGE_HIGH_QUANTILE, margin=c.margin)
        logging.getLogger("hpa").info("coverage trust (%s space): %d rows in the bank; trust 1 up to distance "
                                      "%.4g, 0 from %.4g", self.space, self.bank.shape[0], self.low, self.high)
        self.start_skill, self.far_demonstrations, self.min_skill = float("nan"), 0, c.hold_min_skill
        self.config_boost, self.released_kl, self.released_pairs = c.kl_boost, c.released_kl, c.released_pairs
        self.skill_rule = skill_rule
        if self.kl_boost > 0 and c.hold_min_skill is not None and run.demonstrations:
            self._measure_start_skill(run, rollout)

    def _measure_start_skill(self, run: ControllerInputs, rollout: RolloutConfig) -> None:
        """The start's greedy match share on the demonstrations no pair covers; the boost is 0 below
        ``hold_min_skill``. No far demonstration: nothing measured, the boost stays."""
        examples = evenly_spaced(run.demonstrations, SKILL_CANDIDATES)
        trust = self._prompt_trust([e.prompt_ids for e in examples])  # [n]
        far = evenly_spaced([e for e, t in zip(examples, trust.tolist()) if t <= 0], SKILL_EXAMPLES)
        log = logging.getLogger("hpa")
        if len(far) < SKILL_MIN_EXAMPLES:
            log.info("coverage trust: %d demonstrations (data.sft_path) lie where no pair covers, fewer than %d; "
                     "the far rows are held with boost %g", len(far), SKILL_MIN_EXAMPLES, self.kl_boost)
            return
        score = graded_skill_score(self.skill_rule, run.tokenizer) if self.skill_rule is not None else None
        with self.timer("coverage"):
            self.start_skill, self.far_demonstrations = greedy_match_share(far, run.generate, rollout, run.groups,
                                                                           eos_id=run.tokenizer.eos_id, score=score)
        held, min_skill = self.holds(), self.min_skill
        measure = ("scores %.3f on average (the graded rule, greedy) on" if score is not None else
                   "answers %.3f as demonstrated (greedy) of")
        # a release changes the run's regime (a lighter KL, heavier pairs): a warning, with its numbers
        (log.info if held else log.warning)(
            "coverage trust: the start " + measure + " the %d demonstrations no pair covers; %s",
            self.start_skill, self.far_demonstrations,
            f"at least {min_skill:g}: the far rows are held (boost {self.kl_boost:g})" if held else
            f"below {min_skill:g}: the far rows are not held (boost 0), and every row's KL to the reference "
            f"weighs {self.released_kl:g} (trust.released_kl), the pairs' terms {self.released_pairs:g} "
            f"times as much (trust.released_pairs)")
        if not held:
            self.kl_boost = 0.0

    def holds(self) -> bool:
        """Whether the far rows are held: always, unless the start's skill was measured and is below
        ``hold_min_skill``."""
        return not self.start_skill < self.min_skill if self.min_skill is not None else True

    def _embed_pairs(self, examples) -> torch.Tensor:
        if self.space == "prompt":  # every pair's prompt (a prompt with more pairs weighs more), each embedded once
            prompts, where = unique_rows([e.prompt_ids for e in examples])
            return prompt_embeddings(self.model_reward, prompts, pad_id=self.pad_id)[where]
        return chosen_embeddings(self.model_reward, examples, pad_id=self.pad_id)

    def trust(self, batch) -> torch.Tensor:
        """The trust of each row of a rollout batch ``[b]``: of its prompt (``space: prompt``, each distinct
        prompt embedded once) or of its prompt + response (``space: sequence``)."""
        if self.space == "prompt":
            # one read of the device for both
            ids, masks = torch.stack([batch.prompt_ids, batch.prompt_mask.to(batch.prompt_ids.dtype)]).cpu()
            return self._prompt_trust([i[m.bool()].tolist() for i, m in zip(ids, masks)]).to(batch.response_ids.device)
        else:
            embeddings = self.model_reward.sequence_embeddings(batch.response_ids, batch.response_mask,
                                                               batch.prompt_ids, batch.prompt_mask)  # [b, h]
            where = torch.arange(embeddings.shape[0])
        trust = coverage_trust(knn_distance(embeddings, self.bank, self.k, center=self.center), self.low, self.high)
        return trust[where].to(batch.response_ids.device)

    def _prompt_trust(self, rows) -> torch.Tensor:
        """The trust of each prompt (token ids) alone, each distinct prompt embedded once. # -> [n]"""
        prompts, where = unique_rows(rows)
        embeddings = self.cache.embed(prompts, lambda new: prompt_embeddings(
            self.model_reward, new, pad_id=self.pad_id))  # [u, h]
        return coverage_trust(knn_distance(embeddings, self.bank, self.k, center=self.center), self.low,
                              self.high)[where]

    def update(self, s: StepSignals) -> Dict[str, float]:
        batch = s.batch
        with self.timer("coverage"):
            trust = self.trust(batch)  # [b]
        batch.set("learned_trust", trust)
        mask, judged = batch.get("mask"), batch.extras.get("rule_judged")
        valid = mask.sum(dim=1) > 0  # the rows that train (not dropped by the filter)
        far = far_rows(trust, judged)  # [b]: what the boost holds, and what coverage/far_share counts
        far_sums = torch.zeros(2, dtype=torch.float64, device=trust.device)
        if self.kl_boost > 0:  # the far rows' KL (logged; the adaptive boost's input)
            far_sums = far_kl_sums(batch.get("old_log_probs"), batch.get("ref_log_probs"), mask, far)
        sums = comm.all_reduce_sum(torch.cat([covered_reward_sums(batch, trust, valid), far_sums]), self.dp_group)
        rows = comm.all_gather_cat(torch.stack([trust.double(), valid.double(), far.double()], dim=1),
                                   self.dp_group)  # [B, 3]
        # every number logged below, and the adaptive boost's input, in the step's one read of the device
        read = torch.cat([sums, trust_stats(rows[:, 0], rows[:, 1] > 0, rows[:, 2] > 0)]).cpu().tolist()
        reward_sum, weight, kl_sum, kl_tokens, *stats = read
        nan = float("nan")
        metrics = {f"coverage/{k}": v for k, v in zip(TRUST_METRICS, stats)}
        if self.start_skill == self.start_skill:  # measured (hold_min_skill): the boost it set, 0 included
            metrics["coverage/start_skill"], metrics["coverage/kl_boost"] = self.start_skill, self.kl_boost
        if self.kl_boost > 0:
            far_kl = kl_sum / kl_tokens if kl_tokens > 0 else nan
            if self.kl_boost_target is not None:
                self.kl_boost = adapt_kl_boost(self.kl_boost, far_kl, self.kl_boost_target,
                                               ceiling=self.kl_boost_ceiling)
            batch.set("kl_weights", abstention_kl_weights(trust, self.kl_boost, judged=judged,
                                                             shape=self.kl_boost_shape))
            metrics["coverage/kl_boost"] = self.kl_boost
            if kl_tokens > 0:  # a step with no far row (every row covered or judged by a rule) logs none
                metrics["coverage/far_kl"] = far_kl
        return {**metrics, "coverage/low": self.low, "coverage/high": self.high,
                "perf/coverage_cached_prompts": float(len(self.cache)),  # a cache, not state: not resumed
                "coverage/learned_reward": reward_sum / weight if weight > 0 else nan}

    def act(self, factors: StepFactors) -> StepFactors:
        if self.holds():
            return dataclasses.replace(factors, learned_trust=self.trust)
        # released: the pair stream (DPO, its anchor, the replay) weighs released_pairs times what the balance set,
        # and every row's KL released_kl times w_kl (a step factor, not a column: the logged table shows it)
        return dataclasses.replace(factors, learned_trust=self.trust, pairs=factors.pairs * self.released_pairs,
                                   kl=factors.kl * self.released_kl)

    def state_dict(self) -> Dict:
        state = {"low": self.low, "high": self.high}
        if self.kl_boost_target is not None:  # adapted: run state; a constant boost is the config's
            state["kl_boost"] = self.kl_boost
        if self.start_skill == self.start_skill:  # measured once, on the start: run state
            state["start_skill"] = self.start_skill
        return state

    def load_state_dict(self, state: Dict) -> None:
        self.low, self.high = state["low"], state["high"]
        if "start_skill" in state:  # the start's skill as measured when the run began (not the resumed policy's)
            self.start_skill = state["start_skill"]
            self.kl_boost = self.config_boost if self.holds() else 0.0
        if self.kl_boost_target is not None and self.holds():  # adapted (a checkpoint from before resumes at kl_boost)
            self.kl_boost = state.get("kl_boost", self.kl_boost)
