"""Uncertainty-aware reward shaping: ``r = r̂ − α·σ + β·diversity − length_penalty − copy_penalty``.

Pure torch; nothing here touches ``torch.distributed``. State that must agree across DP ranks (the
diversity bank, the running normaliser) is updated only from tensors the caller has all-gathered over
the DP group, so every rank that feeds the same gathered tensors holds the same state.

Decisions (documented once, here):
- σ is the population std (``correction=0``) over the K heads/models: the spread of the ensemble at
  hand, defined for K = 1 (σ = 0) without a special case.
- Diversity of a response = 1 − mean cosine similarity to the bank entries, in [0, 2]. An empty bank
  gives diversity 0: no evidence of novelty, no bonus (and no constant shift on the first step). A
  batch is scored against the bank as it was BEFORE the batch is added.
- A sample whose raw reward (any head), embedding (when used) or shaped reward is NaN/inf is invalid:
  its reward is set to 0, ``valid`` is False, it is counted in ``reward/nonfinite_count`` and it never
  enters the bank or the normaliser. The trainer must drop it from the update.
- Metrics are means over the valid samples of this rank's batch (0.0 where none is valid or a term
  cannot be computed because its inputs were not given).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from hpa.registry import Registry
from hpa.rollout.base import decode_responses

EMBEDDING_SOURCES: Tuple[str, ...] = ("policy", "reward_model")

TARGET_LENGTH_MODES = Registry("target length mode")
COPY_PENALTY_MODES = Registry("copy penalty mode")


# ---------------------------------------------------------------------------------------------------
# Batch contracts for base rewards


@dataclasses.dataclass
class RewardInputs:
    """What a base reward may read. Token tensors are right- or left-padded; masks say which are real.

    Args:
        response_ids: ``[b, r]`` response token ids.
        response_mask: ``[b, r]`` 1 for response tokens, 0 for padding.
        prompt_ids: ``[b, p]`` prompt token ids (needed for the copy penalty).
        prompt_mask: ``[b, p]``.
        response_texts: decoded responses (needed by rule rewards).
        ground_truths: reference answers (needed by rule rewards).
    """

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    prompt_ids: Optional[torch.Tensor] = None
    prompt_mask: Optional[torch.Tensor] = None
    response_texts: Optional[Sequence[str]] = None
    ground_truths: Optional[Sequence[str]] = None

    @classmethod
    def from_batch(cls, batch, tokenizer, ground_truths: Optional[Sequence[str]]) -> "RewardInputs":
        """The inputs of a ``RolloutBatch``'s responses (decoded with ``tokenizer``, EOS left out)."""
        return cls(response_ids=batch.response_ids, response_mask=batch.response_mask, prompt_ids=batch.prompt_ids,
                   prompt_mask=batch.prompt_mask, response_texts=decode_responses(tokenizer, batch),
                   ground_truths=ground_truths)


@dataclasses.dataclass
class BaseRewardOutput:
    """Raw rewards of a base reward.

    Args:
        rewards: ``[b, K]``; K ensemble heads or K separate models (K = 1 for a rule).
        embeddings: ``[b, h]`` mean-pooled hidden state of the reward model, when it has one.
        rule: ``[b]`` the part of ``rewards`` (every head) that comes from rule rewards; None when no
            rule contributes (per-component advantages read it).
    """

    rewards: torch.Tensor
    embeddings: Optional[torch.Tensor] = None
    rule: Optional[torch.Tensor] = None


class BaseReward(Protocol):
    """Anything that scores a batch: the reward model(s), a rule reward, or a CombinedReward."""

    def __call__(self, inputs: RewardInputs) -> BaseRewardOutput: ...


class CombinedReward:
    """Sum of base rewards. ``[b, K]`` and ``[b, 1]`` outputs broadcast (a rule adds to every head, so
    it moves r̂ and leaves σ alone); two outputs with different K > 1 are an error. The embedding is the
    first one any part returns."""

    def __init__(self, parts: Sequence[BaseReward]):
        if not parts:
            raise ValueError("CombinedReward needs at least one base reward")
        self.parts = list(parts)

    def __call__(self, inputs: RewardInputs) -> BaseRewardOutput:
        total, embeddings, rule = None, None, None
        for part in self.parts:
            out = part(inputs)
            if out.rewards.dim() != 2:
                raise ValueError(f"{type(part).__name__} returned rewards of shape {tuple(out.rewards.shape)}; "
                                 "base rewards must be [b, K]")
            if total is not None and 1 not in (total.shape[1], out.rewards.shape[1]) \
                    and total.shape[1] != out.rewards.shape[1]:
                raise ValueError(f"cannot add base rewards with {total.shape[1]} and {out.rewards.shape[1]} "
                                 "heads; use the same K or K = 1")
            rewards = out.rewards.float()
            total = rewards if total is None else total + rewards
            if embeddings is None:
                embeddings = out.embeddings
            if out.rule is not None:
                rule = out.rule if rule is None else rule + out.rule
        return BaseRewardOutput(rewards=total, embeddings=embeddings, rule=rule)


# ---------------------------------------------------------------------------------------------------
# Terms, each a pure function


def place_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level scores: each response's scalar on its last real token, zeros elsewhere.

    Args:
        scores: ``[b]``.
        response_mask: ``[b, r]``; a row with no real token gets no score.

    Returns:
        ``[b, r]`` in the dtype of ``scores``.
    """
    mask = response_mask.bool()
    num_tokens = response_mask.shape[1]
    positions = torch.arange(num_tokens, device=mask.device).expand_as(mask)  # [b, r]
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values  # [b]
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.nonzero(last >= 0, as_tuple=True)[0]
    out[rows, last[rows]] = scores[rows]
    return out


def ensemble_mean_std(raw_rewards: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """r̂ and σ over K heads/models: ``[b, K] -> ([b], [b])``; σ is the population std (K = 1: σ = 0)."""
    if raw_rewards.dim() != 2:
        raise ValueError(f"raw rewards must be [b, K], got shape {tuple(raw_rewards.shape)}")
    raw = raw_rewards.float()
    return raw.mean(dim=1), raw.std(dim=1, correction=0)


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO overlong buffer (verl ``DAPORewardManager``), as a penalty ``>= 0`` to subtract.

    verl adds ``min(−(len − (max_len − L)) / L · factor, 0)``; this returns its negation.

    Args:
        lengths: ``[b]`` response lengths in tokens.
    """
    expected = max_response_length - buffer_len
    exceed = lengths.float() - expected
    return torch.clamp(exceed / buffer_len * penalty_factor, min=0.0)


@TARGET_LENGTH_MODES.register("two_sided")
def _target_two_sided(lengths: torch.Tensor, target: int, coef: float) -> torch.Tensor:
    return coef * (lengths.float() - target).abs()


@TARGET_LENGTH_MODES.register("above")
def _target_above(lengths: torch.Tensor, target: int, coef: float) -> torch.Tensor:
    return coef * torch.clamp(lengths.float() - target, min=0.0)


def target_length_penalty(lengths: torch.Tensor, target: int, coef: float, mode: str) -> torch.Tensor:
    """``two_sided``: coef·|len − target|; ``above``: coef·max(0, len − target). ``[b] -> [b]``."""
    return TARGET_LENGTH_MODES.get(mode)(lengths, target, coef)


def _real_tokens(ids: torch.Tensor, mask: torch.Tensor) -> List[List[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def ngram_copy_rate(response_ids: torch.Tensor, response_mask: torch.Tensor, prompt_ids: torch.Tensor,
                    prompt_mask: torch.Tensor, n: int) -> torch.Tensor:
    """Fraction of a response's n-grams (counted with multiplicity) that occur in its prompt.

    Padding is removed with the masks before n-grams are formed, so left or right padding both work.
    A response with fewer than n tokens has copy rate 0.

    Args:
        response_ids: ``[b, r]``; response_mask: ``[b, r]``; prompt_ids: ``[b, p]``; prompt_mask: ``[b, p]``.

    Returns:
        ``[b]`` float32 in [0, 1].
    """
    rates = []
    for resp, prompt in zip(_real_tokens(response_ids, response_mask), _real_tokens(prompt_ids, prompt_mask)):
        resp_grams = [tuple(resp[i:i + n]) for i in range(len(resp) - n + 1)]
        if not resp_grams:
            rates.append(0.0)
            continue
        prompt_grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
        rates.append(sum(g in prompt_grams for g in resp_grams) / len(resp_grams))
    return torch.tensor(rates, dtype=torch.float32, device=response_ids.device)


@COPY_PENALTY_MODES.register("linear")
def _copy_linear(copy_rate: torch.Tensor, threshold: float, coef: float) -> torch.Tensor:
    return coef * torch.clamp(copy_rate - threshold, min=0.0)


@COPY_PENALTY_MODES.register("step")
def _copy_step(copy_rate: torch.Tensor, threshold: float, coef: float) -> torch.Tensor:
    return coef * (copy_rate > threshold).float()


def copy_penalty(copy_rate: torch.Tensor, threshold: float, coef: float, mode: str) -> torch.Tensor:
    """``linear``: coef·max(0, rate − threshold); ``step``: coef where rate > threshold. ``[b] -> [b]``."""
    return COPY_PENALTY_MODES.get(mode)(copy_rate, threshold, coef)


def diversity(embeddings: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """1 − mean cosine similarity of each embedding to the bank entries; 0 for an empty bank.

    Args:
        embeddings: ``[b, h]``.
        bank: ``[n, h]`` (n may be 0).

    Returns:
        ``[b]`` float32 in [0, 2].
    """
    if bank.shape[0] == 0:
        return torch.zeros(embeddings.shape[0], dtype=torch.float32, device=embeddings.device)
    e = torch.nn.functional.normalize(embeddings.float(), dim=-1)
    m = torch.nn.functional.normalize(bank.float().to(e.device), dim=-1)
    return 1.0 - (e @ m.T).mean(dim=1)


# ---------------------------------------------------------------------------------------------------
# State that lives in checkpoints


class EmbeddingBank:
    """FIFO ring buffer of the most recent response embeddings.

    Keep it identical on every DP rank: all-gather the batch embeddings (and validity) over the DP
    group and call ``update(all_rank_embeddings, all_rank_valid)`` with the gathered tensors on every
    rank. Stored in float32 on CPU.

    Args:
        capacity: number of embeddings kept.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"bank capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._buffer: Optional[torch.Tensor] = None  # [capacity, h]
        self._next = 0  # slot the next embedding goes to
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def entries(self) -> torch.Tensor:
        """``[n, h]`` oldest first (``[0, 0]`` before the first update)."""
        if self._buffer is None:
            return torch.zeros(0, 0)
        if self._size < self.capacity:
            return self._buffer[:self._size].clone()
        return torch.cat([self._buffer[self._next:], self._buffer[:self._next]])

    def update(self, all_rank_embeddings: torch.Tensor, all_rank_valid: Optional[torch.Tensor] = None) -> None:
        """Append the DP-gathered embeddings ``[B, h]`` in order; invalid rows (``[B]`` False) are skipped."""
        emb = all_rank_embeddings.detach().float().cpu()
        if all_rank_valid is not None:
            emb = emb[all_rank_valid.bool().cpu()]
        emb = emb[torch.isfinite(emb).all(dim=1)]
        if emb.shape[0] == 0:
            return
        if self._buffer is None:
            self._buffer = torch.zeros(self.capacity, emb.shape[1])
        elif emb.shape[1] != self._buffer.shape[1]:
            raise ValueError(f"embedding size {emb.shape[1]} differs from the bank's {self._buffer.shape[1]}")
        emb = emb[-self.capacity:]
        slots = (self._next + torch.arange(emb.shape[0])) % self.capacity
        self._buffer[slots] = emb
        self._next = int((self._next + emb.shape[0]) % self.capacity)
        self._size = min(self.capacity, self._size + emb.shape[0])

    def state_dict(self) -> Dict[str, object]:
        return {"capacity": self.capacity, "next": self._next, "size": self._size,
                "buffer": None if self._buffer is None else self._buffer.clone()}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        if state["capacity"] != self.capacity:
            raise ValueError(f"checkpoint bank capacity {state['capacity']} != configured "
                             f"{self.capacity} (reward.shaping.diversity_bank_size); set it back to "
                             f"{state['capacity']} to resume")
        buffer = state["buffer"]
        self._buffer = None if buffer is None else buffer.clone().float()
        self._next = int(state["next"])
        self._size = int(state["size"])


class RunningNormalizer:
    """Running mean and (population) variance by Welford/Chan merging, in float64.

    Feed ``update`` the DP-gathered rewards so every rank holds the same statistics. Non-finite and
    invalid values are ignored. Before any update, ``normalize`` is the identity.

    Args:
        eps: added to the variance before the square root.
    """

    def __init__(self, eps: float = 1e-8):
        self.eps = eps
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count else 1.0

    def update(self, all_rank_values: torch.Tensor, all_rank_valid: Optional[torch.Tensor] = None) -> None:
        x = all_rank_values.detach().double().flatten().cpu()
        keep = torch.isfinite(x)
        if all_rank_valid is not None:
            keep &= all_rank_valid.bool().flatten().cpu()
        x = x[keep]
        n = x.numel()
        if n == 0:
            return
        batch_mean = x.mean().item()
        batch_m2 = ((x - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, values: torch.Tensor) -> torch.Tensor:
        if self.count == 0:
            return values
        return ((values.double() - self.mean) / math.sqrt(self.var + self.eps)).to(values.dtype)

    def state_dict(self) -> Dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


# ---------------------------------------------------------------------------------------------------
# The wrapper


@dataclasses.dataclass
class ShapedReward:
    """Output of UncertaintyAwareReward; per-term tensors are ``[b]`` float32.

    Only ``rewards`` and ``token_level_scores`` are cleaned of non-finite values; the per-term tensors
    keep what was computed (``raw`` of an invalid row may be NaN), so read them through ``valid``.

    Args:
        rewards: final reward (0 where invalid).
        token_level_scores: ``[b, r]`` rewards on the last response token.
        valid: ``[b]`` bool; False rows must be excluded from the update.
        raw, sigma, diversity, length_penalty, copy_rate, copy_penalty: the terms.
        rule: the rule rewards' part of ``raw`` (zeros without a rule); ``rewards - rule`` is the
            learned part of the shaped reward (reward models, σ, diversity, length and copy terms).
        embeddings: ``[b, h]`` used for diversity (None when β = 0); the caller gathers it for ``update``.
        response_mask: ``[b, r]`` as given.
        metrics: ``reward/*`` scalars.
    """

    rewards: torch.Tensor
    token_level_scores: torch.Tensor
    valid: torch.Tensor
    raw: torch.Tensor
    sigma: torch.Tensor
    diversity: torch.Tensor
    length_penalty: torch.Tensor
    copy_rate: torch.Tensor
    copy_penalty: torch.Tensor
    embeddings: Optional[torch.Tensor]
    response_mask: torch.Tensor
    metrics: Dict[str, float]
    rule: Optional[torch.Tensor] = None


def _single_rank(x: torch.Tensor) -> torch.Tensor:
    return x


def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> float:
    return x[valid].float().mean().item() if valid.any() else 0.0


class UncertaintyAwareReward:
    """``r = r̂ − alpha·σ + beta·diversity − length_penalty − copy_penalty``, then optional running
    normalisation and clipping. Each term is switched off by a zero weight (or a None target).

    Use ``__call__`` for the whole step, or the three phases for explicit control:
    ``shape`` (reads state only) → gather over DP → ``update(all_rank_…)`` → ``finalize``.

    Args:
        base: the base reward (model, rule or CombinedReward); may be None when only ``shape`` is used.
        alpha, beta, diversity_bank_size, diversity_source, overlong_buffer_len, overlong_penalty_factor,
        max_response_length, target_length, target_length_coef, target_length_mode, copy_ngram,
        copy_threshold, copy_coef, copy_mode, normalize, clip: as in ``hpa.config.reward.ShapingConfig``.
    """

    def __init__(self, base: Optional[BaseReward] = None, *, alpha: float = 0.5, beta: float = 0.2,
                 diversity_bank_size: int = 1024, diversity_source: str = "reward_model",
                 overlong_buffer_len: int = 0, overlong_penalty_factor: float = 1.0,
                 max_response_length: Optional[int] = None, target_length: Optional[int] = None,
                 target_length_coef: float = 0.0, target_length_mode: str = "two_sided",
                 copy_ngram: int = 4, copy_threshold: float = 0.5, copy_coef: float = 1.0,
                 copy_mode: str = "linear", normalize: bool = False, clip: Optional[float] = None):
        if diversity_source not in EMBEDDING_SOURCES:
            raise ValueError(f"diversity_source {diversity_source!r}; valid: {', '.join(EMBEDDING_SOURCES)}")
        if overlong_buffer_len > 0 and max_response_length is None:
            raise ValueError("the overlong buffer needs max_response_length")
        TARGET_LENGTH_MODES.get(target_length_mode)
        COPY_PENALTY_MODES.get(copy_mode)
        self.base = base
        self.alpha, self.beta = alpha, beta
        self.diversity_source = diversity_source
        self.overlong_buffer_len = overlong_buffer_len
        self.overlong_penalty_factor = overlong_penalty_factor
        self.max_response_length = max_response_length
        self.target_length, self.target_length_coef = target_length, target_length_coef
        self.target_length_mode = target_length_mode
        self.copy_ngram, self.copy_threshold = copy_ngram, copy_threshold
        self.copy_coef, self.copy_mode = copy_coef, copy_mode
        self.clip = clip
        self.bank = EmbeddingBank(diversity_bank_size)
        self.normalizer = RunningNormalizer() if normalize else None

    @classmethod
    def from_config(cls, cfg, base: Optional[BaseReward] = None) -> "UncertaintyAwareReward":
        """Build from a ``hpa.config.reward.ShapingConfig``."""
        return cls(base, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})

    # -- phases --------------------------------------------------------------------------------------

    def shape(self, raw_rewards: torch.Tensor, response_mask: torch.Tensor, *,
              embeddings: Optional[torch.Tensor] = None, response_ids: Optional[torch.Tensor] = None,
              prompt_ids: Optional[torch.Tensor] = None,
              prompt_mask: Optional[torch.Tensor] = None, rule: Optional[torch.Tensor] = None) -> ShapedReward:
        """Shaped reward before normalisation; reads the bank, changes nothing.

        Args:
            raw_rewards: ``[b, K]`` base rewards.
            response_mask: ``[b, r]``.
            embeddings: ``[b, h]`` mean-pooled hidden states; required when beta > 0.
            response_ids, prompt_ids, prompt_mask: ``[b, r]``, ``[b, p]``, ``[b, p]``; required when
                copy_coef > 0 (when given with copy_coef = 0, the copy rate is still reported).
            rule: ``[b]`` the rule rewards' part of ``raw_rewards`` (``BaseRewardOutput.rule``).
        """
        b = raw_rewards.shape[0]
        device = raw_rewards.device
        zeros = torch.zeros(b, dtype=torch.float32, device=device)
        raw, sigma = ensemble_mean_std(raw_rewards)
        valid = torch.isfinite(raw_rewards).all(dim=1)
        shaped = raw - self.alpha * sigma if self.alpha else raw.clone()

        div = zeros
        if self.beta:
            if embeddings is None:
                raise ValueError(f"beta = {self.beta} needs [b, h] embeddings from the "
                                 f"{self.diversity_source} (reward.shaping.diversity_source); pass them "
                                 "or set reward.shaping.beta: 0")
            valid &= torch.isfinite(embeddings).all(dim=1)
            div = diversity(embeddings, self.bank.entries()).to(device)
            shaped = shaped + self.beta * div

        lengths = response_mask.sum(dim=1)
        length_pen = zeros
        if self.overlong_buffer_len > 0:
            length_pen = length_pen + overlong_penalty(lengths, self.max_response_length,
                                                       self.overlong_buffer_len, self.overlong_penalty_factor)
        if self.target_length is not None and self.target_length_coef:
            length_pen = length_pen + target_length_penalty(lengths, self.target_length,
                                                            self.target_length_coef, self.target_length_mode)
        shaped = shaped - length_pen

        copy_rate, copy_pen = zeros, zeros
        have_copy_inputs = response_ids is not None and prompt_ids is not None and prompt_mask is not None
        if self.copy_coef and not have_copy_inputs:
            raise ValueError(f"copy_coef = {self.copy_coef} needs response_ids, prompt_ids and prompt_mask; "
                             "pass them or set reward.shaping.copy_coef: 0")
        if have_copy_inputs:
            copy_rate = ngram_copy_rate(response_ids, response_mask, prompt_ids, prompt_mask,
                                        self.copy_ngram).to(device)
        if self.copy_coef:
            copy_pen = copy_penalty(copy_rate, self.copy_threshold, self.copy_coef, self.copy_mode)
            shaped = shaped - copy_pen

        valid &= torch.isfinite(shaped)
        shaped = torch.where(valid, shaped, zeros)
        return ShapedReward(
            rewards=shaped, token_level_scores=place_at_last_token(shaped, response_mask), valid=valid,
            raw=raw, sigma=sigma, diversity=div, length_penalty=length_pen, copy_rate=copy_rate,
            copy_penalty=copy_pen, embeddings=embeddings if self.beta else None,
            response_mask=response_mask, metrics={},
            rule=torch.where(valid, rule.float(), zeros) if rule is not None else zeros)

    def update(self, all_rank_embeddings: Optional[torch.Tensor], all_rank_rewards: torch.Tensor,
               all_rank_valid: torch.Tensor) -> None:
        """Add the DP-gathered batch to the bank and the normaliser (pre-normalisation rewards)."""
        if self.beta and all_rank_embeddings is not None:
            self.bank.update(all_rank_embeddings, all_rank_valid)
        if self.normalizer is not None:
            self.normalizer.update(all_rank_rewards, all_rank_valid)

    def finalize(self, shaped: ShapedReward) -> ShapedReward:
        """Normalise (running statistics), clip, re-place on the last token and fill ``metrics``."""
        rewards = shaped.rewards
        if self.normalizer is not None:
            rewards = self.normalizer.normalize(rewards)
        if self.clip is not None:
            rewards = rewards.clamp(-self.clip, self.clip)
        valid = shaped.valid
        rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
        kept = rewards[valid]
        metrics = {
            "reward/raw_mean": _masked_mean(shaped.raw, valid),
            "reward/sigma_mean": _masked_mean(shaped.sigma, valid),
            "reward/diversity_mean": _masked_mean(shaped.diversity, valid),
            "reward/length_penalty_mean": _masked_mean(shaped.length_penalty, valid),
            "reward/copy_rate": _masked_mean(shaped.copy_rate, valid),
            "reward/shaped_mean": kept.mean().item() if kept.numel() else 0.0,
            "reward/shaped_std": kept.std(correction=0).item() if kept.numel() else 0.0,
            "reward/nonfinite_count": float((~valid).sum().item()),
            # the learned part of r̂ (reward models alone), what a policy can exploit
            "reward/learned_mean": _masked_mean(shaped.raw - shaped.rule, valid),
        }
        return dataclasses.replace(shaped, rewards=rewards, metrics=metrics,
                                   token_level_scores=place_at_last_token(rewards, shaped.response_mask))

    # -- whole step ----------------------------------------------------------------------------------

    def __call__(self, inputs: RewardInputs, *, policy_embeddings: Optional[torch.Tensor] = None,
                 all_gather: Callable[[torch.Tensor], torch.Tensor] = _single_rank) -> ShapedReward:
        """Score a batch: base reward → shape → gather over DP → update state → finalize.

        Args:
            inputs: the batch.
            policy_embeddings: ``[b, h]``; used for diversity when diversity_source is ``policy``.
            all_gather: concatenates a ``[b, ...]`` tensor over the DP group along dim 0, the same order
                on every rank (``hpa.distributed.comm`` provides one); the identity for one rank.
        """
        if self.base is None:
            raise ValueError("this UncertaintyAwareReward has no base reward; call shape() with raw rewards")
        out = self.base(inputs)
        embeddings = policy_embeddings if self.diversity_source == "policy" else out.embeddings
        shaped = self.shape(out.rewards, inputs.response_mask, embeddings=embeddings,
                            response_ids=inputs.response_ids, prompt_ids=inputs.prompt_ids,
                            prompt_mask=inputs.prompt_mask, rule=out.rule)
        gathered_embeddings = all_gather(shaped.embeddings) if shaped.embeddings is not None else None
        self.update(gathered_embeddings, all_gather(shaped.rewards), all_gather(shaped.valid))
        return self.finalize(shaped)

    def state_dict(self) -> Dict[str, object]:
        return {"bank": self.bank.state_dict(),
                "normalizer": None if self.normalizer is None else self.normalizer.state_dict()}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.bank.load_state_dict(state["bank"])
        if self.normalizer is not None:
            if state["normalizer"] is None:
                raise ValueError("the checkpoint has no reward normaliser state but "
                                 "reward.shaping.normalize is true; resume with normalize: false")
            self.normalizer.load_state_dict(state["normalizer"])
