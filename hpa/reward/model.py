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

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hpa.config.errors import ConfigError, UserError
from hpa.config.linears import LINEARS
from hpa.config.reward import RewardConfig
from hpa.config.schema import LoRAConfig, ModelConfig, ParallelConfig
from hpa.data.tokenizer import Tokenizer, build_tokenizer
from hpa.distributed.groups import ParallelGroups
from hpa.models import build_reward
from hpa.models.heads import unwrap
from hpa.algorithms.masked import mean_pool
from hpa.reward.shaping import BaseRewardOutput, RewardInputs
from hpa.models.weights import MANIFEST, load_model_weights
from hpa.engine.forward import forward_only
from hpa.engine.batching import Batching
from hpa.engine.collate import TokenRows, chunks, collate

logger = logging.getLogger("hpa")
# Written next to megatron's files in a saved reward model directory.
REWARD_MODEL_INFO = "hpa_reward_model.json"
DEFAULT_BATCHING = Batching(micro_batch_size=8, pad_id=0)  # a ModelReward built without one: 8 sequences a micro-batch


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
                    num_heads: int, batching: Batching, pool_mask: Optional[torch.Tensor] = None,
                    hidden_size: Optional[int] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward-only scores of right-padded sequences, the same on every rank of the model replica.

    Every rank of a model replica (all TP and PP ranks) must call this with the same tensors.

    Args:
        model: a reward model (``build_reward``), possibly DDP-wrapped.
        input_ids, attention_mask: ``[b, s]`` right-padded.
        num_heads: K of the model.
        batching: ``micro_batch_size`` sequences per pipeline micro-batch (the last one is padded with empty
            rows), ``packed`` or padded to the whole width ``s``; no token budget (whole rows are scored).
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
    micro_batch_size = batching.micro_batch_size
    num_micro = -(-b // micro_batch_size)
    padded = num_micro * micro_batch_size
    pad_rows = padded - b

    def extend(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if x is None:
            return None
        return torch.cat([x, x.new_zeros((pad_rows, s))]) if pad_rows else x

    ids, mask, pool = extend(input_ids), extend(attention_mask), extend(pool_mask)
    lengths = mask.sum(dim=1).clamp(min=1)  # the filler rows score one pad token
    rows = TokenRows(input_ids=ids, lengths=lengths,
                     positional={"attention_mask": mask, **({"pool_mask": pool} if want_hidden else {})})
    # on the inputs' device; forward_backward moves them to the model's
    micro_batches = collate("rows", rows, chunks(padded, micro_batch_size), packed=batching.packed, cut=False)

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


# The ModelConfig fields that fix a reward model's weights and their math; the rest (dtype, layer
# implementation, recomputation, dropout, paths, LoRA) follow the run that loads it.
ARCHITECTURE_FIELDS: Tuple[str, ...] = (
    "num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_sequence_length", "num_query_groups",
    "ffn_hidden_size", "normalization", "norm_epsilon", "activation", "add_qkv_bias",
    "untie_embeddings_and_output_weights", "rotary_base", "make_vocab_size_divisible_by")


def architecture_of(model: ModelConfig) -> Dict[str, object]:
    """The architecture a reward model records: ``ARCHITECTURE_FIELDS`` of ``model``."""
    return {key: getattr(model, key) for key in ARCHITECTURE_FIELDS}


def tokenizer_record(tokenizer: Tokenizer) -> Dict[str, object]:
    """What a reward model records of its tokenizer: kind, file, vocabulary size and fingerprint."""
    return {"kind": tokenizer.kind, "path": str(getattr(tokenizer, "path", "")), "vocab_size": tokenizer.vocab_size,
            "fingerprint": tokenizer.fingerprint()}


def write_reward_model_info(directory: os.PathLike, *, num_heads: int, model: ModelConfig,
                            tokenizer: Optional[Dict[str, object]] = None, **extra) -> None:
    """Record K, the architecture (``architecture_of``) and the tokenizer (``tokenizer_record``) next to
    the weights, so a loader builds the reward model from them whatever the policy's size."""
    info = {"num_heads": num_heads, "hidden_size": model.hidden_size, "architecture": architecture_of(model),
            **({"tokenizer": tokenizer} if tokenizer is not None else {}), **extra}
    Path(directory, REWARD_MODEL_INFO).write_text(json.dumps(info, indent=2) + "\n")


def read_reward_model_info(path: os.PathLike) -> Optional[Dict[str, object]]:
    """The ``hpa_reward_model.json`` of a saved reward model, or None when it has none."""
    info_path = Path(path, REWARD_MODEL_INFO)
    if not info_path.is_file():
        return None
    try:
        return json.loads(info_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError("reward.model_paths", f"{info_path} is not valid JSON ({exc}); re-save the reward model "
                          "with 'hpa train-rm'") from None


def reward_model_config(policy: ModelConfig, path: os.PathLike, info: Optional[Dict[str, object]] = None, *,
                        key: str = "reward.model_paths") -> ModelConfig:
    """The ``ModelConfig`` a saved reward model is built with.

    A reward model that records its architecture is built from it (the run's dtype and layer
    implementation kept, LoRA and the policy's paths dropped); an older one, without the record, has the
    policy's architecture (checked against the hidden size it records).

    Raises:
        ConfigError: naming ``key`` on an unknown or invalid recorded architecture, or an old record whose
            hidden size is not the policy's.
    """
    info = read_reward_model_info(path) if info is None else info
    record = str(Path(path, REWARD_MODEL_INFO))
    if info is None or "architecture" not in info:
        if info is not None and info.get("hidden_size") not in (None, policy.hidden_size):
            raise ConfigError(key, f"reward model {path} has hidden size {info.get('hidden_size')} but model."
                              f"hidden_size={policy.hidden_size}, and its {REWARD_MODEL_INFO} records no "
                              "architecture to build it from; use the config the reward model was trained with",
                              source=record)
        return dataclasses.replace(policy, policy_path=None, reference_path=None, critic_path=None,
                                   lora=LoRAConfig())
    arch = info["architecture"]
    if not isinstance(arch, dict):
        raise ConfigError(key, f"its recorded architecture is {arch!r}, not a mapping of model.* keys; re-save the "
                          "reward model with 'hpa train-rm'", source=record)
    unknown = sorted(set(arch) - set(ARCHITECTURE_FIELDS))
    if unknown:
        raise ConfigError(key, f"reward model {path} records unknown architecture keys {unknown}; known: "
                          f"{', '.join(ARCHITECTURE_FIELDS)}", source=record)
    try:
        return dataclasses.replace(policy, **arch, policy_path=None, reference_path=None, critic_path=None,
                                   lora=LoRAConfig())
    except (ConfigError, TypeError) as exc:
        raise ConfigError(key, f"reward model {path}: its recorded architecture is invalid: {exc}",
                          source=record) from None


def checkpoint_tokenizer(path: os.PathLike) -> Tuple[Optional[Dict[str, object]], Optional[str]]:
    """The tokenizer a checkpoint was trained with, and where that is said: a reward model's
    ``hpa_reward_model.json`` record, else the ``data.tokenizer_*`` of the run's ``config.yaml`` up to three
    directories above it (``<run_dir>/reward_model``, ``<run_dir>/sft``, ``<run_dir>/checkpoints/step_N/policy``),
    fingerprinted now; ``(None, None)`` when neither names a tokenizer that can still be read."""
    import yaml

    info = read_reward_model_info(path) if Path(path).is_dir() else None
    if info is not None and isinstance(info.get("tokenizer"), dict):
        return info["tokenizer"], str(Path(path, REWARD_MODEL_INFO))
    for parent in list(Path(path).resolve().parents)[:3]:
        config = parent / "config.yaml"
        if not config.is_file():
            continue
        try:
            data = (yaml.safe_load(config.read_text()) or {}).get("data") or {}
            kind, file = data.get("tokenizer_kind"), data.get("tokenizer_path")
            if not (isinstance(kind, str) and isinstance(file, str) and os.path.exists(file)):
                return None, None
            return tokenizer_record(build_tokenizer(kind, file)), f"{config} (data.tokenizer_path)"
        except (yaml.YAMLError, AttributeError, UserError):
            return None, None
    return None, None


def check_reward_tokenizer(path: os.PathLike, info: Optional[Dict[str, object]],
                           tokenizer: Optional[Dict[str, object]], *, key: str = "reward.model_paths") -> None:
    """A reward model scores the policy's token ids, so it must have been trained with the same tokenizer.
    An older record without the tokenizer is checked against its run's ``config.yaml`` (``checkpoint_tokenizer``);
    with neither, a warning says that nothing could be checked.

    Args:
        path: the reward model directory.
        info: its ``read_reward_model_info``.
        tokenizer: the policy's ``tokenizer_record``; None: nothing to check against.

    Raises:
        ConfigError: naming both tokenizer files when their fingerprints differ, or when the policy's
            tokenizer has ids the reward model cannot embed.
    """
    if tokenizer is None:
        return
    recorded = (info or {}).get("tokenizer")
    source = str(Path(path, REWARD_MODEL_INFO))
    if not isinstance(recorded, dict):
        recorded, source = checkpoint_tokenizer(path)
    if recorded is None:
        logger.warning("reward model %s records no tokenizer (an older %s) and no run config.yaml above it names "
                       "one: it must have been trained with data.tokenizer_path=%s, which cannot be checked; re-save "
                       "it with 'hpa train-rm' to record it", path, REWARD_MODEL_INFO, tokenizer["path"])
        return
    check_same_tokenizer(recorded, tokenizer, key=key, what=f"reward model {path}", source=source)


def check_same_tokenizer(recorded: Dict[str, object], tokenizer: Dict[str, object], *, key: str, what: str,
                         source: str) -> None:
    """Raise a ConfigError naming ``key`` and both tokenizer files when the fingerprints differ."""
    if recorded.get("fingerprint") != tokenizer["fingerprint"]:
        raise ConfigError(key, f"{what} was trained with the tokenizer {recorded.get('path')!r} "
                          f"({recorded.get('kind')}, {recorded.get('vocab_size')} ids) but this run uses "
                          f"data.tokenizer_path={tokenizer['path']!r} ({tokenizer['kind']}, {tokenizer['vocab_size']} "
                          "ids), and the two map ids to different pieces; a reward model must share the policy's "
                          f"tokenizer: train it with 'hpa train-rm data.tokenizer_path={tokenizer['path']}'",
                          source=source)


def check_reward_weights(rm: ModelConfig, path: os.PathLike, num_heads: int, *, recorded: bool,
                         key: str = "reward.model_paths") -> None:
    """The shapes megatron saved at ``path`` (its metadata, no tensor read) against those of the reward model
    ``rm`` with ``num_heads`` heads, before anything is built: a policy checkpoint (an output layer over the
    vocabulary, no bias) and a model of another size are named here instead of a shape error in megatron's load.
    ``recorded``: whether ``rm`` is the architecture the checkpoint records (else it is the policy's)."""
    from megatron.core import dist_checkpointing

    directory = Path(path)
    if (directory / MANIFEST).is_file() and (directory / "policy").is_dir():
        directory = directory / "policy"
    try:
        found = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(str(directory)).items()
                 if hasattr(v, "global_shape")}
    except Exception as exc:  # noqa: BLE001  a file megatron cannot read: its own message, one line
        raise ConfigError(key, f"{path} cannot be read as a megatron checkpoint ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:200]})") from None
    head = found.get("output_layer.weight")
    if head is None or "output_layer.bias" not in found:
        what = "no output layer" if head is None else f"an output layer {list(head)} without a bias"
        raise ConfigError(key, f"{path} is not a reward model: it has {what} (a policy's over the vocabulary; a "
                          f"reward model's is [{num_heads}, hidden] with a bias); give the reward_model/ directory "
                          "that 'hpa train-rm' wrote, or train one from it (reward.training.backbone_path)")
    expected = {**{f"decoder.layers.{lin.parent}.{lin.name}.weight": (rm.num_layers, lin.out_features(rm),
                                                                      lin.in_features(rm)) for lin in LINEARS},
                "output_layer.weight": (num_heads, rm.hidden_size)}
    for name, shape in expected.items():
        if name in found and found[name] != shape:
            fix = f"its {REWARD_MODEL_INFO} records an architecture that does not match its weights; re-save it " \
                  "with 'hpa train-rm'" if recorded else f"it has no {REWARD_MODEL_INFO} with its architecture, so " \
                  f"it is built as the policy (model.*): a reward model of its own size needs that record (hpa " \
                  f"train-rm writes it)"
            if name == "output_layer.weight" and found[name][0] != num_heads:
                fix = f"set reward.num_heads: {found[name][0]}"
            raise ConfigError(key, f"reward model {path}: {name} is {list(found[name])}, {list(shape)} expected; "
                              f"{fix}")


def _checked_reward_config(model: ModelConfig, groups: ParallelGroups, path: os.PathLike, num_heads: int, *,
                           tokenizer: Optional[Dict[str, object]], key: str) -> ModelConfig:
    """The architecture of the reward model at ``path`` after every check that needs no model built: its
    heads, tokenizer, recorded architecture, layout and saved shapes."""
    info = read_reward_model_info(path)
    if info is not None and info.get("num_heads") != num_heads:
        raise ConfigError("reward.num_heads", f"{num_heads}, but reward model {path} has {info.get('num_heads')} "
                          f"heads; set reward.num_heads: {info.get('num_heads')}")
    check_reward_tokenizer(path, info, tokenizer, key=key)
    rm_cfg = reward_model_config(model, path, info, key=key)
    _check_layout(rm_cfg, groups, path)
    check_reward_weights(rm_cfg, path, num_heads, recorded=info is not None and "architecture" in info, key=key)
    return rm_cfg


def check_reward_models(reward: RewardConfig, model: ModelConfig, groups: ParallelGroups, *,
                        tokenizer: Optional[Dict[str, object]] = None) -> None:
    """Every check of ``reward.model_paths`` that ``ModelReward.from_config`` makes before building a model; a run
    makes it before its policy loads."""
    for i, path in enumerate(reward.model_paths):
        _checked_reward_config(model, groups, path, reward.num_heads, tokenizer=tokenizer,
                               key=f"reward.model_paths[{i}]")


def load_reward_model(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups, path: os.PathLike,
                      num_heads: int, *, tokenizer: Optional[Dict[str, object]] = None, trainable: bool = False,
                      key: str = "reward.model_paths"):
    """Build the reward model saved at ``path`` (under any TP/PP layout) from its recorded architecture
    (``reward_model_config``; ``model`` is the policy's) with ``num_heads`` heads, and load it.

    Args:
        tokenizer: the policy's ``tokenizer_record``, checked against the one the reward model records.
        key: the config key that named ``path``, for the errors.

    Raises:
        ConfigError: when the checkpoint records a different number of heads, was trained with another
            tokenizer, is not a reward model or not one of the architecture it is built with, or its
            architecture does not split over ``parallel``.
    """
    rm_cfg = _checked_reward_config(model, groups, path, num_heads, tokenizer=tokenizer, key=key)
    rm = build_reward(rm_cfg, parallel, groups, num_heads=num_heads)
    load_model_weights(rm, path, groups)
    if not trainable:
        rm.requires_grad_(False)
        rm.eval()
    return rm


def _check_layout(rm: ModelConfig, groups: ParallelGroups, path: os.PathLike) -> None:
    """A reward model of its own size shares the policy's TP/PP layout, so its dimensions must split over it."""
    tp, pp = groups.tensor_model_parallel_size, groups.pipeline_model_parallel_size
    for key, value, size, what in (("num_attention_heads", rm.num_attention_heads, tp, "TP"),
                                   ("num_query_groups", rm.kv_heads, tp, "TP"),
                                   ("num_layers", rm.num_layers, pp, "PP")):
        if value % size:
            raise ConfigError("reward.model_paths", f"reward model {path}: its {key}={value} does not split over "
                              f"the run's {what}={size}; train the reward model with a {key} divisible by {size}")


class ModelReward:
    """``BaseReward`` over one or more reward models: ``[b, models · heads]`` rewards and ``[b, h]``
    embeddings (mean-pooled final hidden state over the response tokens of the first model).

    Every rank of a model replica must call it with the same inputs; all of them get the same output.

    Args:
        models: reward models (``build_reward``), each with ``num_heads`` heads.
        groups: the layout they were built under.
        num_heads: heads per model.
        hidden_size: h of the first model (its embeddings are the ones returned).
        batching: ``micro_batch_size`` sequences per pipeline micro-batch, ``packed`` or not; its ``pad_id``
            (any valid token id: padding is masked) pads the sequences.
        with_embeddings: also compute the embeddings (needed for the diversity term).
    """

    def __init__(self, models: Sequence[torch.nn.Module], groups: ParallelGroups, *, num_heads: int,
                 hidden_size: int, batching: Batching = DEFAULT_BATCHING, with_embeddings: bool = True):
        if not models:
            raise ValueError("ModelReward needs at least one reward model")
        self.models = list(models)
        self.groups = groups
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.batching = batching
        self.with_embeddings = with_embeddings

    @classmethod
    def from_config(cls, reward: RewardConfig, model: ModelConfig, parallel: ParallelConfig,
                    groups: ParallelGroups, *, batching: Batching = DEFAULT_BATCHING,
                    with_embeddings: Optional[bool] = None,
                    tokenizer: Optional[Dict[str, object]] = None) -> "ModelReward":
        """Load every checkpoint of ``reward.model_paths`` (each with ``reward.num_heads`` heads), each built
        from the architecture it records (``model`` is the policy's: see ``reward_model_config``).

        Embeddings are computed when ``with_embeddings`` is True; by default (None) only when the
        shaping uses them (beta > 0 with the reward model as the diversity source). ``tokenizer`` (the
        policy's ``tokenizer_record``) is checked against each reward model's.
        """
        if not reward.model_paths:
            raise ValueError("reward.model_paths is empty; list the reward model checkpoint(s) "
                             "(the reward_model/ directory of an 'hpa train-rm' run)")
        models = [load_reward_model(model, parallel, groups, path, reward.num_heads, tokenizer=tokenizer,
                                    key=f"reward.model_paths[{i}]") for i, path in enumerate(reward.model_paths)]
        if with_embeddings is None:
            with_embeddings = reward.shaping.beta > 0 and reward.shaping.diversity_source == "reward_model"
        hidden_size = unwrap(models[0]).config.hidden_size  # the embeddings are the first model's
        return cls(models, groups, num_heads=reward.num_heads, hidden_size=hidden_size, batching=batching,
                   with_embeddings=with_embeddings)

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
            response_ids.cpu(), response_mask.cpu(), self.batching.pad_id,
            None if prompt_ids is None else prompt_ids.cpu(), None if prompt_mask is None else prompt_mask.cpu())
        _, embeddings = score_sequences(self.models[0], input_ids, attention_mask, self.groups,
                                        num_heads=self.num_heads, batching=self.batching,
                                        pool_mask=attention_mask, hidden_size=self.hidden_size)
        return embeddings.to(response_ids.device)

    def __call__(self, inputs: RewardInputs) -> BaseRewardOutput:
        input_ids, attention_mask, response_mask = join_prompt_response(
            inputs.response_ids.cpu(), inputs.response_mask.cpu(), self.batching.pad_id,
            None if inputs.prompt_ids is None else inputs.prompt_ids.cpu(),
            None if inputs.prompt_mask is None else inputs.prompt_mask.cpu())
        rewards, embeddings = [], None
        for i, rm in enumerate(self.models):
            want = self.with_embeddings and i == 0
            r, e = score_sequences(rm, input_ids, attention_mask, self.groups, num_heads=self.num_heads,
                                   batching=self.batching, pool_mask=response_mask if want else None,
                                   hidden_size=self.hidden_size)
            rewards.append(r)
            if want:
                embeddings = e
        device = inputs.response_ids.device
        return BaseRewardOutput(rewards=torch.cat(rewards, dim=1).to(device),  # [b, models · K]
                                embeddings=None if embeddings is None else embeddings.to(device))
