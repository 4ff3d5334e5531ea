"""Reward: rule rewards, uncertainty-aware shaping and the reward-hacking monitor.

The reward model itself (``hpa.reward.model``) is built elsewhere; it plugs in as a ``BaseReward``
returning ``[b, K]`` raw rewards and optionally ``[b, h]`` embeddings.
"""

from __future__ import annotations

from typing import Optional

from hpa.config.errors import ConfigError
from hpa.config.reward import RewardConfig, check_diversity_source
from hpa.reward.monitor import RewardHackingMonitor
from hpa.reward.rules import (RULE_REWARDS, RuleReward, extract_gsm8k_answer, gsm8k_score,
                              load_custom_function)
from hpa.reward.shaping import (COPY_PENALTY_MODES, EMBEDDING_SOURCES,
                                TARGET_LENGTH_MODES, BaseReward, BaseRewardOutput, CombinedReward,
                                EmbeddingBank, RewardInputs, RunningNormalizer, ShapedReward,
                                UncertaintyAwareReward, copy_penalty, diversity, ensemble_mean_std,
                                ngram_copy_rate, overlong_penalty, place_at_last_token,
                                target_length_penalty)


def build_reward(cfg: RewardConfig, model_reward: Optional[BaseReward] = None) -> UncertaintyAwareReward:
    """The shaped reward of a ``reward`` config section.

    Args:
        cfg: the section.
        model_reward: the reward model(s) built from ``cfg.model_paths`` by the caller (``[b, K]`` with
            K = len(model_paths)·num_heads); required exactly when model_paths is set.
    """
    if cfg.model_paths and model_reward is None:
        raise ValueError("reward.model_paths is set but no reward model was passed to build_reward")
    if model_reward is not None and not cfg.model_paths:
        raise ConfigError("reward.model_paths", "a reward model was given but model_paths is empty; "
                                                "list its checkpoint(s)")
    parts = [model_reward] if model_reward is not None else []
    custom = None
    if cfg.custom_function is not None:
        custom = load_custom_function(cfg.custom_function, allow_custom_code=cfg.allow_custom_code)
    if cfg.rules or custom is not None:
        parts.append(RuleReward.from_names(cfg.rules, cfg.rule_weight, custom))
    if not parts:
        raise ConfigError("reward", "no reward source; set reward.model_paths, reward.rules "
                                    "(valid: " + ", ".join(RULE_REWARDS.names()) + ") or "
                                    "reward.custom_function")
    check_diversity_source(cfg.shaping, has_reward_model=model_reward is not None)
    base = parts[0] if len(parts) == 1 else CombinedReward(parts)
    return UncertaintyAwareReward.from_config(cfg.shaping, base)


__all__ = [
    "COPY_PENALTY_MODES", "EMBEDDING_SOURCES", "RULE_REWARDS", "TARGET_LENGTH_MODES",
    "BaseReward", "BaseRewardOutput", "CombinedReward", "EmbeddingBank", "RewardHackingMonitor",
    "RewardInputs", "RuleReward", "RunningNormalizer", "ShapedReward", "UncertaintyAwareReward",
    "build_reward", "copy_penalty", "diversity", "ensemble_mean_std", "extract_gsm8k_answer",
    "gsm8k_score", "load_custom_function", "ngram_copy_rate", "overlong_penalty",
    "place_at_last_token", "target_length_penalty",
]
