"""The reward model as a ``BaseReward``: K scalar heads read at each sequence's last token.

A reward model is the policy backbone with ``K`` scalar heads (``hpa.models.build_reward``); its
last pipeline stage returns ``[b, s, K]``. The score of a sequence is the head output at its LAST
real token (sequences are right-padded; attention is causal, so the padding after it cannot change
it). Several reward models (``reward.model_paths``) concatenate their heads: ``K = models · heads``.

Scoring runs forward-only through megatron's pipeline schedule, so it works under TP and PP; the
results live on the last stage and are broadcast over the pipeline group, so every rank of a model
replica returns the same ``[b, K]``. Each DP rank scores its own batch.

Decisions:
- The scored sequence is ``prompt + response`` with the padding of both removed through their masks
  (prompts may come left-padded from the rollout, responses right-padded), then right-padded.
  Without ``prompt_ids`` the response alone is scored.
- The embedding (for the diversity term) is the mean of the final hidden states (after the final
  norm) over the response tokens, from the first reward model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from hpa.config.reward import RewardConfig
from hpa.config.schema import ModelConfig, ParallelConfig
from hpa.distributed.groups import ParallelGroups
from hpa.models import build_reward
from hpa.algorithms.masked import mean_pool
from hpa.reward.shaping import BaseRewardOutput, RewardInputs
from hpa.models.weights import load_model_weights
from hpa.engine.forward import forward_only
from hpa.engine.micro_batch import MicroBatch

# Written next to megatron's files in a saved reward model directory.
REWARD_MODEL_INFO = "hpa_reward_model.json"


# ---------------------------------------------------------------------------------------------------
# Pure helpers


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each row's last real token: ``[b, s] -> [b]`` (0 for a row without tokens)."""
    mask = attention_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # [b, s]
    return torch.where(mask, positions, torch.zeros_like(positions)).max(dim=1).values


def gather_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence scores read at the last real token.

    Args:
        values: ``[b, s, K]`` head outputs.
        attention_mask: ``[b, s]``, 1 on real tokens.

    Returns:
        ``[b, K]``.
    """
    if values.dim() != 3 or values.shape[:2] != attention_mask.shape:
        raise ValueError(f"values must be [b, s, K] over attention_mask [b, s]; got {tuple(values.shape)} "
                         f"and {tuple(attention_mask.shape)}")
    index = last_token_index(attention_mask).to(values.device)  # [b]
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, index]  # [b, K]


def join_prompt_response(response_ids: torch.Tensor, response_mask: torch.Tensor, pad_id: int,
                         prompt_ids: Optional[torch.Tensor] = None,
                         prompt_mask: Optional[torch.Tensor] = None
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + response`` sequences with the padding of both parts removed.

    Args:
        response_ids, response_mask: ``[b, r]``.
        prompt_ids, prompt_mask: ``[b, p]`` (left- or right-padded) or None.

    Returns:
        ``input_ids [b, s]``, ``attention_mask [b, s]`` (1 on real tokens) and ``response_mask [b, s]``
        (1 on response tokens), int64.
    """
    b = response_ids.shape[0]
    rows: List[List[int]] = []
    prompt_lengths: List[int] = []
    for i in range(b):
        prompt = prompt_ids[i][prompt_mask[i].bool()].tolist() if prompt_ids is not None else []
        response = response_ids[i][response_mask[i].bool()].tolist()
        rows.append(prompt + response)
        prompt_lengths.append(len(prompt))
    s = max(1, max((len(r) for r in rows), default=1))
    input_ids = torch.full((b, s), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, s), dtype=torch.long)
    resp_mask = torch.zeros((b, s), dtype=torch.long)
    for i, (row, p) in enumerate(zip(rows, prompt_lengths)):
        input_ids[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        attention_mask[i, :len(row)] = 1
        resp_mask[i, p:len(row)] = 1
    return input_ids, attention_mask, resp_mask


# ---------------------------------------------------------------------------------------------------
# Scoring through the pipeline schedule


def score_sequences(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: ParallelGroups, *,
                    num_heads: int, micro_batch_size: int, pool_mask: Optional[torch.Tensor] = None,
                    hidden_size: Optional[int] = None, packed: bool = False
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward-only scores of right-padded sequences, the same on every rank of the model replica.

    Every rank of a model replica (all TP and PP ranks) must call this with the same tensors.

    Args:
        model: a reward model (``build_reward``), possibly DDP-wrapped.
        input_ids, attention_mask: ``[b, s]`` right-padded.
        num_heads: K of the model.
        packed: pack each micro-batch's rows (``trainer.sequence_packing``).
        micro_batch_size: sequences per pipeline micro-batch (the last one is padded with empty rows).
        pool_mask: ``[b, s]`` positions to mean-pool the final hidden state over; None: no embeddings.
        hidden_size: h; required with ``pool_mask``.

    Returns:
        ``rewards [b, K]`` float32 and ``embeddings [b, h]`` float32 (None without ``pool_mask``).
    """
    b, s = input_ids.shape
    if b == 0:
        raise ValueError("score_sequences got an empty batch")
    want_hidden = pool_mask is not None
    if want_hidden and hidden_size is None:
        raise ValueError("embeddings (pool_mask) need hidden_size")
    num_micro = -(-b // micro_batch_size)
    padded = num_micro * micro_batch_size
    pad_rows = padded - b

    def extend(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if x is None:
            return None
        return torch.cat([x, x.new_zeros((pad_rows, s))]) if pad_rows else x

    ids, mask, pool = extend(input_ids), extend(attention_mask), extend(pool_mask)
    lengths = mask.sum(dim=1).clamp(min=1)  # the filler rows score one pad token
    micro_batches = []  # on the inputs' device; forward_backward moves them to the model's
    for j in range(num_micro):
        rows = slice(j * micro_batch_size, (j + 1) * micro_batch_size)
        extra = {"pool_mask": pool[rows]} if want_hidden else {}
        micro_batches.append(MicroBatch.from_padded("rows", ids[rows], torch.zeros_like(ids[rows]), lengths[rows],
                                                    packed=packed, attention_mask=mask[rows], **extra))

    def read_scores(batch, output, hidden):
        out = {"rewards": gather_last_token(batch.unpack(output), batch["attention_mask"]).float()}  # [mb, K]
        if want_hidden:
            out["embeddings"] = mean_pool(batch.unpack(hidden), batch["pool_mask"]).float()  # [mb, h]
        return out

    shapes = {"rewards": (num_heads,)}
    if want_hidden:
        shapes["embeddings"] = (hidden_size,)
    out = forward_only(model, micro_batches, groups, read_scores, shapes, capture_hidden=want_hidden)
    return out["rewards"][:b], (out["embeddings"][:b] if want_hidden else None)


# ---------------------------------------------------------------------------------------------------
# Saved reward models


def write_reward_model_info(directory: os.PathLike, *, num_heads: int, hidden_size: int, **extra) -> None:
    """Record K (and h) next to the weights so a loader can check them against its config."""
    info = {"num_heads": num_heads, "hidden_size": hidden_size, **extra}
    Path(directory, REWARD_MODEL_INFO).write_text(json.dumps(info, indent=2) + "\n")


def load_reward_model(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups, path: os.PathLike,
                      num_heads: int, *, trainable: bool = False):
    """Build a reward model with ``num_heads`` heads and load ``path`` (saved under any TP/PP layout).

    Raises:
        ValueError: when the checkpoint records a different number of heads or hidden size.
    """
    info_path = Path(path, REWARD_MODEL_INFO)
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("num_heads") != num_heads:
            raise ValueError(f"reward model {path} has {info.get('num_heads')} heads but reward.num_heads="
                             f"{num_heads}; set reward.num_heads: {info.get('num_heads')}")
        if info.get("hidden_size") != model.hidden_size:
            raise ValueError(f"reward model {path} has hidden size {info.get('hidden_size')} but model."
                             f"hidden_size={model.hidden_size}; use the config the reward model was trained with")
    rm = build_reward(model, parallel, groups, num_heads=num_heads)
    load_model_weights(rm, path, groups)
    if not trainable:
        rm.requires_grad_(False)
        rm.eval()
    return rm


class ModelReward:
    """``BaseReward`` over one or more reward models: ``[b, models · heads]`` rewards and ``[b, h]``
    embeddings (mean-pooled final hidden state over the response tokens of the first model).

    Every rank of a model replica must call it with the same inputs; all of them get the same output.

    Args:
        models: reward models (``build_reward``), each with ``num_heads`` heads.
        groups: the layout they were built under.
        num_heads: heads per model.
        hidden_size: h of the models.
        pad_id: any valid token id; padding is masked.
        micro_batch_size: sequences per pipeline micro-batch.
        packed: pack each micro-batch's sequences (``trainer.sequence_packing``).
        with_embeddings: also compute the embeddings (needed for the diversity term).
    """

    def __init__(self, models: Sequence[torch.nn.Module], groups: ParallelGroups, *, num_heads: int,
                 hidden_size: int, pad_id: int = 0, micro_batch_size: int = 8, with_embeddings: bool = True,
                 packed: bool = False):
        if not models:
            raise ValueError("ModelReward needs at least one reward model")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        self.models = list(models)
        self.groups = groups
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.pad_id = pad_id
        self.micro_batch_size = micro_batch_size
        self.with_embeddings = with_embeddings
        self.packed = packed

    @classmethod
    def from_config(cls, reward: RewardConfig, model: ModelConfig, parallel: ParallelConfig,
                    groups: ParallelGroups, *, pad_id: int = 0, micro_batch_size: int = 8,
                    with_embeddings: Optional[bool] = None, packed: bool = False) -> "ModelReward":
        """Load every checkpoint of ``reward.model_paths`` (each with ``reward.num_heads`` heads).

        Embeddings are computed when ``with_embeddings`` is True; by default (None) only when the
        shaping uses them (beta > 0 with the reward model as the diversity source).
        """
        if not reward.model_paths:
            raise ValueError("reward.model_paths is empty; list the reward model checkpoint(s) "
                             "(the reward_model/ directory of an 'hpa train-rm' run)")
        models = [load_reward_model(model, parallel, groups, path, reward.num_heads) for path in reward.model_paths]
        if with_embeddings is None:
            with_embeddings = reward.shaping.beta > 0 and reward.shaping.diversity_source == "reward_model"
        return cls(models, groups, num_heads=reward.num_heads, hidden_size=model.hidden_size, pad_id=pad_id,
                   micro_batch_size=micro_batch_size, with_embeddings=with_embeddings, packed=packed)

    @property
    def num_outputs(self) -> int:
        """K of the output: models · heads."""
        return len(self.models) * self.num_heads

    def sequence_embeddings(self, response_ids: torch.Tensor, response_mask: torch.Tensor,
                            prompt_ids: Optional[torch.Tensor] = None,
                            prompt_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The first reward model's final hidden state mean-pooled over every real token of ``prompt + response``
        (the coverage trust's space: where a sequence lies against the preference data), ``[b, h]`` float32.
        ``response_*`` ``[b, r]``, ``prompt_*`` ``[b, p]``, as ``__call__``'s inputs."""
        input_ids, attention_mask, _ = join_prompt_response(
            response_ids.cpu(), response_mask.cpu(), self.pad_id, None if prompt_ids is None else prompt_ids.cpu(),
            None if prompt_mask is None else prompt_mask.cpu())
        _, embeddings = score_sequences(self.models[0], input_ids, attention_mask, self.groups,
                                        num_heads=self.num_heads, micro_batch_size=self.micro_batch_size,
                                        pool_mask=attention_mask, hidden_size=self.hidden_size, packed=self.packed)
        return embeddings.to(response_ids.device)

    def __call__(self, inputs: RewardInputs) -> BaseRewardOutput:
        input_ids, attention_mask, response_mask = join_prompt_response(
            inputs.response_ids.cpu(), inputs.response_mask.cpu(), self.pad_id,
            None if inputs.prompt_ids is None else inputs.prompt_ids.cpu(),
            None if inputs.prompt_mask is None else inputs.prompt_mask.cpu())
        rewards, embeddings = [], None
        for i, rm in enumerate(self.models):
            want = self.with_embeddings and i == 0
            r, e = score_sequences(rm, input_ids, attention_mask, self.groups, num_heads=self.num_heads,
                                   micro_batch_size=self.micro_batch_size,
                                   pool_mask=response_mask if want else None, hidden_size=self.hidden_size,
                                   packed=self.packed)
            rewards.append(r)
            if want:
                embeddings = e
        device = inputs.response_ids.device
        return BaseRewardOutput(rewards=torch.cat(rewards, dim=1).to(device),  # [b, models · K]
                                embeddings=None if embeddings is None else embeddings.to(device))
