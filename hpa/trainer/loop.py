"""``hpa train``: the HPA loop. ``train_step`` reads as the step does: it calls the phases of a step
(``hpa.trainer.phases``) in order.

One step: the rollout stream (``rollout_step``: roll out, score, filter, critic values, the controllers
that observe rollouts, advantages) → the step's preference pairs → the update of the loss computed from
the objective's table of terms (``objective``; ppo_epochs × mini-batches) → critic update → metrics; then evaluation, the guard, the stop decision and the checkpoint. Everything per row of the
step travels on the ``RolloutBatch``. What a run builds is ``setup``, what it measures of its start once (for
the controllers; read back from the checkpoint on resume) is ``startup_probes``, its state (save / restore /
rollback) is ``state``, evaluation is ``evaluate``, when it stops is ``run_control``.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Dict, Optional

import torch

from hpa.algorithms.schedules import progress
from hpa.config import write_resolved
from hpa.config.schema import Config, coverage_enabled, to_dict, trust_gate_enabled
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.distributed.watchdog import CollectiveFailure, StepProgress, is_collective_failure
from hpa.reward.coverage import CoverageEstimator
from hpa.reward.rules import graded_rule
from hpa.trainer import faults, phases, reference_cache
from hpa.trainer.guard import Guard
from hpa.trainer.metrics import MetricsWriter, device_name, device_timer, peak_memory_gb, peak_tflops, update_perf
from hpa.trainer.heldout import heldout_nll
from hpa.trainer.objective import ControllerInputs, Controllers, WeightSchedules, active_terms, describe
from hpa.trainer.rollout_step import NoRollouts, RolloutStep, generate
from hpa.trainer.run_control import RunControl, write_exit_status
from hpa.trainer.setup import build_run
from hpa.trainer.startup_probes import (START_MEASURES, ProbeInputs, SavedStartMeasures, measure_start,
                                        saved_start_measures)
from hpa.trainer.state import RunState

logger = logging.getLogger("hpa")


class HPATrainer:
    """One run: its parts (``setup.RunParts``), its state (``state.RunState``: the step, save, restore,
    rollback) and the loop. ``exit_reason`` says why ``train`` returned."""

    def __init__(self, cfg: Config, groups: ParallelGroups):
        """Raises ``CollectiveFailure`` (with the watchdog's message) when a collective of the start-up
        times out or loses a peer."""
        self.cfg, self.groups = cfg, groups
        self.progress = StepProgress(groups.rank, groups.world_size, cfg.parallel.timeout_minutes)
        try:
            with self.progress.phase("start-up"):
                self._start(Path(cfg.trainer.run_dir))
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            if groups.is_main:
                write_exit_status(Path(cfg.trainer.run_dir), "collective_failure", 0, best_step=0)
            raise CollectiveFailure(self.progress.collective_failure_message(exc)) from exc

    def _start(self, run_dir: Path) -> None:
        cfg, groups = self.cfg, self.groups
        faults.record_in(run_dir)
        faults.maybe_hang(0, groups.rank)
        if groups.is_main:
            write_resolved(cfg, run_dir)
        self.parts = p = build_run(cfg, groups)
        self.timings: Dict[str, float] = {}
        self.ctx = phases.StepContext.from_config(cfg, groups, vocab_size=p.tokenizer.vocab_size,
                                                  pad_id=p.tokenizer.pad_id, timer=self.timer)
        self.weights = WeightSchedules(cfg.algorithm)
        self.guard = Guard(cfg.guard)
        trainables = {"policy": p.policy, **({"critic": p.critic} if p.critic is not None else {})}
        parts = {"guard": self.guard, "prompt_sampler": p.prompt_sampler, "pair_sampler": p.pair_sampler,
                 **({"replay_sampler": p.replay_sampler} if p.replay_sampler is not None else {}),
                 "reward": p.reward, "policy_sched": p.policy.scheduler, "monitor": p.evaluator,
                 **({"critic_sched": p.critic.scheduler} if p.critic is not None else {})}
        self.state = RunState(cfg, groups, trainables, parts, self.guard)
        resume_from = self.state.resumable()
        self.controllers = self._controllers(p, RunState.saved_state(resume_from))
        self.state.add_parts(self.controllers.state_parts())
        # w_ppo = 0 for the whole run: plain DPO, which spends no rollouts (the KL and entropy terms,
        # which live on rollouts, go with them)
        pairs_only = not any(v > 0 for v in cfg.algorithm.hpa.w_ppo.used_values())
        if pairs_only:
            logger.info("algorithm.hpa.w_ppo is 0 for the whole run: DPO on the preference pairs only, no rollouts")
        self.rollouts = (NoRollouts if pairs_only else RolloutStep)(self)
        self.state.add_parts(self.rollouts.state_parts())
        self.control = RunControl(cfg.trainer, cfg.guard, self.guard, run_dir, is_main=groups.is_main)
        self.exit_reason = "done"
        resumed = self.state.resume(resume_from)
        if groups.is_main:
            start = self.weights.at(progress(self.state.step, cfg.trainer.total_steps), self.controllers.factors())
            logger.info("the objective at step %d:\n%s", self.state.step,
                        describe(start.scheduled(), start.factors.scales(), active_terms(cfg.algorithm)))
        self.metrics = MetricsWriter(run_dir, cfg.logging, is_main=groups.is_main, run_config=to_dict(cfg),
                                     resume_step=self.state.step + 1 if resumed else None,
                                     total_steps=cfg.trainer.total_steps)
        self.ref_log_probs = self._reference_cache(p) if cfg.data.cache_reference_log_probs else None
        self.num_params = sum(x.numel() for x in p.policy.model.parameters()) * groups.tensor_model_parallel_size \
            * groups.pipeline_model_parallel_size  # approximate: replicated norms are counted TP times
        self.peak_tflops = peak_tflops(cfg.trainer.peak_tflops_per_device, device_name(groups.device))

    def _controllers(self, p, saved: Optional[Dict]) -> Controllers:
        """The run's controllers, from the coverage estimator and the start-up probes' record: the checkpoint's
        (``saved``, the run state being resumed), else measured now on the start weights (and saved with the
        run state from here on)."""
        cfg, t = self.cfg, self.cfg.algorithm.hpa.trust
        coverage = CoverageEstimator(p.model_reward, p.pairs, p.heldout_pairs, pad_id=p.tokenizer.pad_id,
                                     margin=t.margin) if coverage_enabled(cfg) else None
        start = saved_start_measures(saved)
        if start is None:
            if saved is not None:
                logger.info("the checkpoint holds no start measures (saved before they were kept): measuring the start")
            start = measure_start(t, cfg.rollout, ProbeInputs(
                groups=self.groups, generate=self.generate, tokenizer=p.tokenizer, pad_id=p.tokenizer.pad_id,
                model_reward=p.model_reward, prompts=p.prompts, heldout_pairs=p.heldout_pairs,
                demonstrations=p.demonstrations, coverage=coverage, timer=self.timer,
                skill_rule=graded_rule(cfg.reward.rules)), gate=trust_gate_enabled(cfg))
        controllers = Controllers(cfg, ControllerInputs(groups=self.groups, timer=self.timer, start=start,
                                                        coverage=coverage))
        self.state.add_parts({START_MEASURES: SavedStartMeasures(start)})
        return controllers

    def heldout_nll(self) -> float:
        """The policy's NLL per token of the held-out chosen responses (the ``heldout_nll`` gate's signal)."""
        return heldout_nll(self.parts.policy.model, self.parts.heldout_pairs, self.ctx)

    def _reference_cache(self, p) -> torch.Tensor:
        """The reference's log-probs of every preference pair ``[N, 2]``, from the run's cache (built now when
        missing, stale or corrupt), so no step runs the reference over its pairs."""
        cfg = self.cfg
        key = reference_cache.cache_key(p.pairs, p.reference, self.groups, preference_path=cfg.data.preference_path,
                                        model_cfg=cfg.model, parallel_cfg=cfg.parallel,
                                        vocab_size=p.tokenizer.vocab_size, pad_id=p.tokenizer.pad_id,
                                        packed=cfg.trainer.sequence_packing)
        return reference_cache.load_or_build(Path(cfg.trainer.run_dir) / reference_cache.DIRECTORY, key, p.pairs,
                                             lambda examples: phases.reference_pair_log_probs(examples, p.reference,
                                                                                              self.ctx),
                                             self.groups)

    @contextlib.contextmanager
    def timer(self, name: str):
        """Adds the block's wall time to ``timing_s/<name>`` of the current step (synchronised on CUDA)."""
        key = f"timing_s/{name}"

        def add(seconds: float) -> None:
            self.timings[key] = self.timings.get(key, 0.0) + seconds

        with device_timer(self.groups.device, add), self.progress.phase(name):
            yield

    def train(self) -> Dict[str, float]:
        """Run to ``trainer.total_steps`` (or an early stop, a signal, ``max_steps_per_run``).

        Sets ``exit_reason`` (and writes it to ``exit_status.json``) to ``done``, ``all_skipped`` (the run
        ended but the guard skipped every optimizer step of this launch: nothing was learned), ``early_stop``,
        ``signal`` or ``max_steps_per_run`` (in the last two cases a checkpoint was saved, unless
        ``state.last_save_ok`` is False, and the next launch resumes from the newest one), ``save_failed`` (``checkpoint.on_save_failure=stop``) or
        ``collective_failure`` (a collective timed out or lost a peer; the error names the phase and
        the ranks waited for).
        """
        with self.control.catching_signals():
            try:
                last = self._train()
            except RuntimeError as exc:
                if not is_collective_failure(exc):
                    raise
                logger.error("%s", self.progress.collective_failure_message(exc))
                self.exit_reason, last = "collective_failure", {}
            finally:
                self.metrics.close()
        self.control.write_exit_status(self.exit_reason, self.state.step)
        return last

    def _train(self) -> Dict[str, float]:
        last: Dict[str, float] = {}
        state, t, due = self.state, self.cfg.trainer, self.control.due
        steps_this_run = 0
        if t.eval_interval > 0 and state.step == 0:
            self.metrics.write(0, self.evaluate())  # the starting point of the learning curve
        while state.step < t.total_steps:
            faults.maybe_hang(state.step + 1, self.groups.rank)
            self.progress.step = state.step + 1
            self.timings = {}
            with self.timer("step"):
                last = self.train_step()
            last.update(comm.reduce_metrics(self.timings, self.groups.dp_group, op="max"))
            last.update(update_perf(
                self.num_params, tokens=last.pop("_tokens"), padded_tokens=last.pop("_padded_tokens"),
                update_seconds=last.get("timing_s/update_actor", 0.0), step_seconds=last["timing_s/step"],
                model_parallel_size=self.groups.tensor_model_parallel_size * self.groups.pipeline_model_parallel_size,
                peak_tflops=self.peak_tflops))
            state.step += 1
            steps_this_run += 1
            if due(state.step, t.eval_interval):
                with self.progress.phase("evaluate"):
                    last.update(self.evaluate())
                state.last_eval = last.get("eval/score", state.last_eval)
            token_kl = float("inf") if faults.active("kl_spike", state.step, self.groups.rank) else last.get("kl/token")
            reason = self.guard.rollback_reason(token_kl)
            last.update(self.guard.metrics())
            stop = self.control.stop_reason(state.step, last, steps_this_run) if reason is None else None
            if reason is None and (stop or due(state.step, self.cfg.checkpoint.save_interval)):
                with self.progress.phase("checkpoint"):
                    if not state.save():
                        stop = stop if self.cfg.checkpoint.on_save_failure == "continue" else "save_failed"
            last["checkpoint/save_failures"] = float(state.save_failures)
            self.metrics.write(state.step, last)
            if reason is not None:
                if state.rollback(reason):
                    self.metrics.truncate(state.step + 1)
                continue
            if stop:
                self.exit_reason = stop
                break
        if steps_this_run and not self.guard.applied_this_launch and self.exit_reason == "done":
            self.exit_reason = "all_skipped"  # every update's gradient norm was non-finite or a spike
        return last

    def train_step(self) -> Dict[str, float]:
        p, ctx, step = self.parts, self.ctx, self.state.step
        weights = self.weights.at(progress(step, self.cfg.trainer.total_steps), self.controllers.factors())
        batch, metrics, weights = self.rollouts.collect(weights)
        with self.timer("reference"):
            pairs = self.step_pairs()
        pairs = pairs + self.step_replay()
        faults.maybe_kill(step + 1, self.groups.rank)
        with self.timer("update_actor"):
            metrics.update(phases.update_policy(
                batch, pairs, weights, p.policy, self.guard, ctx,
                wrap_loss=lambda loss_fn: faults.maybe_nan_loss(loss_fn, step + 1, self.groups.rank),
                controllers=self.controllers))
        metrics.update(self.rollouts.finish(batch))
        metrics.update(self.weights.metrics(weights))
        metrics["perf/max_memory_gb"] = peak_memory_gb(self.groups.device)
        return metrics

    def step_pairs(self):
        """This step's preference micro-batches with the reference's log-probs: cached, or a reference forward."""
        p = self.parts
        indices = p.pair_sampler.next_batch()
        cached = self.ref_log_probs[indices] if self.ref_log_probs is not None else None
        return phases.preference_micro_batches([p.pairs[i] for i in indices], p.reference, self.ctx, cached)

    def step_replay(self):
        """This step's replayed SFT examples as replay micro-batches (``algorithm.replay``; none when it is off)."""
        p = self.parts
        if p.replay_sampler is None:
            return []
        examples = [p.demonstrations[i] for i in p.replay_sampler.next_batch()]
        return phases.replay_micro_batches(examples, self.ctx)

    def generate(self, prompt_ids, params):
        return generate(self.parts, self.ctx, prompt_ids, params)

    def evaluate(self) -> Dict[str, float]:
        p = self.parts
        return p.evaluator.evaluate(p.policy.model, p.reference, self.generate, self.state.step,
                                    trust=self.controllers.factors().learned_trust)
