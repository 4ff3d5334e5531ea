"""PPO losses: the clipped (dual-clip) policy surrogate, the clipped value loss and the entropy bonus.

Numerics follow verl 0.9.1 ``core_algos.compute_policy_loss_vanilla`` and ``compute_value_loss``; the
explained variance follows verl ``metric_utils`` (``critic/vf_explained_var``).

Policy losses share one signature (``POLICY_LOSSES``)::

    fn(old_log_prob, log_prob, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c,
       aggregation, importance_weights) -> (loss, metrics)

Metrics are detached 0-dim tensors (micro-batch means over the valid tokens), so callers can
reduce them across ranks.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from hpa.algorithms.losses import TOKEN_MEAN, Aggregation
from hpa.algorithms.masked import masked_mean
from hpa.registry import Registry

POLICY_LOSSES = Registry("policy loss")

Metrics = Dict[str, torch.Tensor]


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    aggregation: Aggregation,
    importance_weights: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, Metrics]:
    """Clipped PPO surrogate with dual-clip for negative advantages; see ``policy_loss``."""
    if not clip_ratio_c > 1.0:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {clip_ratio_c}")
    neg_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # [b, r]
    ratio = torch.exp(neg_approx_kl)
    ppo_kl = masked_mean(-neg_approx_kl, mask)

    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_losses = torch.maximum(losses_unclipped, losses_clipped)
    pg_clipfrac = masked_mean(torch.gt(losses_clipped, losses_unclipped).float(), mask)

    # Dual clip: for A < 0 the loss is capped at -A·c, so a huge ratio cannot blow it up.
    losses_dual = -advantages * clip_ratio_c
    dual_clip_losses = torch.min(losses_dual, clip_losses)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_losses, losses_dual) * (advantages < 0).float(), mask)

    pg_losses = torch.where(advantages < 0, dual_clip_losses, clip_losses)  # [b, r]
    if importance_weights is not None:
        pg_losses = pg_losses * importance_weights
    loss = aggregation(pg_losses, mask)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": pg_clipfrac.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
        "ppo_kl": ppo_kl.detach(),
    }
    return loss, metrics


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    name: str = "vanilla",
    clip_ratio: float = 0.2,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: float = 3.0,
    aggregation: Aggregation = TOKEN_MEAN,
    importance_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate loss (to minimise), with dual-clip for negative advantages.

    ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``;
    ``L = max(-A·ratio, -A·clip(ratio, 1 - low, 1 + high))``, and for ``A < 0`` additionally
    ``L = min(L, -A·clip_ratio_c)`` (dual-clip, https://arxiv.org/abs/1912.09729), so the loss of a
    token never exceeds ``|A|·c``. Optional per-token importance weights (e.g. rollout-correction
    weights) multiply the per-token losses before aggregation.

    Args:
        old_log_prob: log-probs of the sampled tokens under the rollout-time policy. # [b, r]
        log_prob: log-probs under the current policy (with grad). # [b, r]
        advantages: # [b, r]
        mask: valid response tokens. # [b, r]
        name: a name in ``POLICY_LOSSES``.
        clip_ratio: symmetric clip epsilon; ``clip_ratio_low``/``clip_ratio_high`` override a side.
        clip_ratio_c: dual-clip constant, > 1.
        aggregation: how the per-token losses become a scalar (mode and global counts).
        importance_weights: optional per-token weights. # [b, r]

    Returns:
        ``(loss, metrics)`` with metrics ``pg_loss``, ``pg_clipfrac`` (fraction of tokens where the
        clipped term is active), ``pg_clipfrac_lower`` (fraction where the dual clip is active) and
        ``ppo_kl`` (mean of ``old_log_prob - log_prob``).
    """
    return POLICY_LOSSES.get(name)(
        old_log_prob,
        log_prob,
        advantages,
        mask,
        clip_ratio_low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
        clip_ratio_high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        aggregation=aggregation,
        importance_weights=importance_weights,
    )


def truncated_importance_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
                                 threshold: float) -> Tuple[torch.Tensor, Metrics]:
    """Truncated importance sampling (TIS) weights of the rollout distribution, per token.

    ``w = min(exp(old_log_prob - rollout_log_prob), threshold)``, 0 where masked, detached: the
    policy-loss weight that corrects for the rollout engine sampling from a slightly different
    distribution than the training forward computes (another kernel, precision or engine).

    Args:
        old_log_prob: training-forward log-probs of the sampled tokens before the update. # [b, r]
        rollout_log_prob: log-probs the rollout engine returned for them. # [b, r]
        mask: response mask. # [b, r]
        threshold: the truncation cap, > 0.

    Returns:
        ``(weights, metrics)``: weights # [b, r]; ``is_weight_mean`` and ``is_truncated_frac``
        (share of valid tokens whose ratio exceeded the cap).
    """
    if not threshold > 0:
        raise ValueError(f"truncated importance sampling needs threshold > 0, got {threshold}")
    with torch.no_grad():
        mask = mask.to(old_log_prob.dtype)
        ratio = torch.exp(torch.clamp(old_log_prob - rollout_log_prob, min=-20.0, max=20.0))  # [b, r]
        weights = torch.clamp(ratio, max=threshold) * mask
        metrics = {"is_weight_mean": masked_mean(weights, mask),
                   "is_truncated_frac": masked_mean((ratio > threshold).to(mask.dtype), mask)}
    return weights, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(returns - values) / (Var(returns) + 1e-5)`` over the valid tokens (unbiased variances).

    Args:
        values: value predictions. # [b, r]
        returns: targets. # [b, r]
        mask: valid tokens. # [b, r]

    Returns:
        A detached 0-dim tensor (NaN with fewer than two valid tokens, as ``torch.var``).
    """
    with torch.no_grad():
        valid = mask.bool()
        valid_returns = torch.masked_select(returns, valid)
        valid_values = torch.masked_select(values, valid)
        return 1.0 - torch.var(valid_returns - valid_values) / (torch.var(valid_returns) + 1e-5)


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range_value: float,
    aggregation: Aggregation = TOKEN_MEAN,
) -> Tuple[torch.Tensor, Metrics]:
    """Clipped value loss ``0.5·agg(max((v - R)², (clip(v, v_old ± ε) - R)²))``.

    Args:
        vpreds: current critic predictions (with grad). # [b, r]
        returns: GAE returns. # [b, r]
        old_values: critic values at rollout time; the clip is centred on them. # [b, r]
        mask: valid tokens. # [b, r]
        clip_range_value: ε of the value clip.
        aggregation: how the per-token losses become a scalar.

    Returns:
        ``(loss, metrics)`` with ``vf_loss``, ``vf_clipfrac`` (fraction of tokens where the clipped
        term is larger) and ``vf_explained_var`` (of ``vpreds`` for ``returns``; verl logs the same
        formula for the rollout values).
    """
    vpred_clipped = torch.max(torch.min(vpreds, old_values + clip_range_value), old_values - clip_range_value)
    losses_unclipped = (vpreds - returns) ** 2
    losses_clipped = (vpred_clipped - returns) ** 2
    loss = 0.5 * aggregation(torch.max(losses_unclipped, losses_clipped), mask)
    vf_clipfrac = masked_mean(torch.gt(losses_clipped, losses_unclipped).float(), mask)
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": vf_clipfrac.detach(),
        "vf_explained_var": explained_variance(vpreds.detach(), returns, mask),
    }
    return loss, metrics


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    *,
    aggregation: Aggregation = TOKEN_MEAN,
) -> Tuple[torch.Tensor, Metrics]:
    """The entropy term to add to the loss: ``-coef · agg(entropy)``.

    Args:
        entropy: per-token entropy of the current policy (with grad), e.g. from the
            vocab-parallel entropy op. # [b, r]
        mask: valid tokens. # [b, r]
        coef: entropy coefficient (scheduled by the trainer).
        aggregation: how the per-token entropies become a scalar.

    Returns:
        ``(loss_term, metrics)`` with ``entropy`` (the aggregated entropy) and ``entropy_coef``.
    """
    aggregated = aggregation(entropy, mask)
    metrics = {
        "entropy": aggregated.detach(),
        "entropy_coef": torch.tensor(float(coef), dtype=aggregated.dtype),
    }
    return -coef * aggregated, metrics
