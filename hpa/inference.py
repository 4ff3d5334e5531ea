"""The HPA KL guard and the loading of a policy checkpoint for sampling: the library both ``hpa generate``
and ``hpa serve`` sample through.

``KLGuard`` scores each sampled response's KL to the reference (k1, per token, at temperature 1, over the
tokenizer's true vocabulary) and samples the responses above ``kl_threshold`` again at
``guard_temperature`` (``hpa.generate``'s docstring gives the recipe). ``load_policy`` builds and loads
the policy (and reference) checkpoints and the rollout engine on them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Dict, Optional

import torch

from hpa.algorithms.masked import masked_mean
from hpa.config.errors import ConfigError
from hpa.data.tokenizer import build_tokenizer
from hpa.distributed import comm
from hpa.engine.batching import Batching
from hpa.engine.forward import response_kl
from hpa.models import unwrap
from hpa.models.stack import build_policy_stack
from hpa.rollout import build_rollout_engine
from hpa.rollout.base import RolloutBatch, SamplingParams, TokenizerInfo

logger = logging.getLogger(__name__)

_RETRY_SEED_STRIDE = 1_000_003  # separates the seeds of retry rounds from the first round's


def _response_kl(policy, reference, batch: RolloutBatch, groups, *, batching: Batching,
                 vocab_size: int) -> torch.Tensor:
    """Per-response mean k1 KL to the reference ``[b]`` (temperature 1, sampled tokens)."""
    kl = response_kl(policy, reference, batch, groups, batching=batching, vocab_size=vocab_size)
    return masked_mean(kl, batch.response_mask.float().cpu(), dim=1)  # [b]


def check_guard_args(*, guard_temperature: float, max_retries: int) -> None:
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    if guard_temperature < 0:
        raise ValueError(f"guard_temperature must be >= 0 (0 = greedy), got {guard_temperature}")


@dataclasses.dataclass
class GuardedBatch:
    """What ``KLGuard.generate`` returns.

    Attributes:
        batch: the responses, regenerated rows replaced.
        kl: ``[b]`` the KL of each returned response (NaN when the guard is off and no KL is scored).
        kl_before: ``[b]`` the KL of the first-round response.
        regenerated: ``[b]`` bool, the row was sampled again at the guard temperature.
    """

    batch: RolloutBatch
    kl: torch.Tensor
    kl_before: torch.Tensor
    regenerated: torch.Tensor


class KLGuard:
    """The HPA KL guard around a rollout engine (see the module docstring); ``hpa generate`` and
    ``hpa serve`` both sample through it.

    Args:
        engine: a ``RolloutEngine`` on ``policy``'s weights.
        policy, reference: the models the KL is scored with (``reference is policy``: KL 0, no second forward).
        groups: the policy's ``ParallelGroups``; the regenerate-or-not decision is collective over DP.
        batching: the micro-batches of the log-prob forwards.
        vocab_size: the tokenizer's true vocabulary.
        kl_threshold: responses whose KL is above it are regenerated.
        guard_temperature: the sampling temperature of regenerations.
        max_retries: regeneration rounds (0: none, the KL is still scored).
        score: score the KL at all (False: no reference forward, ``kl`` is NaN, nothing is regenerated).
    """

    def __init__(self, engine, policy, reference, groups, *, batching: Batching, vocab_size: int,
                 kl_threshold: float = 0.1, guard_temperature: float = 0.5, max_retries: int = 1,
                 score: bool = True):
        check_guard_args(guard_temperature=guard_temperature, max_retries=max_retries)
        self.engine, self.policy, self.reference, self.groups = engine, policy, reference, groups
        self.batching, self.vocab_size = batching, vocab_size
        self.kl_threshold, self.guard_temperature = kl_threshold, guard_temperature
        self.max_retries, self.score = max_retries, score

    def _kl(self, batch: RolloutBatch) -> torch.Tensor:
        return _response_kl(self.policy, self.reference, batch, self.groups,
                            batching=self.batching, vocab_size=self.vocab_size)  # [b]

    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams) -> GuardedBatch:
        """``params.n`` responses per prompt; rows above the threshold are sampled again (one response
        each, at ``guard_temperature``, with seeds derived from ``params.seed``). Collective over DP:
        every DP rank must call it the same number of times."""
        batch = self.engine.generate(prompts, params)
        b = batch.batch_size
        if not self.score:
            nan = torch.full((b,), float("nan"))
            return GuardedBatch(batch, nan, nan.clone(), torch.zeros(b, dtype=torch.bool))
        kl = self._kl(batch)  # [b]
        kl_before = kl.clone()
        regenerated = torch.zeros(b, dtype=torch.bool)
        row_prompts = [prompts[int(i)] for i in batch.group_ids.tolist()]
        for attempt in range(self.max_retries):
            # a collective decision: every DP rank runs (or skips) the round together
            over = (kl > self.kl_threshold).nonzero(as_tuple=True)[0]  # [k]
            flag = torch.tensor([float(len(over) > 0)])
            if comm.all_reduce_max(flag, self.groups.dp_group).item() == 0:
                break
            keep_result = len(over) > 0
            if not keep_result:
                over = torch.tensor([0])  # dummy row, result discarded
            retry = self.engine.generate([row_prompts[i] for i in over.tolist()], dataclasses.replace(
                params, n=1, temperature=self.guard_temperature,
                seed=params.seed + (attempt + 1) * _RETRY_SEED_STRIDE))
            retry_kl = self._kl(retry)  # [k]
            if not keep_result:
                continue
            batch = _replace_rows(batch, over, retry)
            kl[over] = retry_kl
            regenerated[over] = True
        return GuardedBatch(batch, kl, kl_before, regenerated)


@dataclasses.dataclass
class LoadedPolicy:
    """A policy checkpoint ready to sample from: its tokenizer, models, engine and ``KLGuard``."""

    tokenizer: Any
    policy: Any
    reference: Any
    engine: Any
    reference_is_policy: bool


def load_policy(cfg, groups, *, command: str, load_reference: bool = True,
                engine_kwargs: Optional[Dict[str, Any]] = None) -> LoadedPolicy:
    """Build and load ``model.policy_path`` (and ``model.reference_path``), and the rollout engine on it.

    Args:
        cfg: the root ``Config`` (``model``, ``parallel``, ``data`` tokenizer, ``rollout``).
        groups: ``ParallelGroups`` matching ``cfg.parallel``.
        command: named in messages (``hpa generate``, ``hpa serve``).
        load_reference: False: the reference is not built (no KL will be scored).
        engine_kwargs: engine-specific ``build_rollout_engine`` arguments.
    """
    m, g = cfg.model, groups
    if not m.policy_path:
        raise ValueError(f"{command} needs model.policy_path (a checkpoint written by save_model_weights, "
                         "e.g. <run_dir>/sft)")
    tokenizer = build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path, model_vocab_size=m.vocab_size)
    if m.lora.enabled:  # the base (model.policy_path) plus the adapters; the reference is the base
        return _with_adapters(cfg, g, tokenizer, command=command, load_reference=load_reference,
                              engine_kwargs=engine_kwargs)
    reference_is_policy = (not m.reference_path
                           or os.path.realpath(m.reference_path) == os.path.realpath(m.policy_path))
    if reference_is_policy and load_reference:
        logger.info("%s: the reference is the policy checkpoint %s, so every KL is 0 and the guard "
                    "never fires; set model.reference_path to guard against another model", command,
                    m.policy_path)
    stack = build_policy_stack(m, cfg.parallel, g, seed=0,
                               reference="policy" if reference_is_policy or not load_reference else "frozen")
    policy, reference = stack.policy, stack.reference
    policy.eval()
    reference.eval()
    engine = build_rollout_engine(cfg.rollout, unwrap(policy), g, TokenizerInfo.from_tokenizer(tokenizer),
                                  model_cfg=m, checkpoint_path=m.policy_path, **(engine_kwargs or {}))
    engine.sync_weights()  # the policy does not change here: one sync (vLLM) serves every call
    return LoadedPolicy(tokenizer, policy, reference, engine, reference_is_policy)


def _with_adapters(cfg, groups, tokenizer, *, command: str, load_reference: bool,
                   engine_kwargs: Optional[Dict[str, Any]]) -> LoadedPolicy:
    """``load_policy`` of a LoRA policy: ``model.lora``'s adapters attached to the loaded base and loaded from
    ``model.lora.adapter_path``; the reference is the base itself (the same module with its adapters off), so the
    KL guard measures the adapters' drift. The native engine samples through the adapters; vLLM gets the merged
    weights (``hf_tensors_from_megatron`` merges enabled adapters)."""
    m = cfg.model
    if not m.lora.adapter_path:
        raise ConfigError("model.lora.adapter_path", f"{command} with model.lora.rank {m.lora.rank} needs the "
                          "adapters: set it to a LoRA run's checkpoint (<run_dir>/checkpoints/step_N), or "
                          "model.lora.rank: 0 to use the base alone")
    if m.reference_path:
        raise ConfigError("model.reference_path", "with LoRA the reference is the base (model.policy_path) with the "
                          "adapters off; leave model.reference_path out")
    stack = build_policy_stack(m, cfg.parallel, groups, seed=0, reference="frozen" if load_reference else "policy")
    policy = stack.policy
    policy.eval()
    engine = build_rollout_engine(cfg.rollout, unwrap(policy), groups, TokenizerInfo.from_tokenizer(tokenizer),
                                  model_cfg=m, checkpoint_path=m.policy_path, **(engine_kwargs or {}))
    engine.sync_weights()
    return LoadedPolicy(tokenizer, policy, stack.reference, engine, not load_reference)


def _replace_rows(batch: RolloutBatch, rows: torch.Tensor, new: RolloutBatch) -> RolloutBatch:
    """``batch`` with rows ``rows`` replaced by ``new``'s rows (in order); group ids kept."""
    order = list(range(batch.batch_size))
    new_pos = {int(r): k for k, r in enumerate(rows.tolist())}
    keep = [i for i in order if i not in new_pos]
    merged = RolloutBatch.concat([batch.select(keep), new.select(list(range(new.batch_size)))]) if keep \
        else new.select(list(range(new.batch_size)))
    # merged rows: keep... then new...; put them back into the original order
    where = {i: k for k, i in enumerate(keep)}
    where.update({i: len(keep) + new_pos[i] for i in new_pos})
    out = merged.select([where[i] for i in order])
    out.group_ids = batch.group_ids.clone()
    return out
