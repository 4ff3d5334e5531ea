"""Off-policy correction of rollouts: truncated importance sampling, rejection sampling, the token veto,
and decoupled PPO (a proximal policy between the behaviour policy that sampled and the policy trained).

Options, semantics and metric names follow verl's rollout correction as of v0.7.0 (commit f9c855f7,
``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask``, ``compute_is_metrics`` / ``compute_rs_metrics`` and the veto step of
``compute_rollout_correction_and_rejection_mask``). Later verl replaced the ratio levels of ``rollout_rs``
by KL-estimator options (``token_k1``, ``seq_mean_k3``, ...) and dropped the veto; hpa keeps the v0.7.0
form. Everything is computed from ``log_ratio = log π_prox − log π_behaviour`` per token:

- ``rollout_is`` (``IS_LEVELS``): ``token`` weights ``exp(log_ratio)``; ``sequence`` one weight per row,
  ``exp(Σ log_ratio)``. Exponents are clamped to ±20, weights are 0 on padding, truncated at
  ``rollout_is_threshold`` (TIS) and detached.
- ``rollout_rs`` (``RS_LEVELS``): ``token`` | ``sequence`` (product of ratios) | ``geometric`` (geometric
  mean, ``exp(mean log_ratio)``); a token (or a whole row, for the sequence levels) whose weight lies
  outside ``[rollout_rs_threshold_lower, rollout_rs_threshold]`` leaves the mask (lower default:
  ``1 / rollout_rs_threshold``).
- ``rollout_token_veto_threshold``: a row with any valid token whose ratio is below it leaves the mask
  whole (applied after rejection, independently of it).

Metrics are verl's, under ``rollout_corr/`` (``rollout_is_mean/max/min/std``, ``rollout_is_eff_sample_size``,
``rollout_is_ratio_fraction_high/low``, ``rollout_is_seq_*``, the same for ``rollout_rs_*``,
``rollout_rs_masked_fraction``, ``rollout_rs_seq_masked_fraction``, ``rollout_is_veto_fraction``,
``rollout_is_catastrophic_token_fraction``), as detached 0-dim tensors. Like verl, row statistics average
over every row of the batch, empty ones included. Not ported: verl's off-policy diagnostics (KL, PPL,
χ²), ``rollout_is_batch_normalize`` and its bypass mode. Stricter than verl: thresholds must be finite,
and ``rollout_rs_threshold_lower`` may not exceed ``rollout_rs_threshold``.

Decoupled PPO (Hilton et al. 2021, https://arxiv.org/abs/2110.00641; AReaL's form): the PPO ratio and clip
are taken against the proximal policy ``π_prox`` (the policy before this update, recomputed by the trainer
at consume time), and each token's loss is weighted by ``π_prox / π_behaviour`` (the correction above);
``decoupled_policy_loss`` composes this with ``hpa.algorithms.ppo.policy_loss``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from hpa.algorithms.masked import masked_mean, masked_sum
from hpa.algorithms.ppo import policy_loss
from hpa.registry import Registry

Metrics = Dict[str, torch.Tensor]

SAFETY_BOUND = 20.0  # verl's bound on exponents: exp(±20) neither overflows nor underflows fp32

IS_LEVELS = Registry("rollout_is level")
RS_LEVELS = Registry("rollout_rs level")


class LevelWeights(NamedTuple):
    """What a level makes of the per-token log-ratios.

    Attributes:
        weights: the level's ratio per token, exponent clamped to ±20. # [b, r]
        log_ratio: the unclamped log-ratio the metrics read: per token # [b, r], or per row # [b, 1]
        per_sequence: whether the level gives one weight per row.
    """

    weights: torch.Tensor
    log_ratio: torch.Tensor
    per_sequence: bool


@IS_LEVELS.register("token")
@RS_LEVELS.register("token")
def token_level(log_ratio: torch.Tensor, mask: torch.Tensor) -> LevelWeights:
    """Each token's own ratio ``π_prox/π_behaviour``."""
    weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    return LevelWeights(weights, log_ratio, False)


@IS_LEVELS.register("sequence")
@RS_LEVELS.register("sequence")
def sequence_level(log_ratio: torch.Tensor, mask: torch.Tensor) -> LevelWeights:
    """The row's ratio, the product of its token ratios (unbiased, high variance)."""
    row_log_ratio = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)  # [b, 1]
    weights = torch.exp(torch.clamp(row_log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    return LevelWeights(weights, row_log_ratio, True)


@RS_LEVELS.register("geometric")
def geometric_level(log_ratio: torch.Tensor, mask: torch.Tensor) -> LevelWeights:
    """The geometric mean of the row's token ratios (length-normalised)."""
    row_log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)  # [b, 1]
    weights = torch.exp(torch.clamp(row_log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    return LevelWeights(weights, row_log_ratio, True)


def _check_threshold(option: str, value: Optional[float]) -> float:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not value > 0:
        raise ValueError(f"{option} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_mask(log_ratio: torch.Tensor, mask: torch.Tensor) -> None:
    if log_ratio.shape != mask.shape:
        raise ValueError(f"log-probs of shape {tuple(log_ratio.shape)} do not match the response mask's "
                         f"{tuple(mask.shape)}")
    if not mask.bool().any():
        raise ValueError("the response mask has no valid token; the rollout correction needs at least one")


def _weight_metrics(level: LevelWeights, weights: torch.Tensor, mask: torch.Tensor, prefix: str,
                    upper: float, lower: float) -> Metrics:
    """verl's ``compute_is_metrics`` / ``compute_rs_metrics`` (the two differ only in ``lower``)."""
    metrics: Metrics = {}
    log_upper, log_lower = math.log(upper), math.log(lower)
    if level.per_sequence:
        row_log_ratio = level.log_ratio  # [b, 1], unclamped: the true extremes
        metrics["max"] = torch.exp(torch.clamp(row_log_ratio.max(), max=SAFETY_BOUND))
        metrics["min"] = torch.exp(row_log_ratio.min())
        metrics["mean"] = masked_mean(weights, mask)
        metrics["ratio_fraction_high"] = (row_log_ratio > log_upper).to(weights.dtype).mean()
        metrics["ratio_fraction_low"] = (row_log_ratio < log_lower).to(weights.dtype).mean()
    else:
        metrics["mean"] = masked_mean(weights, mask)
        metrics["ratio_fraction_high"] = masked_mean((weights > upper).to(weights.dtype), mask)
        metrics["ratio_fraction_low"] = masked_mean((weights < lower).to(weights.dtype), mask)
        valid = mask.bool()
        metrics["max"] = weights.masked_fill(~valid, float("-inf")).max()
        metrics["min"] = weights.masked_fill(~valid, float("inf")).min()
    bounded = weights.clamp(min=lower, max=upper)  # so that squaring an outlier cannot dominate
    bounded_mean = masked_mean(bounded, mask)
    if mask.sum() > 1:
        variance = masked_mean(bounded.square(), mask) - bounded_mean.square()
        metrics["std"] = torch.sqrt(torch.clamp(variance, min=0.0))
    else:
        metrics["std"] = torch.zeros((), dtype=weights.dtype)
    normalised = bounded / (bounded_mean + 1e-8)
    metrics["eff_sample_size"] = 1.0 / masked_mean(normalised.square(), mask)
    row_means = masked_mean(weights, mask, dim=-1)  # [b]
    metrics["seq_mean"] = row_means.mean()
    metrics["seq_std"] = row_means.std() if row_means.numel() > 1 else torch.zeros((), dtype=weights.dtype)
    metrics["seq_max"] = row_means.max()
    metrics["seq_min"] = row_means.min()
    metrics["seq_max_deviation"] = (row_means - 1.0).abs().max()
    metrics["seq_fraction_high"] = (row_means > upper).to(weights.dtype).mean()
    metrics["seq_fraction_low"] = (row_means < lower).to(weights.dtype).mean()
    return {f"rollout_corr/{prefix}_{key}": value.detach() for key, value in metrics.items()}


def rollout_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, *, rollout_is: str,
                       rollout_is_threshold: float) -> Tuple[torch.Tensor, Metrics]:
    """Truncated importance-sampling weights ``min(π_prox/π_behaviour, threshold)`` at a level.

    Args:
        log_ratio: ``log π_prox − log π_behaviour`` of the sampled tokens. # [b, r]
        mask: valid response tokens. # [b, r]
        rollout_is: a name in ``IS_LEVELS``: ``token`` | ``sequence``.
        rollout_is_threshold: the truncation cap, > 0.

    Returns:
        ``(weights, metrics)``: detached weights, 0 on padding # [b, r]; the ``rollout_corr/rollout_is_*``
        metrics, taken before truncation (so ``ratio_fraction_high`` counts what the cap cut).
    """
    level_fn = IS_LEVELS.get(rollout_is)
    threshold = _check_threshold("rollout_is_threshold", rollout_is_threshold)
    _check_mask(log_ratio, mask)
    with torch.no_grad():
        mask = mask.to(log_ratio.dtype)
        level = level_fn(log_ratio, mask)
        weights = level.weights * mask
        metrics = _weight_metrics(level, weights, mask, "rollout_is", threshold, 1.0 / threshold)
        weights = weights.clamp(max=threshold)
    return weights, metrics


def rollout_rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, *, rollout_rs: str,
                           rollout_rs_threshold: float, rollout_rs_threshold_lower: Optional[float] = None,
                           ) -> Tuple[torch.Tensor, Metrics]:
    """The response mask without the tokens (or rows) whose ratio lies outside ``[lower, upper]``.

    Args:
        log_ratio: ``log π_prox − log π_behaviour``. # [b, r]
        mask: valid response tokens. # [b, r]
        rollout_rs: a name in ``RS_LEVELS``: ``token`` | ``sequence`` | ``geometric``.
        rollout_rs_threshold: upper bound of an accepted ratio, > 0.
        rollout_rs_threshold_lower: lower bound, in (0, upper]; None: ``1 / rollout_rs_threshold``.

    Returns:
        ``(mask, metrics)``: the kept tokens, in ``mask``'s dtype # [b, r]; ``rollout_corr/rollout_rs_*``,
        with ``rollout_rs_masked_fraction`` (share of valid tokens rejected) and
        ``rollout_rs_seq_masked_fraction`` (share of rows with a rejection; for the sequence levels, of
        rows rejected, empty rows counting as verl counts them).
    """
    level_fn = RS_LEVELS.get(rollout_rs)
    upper = _check_threshold("rollout_rs_threshold", rollout_rs_threshold)
    lower = 1.0 / upper if rollout_rs_threshold_lower is None else \
        _check_threshold("rollout_rs_threshold_lower", rollout_rs_threshold_lower)
    if lower > upper:
        raise ValueError(f"rollout_rs_threshold_lower ({lower}) must not exceed rollout_rs_threshold ({upper})")
    _check_mask(log_ratio, mask)
    with torch.no_grad():
        float_mask = mask.to(log_ratio.dtype)
        level = level_fn(log_ratio, float_mask)
        keep = ((level.weights >= lower) & (level.weights <= upper)).to(log_ratio.dtype)  # [b, r]
        metrics = _weight_metrics(level, level.weights, float_mask, "rollout_rs", upper, lower)
        metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(1 - keep, float_mask)
        if level.per_sequence:
            metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = (1 - keep[:, 0]).mean()
        else:
            rejected_rows = masked_sum(1 - keep, float_mask, dim=-1) > 0  # [b]
            metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = rejected_rows.to(log_ratio.dtype).mean()
        kept = (float_mask * keep).to(mask.dtype)
    return kept, metrics


def token_veto(log_ratio: torch.Tensor, mask: torch.Tensor, *, rollout_token_veto_threshold: float,
               ) -> Tuple[torch.Tensor, Metrics]:
    """Drop every row that has a valid token with ``π_prox/π_behaviour < threshold`` (a catastrophic token).

    Args:
        log_ratio: ``log π_prox − log π_behaviour``. # [b, r]
        mask: valid response tokens. # [b, r]
        rollout_token_veto_threshold: the smallest acceptable token ratio, > 0.

    Returns:
        ``(mask, metrics)``: ``mask`` with the vetoed rows zeroed # [b, r];
        ``rollout_corr/rollout_is_veto_fraction`` (share of rows vetoed, over all rows) and
        ``rollout_corr/rollout_is_catastrophic_token_fraction`` (share of valid tokens below the threshold).
    """
    vetoed, metrics = _vetoed_rows(log_ratio, mask, rollout_token_veto_threshold)
    return mask * (~vetoed).to(mask.dtype), metrics


def _vetoed_rows(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> Tuple[torch.Tensor, Metrics]:
    """Rows with a catastrophic valid token # [b, 1] bool, and the veto's metrics."""
    threshold = _check_threshold("rollout_token_veto_threshold", threshold)
    with torch.no_grad():
        catastrophic = (log_ratio < math.log(threshold)) & mask.bool()  # [b, r]
        vetoed = catastrophic.any(dim=-1, keepdim=True)  # [b, 1]
        metrics = {"rollout_corr/rollout_is_veto_fraction": vetoed.to(log_ratio.dtype).mean(),
                   "rollout_corr/rollout_is_catastrophic_token_fraction":
                       masked_mean(catastrophic.to(log_ratio.dtype), mask.to(log_ratio.dtype))}
    return vetoed, metrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutCorrection:
    """verl's rollout-correction options (v0.7.0 names); every one off by default.

    Attributes:
        rollout_is: importance-sampling level, a name in ``IS_LEVELS``; None: no weights.
        rollout_is_threshold: truncation cap of the weights, > 0.
        rollout_rs: rejection level, a name in ``RS_LEVELS``; None: no rejection.
        rollout_rs_threshold: upper bound of an accepted ratio (needed with ``rollout_rs``).
        rollout_rs_threshold_lower: lower bound; None: ``1 / rollout_rs_threshold``.
        rollout_token_veto_threshold: the token veto's threshold; None: no veto.
    """

    rollout_is: Optional[str] = None
    rollout_is_threshold: float = 2.0
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[float] = None
    rollout_rs_threshold_lower: Optional[float] = None
    rollout_token_veto_threshold: Optional[float] = None

    def __post_init__(self):
        if self.rollout_is is not None:
            IS_LEVELS.get(self.rollout_is)
            _check_threshold("rollout_is_threshold", self.rollout_is_threshold)
        if self.rollout_rs is not None:
            RS_LEVELS.get(self.rollout_rs)
            if self.rollout_rs_threshold is None:
                raise ValueError("rollout_rs_threshold must be set when rollout_rs is "
                                 f"{self.rollout_rs!r} (e.g. 2.0)")
            upper = _check_threshold("rollout_rs_threshold", self.rollout_rs_threshold)
            if self.rollout_rs_threshold_lower is not None:
                lower = _check_threshold("rollout_rs_threshold_lower", self.rollout_rs_threshold_lower)
                if lower > upper:
                    raise ValueError(f"rollout_rs_threshold_lower ({lower}) must not exceed "
                                     f"rollout_rs_threshold ({upper})")
        if self.rollout_token_veto_threshold is not None:
            _check_threshold("rollout_token_veto_threshold", self.rollout_token_veto_threshold)


def rollout_correction(proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, mask: torch.Tensor,
                       correction: RolloutCorrection) -> Tuple[Tuple[Optional[torch.Tensor], torch.Tensor], Metrics]:
    """IS weights, rejection and veto in verl's order: weights and rejection on the original mask, the veto's
    test on the original mask too, its rows then removed from the rejected mask.

    Args:
        proximal_log_prob: log-probs of the sampled tokens under the proximal policy (the trainer's
            forward before the update; verl's ``old_log_prob``). # [b, r]
        behaviour_log_prob: log-probs the sampling engine recorded, per token (tokens of one row may
            come from different policy versions). # [b, r]
        mask: valid response tokens. # [b, r]
        correction: the options.

    Returns:
        ``((weights, mask), metrics)``: detached weights # [b, r] (None when ``rollout_is`` is None), the
        response mask after rejection and veto # [b, r], and the ``rollout_corr/`` metrics (the veto's two
        are 0 when it is off, as verl logs them).
    """
    if proximal_log_prob.shape != behaviour_log_prob.shape:
        raise ValueError(f"proximal log-probs {tuple(proximal_log_prob.shape)} and behaviour log-probs "
                         f"{tuple(behaviour_log_prob.shape)} differ in shape")
    log_ratio = (proximal_log_prob - behaviour_log_prob).detach()  # [b, r]
    _check_mask(log_ratio, mask)
    metrics: Metrics = {}
    weights = None
    if correction.rollout_is is not None:
        weights, is_metrics = rollout_is_weights(log_ratio, mask, rollout_is=correction.rollout_is,
                                                 rollout_is_threshold=correction.rollout_is_threshold)
        metrics.update(is_metrics)
    kept = mask
    if correction.rollout_rs is not None:
        kept, rs_metrics = rollout_rejection_mask(log_ratio, mask, rollout_rs=correction.rollout_rs,
                                                  rollout_rs_threshold=correction.rollout_rs_threshold,
                                                  rollout_rs_threshold_lower=correction.rollout_rs_threshold_lower)
        metrics.update(rs_metrics)
    if correction.rollout_token_veto_threshold is not None:
        # as verl: the veto reads the original mask (a token rejection does not hide a catastrophic token)
        vetoed, veto_metrics = _vetoed_rows(log_ratio, mask, correction.rollout_token_veto_threshold)
        kept = kept * (~vetoed).to(kept.dtype)
        metrics.update(veto_metrics)
    else:
        zero = torch.zeros((), dtype=log_ratio.dtype)
        metrics["rollout_corr/rollout_is_veto_fraction"] = zero
        metrics["rollout_corr/rollout_is_catastrophic_token_fraction"] = zero.clone()
    return (weights, kept), metrics


def decoupled_policy_loss(proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                          log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                          correction: RolloutCorrection, **policy_loss_kwargs) -> Tuple[torch.Tensor, Metrics]:
    """Decoupled PPO: ``policy_loss`` with the ratio and clip around ``π_prox`` and the off-policy correction
    ``π_prox/π_behaviour`` (weights and rejection from ``rollout_correction``) per token.

    When the behaviour policy is the proximal one (a synchronous step), the token weights are exactly 1 and
    nothing is rejected, so the loss, its gradient and the policy-loss metrics equal
    ``policy_loss(proximal_log_prob, log_prob, advantages, mask, ...)`` bit for bit, except with ``geo_mean``,
    whose weighting ``exp(mean log(w + 1e-10))`` (verl's) is ``1 + 1e-10`` at ``w = 1``.

    Args:
        proximal_log_prob: log-probs under the proximal policy (no grad). # [b, r]
        behaviour_log_prob: log-probs recorded at sampling, per token. # [b, r]
        log_prob: log-probs under the policy being trained (with grad). # [b, r]
        advantages: # [b, r]
        mask: valid response tokens. # [b, r]
        correction: the rollout-correction options.
        **policy_loss_kwargs: ``hpa.algorithms.ppo.policy_loss``'s keywords (name, clip ratios, aggregation),
            except ``importance_weights``, which this function sets.

    Returns:
        ``(loss, metrics)``: the policy loss's metrics and the ``rollout_corr/`` ones.
    """
    if "importance_weights" in policy_loss_kwargs:
        raise ValueError("decoupled_policy_loss sets the importance weights itself (rollout_is); "
                         "do not pass importance_weights")
    (weights, kept), metrics = rollout_correction(proximal_log_prob, behaviour_log_prob, mask, correction)
    loss, loss_metrics = policy_loss(proximal_log_prob, log_prob, advantages, kept, importance_weights=weights,
                                     **policy_loss_kwargs)
    return loss, {**loss_metrics, **metrics}
