"""Rollout engines behind one interface, chosen by ``rollout.engine`` from ``ROLLOUT_ENGINES``.

Every entry shares one signature: ``fn(rollout_cfg, model, groups, tokenizer_info, **kwargs) ->
RolloutEngine``. ``"megatron"`` (default; CPU and GPU) decodes on the training policy in place;
``"vllm"`` (GPU only; vllm is imported when the engine is built) runs vLLM on synced weights.
"""

from __future__ import annotations

from hpa.registry import Registry

from .base import (FINISH_LENGTH, FINISH_REASONS, FINISH_STOP, RolloutBatch, RolloutEngine, SamplingParams,
                   TokenizerInfo, TrainingSequences, logprob_consistency, prompt_token_lists)

ROLLOUT_ENGINES = Registry("rollout engine")


@ROLLOUT_ENGINES.register("megatron")
def _megatron(rollout_cfg, model, groups, tokenizer_info, **kwargs):
    from .megatron_engine import build_megatron_engine

    return build_megatron_engine(rollout_cfg, model, groups, tokenizer_info, **kwargs)


@ROLLOUT_ENGINES.register("vllm")
def _vllm(rollout_cfg, model, groups, tokenizer_info, **kwargs):
    from .vllm_engine import build_vllm_engine

    return build_vllm_engine(rollout_cfg, model, groups, tokenizer_info, **kwargs)


def build_rollout_engine(rollout_cfg, model, groups, tokenizer_info: TokenizerInfo, **kwargs) -> RolloutEngine:
    """The engine named by ``rollout_cfg.engine``.

    Args:
        rollout_cfg: ``RolloutConfig`` (``rollout.*``).
        model: the policy GPTModel (possibly DDP-wrapped), as sharded for training.
        groups: the policy's ``ParallelGroups``.
        tokenizer_info: vocab size, EOS and pad ids (``TokenizerInfo.from_tokenizer(tok)``).
        **kwargs: engine-specific (``use_kv_cache`` for megatron; ``hf_model_path``, ``model_cfg``
            for vllm).
    """
    return ROLLOUT_ENGINES.get(rollout_cfg.engine)(rollout_cfg, model, groups, tokenizer_info, **kwargs)


__all__ = ["FINISH_LENGTH", "FINISH_REASONS", "FINISH_STOP", "ROLLOUT_ENGINES", "RolloutBatch", "RolloutEngine",
           "SamplingParams", "TokenizerInfo", "TrainingSequences", "build_rollout_engine", "logprob_consistency",
           "prompt_token_lists"]
