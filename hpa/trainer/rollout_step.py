"""The rollout stream of an HPA step: roll out (through the versioned rollout queue, ``hpa/rollout/queue.py``)
→ reference / old-policy forwards → shaped reward →
rollout filter (with DAPO's refill: more rounds of the three before it) → critic values → the controllers
that observe the rollouts → advantages; after the policy update, the critic update and the length
metrics. A run whose ``w_ppo`` is 0 throughout is plain DPO and spends no rollouts (``NoRollouts``).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from hpa.distributed import comm
from hpa.rollout.base import RolloutBatch, SamplingParams
from hpa.rollout.queue import RolloutQueue, rollout_batch, rollout_entry
from hpa.trainer import faults, phases, rollout_filter
from hpa.trainer.metrics import length_metrics
from hpa.trainer.objective import StepSignals, StepWeights


class RolloutStep:
    """The step's rollouts (``collect``), and what follows the policy update on them (``finish``)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.cfg, self.groups, self.parts, self.ctx = trainer.cfg, trainer.groups, trainer.parts, trainer.ctx
        self.observed_weights: Optional[StepWeights] = None
        # the hand-over from sampling to training; at max_staleness 0 (the only value the schema accepts
        # until the asynchronous loop is wired) every rollout is taken back as soon as it is put, so the queue
        # is empty between steps and a checkpoint needs nothing of it
        self.queue = RolloutQueue(self.cfg.rollout.max_staleness)  # its version follows the run state: through_queue

    def collect(self, weights: StepWeights) -> Tuple[RolloutBatch, Dict[str, float], StepWeights]:
        """This step's scored, filtered rollouts with their advantages (and values), their metrics, and the
        step weights with the factors of the controllers that observed them."""
        p, ctx, step = self.parts, self.ctx, self.trainer.state.step
        reward = faults.nan_first_reward(p.reward) if faults.active("nan_reward", step + 1, self.groups.rank) \
            else p.reward
        batch, metrics = self.scored_rollout(reward)
        batch, filter_metrics = rollout_filter.apply(batch, self.cfg.algorithm.rollout_filter, self.groups,
                                                     lambda r: self.scored_rollout(reward, refill_round=r)[0])
        metrics.update(filter_metrics)
        if p.critic is not None:
            with ctx.timer("values"):
                phases.critic_values(batch, p.critic.model, ctx)
        controllers = self.trainer.controllers
        self.observed_weights = weights  # what the controllers that observe after the update read
        observed = controllers.update("rollouts", StepSignals(batch=batch, metrics=metrics, weights=weights))
        weights = weights.with_factors(controllers.factors())
        metrics.update(phases.compute_advantages(batch, ctx, weights.reward_kl_coef,
                                                 weights.factors.learned_advantage))
        # after the advantages' metrics: the KL controller's actor/reward_kl (the DP mean) is the one logged
        metrics.update(observed)
        metrics.update(self.queue_metrics())
        return batch, metrics, weights

    def queue_metrics(self) -> Dict[str, float]:
        """The step's ``async/lag_max`` (max over DP ranks) and the rows dropped as too old (summed)."""
        queued = self.queue.metrics()
        metrics = comm.reduce_metrics({"async/lag_max": queued["async/lag_max"]}, self.groups.dp_group, op="max")
        metrics.update(comm.reduce_metrics({"async/dropped_rows": queued["async/dropped_rows"]},
                                           self.groups.dp_group, op="sum"))
        return metrics

    def finish(self, batch: RolloutBatch) -> Dict[str, float]:
        """The critic update and the response-length metrics, after the policy update; on an on-policy step
        (``ctx.old_from_update``) first what reads the old log-probs the update gave: the rollout/training
        log-prob metrics and the controllers that observe ``updated_rollouts`` (the KL controller)."""
        metrics: Dict[str, float] = {}
        if self.ctx.old_from_update:
            metrics.update(phases.old_policy_metrics(batch, self.ctx))
            metrics.update(self.trainer.controllers.update("updated_rollouts", StepSignals(
                batch=batch, metrics={}, weights=self.observed_weights)))
        if self.parts.critic is not None:
            with self.ctx.timer("update_critic"):
                metrics.update(phases.update_critic(batch, self.parts.critic, self.ctx))
        metrics.update(length_metrics(batch.response_lengths, self.cfg.rollout.max_new_tokens, self.groups.dp_group))
        return metrics

    def scored_rollout(self, reward, refill_round: int = 0):
        """One round of the step's rollouts: prompts from the sampler, responses, the reference and
        old-policy forwards, the reward. Round 0 is the step's; the rollout filter asks for more
        (``refill_round`` 1, 2, ...). Returns ``(batch, metrics)``."""
        p, ctx = self.parts, self.ctx
        examples = [p.prompts[i] for i in p.prompt_sampler.next_batch()]
        with ctx.timer("rollout"):
            batch = self.rollout([e.prompt_ids for e in examples], refill_round)
        metrics = phases.reference_and_old_policy(batch, p.reference, p.policy.model, ctx)
        metrics.update(p.engine.decode_metrics())  # which decode ran (bench/gpu_check.py fails on a fallback)
        with ctx.timer("reward"):
            truths = [examples[int(i)].ground_truth for i in batch.group_ids]
            metrics.update(phases.score(batch, truths, reward, p.tokenizer, ctx))
        return batch, metrics

    def rollout(self, prompt_ids, refill_round: int = 0) -> RolloutBatch:
        g = self.groups
        # a refill round's seed is far from every step's first round (a prime stride)
        seed = self.cfg.rollout.seed + self.trainer.state.step * g.data_parallel_size + g.dp_rank \
            + refill_round * 1_000_003
        batch = generate(self.parts, self.ctx, prompt_ids, SamplingParams.from_config(self.cfg.rollout, seed=seed))
        return self.through_queue(batch)

    def through_queue(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch``, sampled by the current policy (version: the optimizer steps so far), put into the queue
        and taken back: what the trainer gets is never older than ``rollout.max_staleness`` versions."""
        step = self.trainer.state.step
        if step < self.queue.version:  # the guard rolled back to an earlier checkpoint
            self.queue.rewind(step)
        self.queue.advance(step)
        self.queue.put(rollout_entry(batch, step))
        (entry,) = self.queue.get()  # at staleness 0: exactly the rollout just put
        return rollout_batch(entry)


class NoRollouts:
    """The rollout stream of a pairs-only run (``w_ppo`` 0 throughout): no batch, no metrics."""

    def __init__(self, trainer):
        pass

    def collect(self, weights: StepWeights) -> Tuple[Optional[RolloutBatch], Dict[str, float], StepWeights]:
        return None, {}, weights

    def finish(self, batch) -> Dict[str, float]:
        return {}


def generate(parts, ctx, prompt_ids, params: SamplingParams) -> RolloutBatch:
    """Responses from the rollout engine on the policy's current weights (vLLM keeps a copy: synced
    here, every time, a no-op for the native engine); the engine sleeps after, so training gets its
    memory back."""
    model, engine = parts.policy.model, parts.engine
    model.eval()
    with torch.no_grad():
        with ctx.timer("sync_weights"):
            engine.sync_weights()
        try:
            batch = engine.generate(prompt_ids, params)
        finally:
            engine.sleep()
    model.train()
    return batch
