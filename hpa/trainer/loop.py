"""``hpa train``: the HPA loop. ``train_step`` reads top to bottom (STYLE rule 10).

One step: roll out → shaped reward → reference / old-policy / critic forwards → advantages →
mixed PPO + DPO + hierarchical-KL update (ppo_epochs × mini-batches) → critic update → KL
controller → metrics → evaluation → checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import signal
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from hpa.algorithms.kl import kl_penalty, kl_warmup_scale, make_kl_controller
from hpa.algorithms.ppo import truncated_importance_weights
from hpa.algorithms.schedules import make_schedule, progress
from hpa.config import write_resolved
from hpa.config.schema import Config, to_dict
from hpa.data.collate import balanced_micro_batches, token_budget_micro_batches
from hpa.data.preferences import PreferenceDataset
from hpa.data.prompts import PromptDataset
from hpa.data.sampler import DistributedBatchSampler
from hpa.data.tokenizer import build_tokenizer
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.distributed.watchdog import StepProgress, is_collective_failure
from hpa.models import build_policy, build_reference, build_value, unwrap
from hpa.reward import RewardHackingMonitor, RewardInputs, build_reward
from hpa.reward.rules import RuleReward
from hpa.reward.shaping import ngram_copy_rate
from hpa.rollout import build_rollout_engine
from hpa.rollout.base import RolloutBatch, SamplingParams, TokenizerInfo, decode_responses, logprob_consistency
from hpa.trainer import faults, phases
from hpa.trainer.checkpoint import (EXIT_SAVE_FAILED, CheckpointManager, CheckpointSaveError,
                                    load_model_weights)
from hpa.trainer.guard import Guard
from hpa.trainer.metrics import MetricsWriter
from hpa.trainer.optimizer import build_lr_scheduler, build_optimizer, wrap_ddp
from hpa.trainer.step import forward_backward, guarded_optimizer_step, optimizer_step, zero_grad

logger = logging.getLogger("hpa")


class HPATrainer:
    """Owns the models, data and state of one run. Components get their own config sections."""

    def __init__(self, cfg: Config, groups: ParallelGroups):
        self.cfg, self.groups = cfg, groups
        self.run_dir = Path(cfg.trainer.run_dir)
        faults.record_in(self.run_dir)
        if groups.is_main:
            write_resolved(cfg, self.run_dir)
        self._build_data()
        self._build_models()
        algo = cfg.algorithm
        self.kl_ctrl = make_kl_controller(algo.kl.controller, kl_coef=algo.kl.init_kl_coef,
                                          target_kl=algo.kl.target_kl, horizon=algo.kl.horizon)
        self.schedules = {name: make_schedule(**dataclasses.asdict(getattr(algo.hpa, name)))
                          for name in ("w_ppo", "w_dpo", "w_kl", "lambda_token", "lambda_semantic")}
        self.schedules["entropy_coef"] = make_schedule(**dataclasses.asdict(algo.ppo.entropy_coef))
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
        self.model_reward = model_reward
        self.reward = build_reward(cfg.reward, model_reward)
        self.guard = Guard(cfg.guard)
        self.ckpt = CheckpointManager(cfg.checkpoint, self.run_dir, groups)
        self.step = 0
        self.last_eval: Optional[float] = None
        self.exit_reason = "done"
        self._signal: Optional[int] = None
        self.save_failures = 0
        self.last_save_ok = True
        self.progress = StepProgress(groups.rank, groups.world_size, cfg.parallel.timeout_minutes)
        resumed = self.ckpt.find_resumable(cfg.checkpoint.resume)
        if resumed is not None:
            self.restore(resumed)
            logger.info("resumed from %s at step %d", resumed, self.step)
        self.metrics = MetricsWriter(self.run_dir, cfg.logging, is_main=groups.is_main, run_config=to_dict(cfg),
                                     resume_step=self.step + 1 if resumed is not None else None,
                                     total_steps=cfg.trainer.total_steps)
        self.timings: Dict[str, float] = {}
        self.num_params = sum(p.numel() for p in self.policy.parameters()) * groups.tensor_model_parallel_size \
            * groups.pipeline_model_parallel_size  # approximate: replicated norms are counted TP times

    # ----------------------------------------------------------------------------------- setup

    def _build_data(self) -> None:
        cfg, g = self.cfg, self.groups
        rejects = cfg.data.rejects_dir or str(self.run_dir / "rejects")
        self.tokenizer = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path)
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ValueError(f"the tokenizer at data.tokenizer_path has {self.tokenizer.vocab_size} tokens but "
                             f"model.vocab_size is {cfg.model.vocab_size}; raise model.vocab_size")
        self.prompts = PromptDataset.from_config(cfg.data, self.tokenizer, rejects_dir=rejects)
        self.pairs = PreferenceDataset.from_config(cfg.data, self.tokenizer, rejects_dir=rejects)
        self.eval_prompts = (PromptDataset.from_config(cfg.data, self.tokenizer, rejects_dir=rejects, split="eval")
                             if cfg.data.eval_prompt_path else None)
        self.adversarial_prompts = (PromptDataset.from_config(cfg.data, self.tokenizer, rejects_dir=rejects,
                                                              split="adversarial")
                                    if cfg.data.adversarial_prompt_path else None)
        self.monitor = RewardHackingMonitor.from_config(cfg.reward.monitor)
        seed = cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed
        self.prompt_sampler = DistributedBatchSampler(
            len(self.prompts), global_batch_size=cfg.trainer.global_batch_size, dp_rank=g.dp_rank,
            dp_size=g.data_parallel_size, seed=seed, shuffle=cfg.data.shuffle)
        self.pair_sampler = DistributedBatchSampler(
            len(self.pairs), global_batch_size=cfg.trainer.preference_batch_size, dp_rank=g.dp_rank,
            dp_size=g.data_parallel_size, seed=seed + 1, shuffle=cfg.data.shuffle)

    def _build_models(self) -> None:
        cfg, g = self.cfg, self.groups
        policy = build_policy(cfg.model, cfg.parallel, g)
        if cfg.model.policy_path:
            load_model_weights(policy, cfg.model.policy_path, g)
        self.reference = build_reference(cfg.model, cfg.parallel, g)
        if cfg.model.reference_path:
            load_model_weights(self.reference, cfg.model.reference_path, g)
        else:  # the frozen reference is the initial policy
            self.reference.load_state_dict(policy.state_dict())
        self.policy = wrap_ddp(policy, cfg.parallel, g)
        self.policy_opt = build_optimizer(self.policy, cfg.optim, cfg.parallel, g)
        self.policy_sched = build_lr_scheduler(self.policy_opt, cfg.optim, cfg.trainer.total_steps)
        self.critic = None
        if cfg.algorithm.advantage.estimator == "gae":
            critic = build_value(cfg.model, cfg.parallel, g)
            if cfg.model.critic_path:
                load_model_weights(critic, cfg.model.critic_path, g, exclude_prefixes=("output_layer.",))
            elif cfg.model.policy_path:  # the critic starts from the policy's backbone
                load_model_weights(critic, cfg.model.policy_path, g, exclude_prefixes=("output_layer.",))
            lr = cfg.optim.critic_lr or cfg.optim.lr
            self.critic = wrap_ddp(critic, cfg.parallel, g)
            self.critic_opt = build_optimizer(self.critic, cfg.optim, cfg.parallel, g, lr=lr)
            self.critic_sched = build_lr_scheduler(self.critic_opt, cfg.optim, cfg.trainer.total_steps, lr=lr)
        self.engine = build_rollout_engine(cfg.rollout, unwrap(self.policy), g,
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
        last: Dict[str, float] = {}
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        steps_this_run = 0
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
                last["perf/mfu"] = self._mfu(last)
                self.step += 1
                steps_this_run += 1
                if self._due(self.cfg.trainer.eval_interval):
                    with self.progress.phase("evaluate"):
                        last.update(self.evaluate())
                    self.last_eval = last.get("eval/score", self.last_eval)
                reason = self.guard.rollback_reason(self._token_kl(last))
                last.update(self.guard.metrics())
                stop = self._stop_reason(last, steps_this_run) if reason is None else None
                if reason is None and (stop or self._due(self.cfg.checkpoint.save_interval)) and not self.save():
                    stop = stop if self.cfg.checkpoint.on_save_failure == "continue" else "save_failed"
                last["checkpoint/save_failures"] = float(self.save_failures)
                self.metrics.write(self.step, last)
                if reason is not None:
                    self.rollback(reason)
                    continue
                if stop:
                    self.exit_reason = stop
                    self._write_exit_status()
                    break
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            logger.error("%s", self.progress.collective_failure_message(exc))
            self.exit_reason = "collective_failure"
            self._write_exit_status()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.metrics.close()
        return last

    def _write_exit_status(self) -> None:
        """``<run_dir>/exit_status.json``: why this process stopped before ``total_steps`` and where."""
        if self.groups.is_main:
            (self.run_dir / "exit_status.json").write_text(json.dumps(
                {"reason": self.exit_reason, "step": self.step, "resumable": self.exit_reason != "early_stop",
                 "best_step": self.guard.best_step}))

    def _on_signal(self, signum, frame) -> None:
        logger.warning("received signal %d: checkpointing at the end of this step, then exiting", signum)
        self._signal = signum

    def _token_kl(self, metrics: Dict[str, float]) -> Optional[float]:
        if faults.active("kl_spike", self.step, self.groups.rank):
            return float("inf")
        return metrics.get("kl/token")

    def _stop_reason(self, metrics: Dict[str, float], steps_this_run: int) -> Optional[str]:
        flags = torch.tensor([float(self._signal is not None)])
        comm.all_reduce_max(flags, None)  # any rank signalled: every rank stops at this step
        if flags.item() > 0:
            return "signal"
        if self.cfg.guard.early_stop_on_hacking and metrics.get("hacking/alert_count", 0.0) > 0:
            logger.warning("early stop at step %d: the reward-hacking monitor alerted (guard.early_stop_on_hacking); "
                           "best step %d", self.step, self.guard.best_step)
            return "early_stop"
        if self.guard.should_stop(self.step, metrics.get("reward/raw_mean", 0.0), metrics.get("reward/shaped_std", 0.0),
                                  metrics.get("kl/token", 0.0)):
            logger.info("early stop at step %d: no improvement of the stop metric for %d steps; best step %d "
                        "(metric %.4g)", self.step, self.cfg.guard.early_stop_patience, self.guard.best_step,
                        self.guard.best_metric)
            return "early_stop"
        limit = self.cfg.trainer.max_steps_per_run
        if limit is not None and steps_this_run >= limit and self.step < self.cfg.trainer.total_steps:
            return "max_steps_per_run"
        return None

    # ------------------------------------------------------------------------------ checkpoints

    def _models(self):
        models = {"policy": (self.policy, self.policy_opt)}
        if self.critic is not None:
            models["critic"] = (self.critic, self.critic_opt)
        return models

    def state_dict(self) -> Dict:
        """Everything besides models and optimizers that exact resume needs (identical on all ranks)."""
        state = {"step": self.step, "layout": self.groups.layout,
                 # the frozen models are recorded by path (their weights are not copied into the checkpoint)
                 "reference_path": self.cfg.model.reference_path or self.cfg.model.policy_path,
                 "reward_model_paths": list(self.cfg.reward.model_paths),
                 "kl_ctrl": self.kl_ctrl.state_dict(), "guard": self.guard.state_dict(),
                 "prompt_sampler": self.prompt_sampler.state_dict(), "pair_sampler": self.pair_sampler.state_dict(),
                 "reward": self.reward.state_dict(), "policy_sched": self.policy_sched.state_dict(),
                 "monitor": self.monitor.state_dict(),
                 "last_eval": self.last_eval}
        if self.critic is not None:
            state["critic_sched"] = self.critic_sched.state_dict()
        return state

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
        self.step = state["step"]
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.guard.load_state_dict(state["guard"])
        self.prompt_sampler.load_state_dict(state["prompt_sampler"])
        self.pair_sampler.load_state_dict(state["pair_sampler"])
        self.reward.load_state_dict(state["reward"])
        self.policy_sched.load_state_dict(state["policy_sched"])
        self.monitor.load_state_dict(state["monitor"])
        if self.critic is not None:
            self.critic_sched.load_state_dict(state["critic_sched"])
        self.last_eval = state["last_eval"]

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
        factor = self.guard.lr_scale / saved_scale
        for sched in [self.policy_sched] + ([self.critic_sched] if self.critic is not None else []):
            sched.max_lr *= factor
            sched.min_lr *= factor
            for group in sched.optimizer.param_groups:  # megatron keeps per-group LR bounds too
                for key in ("max_lr", "min_lr"):
                    if group.get(key) is not None:
                        group[key] *= factor
            sched.step(increment=0)
        logger.warning("guard: %s; rolled back to %s (step %d), LR x%.3g (rollback %d)", reason, path, self.step,
                       self.guard.lr_scale, self.guard.rollbacks)

    def _due(self, interval: int) -> bool:
        return interval > 0 and (self.step % interval == 0 or self.step == self.cfg.trainer.total_steps)

    def train_step(self) -> Dict[str, float]:
        weights = self.step_weights()
        if self.pairs_only:
            return self.pairs_only_step(weights)
        examples = [self.prompts[i] for i in self.prompt_sampler.next_batch()]
        with self.timer("rollout"):
            batch = self.rollout(examples)
        ts = batch.training_sequences()
        metrics = self.reference_and_old_policy(batch, ts)
        with self.timer("reward"):
            token_scores, mask, reward_metrics = self.score(batch, examples)
        metrics.update(reward_metrics)
        if self.critic is not None:
            with self.timer("values"):
                batch.set("values", phases.sequence_values(self.critic, ts, self.groups, micro_batch_size=self.mbs))
        advantages, returns, adv_metrics = phases.compute_advantages(
            batch, mask, token_scores, self.cfg.algorithm, weights.reward_kl_coef)
        batch.set("advantages", advantages).set("returns", returns)
        metrics.update(adv_metrics)
        with self.timer("reference"):
            pairs = self.preference_micro_batches()
        faults.maybe_kill(self.step + 1, self.groups.rank)
        with self.timer("update_actor"):
            metrics.update(self.update_policy(batch, ts, mask, pairs, weights))
        if self.critic is not None:
            with self.timer("update_critic"):
                metrics.update(self.update_critic(batch, ts, mask))
        metrics.update(self.update_kl_controller(batch, mask, weights))
        metrics.update(self.weight_metrics(weights))
        metrics.update(self.length_metrics(batch))
        metrics.update(self.perf_metrics(batch, pairs))
        return metrics

    def pairs_only_step(self, weights: phases.StepWeights) -> Dict[str, float]:
        """A step without rollouts (``pairs_only``): the DPO update on this step's preference pairs."""
        with self.timer("reference"):
            pairs = self.preference_micro_batches()
        with self.timer("update_actor"):
            metrics = self.update_policy(None, None, None, pairs, weights)
        metrics.update(self.weight_metrics(weights))
        metrics.update(self.perf_metrics(None, pairs))
        return metrics

    # ---------------------------------------------------------------------------------- phases

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary: the embedding rows beyond it (model.vocab_size and megatron's
        padding) are never sampled and never normalised over, in rollout and training alike."""
        return self.tokenizer.vocab_size

    @property
    def mbs(self) -> int:
        return self.cfg.trainer.micro_batch_size

    @property
    def temperature(self) -> float:
        return self.cfg.rollout.temperature if self.cfg.rollout.temperature > 0 else 1.0

    def step_weights(self) -> phases.StepWeights:
        p = progress(self.step, self.cfg.trainer.total_steps)
        s = self.schedules
        return phases.StepWeights(
            w_ppo=s["w_ppo"](p), w_dpo=s["w_dpo"](p), w_kl=s["w_kl"](p), lambda_token=s["lambda_token"](p),
            lambda_semantic=s["lambda_semantic"](p), entropy_coef=s["entropy_coef"](p),
            reward_kl_coef=self.kl_ctrl.value * kl_warmup_scale(p, self.cfg.algorithm.kl.warmup_fraction))

    def rollout(self, examples) -> RolloutBatch:
        g = self.groups
        seed = self.cfg.rollout.seed + self.step * g.data_parallel_size + g.dp_rank
        params = SamplingParams.from_config(self.cfg.rollout, seed=seed)
        self.policy.eval()
        with torch.no_grad(), self.engine_on_current_policy():
            batch = self.engine.generate([e.prompt_ids for e in examples], params)
        self.policy.train()
        return batch

    @contextlib.contextmanager
    def engine_on_current_policy(self):
        """The rollout engine with the policy's current weights (vLLM keeps a copy: synced here, every
        time, a no-op for the native engine), put to sleep after, so training gets its memory back."""
        with self.timer("sync_weights"):
            self.engine.sync_weights()
        try:
            yield self.engine
        finally:
            self.engine.sleep()

    def score(self, batch: RolloutBatch, examples):
        """Shaped reward at each response's last token; rows with a non-finite reward (and rows the
        filter drops) get an all-zero mask, so they reach no loss and move no baseline."""
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
        mask = batch.response_mask * keep[:, None].float()
        metrics = {k: float(v) for k, v in shaped.metrics.items()}
        metrics["reward/kept_fraction"] = float(keep.float().mean())
        metrics = comm.reduce_metrics(metrics, self.groups.dp_group)
        return shaped.token_level_scores, mask, metrics

    def reference_and_old_policy(self, batch: RolloutBatch, ts) -> Dict[str, float]:
        """Reference and rollout-policy log-probs ``[b, r]`` and response-pooled hidden states ``[b, h]``."""
        m = self.cfg.model
        kw = dict(micro_batch_size=self.mbs, vocab_size=self.vocab_size, temperature=self.temperature,
                  hidden_size=m.hidden_size)
        with self.timer("reference"):
            ref = phases.sequence_log_probs(self.reference, ts, batch.response_mask, self.groups, **kw)
        with self.timer("old_logprob"):
            old = phases.sequence_log_probs(self.policy, ts, batch.response_mask, self.groups, **kw)
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
        mbs = phases.pair_micro_batches(examples, micro_batch_size=self.mbs, pad_id=self.tokenizer.pad_id)
        ref = phases.pair_sequence_log_probs(self.reference, mbs, self.groups, vocab_size=self.vocab_size)
        phases.attach_ref_pair_logps(mbs, ref)
        for mb in mbs:
            mb["kind"] = "pairs"
        return mbs

    def _rollout_micro_batches(self, batch: RolloutBatch, ts, mask, rows: List[int]) -> List[dict]:
        """Micro-batches of ``rows``: ``trainer.micro_batch_size`` rows each, or, with
        ``trainer.ppo_max_token_len_per_rank``, groups under that token budget, each cut to its own
        longest sequence (so short responses do not pay for long ones). Every DP rank gets the same
        number of micro-batches (the pipeline schedule and DDP need it)."""
        pool_mask = phases.response_token_mask(ts, batch.response_mask)
        lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
        budget = self.cfg.trainer.ppo_max_token_len_per_rank
        if budget is None:
            groups = [[rows[i] for i in chunk] for chunk in phases.chunks(len(rows), self.mbs)]
        else:
            own = len(token_budget_micro_batches([lengths[r] for r in rows], budget))
            count = int(comm.all_reduce_max(torch.tensor([own]), self.groups.dp_group).item())
            groups = [[rows[i] for i in g] for g in balanced_micro_batches([lengths[r] for r in rows], count)]
        out = []
        for group in groups:
            idx = torch.tensor(group)
            width = max(lengths[r] for r in group)
            mb = {k: v[:, :width] for k, v in ts.micro_batch(idx).items() if k != "response_index"}
            mb["response_index"] = ts.response_index[idx].clamp(max=width - 1)
            mb.update(kind="rollout", mask=mask[idx], pool_mask=pool_mask[idx][:, :width],
                      **{k: batch.get(k)[idx] for k in ("old_log_probs", "ref_log_probs", "ref_pooled",
                                                        "advantages", "returns")},
                      **({"values": batch.get("values")[idx]} if self.critic is not None else {}),
                      **({"is_weights": batch.get("is_weights")[idx]} if "is_weights" in batch.extras else {}))
            out.append(mb)
        return out

    def _mini_batches(self, num_rows: int) -> List[List[int]]:
        t = self.cfg.trainer
        num = t.global_batch_size // t.ppo_mini_batch_size if t.ppo_mini_batch_size else 1
        size = num_rows // num
        return [list(range(i * size, (i + 1) * size)) for i in range(num)]

    def update_policy(self, batch, ts, mask, pairs: List[dict], weights) -> Dict[str, float]:
        """``ppo_epochs`` x mini-batches of optimizer updates at this step's LR; the LR schedule then
        advances once per HPA step (as verl's), whatever the number of updates in it."""
        steps, grad_norms = [], []
        lr = self.policy_opt.param_groups[0]["lr"]
        minis = self._mini_batches(batch.batch_size if batch is not None else 0)  # batch None: pairs only
        pair_split = [pairs[i::len(minis)] for i in range(len(minis))]
        for _ in range(self.cfg.trainer.ppo_epochs):
            for rows, pair_mbs in zip(minis, pair_split):
                rollout_mbs = self._rollout_micro_batches(batch, ts, mask, rows) if rows else []
                counts = phases.global_counts(rollout_mbs, pair_mbs, self.groups)
                loss_fn = phases.make_policy_loss(self.cfg.algorithm, weights, counts, self.groups,
                                                  vocab_size=self.vocab_size, temperature=self.temperature)
                if faults.active("nan_loss", self.step + 1, self.groups.rank):
                    loss_fn = _nan_loss(loss_fn)
                zero_grad(self.policy, self.policy_opt)
                records = forward_backward(self.policy, rollout_mbs + pair_mbs, loss_fn, self.groups,
                                           capture_hidden=True)
                updated, grad_norm = guarded_optimizer_step(self.policy_opt, None, self.guard.grad_norm_action,
                                                            self.guard.spike_clip_value)
                self.guard.record(updated)
                steps.append(phases.step_metrics(records, self.groups))
                grad_norms.append(grad_norm)
        metrics = phases.average(steps)
        finite = [g for g in grad_norms if math.isfinite(g)]
        metrics["actor/grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        metrics["actor/lr"] = lr
        self.policy_sched.step(increment=1)
        return metrics

    def update_critic(self, batch, ts, mask) -> Dict[str, float]:
        steps = []
        for _ in range(self.cfg.trainer.ppo_epochs):
            for rows in self._mini_batches(batch.batch_size):
                mbs = self._rollout_micro_batches(batch, ts, mask, rows)
                counts = phases.global_counts(mbs, [], self.groups)
                zero_grad(self.critic, self.critic_opt)
                records = forward_backward(self.critic, mbs, phases.make_critic_loss(self.cfg.algorithm, counts),
                                           self.groups)
                optimizer_step(self.critic_opt)
                steps.append(phases.step_metrics(records, self.groups))
        self.critic_sched.step(increment=1)  # once per HPA step, as the policy's
        return phases.average(steps)

    def update_kl_controller(self, batch: RolloutBatch, mask, weights) -> Dict[str, float]:
        """The controller follows the DP-mean KL between the rollout policy and the reference."""
        from hpa.algorithms.kl import kl_penalty
        from hpa.algorithms.losses import masked_mean

        kl = masked_mean(kl_penalty(batch.get("old_log_probs"), batch.get("ref_log_probs"),
                                    self.cfg.algorithm.kl.reward_estimator), mask)
        current = comm.all_reduce_mean(kl.reshape(1).double(), self.groups.dp_group).item()
        n_steps = batch.batch_size * self.groups.data_parallel_size
        self.kl_ctrl.update(current, n_steps)
        return {"actor/kl_coef": weights.reward_kl_coef, "actor/reward_kl": current}

    @staticmethod
    def weight_metrics(w: phases.StepWeights) -> Dict[str, float]:
        return {"hpa/w_ppo": w.w_ppo, "hpa/w_dpo": w.w_dpo, "hpa/w_kl": w.w_kl,
                "hpa/lambda_token": w.lambda_token, "hpa/lambda_semantic": w.lambda_semantic}

    def length_metrics(self, batch: RolloutBatch) -> Dict[str, float]:
        """Response lengths over the global batch (mean weighted by responses, max as max)."""
        lengths = batch.response_lengths.double()
        g = self.groups.dp_group
        total = comm.all_reduce_sum(torch.stack([lengths.sum(), torch.tensor(float(len(lengths))),
                                                 (lengths >= self.cfg.rollout.max_new_tokens).double().sum()]), g)
        longest = comm.all_reduce_max(lengths.max().reshape(1), g)
        return {"response_length/mean": (total[0] / total[1]).item(), "response_length/max": longest.item(),
                "response_length/clip_ratio": (total[2] / total[1]).item()}

    def perf_metrics(self, batch: RolloutBatch, pairs: List[dict]) -> Dict[str, float]:
        """Tokens this rank trained on (for ``perf/throughput``) and the peak memory."""
        tokens = float(batch.prompt_mask.sum() + batch.response_mask.sum()) if batch is not None else 0.0
        tokens += sum(float((mb["input_ids"] != self.tokenizer.pad_id).sum()) for mb in pairs)
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated() / 2**30
        else:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
        return {"_tokens": tokens * self.cfg.trainer.ppo_epochs, "perf/max_memory_gb": peak}

    def _mfu(self, metrics: Dict[str, float]) -> float:
        """Model FLOPs utilisation: 6·N·tokens per second per device over the declared peak."""
        peak = self.cfg.trainer.peak_tflops_per_device
        if not peak:
            return float("nan")  # unknown peak (e.g. CPU): reported as NaN, not as a made-up figure
        per_device = 6.0 * self.num_params * metrics["perf/throughput"] / (self.groups.tensor_model_parallel_size
                                                                          * self.groups.pipeline_model_parallel_size)
        return per_device / (peak * 1e12)

    # ------------------------------------------------------------------------------ evaluation

    def evaluate(self) -> Dict[str, float]:
        """Greedy responses on the held-out prompts (``eval/*``) and on the adversarial set, whose
        numbers go to the reward-hacking monitor (``hacking/*``; alerts are logged)."""
        metrics: Dict[str, float] = {}
        if self.eval_prompts is not None:
            metrics.update({f"eval/{k}": v for k, v in self._evaluate_prompts(self.eval_prompts).items()})
        if self.adversarial_prompts is not None:
            adv = self._evaluate_prompts(self.adversarial_prompts)
            alerts, hacking = self.monitor.update(model_reward=adv["model_reward"], gold_score=adv["score"],
                                                  copy_rate=adv["copy_rate"],
                                                  mean_response_length=adv["response_length"])
            metrics.update(hacking)
            for alert in alerts if self.groups.is_main else ():
                logger.warning("reward-hacking monitor at step %d: %s", self.step, alert)
        return metrics

    def _evaluate_prompts(self, dataset: PromptDataset) -> Dict[str, float]:
        """Greedy responses to ``dataset`` (DP-sharded) and their means over the whole set: the gold
        rule ``score`` (``reward.rules``, exact match by default), the configured base ``reward``
        (r̂: reward model heads and rules), the ``model_reward`` (the reward models' heads alone,
        what a policy can exploit; r̂ without a reward model), the k1 ``kl`` to the reference per
        response token at temperature 1, the n-gram ``copy_rate`` and the ``response_length``."""
        g = self.groups
        mine = list(range(g.dp_rank, len(dataset), g.data_parallel_size))
        n = comm.all_reduce_max(torch.tensor([len(mine)]), g.dp_group).item()
        mine = (mine + mine[:1] * n)[:n]  # equal work on every DP rank (the repeat is not counted)
        examples = [dataset[i] for i in mine]
        params = SamplingParams.from_config(self.cfg.rollout, n=1, temperature=0.0)
        self.policy.eval()
        with torch.no_grad():
            with self.engine_on_current_policy():
                batch = self.engine.generate([e.prompt_ids for e in examples], params)
            inputs = RewardInputs(response_ids=batch.response_ids, response_mask=batch.response_mask,
                                  prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
                                  response_texts=decode_responses(self.tokenizer, batch),
                                  ground_truths=[e.ground_truth for e in examples])
            gold = RuleReward.from_names(self.cfg.reward.rules or ("exact_match",), 1.0, None)(inputs).rewards[:, 0]
            reward = self.reward.base(inputs).rewards.float().mean(dim=1)  # [b]
            learned = (self.model_reward(inputs).rewards.float().mean(dim=1) if self.model_reward is not None
                       else reward)  # [b]
            copy = ngram_copy_rate(batch.response_ids, batch.response_mask, batch.prompt_ids, batch.prompt_mask,
                                   self.cfg.reward.shaping.copy_ngram)  # [b]
            ts = batch.training_sequences()
            kw = dict(micro_batch_size=self.mbs, vocab_size=self.vocab_size, temperature=1.0)
            logp = phases.sequence_log_probs(self.policy, ts, batch.response_mask, g, **kw)["log_probs"]
            ref = phases.sequence_log_probs(self.reference, ts, batch.response_mask, g, **kw)["log_probs"]
        self.policy.train()
        mask = batch.response_mask.float()  # [b, r]
        kl = (kl_penalty(logp.cpu(), ref.cpu(), kind="k1") * mask).sum(dim=1)  # [b]
        lengths = mask.sum(dim=1)  # [b]
        counted = len(set(mine))
        sums = torch.stack([gold.cpu().float(), reward.cpu(), learned.cpu(), copy.cpu().float(), lengths, kl,
                            torch.ones_like(lengths)])[:, :counted].sum(dim=1).double()
        comm.all_reduce_sum(sums, g.dp_group)
        score, reward_sum, learned_sum, copy_sum, tokens, kl_sum, rows = sums.tolist()
        return {"score": score / rows, "reward": reward_sum / rows, "model_reward": learned_sum / rows,
                "copy_rate": copy_sum / rows, "response_length": tokens / rows, "kl": kl_sum / max(tokens, 1.0)}


def _nan_loss(loss_fn):
    def wrapped(batch, output, hidden):
        loss, metrics = loss_fn(batch, output, hidden)
        return loss * float("nan"), metrics

    return wrapped
