"""The phases of one HPA step, each a function of what it reads: the step's ``RolloutBatch`` (where it
writes its per-row results), the models it runs, and the ``StepContext``. ``loop.HPATrainer.train_step``
calls them in order; the loss closures they hand the pipeline schedule are ``hpa.trainer.objective``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from hpa.algorithms import advantages as adv_lib
from hpa.algorithms.coverage import KL_BOOST_SHAPE, abstention_kl_weights
from hpa.algorithms.kl import apply_kl_penalty
from hpa.algorithms import rollout_correction as correction_lib
from hpa.config.algorithm import AlgorithmConfig
from hpa.config.schema import Config, TrainerConfig, component_advantages, old_log_probs_from_update
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.engine import forward
from hpa.engine.batching import Batching
from hpa.engine.micro_batch import MicroBatch
from hpa.engine.optimizer import Trainable
from hpa.engine.step import (add_grads, forward_backward, gradient_norm, guarded_optimizer_step, optimizer_step,
                             snapshot_grads, zero_grad)
from hpa.reward import RewardInputs
from hpa.rollout.base import RolloutBatch, logprob_consistency
from hpa.trainer import micro_batches, objective
from hpa.trainer.objective import Controllers, StepFactors, StepSignals, StepWeights


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepContext:
    """What every phase reads besides its models: config sections, never the root config.

    Args:
        groups: the run's parallel groups.
        algorithm: the ``algorithm`` section (the losses, the advantages, the in-reward KL).
        trainer: the ``trainer`` section (PPO epochs and mini-batches).
        batching: how the step's rows are cut into micro-batches.
        vocab_size: the tokenizer's vocabulary; the embedding rows beyond it (``model.vocab_size`` and
            megatron's padding) are never sampled and never normalised over, in rollout and training alike.
        temperature: the rollout temperature (1 for greedy), which the training log-probs use too.
        hidden_size: the policy's hidden size (the pooled hidden states the semantic KL reads).
        reward_shares: the rule and learned shares of per-component advantages (``component_shares``), None
            when the advantage is computed from the whole reward.
        timer: ``timer(name)`` is a context manager adding the block's wall time to ``timing_s/<name>``.
        old_from_update: the step is on-policy (``hpa.config.schema.old_log_probs_from_update``): no old-policy
            forward; the update's forward gives the old log-probs.
    """

    groups: ParallelGroups
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    batching: Batching
    vocab_size: int
    temperature: float
    hidden_size: int
    reward_shares: Optional[Dict[str, float]] = None
    timer: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()
    old_from_update: bool = False

    @classmethod
    def from_config(cls, cfg: Config, groups: ParallelGroups, *, vocab_size: int, pad_id: int,
                    timer: Optional[Callable[[str], contextlib.AbstractContextManager]] = None) -> "StepContext":
        """The context of a run: its sections picked from ``cfg`` here, once."""
        return cls(groups=groups, algorithm=cfg.algorithm, trainer=cfg.trainer,
                   batching=Batching.from_config(cfg.trainer, pad_id), vocab_size=vocab_size,
                   temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
                   hidden_size=cfg.model.hidden_size,
                   reward_shares=component_shares(cfg.reward) if component_advantages(cfg) else None,
                   old_from_update=old_log_probs_from_update(cfg),
                   **({"timer": timer} if timer is not None else {}))


def reference_and_old_policy(batch: RolloutBatch, reference, policy, ctx: StepContext) -> Dict[str, float]:
    """Reference and rollout-policy log-probs ``[b, r]`` and response-pooled hidden states ``[b, h]``
    (``ref_*``, ``old_*``), and the rollout correction when configured (``rollout_correction``).

    On an on-policy step (``ctx.old_from_update``) only the reference runs: ``update_policy`` sets
    ``old_log_probs`` from its own forward and ``old_policy_metrics`` follows it."""
    kw = dict(batching=ctx.batching, vocab_size=ctx.vocab_size, temperature=ctx.temperature,
              hidden_size=ctx.hidden_size, lengths=batch.sequence_lengths)
    with ctx.timer("reference"):
        ref = forward.sequence_log_probs(reference, batch.sequences, batch.response_mask, ctx.groups, **kw)
    batch.set("ref_log_probs", ref["log_probs"]).set("ref_pooled", ref["pooled"])
    metrics = {"perf/forward_tokens": float(batch.sequence_lengths.sum())}  # this rank's, in each forward pass
    if ctx.old_from_update:
        return comm.reduce_metrics(metrics, ctx.groups.dp_group)
    with ctx.timer("old_logprob"):
        old = forward.sequence_log_probs(policy, batch.sequences, batch.response_mask, ctx.groups, **kw)
    batch.set("old_log_probs", old["log_probs"]).set("old_pooled", old["pooled"])
    metrics.update(logprob_consistency(batch.log_probs, old["log_probs"], batch.response_mask))
    metrics = comm.reduce_metrics({k: float(v) for k, v in metrics.items()}, ctx.groups.dp_group)
    if ctx.algorithm.rollout_correction.enabled:
        metrics.update(rollout_correction(batch, old["log_probs"], ctx))
    return metrics


def rollout_correction(batch: RolloutBatch, old_log_probs: torch.Tensor, ctx: StepContext) -> Dict[str, float]:
    """The off-policy correction of the rollout (``algorithm.rollout_correction``) from the old policy's log-probs
    (π_old, the proximal policy) ``[b, r]`` and the ones the engine recorded when it sampled (π_behaviour,
    ``batch.log_probs``): the importance weights ``is_weights`` ``[b, r]`` (with ``rollout_is``), which the PPO
    and KL terms read, and the tokens the rejection and the veto keep ``rollout_kept`` ``[b, r]`` (with either),
    which ``compute_advantages`` applies to the loss mask. Returns verl's ``rollout_corr/`` metrics of the step's
    rows on every DP rank (as verl computes them over its whole batch), the same on every rank."""
    options = correction_lib.RolloutCorrection(**dataclasses.asdict(ctx.algorithm.rollout_correction))
    (weights, kept), metrics = correction_lib.rollout_correction(old_log_probs, batch.log_probs,
                                                                 batch.response_mask, options)
    if weights is not None:
        batch.set("is_weights", weights)
    if ctx.algorithm.rollout_correction.rejects:
        batch.set("rollout_kept", kept.to(batch.response_mask.dtype))
    if ctx.groups.data_parallel_size > 1:
        rows = gather_rows([old_log_probs, batch.log_probs, batch.response_mask], ctx.groups.dp_group)
        _, metrics = correction_lib.rollout_correction(*rows, options)
    return {k: float(v) for k, v in metrics.items()}


def gather_rows(tensors: List[torch.Tensor], group) -> List[torch.Tensor]:
    """Each ``[b, r]`` tensor's rows of every rank of ``group``, in rank order ``[sum b, max r]`` (zero-padded on
    the right where a rank's ``r`` is shorter; ranks may hold different numbers of rows)."""
    b, r = tensors[0].shape
    sizes = comm.all_gather_cat(torch.tensor([[b, r]], dtype=torch.int64), group)  # [n, 2]
    max_b, max_r = (int(v) for v in sizes.max(dim=0).values)
    rows = torch.cat([i * max_b + torch.arange(int(n)) for i, n in enumerate(sizes[:, 0])])
    return [comm.all_gather_cat(torch.nn.functional.pad(t, (0, max_r - r, 0, max_b - b)), group)[rows]
            for t in tensors]


def old_policy_metrics(batch: RolloutBatch, ctx: StepContext) -> Dict[str, float]:
    """On an on-policy step, after the update has set ``old_log_probs``: the rollout/training log-prob metrics
    that ``reference_and_old_policy`` gives on the other steps."""
    metrics = logprob_consistency(batch.log_probs, batch.get("old_log_probs"), batch.response_mask)
    return comm.reduce_metrics({k: float(v) for k, v in metrics.items()}, ctx.groups.dp_group)


class _UpdateLogProbs:
    """The update forward's log-probs of a batch's rows ``[b, r]``, detached, filled micro-batch by micro-batch
    (each carries its rows' ``row_ids``)."""

    def __init__(self, batch: RolloutBatch):
        self.log_probs: Optional[torch.Tensor] = None
        self.seen: Optional[torch.Tensor] = None  # [b] bool
        self.shape = (batch.batch_size, batch.response_mask.shape[1])

    def __call__(self, mb: MicroBatch, outputs: Dict[str, torch.Tensor]) -> None:
        logp = outputs["log_probs"].detach()  # [n, r]
        if self.log_probs is None:
            self.log_probs = logp.new_zeros(self.shape)
            self.seen = torch.zeros(self.shape[0], dtype=torch.bool, device=logp.device)
        rows = mb["row_ids"].to(logp.device)
        self.log_probs[rows] = logp
        self.seen[rows] = True

    def result(self) -> torch.Tensor:
        """``[b, r]`` on the host, where the batch's per-row tensors are (as ``forward.forward_only`` gives them)."""
        if self.log_probs is None or not bool(self.seen.all()):
            raise RuntimeError("the update's forward did not give every rollout row's log-probs")
        return self.log_probs.cpu()


def score(batch: RolloutBatch, ground_truths, reward, tokenizer, ctx: StepContext) -> Dict[str, float]:
    """Shaped reward at each response's last token (``token_scores``), per row (``shaped_rewards``, and
    ``raw_rewards``: r̂ before shaping; with per-component advantages ``rule_judged``, the rows a rule reward
    scores: a rule is configured and the prompt has a ground truth) and the loss ``mask``: rows with a non-finite reward get an all-zero
    mask, so they reach no loss and move no baseline (``hpa.trainer.rollout_filter`` zeroes the rows it
    drops the same way)."""
    shaped = reward(RewardInputs.from_batch(batch, tokenizer, ground_truths),
                    policy_embeddings=batch.extras.get("old_pooled"),  # none on an on-policy step
                    all_gather=lambda t: comm.all_gather_cat(t, ctx.groups.dp_group))
    valid = shaped.valid
    batch.set("rule_scores", shaped.rule)
    if ctx.reward_shares is not None:  # which rows a rule judges: a rule is configured and the prompt has a truth
        truths = ground_truths if ground_truths is not None else [None] * batch.batch_size
        judged = [ctx.reward_shares["rule"] > 0 and truth is not None for truth in truths]
        batch.set("rule_judged", torch.tensor(judged, dtype=torch.bool, device=valid.device))
    batch.set("mask", batch.response_mask * valid[:, None].float()).set("token_scores", shaped.token_level_scores)
    batch.set("shaped_rewards", shaped.rewards.float())
    batch.set("raw_rewards", torch.where(valid, shaped.raw.float(), torch.zeros_like(shaped.rewards.float())))
    metrics = {k: float(v) for k, v in shaped.metrics.items()}
    return comm.reduce_metrics(metrics, ctx.groups.dp_group)


def critic_values(batch: RolloutBatch, critic, ctx: StepContext) -> None:
    """The critic's values ``[b, r]`` of the rollout (``values``)."""
    batch.set("values", forward.sequence_values(critic, batch.sequences, ctx.groups, batching=ctx.batching,
                                                lengths=batch.sequence_lengths))


def apply_row_factors(batch: RolloutBatch, factors: StepFactors, *, kl_boost_shape: str = KL_BOOST_SHAPE) -> None:
    """The step's per-row factors on its rollouts: each row's ``learned_trust`` ``[b]`` (the factor's function of
    the batch; the advantages read it) and, where the far rows are held (``far_kl_boost`` > 0), each row's
    ``kl_weights`` ``[b]`` (``abstention_kl_weights``; a row a rule judges, ``rule_judged``, keeps 1). Nothing
    without a ``learned_trust``. ``kl_boost_shape``: ``KL_BOOST_SHAPE``, an argument for the tests."""
    if factors.learned_trust is None:
        return
    trust = factors.learned_trust(batch)  # [b]
    batch.set("learned_trust", trust)
    if factors.far_kl_boost > 0:
        judged = batch.extras.get("rule_judged")
        batch.set("kl_weights", abstention_kl_weights(trust, factors.far_kl_boost, judged=judged, shape=kl_boost_shape))


def compute_advantages(batch: RolloutBatch, ctx: StepContext, reward_kl_coef: float,
                       learned_weight: float = 1.0) -> Dict[str, float]:
    """Token rewards (the batch's ``token_scores``, minus the in-reward KL when configured) ->
    ``advantages`` and ``returns`` ``[b, r]``, under the batch's loss ``mask``; then the tokens the rollout
    correction rejects (``rollout_kept``, when present) leave the loss ``mask``: the advantages (group baselines,
    GAE) see every scored token, the losses (PPO, entropy, KL, value) only the kept ones.

    With ``algorithm.advantage.per_component`` the rule reward (``rule_scores``) and the learned rest of
    the shaped reward are group-normalised apart and added with their shares of the reward weights
    (``reward.rule_weight`` : 1 for the reward models), the learned share times ``learned_weight`` (the
    trust gate) and each learned row times its ``learned_trust`` when the batch has one (the coverage
    trust); the in-reward KL penalty enters centred within its group, ungated.
    """
    algo = ctx.algorithm
    metrics: Dict[str, float] = {}
    mask, token_scores = batch.get("mask"), batch.get("token_scores")
    rewards = token_scores
    if algo.kl.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_penalty(token_scores, batch.get("old_log_probs"),
                                               batch.get("ref_log_probs"), mask, reward_kl_coef,
                                               kind=algo.kl.reward_estimator)
        metrics.update({f"actor/{k}": float(v) for k, v in kl_metrics.items()})
    # a row masked out (non-finite reward, filtered) is its own group, so it cannot move a group baseline
    valid = mask.sum(dim=1) > 0
    group_ids = torch.where(valid, batch.group_ids, -1 - torch.arange(batch.batch_size))
    a = algo.advantage
    if ctx.reward_shares is not None:
        rule = batch.get("rule_scores")  # [b]
        learned = token_scores.sum(dim=1) - rule  # [b]
        shares = ctx.reward_shares
        advantages, returns = adv_lib.compute_component_advantages(
            [rule, learned], [shares["rule"], shares["learned"] * learned_weight], mask, group_ids,
            offset=(rewards - token_scores).sum(dim=1), row_weights=[None, batch.extras.get("learned_trust")],
            norm_by_std=a.norm_by_std, epsilon=a.epsilon)
        metrics["hpa/learned_share"] = shares["learned"] * learned_weight
    else:
        advantages, returns = adv_lib.compute_advantages(a.estimator, rewards, mask,
                                                         values=batch.extras.get("values"), group_ids=group_ids,
                                                         gamma=a.gamma, lam=a.lam, norm_by_std=a.norm_by_std,
                                                         epsilon=a.epsilon)
    batch.set("advantages", advantages * mask).set("returns", returns)
    kept = batch.extras.get("rollout_kept")
    if kept is not None:  # the rollout correction's rejection and veto: out of every rollout term from here on
        batch.set("mask", mask * kept.to(mask.dtype))
    return metrics


def component_shares(reward_cfg) -> Dict[str, float]:
    """The shares of the rule and the learned components of the advantage: the reward weights
    (``reward.rule_weight`` for the rules, 1 for the reward models) over their sum; a source that is
    not configured has share 0 (the shaping terms alone still form the learned component)."""
    rule = reward_cfg.rule_weight if (reward_cfg.rules or reward_cfg.custom_function is not None) else 0.0
    learned = 1.0 if reward_cfg.model_paths or rule == 0.0 else 0.0
    total = rule + learned
    return {"rule": rule / total, "learned": learned / total}


def reference_pair_log_probs(examples, reference, ctx: StepContext) -> torch.Tensor:
    """The reference's summed response log-probs of each pair ``[m, 2]`` (chosen, rejected), on every rank.

    Each pair is a micro-batch of its own, so its values depend on the pair alone: matmul kernels round
    differently for different batch shapes (about 1e-6 on CPU), and which pairs share a micro-batch
    changes every step. The reference log-prob cache (``hpa.trainer.reference_cache``) stores what this
    returns, so cached and live values are the same bits.
    """
    mbs = micro_batches.preference_micro_batches(examples, ctx.batching, micro_batch_size=1)
    rows = forward.pair_sequence_log_probs(reference, mbs, ctx.groups, vocab_size=ctx.vocab_size)  # [2m]
    return torch.stack([rows[:len(examples)], rows[len(examples):]], dim=1)  # every chosen row, then every rejected


def preference_micro_batches(examples, reference, ctx: StepContext,
                             ref_log_probs: Optional[torch.Tensor] = None) -> List[MicroBatch]:
    """This step's preference pairs as pair micro-batches, with the reference's summed log-probs: the
    cached ones ``ref_log_probs`` ``[m, 2]`` (chosen, rejected) when given, else from a reference forward."""
    if ref_log_probs is None:
        ref_log_probs = reference_pair_log_probs(examples, reference, ctx)
    return micro_batches.preference_micro_batches(examples, ctx.batching, ref_log_probs,
                                                  min_count=num_mini_batches(ctx.trainer),
                                                  dp_group=ctx.groups.dp_group)


def replay_micro_batches(examples, ctx: StepContext) -> List[MicroBatch]:
    """This step's replayed SFT examples as replay micro-batches (cut as the pairs are)."""
    return micro_batches.sft_micro_batches(examples, ctx.batching, kind="replay",
                                           min_count=num_mini_batches(ctx.trainer), dp_group=ctx.groups.dp_group)


def num_mini_batches(trainer: TrainerConfig) -> int:
    """Optimizer updates per PPO epoch: the offline streams' micro-batches are dealt over them, so each stream has at
    least that many (where it has the rows)."""
    return trainer.global_batch_size // trainer.ppo_mini_batch_size if trainer.ppo_mini_batch_size else 1


def _mini_batches(batch: Optional[RolloutBatch], ctx: StepContext) -> Iterator[Tuple[int, int, List[MicroBatch]]]:
    """Per PPO epoch and mini-batch: its index, the number of mini-batches and the rollout micro-batches
    of its rows (none when ``batch`` is None: a pairs-only step)."""
    t = ctx.trainer
    minis = micro_batches.mini_batches(batch.batch_size if batch is not None else 0, num_mini_batches(t))
    for _ in range(t.ppo_epochs):
        for index, rows in enumerate(minis):
            yield index, len(minis), micro_batches.rollout_micro_batches(
                batch, rows, ctx.batching, ctx.groups.dp_group) if rows else []


def update_policy(batch: Optional[RolloutBatch], offline: List[MicroBatch], weights: StepWeights, policy: Trainable, guard,
                  ctx: StepContext, *, wrap_loss=lambda loss_fn: loss_fn,
                  controllers: Optional[Controllers] = None) -> Dict[str, float]:
    """``ppo_epochs`` x mini-batches of optimizer updates at this step's LR, the micro-batches of the offline
    streams (``offline``: the preference pairs, ...) dealt round-robin over the mini-batches; the LR schedule then advances once per HPA step (as verl's),
    whatever the number of updates in it. ``guard`` decides what a non-finite or spiking gradient does.
    The metrics carry ``_tokens`` and ``_padded_tokens``: this rank's real tokens and the positions its
    updates computed (``tokens_computed``), and ``hpa/pairs_factor``, the factor the last update scaled the
    pair stream by (the balance's times the coverage trust's ``released_pairs`` where it releases the hold).
    On an on-policy step (``ctx.old_from_update``) the PPO term's old log-probs are the update forward's own,
    detached, and the batch gets them as ``old_log_probs`` ``[b, r]`` after the update.

    Args:
        weights: the step's weights and factors (the ``pairs`` factor scales the pair stream).
        wrap_loss: applied to each update's loss closure (fault injection).
        controllers: the run's controllers: while one that observes ``gradients`` (the automatic balance)
            measures, an update with both rollout and pair micro-batches runs them as two backward passes,
            updates it with their gradient norms (its new factors apply from then on) and logs
            ``grad_norm/rollout`` and ``grad_norm/pairs``; otherwise the offline micro-batches ride in the
            rollout ones where both fit the token budget (``micro_batches.ride_along``, packed).
    """
    steps, grad_norms = [], []
    tokens = computed = 0.0
    lr = policy.optimizer.param_groups[0]["lr"]
    update_log_probs = None
    if ctx.old_from_update and batch is not None:  # on-policy: this update's forward gives the old log-probs
        batch.set("row_ids", torch.arange(batch.batch_size, device=batch.response_mask.device))
        update_log_probs = _UpdateLogProbs(batch)
    for index, num_minis, rollout_mbs in _mini_batches(batch, ctx):
        offline_mbs = offline[index::num_minis]
        real, positions = tokens_computed(rollout_mbs + offline_mbs)
        tokens, computed = tokens + real, computed + positions
        counts = objective.global_counts(rollout_mbs, offline_mbs, ctx.groups)
        split = controllers is not None and controllers.measuring("gradients") and bool(rollout_mbs) \
            and bool(offline_mbs)
        # a measured update scales the pair gradients after both backward passes, not inside the loss
        loss_weights = weights.with_factors(dataclasses.replace(weights.factors, pairs=1.0)) if split else weights
        loss_fn = wrap_loss(objective.make_policy_loss(ctx.algorithm, loss_weights, counts, ctx.groups,
                                                       vocab_size=ctx.vocab_size, temperature=ctx.temperature,
                                                       observe_rollout=update_log_probs))
        zero_grad(policy.model, policy.optimizer)
        if split:
            records, norms = _measured_backward(policy, rollout_mbs, offline_mbs, loss_fn, ctx)
            controllers.update("gradients", StepSignals(weights=weights, grad_norms={
                "rollout": norms["grad_norm/rollout"], "pairs": norms["grad_norm/pairs"]}))
            weights = weights.with_factors(controllers.factors())
            add_grads(policy.model, norms.pop("_rollout_grads"), scale=weights.factors.pairs)
            records.append(norms)
        else:  # the balance frozen (or off): offline rows ride in the rollout micro-batches where they fit
            mbs = micro_batches.ride_along(rollout_mbs, offline_mbs, ctx.batching.update_token_budget,
                                           ctx.groups.dp_group)
            records = forward_backward(policy.model, mbs, loss_fn, ctx.groups, capture_hidden=True,
                                       hidden_head=True)
        updated, grad_norm = guarded_optimizer_step(policy.optimizer, None, guard.grad_norm_action,
                                                    guard.spike_clip_value)
        guard.record(updated)
        steps.append(objective.step_metrics(records, ctx.groups))
        grad_norms.append(grad_norm)
    if update_log_probs is not None:
        batch.set("old_log_probs", update_log_probs.result())
    metrics = objective.average(steps)
    finite = [g for g in grad_norms if math.isfinite(g)]
    metrics["actor/grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
    metrics["actor/lr"] = lr
    metrics["hpa/pairs_factor"] = weights.factors.pairs  # what the last update scaled the pair stream by
    metrics["_tokens"], metrics["_padded_tokens"] = tokens, computed
    if controllers is not None:
        metrics.update(controllers.metrics())
    policy.scheduler.step(increment=1)
    return metrics


def _measured_backward(policy: Trainable, rollout_mbs: List[MicroBatch], pair_mbs: List[MicroBatch], loss_fn,
                       ctx: StepContext) -> Tuple[List[Dict], Dict]:
    """The rollout and the pair micro-batches as two backward passes; the pair gradients stay in the
    buffers, the rollout ones come back as a snapshot, with both groups' gradient norms."""
    records = forward_backward(policy.model, rollout_mbs, loss_fn, ctx.groups, capture_hidden=True, hidden_head=True)
    rollout_norm = gradient_norm(policy.optimizer)
    saved = snapshot_grads(policy.model)
    zero_grad(policy.model, policy.optimizer)
    records += forward_backward(policy.model, pair_mbs, loss_fn, ctx.groups, capture_hidden=True, hidden_head=True)
    pairs_norm = gradient_norm(policy.optimizer)
    return records, {"grad_norm/rollout": rollout_norm, "grad_norm/pairs": pairs_norm, "_rollout_grads": saved}


def update_critic(batch: RolloutBatch, critic: Trainable, ctx: StepContext) -> Dict[str, float]:
    """The clipped value loss over the same epochs and mini-batches as the policy's update."""
    steps = []
    for _, _, mbs in _mini_batches(batch, ctx):
        counts = objective.global_counts(mbs, [], ctx.groups)
        zero_grad(critic.model, critic.optimizer)
        records = forward_backward(critic.model, mbs, objective.make_critic_loss(ctx.algorithm, counts),
                                   ctx.groups)
        optimizer_step(critic.optimizer)
        steps.append(objective.step_metrics(records, ctx.groups))
    critic.scheduler.step(increment=1)  # once per HPA step, as the policy's
    return objective.average(steps)


def tokens_computed(micro_batches: List[MicroBatch]) -> Tuple[float, float]:
    """Real tokens of ``micro_batches`` and the positions the model computes for them (padding included;
    packed, the two are equal) (``perf/``)."""
    return (float(sum(mb.tokens for mb in micro_batches)),
            float(sum(mb.computed_tokens for mb in micro_batches)))
