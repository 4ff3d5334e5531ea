"""The rollout interface: ``RolloutEngine.generate(prompts, SamplingParams) -> RolloutBatch``.

Every backend (the native Megatron engine, vLLM) samples ``n`` responses per prompt and returns a
``RolloutBatch``: left-padded prompts, right-padded responses with their mask, the log-prob of every
sampled token, finish reasons and group ids. Later phases attach more per-row tensors (old/ref
log-probs, values, rewards, advantages, ...) in ``extras``.

Log-prob convention (all engines): ``log softmax(logits / T)`` of the sampled token over the true
vocabulary, before top-k/top-p truncation; ``T = 1`` for greedy. The training forward reproduces it
with ``vocab_parallel_log_probs(logits, labels, tp_group, vocab_size, temperature=T)``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from hpa.distributed.comm import all_reduce_max, all_reduce_sum
from hpa.engine.sequences import TrainingSequences

FINISH_STOP = "stop"  # EOS or a stop id was sampled (and is part of the response)
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample.

    Attributes:
        n: responses per prompt.
        temperature: 0 means greedy.
        top_p: nucleus mass in ``(0, 1]``; 1 is off.
        top_k: -1 is off.
        max_new_tokens: response length limit.
        stop_token_ids: ids that end a response (besides EOS); the stop token is kept in the
            response and masked in.
        ignore_eos: do not stop on the tokenizer's EOS.
        seed: seeds the sampling generator; the same seed gives the same tokens under any TP size.
            Vary it per step (and per DP rank, if the prompts could repeat) to get fresh samples.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: Tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or positive, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, rollout_cfg, **overrides) -> "SamplingParams":
        """From ``RolloutConfig`` (``rollout.*``); keyword overrides win (e.g. ``seed=step``)."""
        values = dict(n=rollout_cfg.n, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                      top_k=rollout_cfg.top_k, max_new_tokens=rollout_cfg.max_new_tokens,
                      seed=rollout_cfg.seed)
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    """What an engine needs from the tokenizer.

    Attributes:
        vocab_size: true vocabulary size (the model's embedding may be padded beyond it).
        eos_token_id: ends a response unless ``SamplingParams.ignore_eos``.
        pad_token_id: fills prompts on the left and responses on the right.
    """

    vocab_size: int
    eos_token_id: int
    pad_token_id: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "TokenizerInfo":
        """From an ``hpa.data.tokenizer.Tokenizer``."""
        return cls(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)


Index = Union[torch.Tensor, Sequence[int], slice]


@dataclass
class RolloutBatch:
    """Sampled responses of one (DP-local) batch of prompts; row i came from prompt ``group_ids[i]``.

    Attributes:
        prompt_ids: ``[b, p]`` int64, left-padded with ``pad_token_id``.
        prompt_mask: ``[b, p]`` int64, 1 on prompt tokens.
        response_ids: ``[b, r]`` int64, right-padded with ``pad_token_id``.
        response_mask: ``[b, r]`` float32, 1 on sampled tokens (including the final EOS/stop token).
        log_probs: ``[b, r]`` float32, sampled-token log-probs (module docstring), 0 on padding.
        finish_reasons: ``b`` strings, ``"stop"`` (EOS/stop id) or ``"length"`` (max_new_tokens).
        group_ids: ``[b]`` int64, index of the prompt (in the ``generate`` call) a row answers.
        pad_token_id: the id used for padding.
        extras: optional per-row tensors ``[b, ...]`` added by later phases of a training step
            (``mask``: the loss mask, ``token_scores``, ``old_log_probs``, ``ref_log_probs``, ``values``,
            ``advantages``, ...); see ``set``. Everything per row of a step travels here.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor
    finish_reasons: List[str]
    group_ids: torch.Tensor
    pad_token_id: int = 0
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)
    _sequences: Optional[TrainingSequences] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        b = self.prompt_ids.shape[0]
        for name in ("prompt_mask", "response_ids", "response_mask", "log_probs", "group_ids"):
            if getattr(self, name).shape[0] != b:
                raise ValueError(f"RolloutBatch.{name} has {getattr(self, name).shape[0]} rows, prompt_ids {b}")
        if self.response_mask.shape != self.response_ids.shape or self.log_probs.shape != self.response_ids.shape:
            raise ValueError("RolloutBatch.response_mask and log_probs must have response_ids' shape "
                             f"{tuple(self.response_ids.shape)}")
        if len(self.finish_reasons) != b:
            raise ValueError(f"RolloutBatch.finish_reasons has {len(self.finish_reasons)} entries for {b} rows")
        for name, value in self.extras.items():
            self._check_extra(name, value)

    def _check_extra(self, name: str, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != self.batch_size:
            raise ValueError(f"RolloutBatch extra {name!r} must be a tensor with {self.batch_size} rows, "
                             f"got {getattr(value, 'shape', type(value))}")

    @property
    def batch_size(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """``[b]`` int64."""
        return self.prompt_mask.sum(dim=1).long()

    @property
    def response_lengths(self) -> torch.Tensor:
        """``[b]`` int64."""
        return self.response_mask.sum(dim=1).long()

    @property
    def sequence_lengths(self) -> torch.Tensor:
        """``[b]`` int64, the positions of each row's training sequence (its prompt and response tokens,
        at least 1): what a packed micro-batch computes for it."""
        return (self.prompt_lengths + self.response_lengths).clamp(min=1)

    def set(self, name: str, value: torch.Tensor) -> "RolloutBatch":
        """Attach (or replace) a per-row tensor ``[b, ...]``; returns self."""
        self._check_extra(name, value)
        self.extras[name] = value
        return self

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.extras[name]
        except KeyError:
            raise KeyError(f"RolloutBatch has no extra {name!r}; present: {sorted(self.extras)}") from None

    def select(self, rows: Index) -> "RolloutBatch":
        """The rows ``rows`` (bool mask ``[b]``, indices or slice), extras included."""
        if isinstance(rows, slice):
            index = torch.arange(self.batch_size)[rows]
        else:
            index = torch.as_tensor(rows)
            if index.dtype == torch.bool:
                if index.shape != (self.batch_size,):
                    raise ValueError(f"a bool row mask must have shape [{self.batch_size}], got {tuple(index.shape)}")
                index = index.nonzero(as_tuple=True)[0]
            index = index.long().reshape(-1)

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[index.to(t.device)]

        return RolloutBatch(prompt_ids=take(self.prompt_ids), prompt_mask=take(self.prompt_mask),
                            response_ids=take(self.response_ids), response_mask=take(self.response_mask),
                            log_probs=take(self.log_probs),
                            finish_reasons=[self.finish_reasons[i] for i in index.tolist()],
                            group_ids=take(self.group_ids), pad_token_id=self.pad_token_id,
                            extras={k: take(v) for k, v in self.extras.items()})

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Stack batches row-wise (prompts re-left-padded and responses re-right-padded to the widest).

        Group ids are kept as they are: offset them first if the batches came from different
        ``generate`` calls.
        """
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        pad = batches[0].pad_token_id
        p = max(b.prompt_ids.shape[1] for b in batches)
        r = max(b.response_ids.shape[1] for b in batches)

        def left(t, value):
            return torch.nn.functional.pad(t, (p - t.shape[1], 0), value=value)

        def right(t, value):
            return torch.nn.functional.pad(t, (0, r - t.shape[1]), value=value)

        keys = set(batches[0].extras)
        if any(set(b.extras) != keys for b in batches):
            raise ValueError("RolloutBatch.concat: every batch must carry the same extras")
        extras = {}
        for k in keys:
            parts = [b.extras[k] for b in batches]
            if len({t.shape[1:] for t in parts}) > 1:
                if any(t.dim() != 2 for t in parts):
                    raise ValueError(f"RolloutBatch.concat: extra {k!r} has different shapes "
                                     f"{[tuple(t.shape) for t in parts]}")
                width = max(t.shape[1] for t in parts)  # response-aligned [b, r]: right-pad with 0
                parts = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts]
            extras[k] = torch.cat(parts)
        return RolloutBatch(
            prompt_ids=torch.cat([left(b.prompt_ids, pad) for b in batches]),
            prompt_mask=torch.cat([left(b.prompt_mask, 0) for b in batches]),
            response_ids=torch.cat([right(b.response_ids, pad) for b in batches]),
            response_mask=torch.cat([right(b.response_mask, 0) for b in batches]),
            log_probs=torch.cat([right(b.log_probs, 0) for b in batches]),
            finish_reasons=[f for b in batches for f in b.finish_reasons],
            group_ids=torch.cat([b.group_ids for b in batches]), pad_token_id=pad, extras=extras)

    @property
    def sequences(self) -> TrainingSequences:
        """``training_sequences()``, built once per batch (the rows' tokens never change)."""
        if self._sequences is None:
            self._sequences = self.training_sequences()
        return self._sequences

    def training_sequences(self) -> TrainingSequences:
        """Right-padded ``prompt (no left padding) + response`` rows, see ``TrainingSequences``."""
        b, p = self.prompt_ids.shape
        r = self.response_ids.shape[1]
        s = p + r
        device = self.prompt_ids.device
        prompt_len = self.prompt_lengths.to(device)  # [b]
        input_ids = torch.full((b, s), self.pad_token_id, dtype=torch.long, device=device)
        # Left-aligned prompt: column j of the padded prompt moves to j - (p - p_i).
        cols = torch.arange(p, device=device).unsqueeze(0) - (p - prompt_len).unsqueeze(1)  # [b, p]
        real = self.prompt_mask.bool()
        rows = torch.arange(b, device=device).unsqueeze(1).expand(b, p)
        input_ids[rows[real], cols[real]] = self.prompt_ids[real]
        resp_pos = prompt_len.unsqueeze(1) + torch.arange(r, device=device).unsqueeze(0)  # [b, r]
        resp_real = self.response_mask.bool()
        input_ids[torch.arange(b, device=device).unsqueeze(1).expand(b, r)[resp_real],
                  resp_pos[resp_real]] = self.response_ids.to(device)[resp_real]
        labels = torch.full_like(input_ids, self.pad_token_id)
        labels[:, :-1] = input_ids[:, 1:]
        response_index = (resp_pos - 1).clamp(0, s - 1)  # [b, r]
        response_mask = torch.zeros((b, s), dtype=torch.float32, device=device)
        response_mask.scatter_(1, response_index, self.response_mask.float().to(device))
        position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s).contiguous()
        return TrainingSequences(input_ids=input_ids, position_ids=position_ids, labels=labels,
                                 response_mask=response_mask, response_index=response_index)


def logprob_consistency(rollout_log_probs: torch.Tensor, training_log_probs: torch.Tensor,
                        mask: torch.Tensor, group=None) -> Dict[str, float]:
    """How far the rollout engine's log-probs are from the training forward's on the same tokens.

    Args:
        rollout_log_probs: ``[b, r]`` from ``RolloutBatch.log_probs``.
        training_log_probs: ``[b, r]`` from the policy forward (same temperature).
        mask: ``[b, r]`` response mask.
        group: reduce over this process group (e.g. the DP group); None for local numbers.

    Returns:
        ``rollout/logprob_diff_mean`` (mean |diff| over masked tokens) and ``rollout/logprob_diff_max``.
    """
    diff = (rollout_log_probs.float() - training_log_probs.detach().float()).abs()
    m = mask.float()
    stats = torch.stack([(diff * m).sum(), m.sum()]).double()  # [2]
    peak = torch.where(m > 0, diff, torch.zeros_like(diff)).max().double().reshape(1) if diff.numel() \
        else torch.zeros(1, dtype=torch.float64, device=diff.device)
    if group is not None:
        all_reduce_sum(stats, group)
        all_reduce_max(peak, group)
    return {"rollout/logprob_diff_mean": float(stats[0] / stats[1].clamp(min=1)),
            "rollout/logprob_diff_max": float(peak[0])}


@dataclass(frozen=True, kw_only=True)
class PartialRollout:
    """The rows of one ``generate`` request stopped between decode steps (``RolloutEngine.resume``), to be
    continued, possibly by other weights. Every row is kept, the finished ones too: the sampling noise of a step
    is drawn for all rows (``hpa.rollout.sampling``), so the continuation draws what the uninterrupted call would.

    Attributes:
        prompts: the request's prompts (token-id lists, no padding); row i answers ``prompts[i // params.n]``.
        params: the request's sampling parameters (``max_new_tokens`` counts the steps done too).
        response_ids: int64 tokens of the steps done, pad after a row stopped. # [b, j]
        response_mask: bool, True on sampled tokens. # [b, j]
        log_probs: fp32 sampled-token log-probs (by the weights of the step that sampled each), 0 on padding. # [b, j]
        stopped: bool, the row sampled EOS or a stop id. # [b]
        generator_state: the sampling generator's state after the ``j`` steps (``torch.Generator.get_state``);
            None when greedy and on a request not started (``start``: the continuation seeds ``params.seed``).
            The continuation restores it, so a continued row's noise is that of the uninterrupted call.
    """

    prompts: List[List[int]]
    params: SamplingParams
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor
    stopped: torch.Tensor
    generator_state: Optional[torch.Tensor] = None

    @classmethod
    def start(cls, prompts, params: SamplingParams) -> "PartialRollout":
        """``prompts`` (token-id lists or 1-d tensors) with no step done."""
        token_lists = prompt_token_lists(prompts)
        b = len(token_lists) * params.n
        return cls(prompts=token_lists, params=params, response_ids=torch.zeros((b, 0), dtype=torch.long),
                   response_mask=torch.zeros((b, 0), dtype=torch.bool), log_probs=torch.zeros((b, 0)),
                   stopped=torch.zeros(b, dtype=torch.bool))

    def __post_init__(self):
        b, j = len(self.prompts) * self.params.n, self.response_ids.shape[1]
        for name in ("response_ids", "response_mask", "log_probs"):
            if tuple(getattr(self, name).shape) != (b, j):
                raise ValueError(f"PartialRollout.{name} has shape {tuple(getattr(self, name).shape)}, want {(b, j)}")
        if j > self.params.max_new_tokens:
            raise ValueError(f"PartialRollout has {j} steps, more than max_new_tokens {self.params.max_new_tokens}")

    @property
    def rows(self) -> List[List[int]]:
        """Each row's prompt (``params.n`` consecutive rows per prompt)."""
        return [p for p in self.prompts for _ in range(self.params.n)]

    @property
    def group_ids(self) -> torch.Tensor:
        """``[b]`` int64: the prompt each row answers."""
        return torch.arange(len(self.prompts)).repeat_interleave(self.params.n)

    @property
    def steps(self) -> int:
        """Decode steps done (``j``)."""
        return self.response_ids.shape[1]

    @property
    def done(self) -> bool:
        """Every row stopped, or ``max_new_tokens`` steps are done: nothing left to decode."""
        return self.steps >= self.params.max_new_tokens or bool(self.stopped.all())


class GenerationStopped(RuntimeError):
    """``generate`` stopped between decode steps because the engine's ``should_stop`` said so."""


class RolloutEngine(abc.ABC):
    """A backend the trainer samples from (chosen by ``rollout.engine``).

    Attributes:
        copies_weights: the engine samples from its own copy of the weights (vLLM), which
            ``sync_weights`` fills; False when it samples from the training policy in place.
        should_stop: called between decode steps by engines that decode step by step (the native one);
            True ends ``generate`` with ``GenerationStopped`` (``hpa serve``'s drain deadline; one process:
            the answer is not agreed over ranks).
    """

    name: str = ""
    copies_weights: bool = False
    has_async_worker: bool = False  # ``detached_copy`` gives an engine over its own weights (``hpa/rollout/worker.py``)
    can_resume: bool = False  # ``resume`` stops a request between decode steps and continues it (rollout.partial)
    should_stop: Optional[Callable[[], bool]] = None

    @abc.abstractmethod
    def generate(self, prompts, params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` responses for each prompt.

        Args:
            prompts: token-id lists (no padding).
            params: sampling parameters.

        Returns:
            ``RolloutBatch`` with ``len(prompts) · n`` rows; the n responses of prompt g are
            consecutive rows with ``group_ids == g``.
        """

    def resume(self, partial: PartialRollout, *,
               stop: Optional[Callable[[], bool]] = None) -> Union[RolloutBatch, "PartialRollout"]:
        """Continue ``partial`` (``PartialRollout.start`` for a new request) with the engine's current weights:
        the finished ``RolloutBatch``, or, when ``stop()`` said so between two decode steps, the rows so far
        as a ``PartialRollout`` (engines with ``can_resume`` only)."""
        raise NotImplementedError(f"the {self.name!r} rollout engine cannot stop a request and resume its rows "
                                  f"(rollout.partial needs rollout.engine=megatron)")

    def decode_metrics(self) -> Dict[str, float]:
        """Facts of the engine's decoding for the step's metrics (the native engine: which decode ran)."""
        return {}

    def sync_weights(self, *args, **kwargs) -> None:
        """Copy the current policy weights into the engine; a no-op for engines that use them in place.
        Callers sync before every rollout that follows a change of the weights."""

    def weights_held(self, named_tensors: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``named_tensors`` (the policy's, by Megatron name) with the values the engine samples from: the tensors
        themselves for an engine that uses them in place; an engine with a copy of its own puts in what it holds
        (a disaggregated rollout rank's delivery check reads them)."""
        return dict(named_tensors)

    def sleep(self) -> None:
        """Release the engine's memory (KV cache, and weights where it keeps its own) between rollouts."""

    def wake(self) -> None:
        """Undo ``sleep``."""


class WeightsFrom(RolloutEngine):
    """One weight-copying engine (``copies_weights``) sampling for ``model``: the engine is synced from
    ``model`` before a ``generate`` whenever another model was synced into it last. Several views on one
    engine sample from several policies with one copy of the inference weights in memory."""

    def __init__(self, engine: RolloutEngine, model):
        if not engine.copies_weights:
            raise ValueError(f"the {engine.name!r} engine samples from its own model in place; build one per model")
        self.engine, self.model = engine, model
        self.name = engine.name

    def generate(self, prompts, params: "SamplingParams") -> "RolloutBatch":
        if self.engine.synced_from is not self.model:
            self.engine.sync_weights(model=self.model)
        return self.engine.generate(prompts, params)


def decode_responses(tokenizer, batch: RolloutBatch) -> List[str]:
    """The response texts of ``batch``: each row's real tokens, EOS left out, through ``tokenizer.decode``."""
    eos = tokenizer.eos_id
    return [tokenizer.decode([t for t, keep in zip(ids, mask) if keep and t != eos])
            for ids, mask in zip(batch.response_ids.tolist(), batch.response_mask.tolist())]


def prompt_token_lists(prompts) -> List[List[int]]:
    """Token-id lists from a list of token-id lists or 1-d tensors."""
    out = [[int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)] for p in prompts]
    if not out:
        raise ValueError("generate() needs at least one prompt")
    if any(len(p) == 0 for p in out):
        raise ValueError("generate() got an empty prompt; every prompt needs at least one token")
    return out


__all__ = ["FINISH_LENGTH", "FINISH_REASONS", "FINISH_STOP", "PartialRollout", "RolloutBatch", "decode_responses",
           "RolloutEngine", "SamplingParams", "TokenizerInfo", "TrainingSequences", "WeightsFrom",
           "logprob_consistency", "prompt_token_lists"]
