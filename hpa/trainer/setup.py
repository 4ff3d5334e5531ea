"""Everything an HPA run builds before its first step, in a fixed order (model initialisation draws from
the RNG, so the order is part of the run's numerics): tokenizer, data and samplers, policy, reference,
critic, rollout engine, reward, evaluator."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from hpa.config.errors import ConfigError
from hpa.config.schema import Config, demonstrations_needed, heldout_pairs_needed
from hpa.data.preferences import PreferenceDataset, SFTDataset
from hpa.data.prompts import PromptDataset
from hpa.data.sampler import DistributedBatchSampler
from hpa.data.tokenizer import build_tokenizer
from hpa.distributed.groups import ParallelGroups
from hpa.engine.batching import Batching
from hpa.engine.optimizer import Trainable, make_trainable
from hpa.models import unwrap
from hpa.models.stack import build_policy_stack
from hpa.reward import build_reward
from hpa.reward.model import ModelReward, check_reward_models, tokenizer_record
from hpa.rollout import build_rollout_engine
from hpa.rollout.base import TokenizerInfo
from hpa.trainer.evaluate import Evaluator


@dataclasses.dataclass
class RunParts:
    """The built parts of a run.

    Args:
        policy: the trained policy (DDP model, optimizer, LR schedule).
        reference: the frozen reference (the initial policy unless ``model.reference_path``).
        critic: the trained critic, with GAE only (``algorithm.advantage.estimator``), else None.
        engine: the rollout engine on the policy's weights.
        reward: the shaped reward (rule rewards and the reward-model ensemble, with uncertainty shaping).
        model_reward: the reward-model ensemble alone (the learned reward), None without reward models.
        demonstrations: the SFT examples of ``data.sft_path`` when the run reads them (the replay, or the
            coverage trust's measure of the start's skill, ``algorithm.hpa.trust.hold_min_skill``); else
            None.
        replay_sampler: the sampler of the ``demonstrations`` replayed in every step, with
            ``algorithm.replay`` on; else None.
    """

    tokenizer: object
    prompts: PromptDataset
    pairs: PreferenceDataset
    heldout_pairs: Optional[PreferenceDataset]
    prompt_sampler: DistributedBatchSampler
    pair_sampler: DistributedBatchSampler
    policy: Trainable
    reference: object
    critic: Optional[Trainable]
    engine: object
    reward: object
    evaluator: Evaluator
    model_reward: Optional[object] = None
    demonstrations: Optional[SFTDataset] = None
    replay_sampler: Optional[DistributedBatchSampler] = None


def build_run(cfg: Config, groups: ParallelGroups) -> RunParts:
    t = cfg.trainer
    rejects = cfg.data.rejects_dir or str(Path(t.run_dir) / "rejects")
    tokenizer = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path, model_vocab_size=cfg.model.vocab_size)
    prompts = PromptDataset.from_config(cfg.data, tokenizer, rejects_dir=rejects)
    pairs = PreferenceDataset.from_config(cfg.data, tokenizer, rejects_dir=rejects)
    heldout = (PreferenceDataset.from_config(cfg.data, tokenizer, rejects_dir=rejects, split="heldout")
               if heldout_pairs_needed(cfg) else None)
    seed = cfg.data.seed if cfg.data.seed is not None else t.seed

    def sampler(n: int, batch_size: int, seed: int, key: str, path: str) -> DistributedBatchSampler:
        return make_sampler(n, batch_size, seed, groups, shuffle=cfg.data.shuffle, key=key, path=path)

    prompt_sampler = sampler(len(prompts), t.global_batch_size, seed, "trainer.global_batch_size", cfg.data.prompt_path)
    pair_sampler = sampler(len(pairs), t.preference_batch_size, seed + 1, "trainer.preference_batch_size",
                           cfg.data.preference_path)
    replay_sampler = demonstrations = None
    if demonstrations_needed(cfg):
        demonstrations = SFTDataset.from_config(cfg.data, tokenizer, rejects_dir=rejects)
    if cfg.algorithm.replay.enabled:  # the SFT examples, replayed in every step (algorithm.replay)
        replay_sampler = sampler(len(demonstrations), t.replay_batch_size, seed + 2, "trainer.replay_batch_size",
                                 cfg.data.sft_path)
    if cfg.reward.model_paths:  # before the policy loads: a reward model that cannot load is told in a moment
        check_reward_models(cfg.reward, cfg.model, groups, tokenizer=tokenizer_record(tokenizer))
    policy, reference, critic = build_models(cfg, groups)
    # disaggregated: the rollout ranks sample with rollout.engine; the trainer's native engine, over the policy in
    # place, only names the weights pushed to them (and samples the evaluation), so no vLLM is built here
    rollout_cfg = cfg.rollout if groups.placement is None else dataclasses.replace(cfg.rollout, engine="megatron")
    engine = build_rollout_engine(rollout_cfg, unwrap(policy.model), groups, TokenizerInfo.from_tokenizer(tokenizer),
                                  model_cfg=cfg.model, checkpoint_path=cfg.model.policy_path)
    model_reward = None  # the learned (hackable) part of the reward, watched by the monitor
    if cfg.reward.model_paths:  # the reward-model ensemble (hpa train-rm), next to the rule rewards
        model_reward = ModelReward.from_config(cfg.reward, cfg.model, cfg.parallel, groups,
                                               batching=Batching.from_config(t, tokenizer.pad_id),
                                               tokenizer=tokenizer_record(tokenizer))
    reward = build_reward(cfg.reward, model_reward)
    evaluator = Evaluator(cfg.data, cfg.rollout, cfg.reward, groups, tokenizer, rejects_dir=rejects, reward=reward,
                          model_reward=model_reward,  # rows of micro_batch_size, no token budget
                          batching=Batching(micro_batch_size=t.micro_batch_size, pad_id=tokenizer.pad_id,
                                            packed=t.sequence_packing))
    return RunParts(tokenizer=tokenizer, prompts=prompts, pairs=pairs, heldout_pairs=heldout, prompt_sampler=prompt_sampler,
                    pair_sampler=pair_sampler, policy=policy, reference=reference, critic=critic, engine=engine,
                    reward=reward, evaluator=evaluator, model_reward=model_reward,
                    demonstrations=demonstrations, replay_sampler=replay_sampler)



def make_sampler(n: int, batch_size: int, seed: int, groups, *, shuffle: bool, key: str,
                 path: str) -> DistributedBatchSampler:
    """The sampler of ``n`` examples read from ``path`` in global batches of ``batch_size`` (the config's ``key``);
    a dataset that cannot fill one batch is a ``ConfigError`` naming the key and the file."""
    try:
        return DistributedBatchSampler(n, global_batch_size=batch_size, dp_rank=groups.dp_rank,
                                       dp_size=groups.data_parallel_size, seed=seed, shuffle=shuffle)
    except ValueError as exc:
        raise ConfigError(key, f"{exc} (the examples kept from {path}; the rejects file says what was dropped)") \
            from None


def build_models(cfg: Config, groups: ParallelGroups):
    """``(policy, reference, critic)``: the trained policy, the frozen reference and, with GAE, the critic
    (``build_policy_stack``), the policy and the critic wrapped for training (DDP, optimizer, LR schedule).

    With ``model.lora`` on, the policy is the loaded base plus adapters (the base frozen) and the reference
    is the same module with its adapters off (``BaseView``): no second copy. With GAE the critic is its own
    adapter set and value head over the same base (``CriticView``), with its own DDP and optimizer."""
    gae = cfg.algorithm.advantage.estimator == "gae"
    stack = build_policy_stack(cfg.model, cfg.parallel, groups, seed=cfg.trainer.seed, critic=gae)
    total, critic_lr = cfg.trainer.total_steps, cfg.optim.critic_lr or cfg.optim.lr
    critic = None
    if stack.critic is not None and cfg.model.lora.enabled:  # the wrapping order set-up has always had
        critic = make_trainable(stack.critic, cfg.optim, cfg.parallel, groups, total, lr=critic_lr)
    policy = make_trainable(stack.policy, cfg.optim, cfg.parallel, groups, total)
    if stack.critic is not None and critic is None:
        critic = make_trainable(stack.critic, cfg.optim, cfg.parallel, groups, total, lr=critic_lr)
    return policy, stack.reference, critic
