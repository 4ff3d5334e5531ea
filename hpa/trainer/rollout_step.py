"""The rollout stream of an HPA step: roll out (through the versioned rollout queue, ``hpa/rollout/queue.py``;
at ``rollout.max_staleness`` k >= 1 sampled one step ahead by a ``RolloutWorker``, ``hpa/rollout/worker.py``;
disaggregated, at every k, by rollout ranks of their own through a ``RemoteRolloutWorker``, ``hpa/rollout/remote.py``)
→ reference / old-policy forwards → shaped reward →
rollout filter (with DAPO's refill: more rounds of the three before it) → critic values → the controllers
that observe the rollouts → advantages; after the policy update, the critic update and the length
metrics. A run whose ``w_ppo`` is 0 throughout is plain DPO and spends no rollouts (``NoRollouts``).

Resume at k >= 1 is exact: a checkpoint holds, per DP rank, the prompts drawn for the steps ahead and the rows
the worker sampled for them (it waits for them), sampled by the policy before the checkpoint's, and the
queue's counters. Re-sampling them after a resume could not give the same rows: the weights that sampled them
are not in the checkpoint. A rollback restores them as a resume does.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from hpa.config.errors import ConfigError
from hpa.distributed import comm
from hpa.rollout.base import RolloutBatch, SamplingParams
from hpa.rollout.queue import RolloutQueue, VersionedRollout, rollout_batch, rollout_entry
from hpa.rollout.remote import RemoteRolloutWorker
from hpa.rollout.worker import RolloutWorker, WorkerResult, check_delivery, checksum
from hpa.trainer import faults, phases, rollout_filter
from hpa.trainer.metrics import length_metrics
from hpa.trainer.objective import StepSignals, StepWeights

logger = logging.getLogger("hpa")

# steps the worker samples ahead of the update: one keeps every trained row at most one version old and hides
# generation behind training (or the reverse); tests raise it past k to make rows stale (``steps_ahead``)
STEPS_AHEAD = 1


class RolloutStep:
    """The step's rollouts (``collect``), and what follows the policy update on them (``finish``)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.cfg, self.groups, self.parts, self.ctx = trainer.cfg, trainer.groups, trainer.parts, trainer.ctx
        self.observed_weights: Optional[StepWeights] = None
        # the hand-over from sampling to training; at max_staleness 0 every rollout is taken back as soon as it
        # is put, so the queue is empty between steps and a checkpoint needs nothing of it
        self.queue = RolloutQueue(self.cfg.rollout.max_staleness)  # its version follows the run state: through_queue
        self.worker: Optional[RolloutWorker] = None
        self.ahead: Dict[int, List[int]] = {}  # step -> the prompt indices submitted to the worker for it
        self.finished: Dict[int, WorkerResult] = {}  # step -> its job's result, taken from the worker at a save
        # step -> a checkpoint's (prompt indices, rows; None: to be sampled), until drawn
        self.restored: Dict[int, Tuple[List[int], Optional[WorkerResult]]] = {}
        self.collected: Optional[int] = None  # the last step whose rows the worker gave
        if self.groups.placement is not None:  # disaggregated: the rollout ranks sample, at every k
            self.worker = RemoteRolloutWorker(self.groups.placement,
                                              [n for n, _ in self.parts.engine.module.named_parameters()],
                                              partial=self.cfg.rollout.partial)
        elif self.cfg.rollout.max_staleness > 0:
            if not self.parts.engine.has_async_worker:  # the schema refuses it; an engine registered later too
                raise ConfigError("rollout.max_staleness", f"{self.cfg.rollout.max_staleness} needs an engine with "
                                  f"an asynchronous worker; {self.parts.engine.name!r} has none")
            engine = self.parts.engine.detached_copy()
            self.worker = RolloutWorker(engine, engine.module, version=-1,  # the first push sets the weights
                                        partial=self.cfg.rollout.partial)

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
        heldout = None
        if controllers.reads("rollouts", "heldout_nll"):  # the heldout_nll gate's signal, on the policy as it is
            with ctx.timer("gate"):
                heldout = self.trainer.heldout_nll()
        observed = controllers.update("rollouts", StepSignals(batch=batch, metrics=metrics, weights=weights,
                                                              heldout_nll=heldout))
        weights = weights.with_factors(controllers.factors())
        phases.apply_row_factors(batch, weights.factors)  # the coverage trust's per-row weights
        metrics.update(phases.compute_advantages(batch, ctx, weights.reward_kl_coef,
                                                 weights.factors.learned_advantage))
        # after the advantages' metrics: the KL controller's actor/reward_kl (the DP mean) is the one logged
        metrics.update(observed)
        metrics.update(self.queue_metrics())
        return batch, metrics, weights

    def queue_metrics(self) -> Dict[str, float]:
        """The step's ``async/lag_max`` (max over DP ranks) and the rows dropped as too old (summed); at k >= 1
        also those discarded at a rollback, and the staleness histogram: ``async/lag_frac_<i>`` (the share of
        trained tokens i versions old, i = 0..k) and ``async/lag_mean``, means over DP ranks."""
        queued = self.queue.metrics()
        metrics = comm.reduce_metrics({"async/lag_max": queued["async/lag_max"]}, self.groups.dp_group, op="max")
        if self.cfg.rollout.max_staleness > 0:
            metrics.update(comm.reduce_metrics({k: v for k, v in queued.items() if k.startswith("async/lag_frac_")
                                                or k == "async/lag_mean"}, self.groups.dp_group))
        counts = {"async/dropped_rows": queued["async/dropped_rows"]}
        if self.cfg.rollout.max_staleness > 0:  # rows sampled ahead and discarded at a rollback
            counts["async/discarded_rows"] = queued["async/discarded_rows"]
        metrics.update(comm.reduce_metrics(counts, self.groups.dp_group, op="sum"))
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
        if self.worker is not None and refill_round == 0:
            with ctx.timer("rollout"):
                examples, batch = self.async_rollout()
        else:  # refill rounds sample now, by the current policy (lag 0)
            examples = [p.prompts[i] for i in p.prompt_sampler.next_batch()]
            with ctx.timer("rollout"):
                batch = self.rollout([e.prompt_ids for e in examples], refill_round)
        metrics = phases.reference_and_old_policy(batch, p.reference, p.policy.model, ctx)
        metrics.update(p.engine.decode_metrics())  # which decode ran (bench/gpu_check.py fails on a fallback)
        with ctx.timer("reward"):
            truths = [examples[int(i)].ground_truth for i in batch.group_ids]
            metrics.update(phases.score(batch, truths, reward, p.tokenizer, ctx))
        return batch, metrics

    def sampling_params(self, step: int, refill_round: int = 0) -> SamplingParams:
        g = self.groups
        # a refill round's seed is far from every step's first round (a prime stride)
        seed = self.cfg.rollout.seed + step * g.data_parallel_size + g.dp_rank + refill_round * 1_000_003
        return SamplingParams.from_config(self.cfg.rollout, seed=seed)

    def rollout(self, prompt_ids, refill_round: int = 0) -> RolloutBatch:
        params = self.sampling_params(self.trainer.state.step, refill_round)
        batch = generate(self.parts, self.ctx, prompt_ids, params)
        return self.through_queue(batch)

    def steps_ahead(self, step: int) -> int:
        """How many steps past ``step`` the worker has prompts for when step ``step`` trains (none at k = 0:
        the disaggregated synchronous loop samples each step's prompts after its push)."""
        return STEPS_AHEAD if self.cfg.rollout.max_staleness > 0 else 0

    def async_rollout(self):
        """Step s's examples and rows at ``max_staleness`` k >= 1: the worker gets version s's weights (after
        step s's job, which sampled during step s−1's update), then the prompts of the steps ahead; step s's
        rows go through the queue, and if they are older than s − k (dropped, counted) version s samples
        step s's prompts again. After a resume or a rollback the checkpoint's prompts and rows ahead are used
        (``draw``). Returns ``(examples, batch)``."""
        step, worker, p = self.trainer.state.step, self.worker, self.parts
        if self.collected is not None and step <= self.collected:
            # the guard rolled back (to this version or an earlier one): what was sampled ahead is discarded, and
            # the restored weights are pushed (and checked) whatever the worker's version says
            worker.drain()
            self.queue.rewind(step)
            self.queue.num_discarded_rows += sum(r.batch.batch_size for r in worker.poll() if r.batch is not None)
            self.ahead.clear()
            worker.version = -1
        self.collected = step
        self.queue.advance(step)
        with self.ctx.timer("push_weights"):
            self.push_weights(step)
        last = min(step + self.steps_ahead(step), self.cfg.trainer.total_steps - 1)
        for target in range(step, last + 1):
            if target not in self.ahead:
                self.ahead[target] = self.draw(target)
        examples = [p.prompts[i] for i in self.ahead.pop(step)]
        taken = self.take(step)
        if not taken:  # too old: dropped and counted; sampled again by this step's policy
            self.submit(step, examples)
            taken = self.take(step)
        (entry,) = taken
        return examples, rollout_batch(entry)

    def draw(self, step: int) -> List[int]:
        """Step ``step``'s prompt indices, and its job: a checkpoint's prompts and rows when it holds them (not
        sampled again), else the sampler's next batch, submitted."""
        p = self.parts
        indices, result = self.restored.pop(step, (None, None))
        if indices is None:
            indices = p.prompt_sampler.next_batch()
        if result is None:
            self.submit(step, [p.prompts[i] for i in indices])
        else:
            self.finished[step] = result
        return list(indices)

    def submit(self, step: int, examples) -> None:
        self.worker.submit([e.prompt_ids for e in examples], self.sampling_params(step), tag=step)

    def take(self, step: int):
        result = self.finished.pop(step, None) or self.worker.wait(step)
        self.queue.put(rollout_entry(result.batch, result.version))
        return self.queue.get(max_rows=1)

    def push_weights(self, version: int) -> None:
        """The policy's weights of ``version`` into the worker, checked: every watched tensor arrived."""
        if self.worker.version == version:
            return
        tensors = dict(self.parts.engine.module.named_parameters())
        sent = {name: checksum(tensors[name]) for name in self.worker.watched}
        check_delivery(version, sent, self.worker.push_weights(version, tensors))

    def state_parts(self) -> Dict[str, object]:
        return {"rollouts": self}

    def state_dict(self) -> Dict[str, object]:
        """What was sampled ahead, for a checkpoint (identical on every rank: each DP rank's part, gathered).
        Waits for the jobs ahead. At ``max_staleness`` 0 nothing is ahead and the queue is empty between steps."""
        if self.worker is None:
            return {"data_parallel_size": self.groups.data_parallel_size, "ranks": None}
        for step in self.ahead:
            if step not in self.finished:
                self.finished[step] = self.worker.wait(step)
        ahead = [{"step": step, "indices": list(indices), "version": self.finished[step].version,
                  "rows": _to(rollout_entry(self.finished[step].batch, self.finished[step].version).to_state(), "cpu")}
                 for step, indices in sorted(self.ahead.items())]
        mine = {"queue": _to(self.queue.state_dict(), "cpu"), "ahead": ahead}
        return {"data_parallel_size": self.groups.data_parallel_size,
                "ranks": comm.all_gather_objects(mine, self.groups.dp_group)}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore ``state_dict``'s prompts and rows ahead (and queue counters) for this DP rank. Under another
        DP size each step's global batch of prompts is split anew and sampled again by the restored policy; at
        ``max_staleness`` 0 the prompts drawn ahead are skipped. Both say so."""
        discarded = sum(r.batch.batch_size for r in self.finished.values() if r.batch is not None)
        self.finished, self.restored = {}, {}  # a rollback: what the lost policies sampled ahead goes
        ranks, g = state["ranks"], self.groups
        steps = [entry["step"] for entry in ranks[0]["ahead"]] if ranks else []
        if ranks and self.worker is None and steps:
            logger.warning("the checkpoint holds prompts drawn ahead for steps %s by rollout.max_staleness >= 1; "
                           "at rollout.max_staleness 0 they are skipped", steps)
        if ranks and self.worker is not None and len(ranks) == g.data_parallel_size:
            mine = ranks[g.dp_rank]
            self.queue.load_state_dict(mine["queue"])
            for entry in mine["ahead"]:
                batch = rollout_batch(VersionedRollout(**_to(entry["rows"], g.device)))
                self.restored[entry["step"]] = (entry["indices"],
                                                WorkerResult(tag=entry["step"], version=entry["version"], batch=batch))
        elif ranks and self.worker is not None:
            if steps:
                logger.warning("the checkpoint's rows sampled ahead for steps %s are from %d DP ranks, this run has "
                               "%d: their prompts are split anew and sampled again by the restored policy", steps,
                               len(ranks), g.data_parallel_size)
            for i, step in enumerate(steps):
                prompts = [index for rank in ranks for index in rank["ahead"][i]["indices"]]  # the global batch
                share = len(prompts) // g.data_parallel_size
                self.restored[step] = (prompts[g.dp_rank * share:(g.dp_rank + 1) * share], None)
            # the counters are summed over DP ranks when logged: DP rank 0 carries the saved ranks' sums
            counters = {name: sum(rank["queue"]["counters"][name] for rank in ranks) if g.dp_rank == 0 else 0
                        for name in ranks[0]["queue"]["counters"]}
            self.queue.load_state_dict(dict(ranks[0]["queue"], entries=[], counters=counters))  # empty between steps
        self.queue.num_discarded_rows += discarded

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

    def state_parts(self) -> Dict[str, object]:
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


def _to(state, device):
    """``state`` (nested dicts and lists) with its tensors on ``device``."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {name: _to(value, device) for name, value in state.items()}
    if isinstance(state, list):
        return [_to(value, device) for value in state]
    return state
