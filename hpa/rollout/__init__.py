"""Rollout engines behind one interface, chosen by ``rollout.engine`` from ``ROLLOUT_ENGINES``.

Every entry shares one signature: ``fn(rollout_cfg, model, groups, tokenizer_info, *, model_cfg,
checkpoint_path, **kwargs) -> RolloutEngine``. ``"megatron"`` (default; CPU and GPU) decodes on the
training policy in place; ``"vllm"`` (CUDA, or vLLM's CPU build; vllm is imported when the engine is
built) runs vLLM on weights synced from the policy before every rollout.
"""

from __future__ import annotations

from hpa.registry import Registry

from .base import (FINISH_LENGTH, FINISH_REASONS, FINISH_STOP, PartialRollout, RolloutBatch, RolloutEngine,
                   SamplingParams, TokenizerInfo, TrainingSequences, logprob_consistency, prompt_token_lists)
from .megatron_engine import build_megatron_engine
from .vllm_engine import build_vllm_engine

ROLLOUT_ENGINES = Registry("rollout engine")


@ROLLOUT_ENGINES.register("megatron")
def _megatron(rollout_cfg, model, groups, tokenizer_info, *, model_cfg=None, checkpoint_path=None, **kwargs):
    return build_megatron_engine(rollout_cfg, model, groups, tokenizer_info, **kwargs)


@ROLLOUT_ENGINES.register("vllm")
def _vllm(rollout_cfg, model, groups, tokenizer_info, *, model_cfg=None, checkpoint_path=None, **kwargs):
    return build_vllm_engine(rollout_cfg, model, groups, tokenizer_info, model_cfg=model_cfg,
                             checkpoint_path=checkpoint_path, **kwargs)


def build_rollout_engine(rollout_cfg, model, groups, tokenizer_info: TokenizerInfo, *, model_cfg=None,
                         checkpoint_path=None, **kwargs) -> RolloutEngine:
    """The engine named by ``rollout_cfg.engine``.

    Args:
        rollout_cfg: ``RolloutConfig`` (``rollout.*``).
        model: the policy GPTModel (possibly DDP-wrapped), as sharded for training.
        groups: the policy's ``ParallelGroups``.
        tokenizer_info: vocab size, EOS and pad ids (``TokenizerInfo.from_tokenizer(tok)``).
        model_cfg: the policy's ``ModelConfig`` (``model.*``); the vllm engine writes its HF config
            from it and requires it.
        checkpoint_path: the policy checkpoint (``model.policy_path``); the vllm engine reads the HF
            family of an ``hpa convert`` import there.
        **kwargs: engine-specific (``kv_cache``, ``decode`` for megatron; ``hf_model_path``, ``llm_kwargs``
            for vllm).
    """
    return ROLLOUT_ENGINES.get(rollout_cfg.engine)(rollout_cfg, model, groups, tokenizer_info, model_cfg=model_cfg,
                                                   checkpoint_path=checkpoint_path, **kwargs)


__all__ = ["FINISH_LENGTH", "FINISH_REASONS", "FINISH_STOP", "PartialRollout", "ROLLOUT_ENGINES", "RolloutBatch",
           "RolloutEngine", "SamplingParams", "TokenizerInfo", "TrainingSequences", "build_rollout_engine",
           "logprob_consistency", "prompt_token_lists"]
