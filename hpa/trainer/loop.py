"""``hpa train``: the HPA loop. ``train_step`` reads top to bottom: it calls the named phases of a
step in order.

One step: roll out → shaped reward → reference / old-policy / critic forwards → advantages →
mixed PPO + DPO + hierarchical-KL update (ppo_epochs × mini-batches) → critic update → KL
controller → metrics → evaluation → checkpoint. Everything per row of the step travels on the
``RolloutBatch``; micro-batching is ``hpa.trainer.micro_batches``; evaluation is
``hpa.trainer.evaluate``; the loss math is ``hpa.trainer.phases``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from hpa.algorithms.kl import kl_penalty, make_kl_controller
from hpa.algorithms.masked import masked_mean
from hpa.algorithms.ppo import truncated_importance_weights
from hpa.algorithms.schedules import progress
from hpa.config import write_resolved
from hpa.config.schema import Config, to_dict
from hpa.data.preferences import PreferenceDataset
from hpa.data.prompts import PromptDataset
from hpa.data.sampler import DistributedBatchSampler
from hpa.data.tokenizer import build_tokenizer
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.distributed.watchdog import StepProgress, is_collective_failure
from hpa.engine import forward
from hpa.engine.optimizer import make_trainable, scale_lr
from hpa.engine.step import forward_backward, guarded_optimizer_step, optimizer_step, zero_grad
from hpa.models import build_policy, build_reference, build_value, unwrap
from hpa.models.weights import load_model_weights
from hpa.reward import RewardInputs, build_reward
from hpa.rollout import build_rollout_engine
from hpa.rollout.base import RolloutBatch, SamplingParams, TokenizerInfo, decode_responses, logprob_consistency
from hpa.trainer import faults, micro_batches, phases
from hpa.trainer.checkpoint import EXIT_SAVE_FAILED, CheckpointManager, CheckpointSaveError
from hpa.trainer.evaluate import Evaluator
from hpa.trainer.guard import Guard
from hpa.trainer.metrics import MetricsWriter, length_metrics, mfu, peak_memory_gb
from hpa.trainer.run_control import RunControl

logger = logging.getLogger("hpa")


class HPATrainer:
    """Owns the models, data and state of one run. Components get their own config sections.

    ``states`` maps a name to every stateful part besides models and optimizers (samplers, schedulers,
    KL controller, guard, reward shaping, hacking monitor); save, restore and rollback loop over it.
    """

    def __init__(self, cfg: Config, groups: ParallelGroups):
        self.cfg, self.groups = cfg, groups
        t = cfg.trainer
        self.run_dir = Path(t.run_dir)
        faults.record_in(self.run_dir)
        if groups.is_main:
            write_resolved(cfg, self.run_dir)
        rejects = cfg.data.rejects_dir or str(self.run_dir / "rejects")
        self.tokenizer = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path,
                                         model_vocab_size=cfg.model.vocab_size)
        # the tokenizer's vocabulary: the embedding rows beyond it (model.vocab_size and megatron's padding)
        # are never sampled and never normalised over, in rollout and training alike
        self.vocab_size = self.tokenizer.vocab_size
        self.mbs = t.micro_batch_size
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.prompts = PromptDataset.from_config(cfg.data, self.tokenizer, rejects_dir=rejects)
        self.pairs = PreferenceDataset.from_config(cfg.data, self.tokenizer, rejects_dir=rejects)
        seed = cfg.data.seed if cfg.data.seed is not None else t.seed
        self.prompt_sampler = DistributedBatchSampler(
            len(self.prompts), global_batch_size=t.global_batch_size, dp_rank=groups.dp_rank,
            dp_size=groups.data_parallel_size, seed=seed, shuffle=cfg.data.shuffle)
        self.pair_sampler = DistributedBatchSampler(
            len(self.pairs), global_batch_size=t.preference_batch_size, dp_rank=groups.dp_rank,
            dp_size=groups.data_parallel_size, seed=seed + 1, shuffle=cfg.data.shuffle)
        self._build_models()
        algo = cfg.algorithm
        self.kl_ctrl = make_kl_controller(algo.kl.controller, kl_coef=algo.kl.init_kl_coef,
                                          target_kl=algo.kl.target_kl, horizon=algo.kl.horizon)
        self.weights = phases.WeightSchedules(algo)
        # w_ppo = 0 for the whole run: plain DPO, which spends no rollouts (the KL and entropy terms,
        # which live on rollouts, go with them)
        self.pairs_only = not any(v > 0 for v in algo.hpa.w_ppo.used_values())
        if self.pairs_only:
            logger.info("algorithm.hpa.w_ppo is 0 for the whole run: DPO on the preference pairs only, no rollouts")
        model_reward = None  # the learned (hackable) part of the reward, watched by the monitor
        if cfg.reward.model_paths:  # the reward-model ensemble (hpa train-rm), next to the rule rewards
            from hpa.reward.model import ModelReward

            model_reward = ModelReward.from_config(cfg.reward, cfg.model, cfg.parallel, groups,
                                                   pad_id=self.tokenizer.pad_id, micro_batch_size=self.mbs)
        self.reward = build_reward(cfg.reward, model_reward)
        self.evaluator = Evaluator(cfg.data, cfg.rollout, cfg.reward, groups, self.tokenizer, rejects_dir=rejects,
                                   reward=self.reward, model_reward=model_reward, micro_batch_size=self.mbs)
        self.guard = Guard(cfg.guard)
        self.control = RunControl(t, cfg.guard, self.guard, self.run_dir, is_main=groups.is_main)
        self.states = {"kl_ctrl": self.kl_ctrl, "guard": self.guard, "prompt_sampler": self.prompt_sampler,
                       "pair_sampler": self.pair_sampler, "reward": self.reward,
                       "policy_sched": self.policy.scheduler, "monitor": self.evaluator}
        if self.critic is not None:
            self.states["critic_sched"] = self.critic.scheduler
        self.ckpt = CheckpointManager(cfg.checkpoint, self.run_dir, groups)
        self.step = 0
        self.last_eval: Optional[float] = None
        self.exit_reason = "done"
        self.save_failures = 0
        self.last_save_ok = True
        self.progress = StepProgress(groups.rank, groups.world_size, cfg.parallel.timeout_minutes)
        resumed = self.ckpt.find_resumable(cfg.checkpoint.resume)
        if resumed is not None:
            self.restore(resumed)
            logger.info("resumed from %s at step %d", resumed, self.step)
        self.metrics = MetricsWriter(self.run_dir, cfg.logging, is_main=groups.is_main, run_config=to_dict(cfg),
                                     resume_step=self.step + 1 if resumed is not None else None,
                                     total_steps=t.total_steps)
        self.timings: Dict[str, float] = {}
        self.num_params = sum(p.numel() for p in self.policy.model.parameters()) * groups.tensor_model_parallel_size \
            * groups.pipeline_model_parallel_size  # approximate: replicated norms are counted TP times

    def _build_models(self) -> None:
        """Policy (trained), frozen reference, critic (with GAE), and the rollout engine on the policy."""
        cfg, g = self.cfg, self.groups
        policy = build_policy(cfg.model, cfg.parallel, g)
        if cfg.model.policy_path:
            load_model_weights(policy, cfg.model.policy_path, g)
        self.reference = build_reference(cfg.model, cfg.parallel, g)
        if cfg.model.reference_path:
            load_model_weights(self.reference, cfg.model.reference_path, g)
        else:  # the frozen reference is the initial policy
            self.reference.load_state_dict(policy.state_dict())
        total = cfg.trainer.total_steps
        self.policy = make_trainable(policy, cfg.optim, cfg.parallel, g, total)
        self.critic = None
        if cfg.algorithm.advantage.estimator == "gae":
            critic = build_value(cfg.model, cfg.parallel, g)
            start = cfg.model.critic_path or cfg.model.policy_path  # else the critic starts from the policy's backbone
            if start:
                load_model_weights(critic, start, g, exclude_prefixes=("output_layer.",))
            self.critic = make_trainable(critic, cfg.optim, cfg.parallel, g, total, lr=cfg.optim.critic_lr or cfg.optim.lr)
        self.engine = build_rollout_engine(cfg.rollout, unwrap(self.policy.model), g,
                                           TokenizerInfo.from_tokenizer(self.tokenizer), model_cfg=cfg.model,
                                           checkpoint_path=cfg.model.policy_path)

    # ------------------------------------------------------------------------------------ loop

    @contextlib.contextmanager
    def timer(self, name: str):
        """Adds the block's wall time to ``timing_s/<name>`` of the current step."""
        start = time.perf_counter()
        try:
            with self.progress.phase(name):
                yield
        finally:
            key = f"timing_s/{name}"
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start

    def train(self) -> Dict[str, float]:
        """Run to ``trainer.total_steps`` (or an early stop, a signal, ``max_steps_per_run``).

        Sets ``exit_reason`` to ``done``, ``early_stop``, ``signal`` or ``max_steps_per_run`` (in the
        last two cases a checkpoint was saved, unless ``last_save_ok`` is False, and the next launch
        resumes from the newest one), ``save_failed`` (``checkpoint.on_save_failure=stop``) or
        ``collective_failure`` (a collective timed out or lost a peer; the error names the phase and
        the ranks waited for).
        """
        with self.control.catching_signals():
            return self._train()

    def _train(self) -> Dict[str, float]:
        last: Dict[str, float] = {}
        steps_this_run = 0
        due = self.control.due
        try:
            if self.cfg.trainer.eval_interval > 0 and self.step == 0:
                self.metrics.write(0, self.evaluate())  # the starting point of the learning curve
            while self.step < self.cfg.trainer.total_steps:
                faults.maybe_hang(self.step + 1, self.groups.rank)
                self.progress.step = self.step + 1
                self.timings = {}
                with self.timer("step"):
                    last = self.train_step()
                last.update(comm.reduce_metrics(self.timings, self.groups.dp_group, op="max"))
                last["perf/throughput"] = last.pop("_tokens") / last["timing_s/step"]
                last["perf/mfu"] = mfu(self.num_params, last["perf/throughput"],
                                       self.groups.tensor_model_parallel_size * self.groups.pipeline_model_parallel_size,
                                       self.cfg.trainer.peak_tflops_per_device)
                self.step += 1
                steps_this_run += 1
                if due(self.step, self.cfg.trainer.eval_interval):
                    with self.progress.phase("evaluate"):
                        last.update(self.evaluate())
                    self.last_eval = last.get("eval/score", self.last_eval)
                reason = self.guard.rollback_reason(self._token_kl(last))
                last.update(self.guard.metrics())
                stop = self.control.stop_reason(self.step, last, steps_this_run) if reason is None else None
                if reason is None and (stop or due(self.step, self.cfg.checkpoint.save_interval)) and not self.save():
                    stop = stop if self.cfg.checkpoint.on_save_failure == "continue" else "save_failed"
                last["checkpoint/save_failures"] = float(self.save_failures)
                self.metrics.write(self.step, last)
                if reason is not None:
                    self.rollback(reason)
                    continue
                if stop:
                    self.exit_reason = stop
                    self.control.write_exit_status(stop, self.step)
                    break
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            logger.error("%s", self.progress.collective_failure_message(exc))
            self.exit_reason = "collective_failure"
            self.control.write_exit_status(self.exit_reason, self.step)
        finally:
            self.metrics.close()
        return last

    def train_step(self) -> Dict[str, float]:
        weights = self.weights.at(progress(self.step, self.cfg.trainer.total_steps), self.kl_ctrl.value)
        if self.pairs_only:
            return self.pairs_only_step(weights)
        examples = [self.prompts[i] for i in self.prompt_sampler.next_batch()]
        with self.timer("rollout"):
            batch = self.rollout(examples)
        metrics = self.reference_and_old_policy(batch)
        with self.timer("reward"):
            metrics.update(self.score(batch, examples))
        if self.critic is not None:
            with self.timer("values"):
                batch.set("values", forward.sequence_values(self.critic.model, batch.sequences, self.groups,
                                                            micro_batch_size=self.mbs))
        advantages, returns, adv_metrics = phases.compute_advantages(batch, self.cfg.algorithm, weights.reward_kl_coef)
        batch.set("advantages", advantages).set("returns", returns)
        metrics.update(adv_metrics)
        with self.timer("reference"):
            pairs = self.preference_micro_batches()
        faults.maybe_kill(self.step + 1, self.groups.rank)
        with self.timer("update_actor"):
            metrics.update(self.update_policy(batch, pairs, weights))
        if self.critic is not None:
            with self.timer("update_critic"):
                metrics.update(self.update_critic(batch))
        metrics.update(self.update_kl_controller(batch, weights))
        metrics.update(self.weights.metrics(weights))
        metrics.update(length_metrics(batch.response_lengths, self.cfg.rollout.max_new_tokens, self.groups.dp_group))
        metrics["_tokens"] = self.tokens_trained(batch, pairs)
        metrics["perf/max_memory_gb"] = peak_memory_gb()
        return metrics

    def pairs_only_step(self, weights: phases.StepWeights) -> Dict[str, float]:
        """A step without rollouts (``pairs_only``): the DPO update on this step's preference pairs."""
        with self.timer("reference"):
            pairs = self.preference_micro_batches()
        with self.timer("update_actor"):
            metrics = self.update_policy(None, pairs, weights)
        metrics.update(self.weights.metrics(weights))
        metrics["_tokens"] = self.tokens_trained(None, pairs)
        metrics["perf/max_memory_gb"] = peak_memory_gb()
        return metrics

    # ---------------------------------------------------------------------------------- phases

    def rollout(self, examples) -> RolloutBatch:
        g = self.groups
        seed = self.cfg.rollout.seed + self.step * g.data_parallel_size + g.dp_rank
        params = SamplingParams.from_config(self.cfg.rollout, seed=seed)
        return self.generate([e.prompt_ids for e in examples], params)

    def generate(self, prompt_ids, params: SamplingParams) -> RolloutBatch:
        """Responses from the rollout engine on the policy's current weights (vLLM keeps a copy: synced
        here, every time, a no-op for the native engine); the engine sleeps after, so training gets its
        memory back."""
        self.policy.model.eval()
        with torch.no_grad():
            with self.timer("sync_weights"):
                self.engine.sync_weights()
            try:
                batch = self.engine.generate(prompt_ids, params)
            finally:
                self.engine.sleep()
        self.policy.model.train()
        return batch

    def score(self, batch: RolloutBatch, examples) -> Dict[str, float]:
        """Shaped reward at each response's last token (``token_scores``) and the loss ``mask``: rows with
        a non-finite reward (and rows the filter drops) get an all-zero mask, so they reach no loss and
        move no baseline."""
        truths = [examples[int(i)].ground_truth for i in batch.group_ids]
        inputs = RewardInputs(response_ids=batch.response_ids, response_mask=batch.response_mask,
                              prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
                              response_texts=decode_responses(self.tokenizer, batch), ground_truths=truths)
        reward = faults.nan_first_reward(self.reward) if faults.active("nan_reward", self.step + 1,
                                                                        self.groups.rank) else self.reward
        shaped = reward(inputs, policy_embeddings=batch.get("old_pooled"),
                        all_gather=lambda t: comm.all_gather_cat(t, self.groups.dp_group))
        keep = shaped.valid.clone()
        f = self.cfg.reward.filter
        if f.mode != "none":
            from hpa.reward.shaping import filter_responses

            keep &= filter_responses(shaped.rewards, shaped.valid, f.mode, f.k)
        batch.set("mask", batch.response_mask * keep[:, None].float()).set("token_scores", shaped.token_level_scores)
        metrics = {k: float(v) for k, v in shaped.metrics.items()}
        metrics["reward/kept_fraction"] = float(keep.float().mean())
        return comm.reduce_metrics(metrics, self.groups.dp_group)

    def reference_and_old_policy(self, batch: RolloutBatch) -> Dict[str, float]:
        """Reference and rollout-policy log-probs ``[b, r]`` and response-pooled hidden states ``[b, h]``."""
        kw = dict(micro_batch_size=self.mbs, vocab_size=self.vocab_size, temperature=self.temperature,
                  hidden_size=self.cfg.model.hidden_size)
        ts = batch.sequences
        with self.timer("reference"):
            ref = forward.sequence_log_probs(self.reference, ts, batch.response_mask, self.groups, **kw)
        with self.timer("old_logprob"):
            old = forward.sequence_log_probs(self.policy.model, ts, batch.response_mask, self.groups, **kw)
        batch.set("ref_log_probs", ref["log_probs"]).set("ref_pooled", ref["pooled"])
        batch.set("old_log_probs", old["log_probs"]).set("old_pooled", old["pooled"])
        metrics = dict(logprob_consistency(batch.log_probs, old["log_probs"], batch.response_mask))
        threshold = self.cfg.algorithm.ppo.rollout_is_threshold
        if threshold is not None:
            weights, is_m = truncated_importance_weights(old["log_probs"], batch.log_probs, batch.response_mask,
                                                         threshold)
            batch.set("is_weights", weights)
            metrics.update({f"rollout/{k}": v for k, v in is_m.items()})
        return comm.reduce_metrics({k: float(v) for k, v in metrics.items()}, self.groups.dp_group)

    def preference_micro_batches(self) -> List[dict]:
        examples = [self.pairs[i] for i in self.pair_sampler.next_batch()]
        mbs = micro_batches.pair_micro_batches(examples, micro_batch_size=self.mbs, pad_id=self.tokenizer.pad_id)
        ref = forward.pair_sequence_log_probs(self.reference, mbs, self.groups, vocab_size=self.vocab_size)
        micro_batches.attach_ref_pair_logps(mbs, ref)
        return mbs

    def _mini_batches(self, batch: Optional[RolloutBatch]):
        """Per PPO epoch and mini-batch, the rollout micro-batches of that mini-batch's rows (none when
        ``batch`` is None: a pairs-only step)."""
        t = self.cfg.trainer
        minis = micro_batches.mini_batches(batch.batch_size if batch is not None else 0,
                                           t.global_batch_size // t.ppo_mini_batch_size if t.ppo_mini_batch_size else 1)
        for _ in range(t.ppo_epochs):
            for index, rows in enumerate(minis):
                yield index, len(minis), micro_batches.rollout_micro_batches(
                    batch, rows, micro_batch_size=self.mbs, token_budget=t.ppo_max_token_len_per_rank,
                    dp_group=self.groups.dp_group) if rows else []

    def update_policy(self, batch: Optional[RolloutBatch], pairs: List[dict], weights: phases.StepWeights) -> Dict[str, float]:
        """``ppo_epochs`` x mini-batches of optimizer updates at this step's LR; the LR schedule then
        advances once per HPA step (as verl's), whatever the number of updates in it."""
        steps, grad_norms = [], []
        policy = self.policy
        lr = policy.optimizer.param_groups[0]["lr"]
        for index, num_minis, rollout_mbs in self._mini_batches(batch):
            pair_mbs = pairs[index::num_minis]
            counts = phases.global_counts(rollout_mbs, pair_mbs, self.groups)
            loss_fn = phases.make_policy_loss(self.cfg.algorithm, weights, counts, self.groups,
                                              vocab_size=self.vocab_size, temperature=self.temperature)
            if faults.active("nan_loss", self.step + 1, self.groups.rank):
                loss_fn = _nan_loss(loss_fn)
            zero_grad(policy.model, policy.optimizer)
            records = forward_backward(policy.model, rollout_mbs + pair_mbs, loss_fn, self.groups, capture_hidden=True)
            updated, grad_norm = guarded_optimizer_step(policy.optimizer, None, self.guard.grad_norm_action,
                                                        self.guard.spike_clip_value)
            self.guard.record(updated)
            steps.append(phases.step_metrics(records, self.groups))
            grad_norms.append(grad_norm)
        metrics = phases.average(steps)
        finite = [g for g in grad_norms if math.isfinite(g)]
        metrics["actor/grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        metrics["actor/lr"] = lr
        policy.scheduler.step(increment=1)
        return metrics

    def update_critic(self, batch: RolloutBatch) -> Dict[str, float]:
        steps = []
        critic = self.critic
        for _, _, mbs in self._mini_batches(batch):
            counts = phases.global_counts(mbs, [], self.groups)
            zero_grad(critic.model, critic.optimizer)
            records = forward_backward(critic.model, mbs, phases.make_critic_loss(self.cfg.algorithm, counts),
                                       self.groups)
            optimizer_step(critic.optimizer)
            steps.append(phases.step_metrics(records, self.groups))
        critic.scheduler.step(increment=1)  # once per HPA step, as the policy's
        return phases.average(steps)

    def update_kl_controller(self, batch: RolloutBatch, weights: phases.StepWeights) -> Dict[str, float]:
        """The controller follows the DP-mean KL between the rollout policy and the reference."""
        kl = masked_mean(kl_penalty(batch.get("old_log_probs"), batch.get("ref_log_probs"),
                                    self.cfg.algorithm.kl.reward_estimator), batch.get("mask"))
        current = comm.all_reduce_mean(kl.reshape(1).double(), self.groups.dp_group).item()
        self.kl_ctrl.update(current, batch.batch_size * self.groups.data_parallel_size)
        return {"actor/kl_coef": weights.reward_kl_coef, "actor/reward_kl": current}

    def tokens_trained(self, batch: Optional[RolloutBatch], pairs: List[dict]) -> float:
        """Tokens this rank trained on this step (for ``perf/throughput``)."""
        tokens = float(batch.prompt_mask.sum() + batch.response_mask.sum()) if batch is not None else 0.0
        tokens += sum(float((mb["input_ids"] != self.tokenizer.pad_id).sum()) for mb in pairs)
        return tokens * self.cfg.trainer.ppo_epochs

    def evaluate(self) -> Dict[str, float]:
        return self.evaluator.evaluate(self.policy.model, self.reference, self.generate, self.step)

    # ------------------------------------------------------------------------ state and stops

    def _models(self):
        models = {"policy": self.policy.state()}
        if self.critic is not None:
            models["critic"] = self.critic.state()
        return models

    def state_dict(self) -> Dict:
        """Everything besides models and optimizers that exact resume needs (identical on all ranks)."""
        return {"step": self.step, "layout": self.groups.layout, "last_eval": self.last_eval,
                # the frozen models are recorded by path (their weights are not copied into the checkpoint)
                "reference_path": self.cfg.model.reference_path or self.cfg.model.policy_path,
                "reward_model_paths": list(self.cfg.reward.model_paths),
                **{name: part.state_dict() for name, part in self.states.items()}}

    def save(self) -> bool:
        """Checkpoint this step; a failed save (previous checkpoint and ``latest`` intact) is logged,
        counted in ``checkpoint/save_failures`` and returns False."""
        with self.progress.phase("checkpoint"):
            try:
                self.ckpt.save(self.step, self._models(), self.state_dict(), score=self.last_eval)
                self.last_save_ok = True
                return True
            except CheckpointSaveError as exc:
                self.last_save_ok = False
                self.save_failures += 1
                then = ("training continues (checkpoint.on_save_failure=continue)"
                        if self.cfg.checkpoint.on_save_failure == "continue" else
                        f"stopping with status {EXIT_SAVE_FAILED} (checkpoint.on_save_failure=stop)")
                logger.warning("%s; %s; %d failed save(s) in this process", exc, then, self.save_failures)
                return False

    def restore(self, path) -> None:
        state = self.ckpt.load(path, self._models())
        self.step, self.last_eval = state["step"], state["last_eval"]
        for name, part in self.states.items():
            part.load_state_dict(state[name])

    def rollback(self, reason: str) -> None:
        """Back to the newest good checkpoint with the LR scaled down; the guard keeps its own count.

        The LR becomes the schedule's × the guard's cumulative ``lr_scale``: the checkpoint's schedulers
        carry the scale of their save, so a second rollback to the same checkpoint lowers the LR again
        (a fixed factor on the restored schedule would replay the same trajectory)."""
        path = self.ckpt.find_resumable("auto")
        if path is None:
            logger.warning("guard: %s, but there is no checkpoint to roll back to; continuing", reason)
            return
        guard_state = self.guard.state_dict()
        self.restore(path)
        saved_scale = self.guard.lr_scale  # the scale the checkpoint's schedulers were saved with
        self.guard.load_state_dict(guard_state)
        self.guard.rolled_back()
        self.metrics.truncate(self.step + 1)
        for trainable in [self.policy] + ([self.critic] if self.critic is not None else []):
            scale_lr(trainable.scheduler, self.guard.lr_scale / saved_scale)
        logger.warning("guard: %s; rolled back to %s (step %d), LR x%.3g (rollback %d)", reason, path, self.step,
                       self.guard.lr_scale, self.guard.rollbacks)

    def _token_kl(self, metrics: Dict[str, float]) -> Optional[float]:
        if faults.active("kl_spike", self.step, self.groups.rank):
            return float("inf")
        return metrics.get("kl/token")


def _nan_loss(loss_fn):
    def wrapped(batch, output, hidden):
        loss, metrics = loss_fn(batch, output, hidden)
        return loss * float("nan"), metrics

    return wrapped
