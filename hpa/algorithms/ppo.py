"""PPO losses: the clipped (dual-clip) policy surrogate and its sequence-level relatives (GSPO, CISPO,
GMPO), the clipped value loss and the entropy bonus.

Numerics follow verl 0.9.1 ``core_algos.compute_policy_loss_vanilla``, ``compute_policy_loss_gspo``,
``compute_policy_loss_cispo``, ``compute_policy_loss_geo_mean`` and ``compute_value_loss`` (registered
under verl's names); the explained variance follows verl ``metric_utils`` (``critic/vf_explained_var``).

Policy losses share one signature (``POLICY_LOSSES``); their settings come as one object, so a
setting a new loss needs is a field of ``PolicyLossSettings``, not a keyword of every loss::

    fn(old_log_prob, log_prob, advantages, mask, settings: PolicyLossSettings) -> (loss, metrics)

Metrics are detached 0-dim tensors (micro-batch means over the valid tokens), so callers can
reduce them across ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from hpa.algorithms.losses import TOKEN_MEAN, Aggregation
from hpa.algorithms.masked import masked_mean, masked_sum
from hpa.registry import Registry

POLICY_LOSSES = Registry("policy loss")

Metrics = Dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class PolicyLossSettings:
    """What a policy loss reads besides its tensors (``policy_loss`` documents each)."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    aggregation: Aggregation
    importance_weights: Optional[torch.Tensor] = None


def _aggregated(pg_losses: torch.Tensor, mask: torch.Tensor, settings: PolicyLossSettings, *, clipfrac: torch.Tensor,
                ppo_kl: torch.Tensor, clipfrac_lower: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Metrics]:
    """The end of a token-level policy loss: the per-token losses ``[b, r]`` times ``settings.importance_weights``
    (when given), aggregated by ``settings.aggregation``, and the metrics every policy loss reports
    (``clipfrac_lower`` None: 0)."""
    if settings.importance_weights is not None:
        pg_losses = pg_losses * settings.importance_weights
    loss = settings.aggregation(pg_losses, mask)
    lower = torch.zeros((), dtype=loss.dtype) if clipfrac_lower is None else clipfrac_lower.detach()
    return loss, {"pg_loss": loss.detach(), "pg_clipfrac": clipfrac.detach(), "pg_clipfrac_lower": lower,
                  "ppo_kl": ppo_kl.detach()}


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, settings: PolicyLossSettings) -> Tuple[torch.Tensor, Metrics]:
    """Clipped PPO surrogate with dual-clip for negative advantages; see ``policy_loss``."""
    clip_ratio_low, clip_ratio_high = settings.clip_ratio_low, settings.clip_ratio_high
    clip_ratio_c = settings.clip_ratio_c
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
    return _aggregated(pg_losses, mask, settings, clipfrac=pg_clipfrac, clipfrac_lower=pg_clipfrac_lower,
                       ppo_kl=ppo_kl)


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, settings: PolicyLossSettings) -> Tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071): one importance ratio per sequence, the
    geometric mean of its token ratios, clipped like PPO's.

    As verl's ``compute_policy_loss_gspo`` (the paper's GSPO-token form): per token
    ``s_t = sg[s]·π_t/sg[π_t]`` with ``log s = mean over the response of (log_prob − old_log_prob)``, so
    the value of every token's ratio is the sequence's and its gradient is the token's; ``log s_t`` is
    clamped at 10; ``L_t = max(−A_t·s_t, −A_t·clip(s_t, 1 − low, 1 + high))``; no dual clip
    (``clip_ratio_c`` is unused). The loss is aggregated by ``aggregation`` (its mode and global counts), as
    verl 0.9.1 passes the configured ``loss_agg_mode``; the paper's sequence-level objective is
    ``seq-mean-token-mean``. Where verl differs from the paper, this follows verl: the paper clips one
    sequence-level ratio times a sequence-level advantage, verl (and this) takes per-token advantages
    (equal for outcome rewards, where both agree) and clamps ``log s`` at 10, which the paper does not. The
    paper's clip ranges are tiny (3e-4 / 4e-4), not PPO's 0.2.

    Metrics: ``pg_clipfrac`` (tokens where the clipped term is active), ``pg_clipfrac_lower`` (always 0),
    ``ppo_kl`` (mean of ``old_log_prob − log_prob``, unclamped), ``pg_loss``.
    """
    clip_ratio_low, clip_ratio_high = settings.clip_ratio_low, settings.clip_ratio_high
    mask = mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob  # [b, r]
    seq_lengths = mask.sum(dim=-1).clamp(min=1)  # [b]
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / seq_lengths  # [b]
    # the sequence's ratio as the value, the token's log-prob as the gradient
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)  # [b, r]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(losses_unclipped, losses_clipped)  # [b, r]
    clipfrac = masked_mean(torch.gt(losses_clipped, losses_unclipped).float(), mask)
    return _aggregated(pg_losses, mask, settings, clipfrac=clipfrac, ppo_kl=masked_mean(-log_ratio, mask))


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, settings: PolicyLossSettings) -> Tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): clip the importance-sampling weight, not the
    update, so every token keeps a gradient.

    As verl's ``compute_policy_loss_cispo``: ``ratio = exp(clamp(log_prob − old_log_prob, −20, 20))``,
    ``L_t = −sg[clip(ratio, 1 − low, 1 + high)]·A_t·log_prob_t``, aggregated by ``aggregation`` (every
    mode verl allows). The loss value therefore carries ``log_prob`` itself (it is not a surrogate that is
    0 at the old policy); its gradient is the clipped-weight policy gradient. ``clip_ratio_c`` is unused.
    The paper bounds only the upper side; a ``clip_ratio_low`` of 1 or more turns the lower bound off
    (verl's example uses 10). The paper normalises by the group's tokens (``token-mean``); verl lets the
    aggregation mode choose, and so does this.

    Metrics: ``pg_clipfrac`` (tokens whose weight was clipped, either side), ``pg_clipfrac_lower`` (always
    0), ``ppo_kl``, ``pg_loss``.
    """
    clip_ratio_low, clip_ratio_high = settings.clip_ratio_low, settings.clip_ratio_high
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # [b, r]
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob  # [b, r]
    clipfrac = masked_mean(torch.ne(ratio, clipped_ratio).float(), mask)
    return _aggregated(pg_losses, mask, settings, clipfrac=clipfrac, ppo_kl=masked_mean(-log_ratio, mask))


@POLICY_LOSSES.register("geo_mean")
def geo_mean_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                         mask: torch.Tensor, settings: PolicyLossSettings) -> Tuple[torch.Tensor, Metrics]:
    """GMPO (Zhao et al. 2025, https://arxiv.org/abs/2507.20673): maximise the geometric mean of the token
    ratios of a sequence, clipped token by token in log space.

    As verl's ``compute_policy_loss_geo_mean``: per token ``δ_t = log_prob − old_log_prob`` (unclamped),
    clipped against ``[−low, high]`` on the side the advantage's sign makes pessimistic
    (``sgn(A)·min(sgn(A)·δ, sgn(A)·clip(δ))``); per sequence ``ρ = exp(mean of the clipped δ)``,
    ``Â = mean of A`` over the response (the sequence advantage) and ``L = −Â·ρ``; with importance weights,
    ``L`` is multiplied by their geometric mean over the response (``exp(mean log(w + 1e-10))``).
    ``clip_ratio_c`` and ``aggregation.mode`` are unused (verl ignores ``loss_agg_mode`` here): the
    sequence losses are averaged over sequences.

    Deliberate difference from verl: verl averages with ``torch.mean`` over the rows of the micro-batch,
    so a fully masked row (a dropped or filtered response) counts in the denominator, and the mean is
    per micro-batch; here the mean is over the non-empty sequences, by ``aggregation.num_global_seqs`` when
    given (exact across micro-batches and DP ranks). Without fully masked rows, and for one micro-batch,
    the two are identical. The clip bounds are on the log-ratio (the paper's ``(e^−0.4, e^0.4)``:
    ``clip_ratio_low = clip_ratio_high = 0.4``), as in the paper and verl.

    Metrics (verl's): ``pg_clipfrac`` (tokens with A > 0 whose δ lies outside ``[−low, high]``, on either
    side), ``pg_clipfrac_lower`` (the same for A < 0), ``ppo_kl``, ``pg_loss``.
    """
    clip_ratio_low, clip_ratio_high = settings.clip_ratio_low, settings.clip_ratio_high
    aggregation, importance_weights = settings.aggregation, settings.importance_weights
    mask = mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob  # [b, r]
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.min(sign * log_ratio, sign * clamped)  # [b, r]
    seq_lengths = mask.sum(dim=-1)  # [b]
    seq_ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / (seq_lengths + 1e-8))  # [b]
    seq_advantage = masked_sum(advantages, mask, dim=-1) / (seq_lengths + 1e-8)  # [b]
    seq_losses = -seq_advantage * seq_ratio  # [b]
    if importance_weights is not None:
        seq_losses = seq_losses * torch.exp(
            masked_sum(torch.log(importance_weights + 1e-10), mask, dim=-1) / (seq_lengths + 1e-8))
    loss = aggregation.seq_mean(seq_losses, seq_lengths > 0)
    clipped = torch.ne(log_ratio, clamped).float()
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_mean(clipped * (advantages > 0).float(), mask).detach(),
        "pg_clipfrac_lower": masked_mean(clipped * (advantages < 0).float(), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
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
    """The policy loss ``name`` (to minimise); by default PPO's clipped surrogate with dual-clip.

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
        name: a name in ``POLICY_LOSSES``: ``vanilla`` (below), ``gspo``, ``cispo``, ``geo_mean`` (GMPO;
            their functions say how each uses the clip ratios and the aggregation).
        clip_ratio: symmetric clip epsilon; ``clip_ratio_low``/``clip_ratio_high`` override a side.
        clip_ratio_c: dual-clip constant, > 1.
        aggregation: how the per-token losses become a scalar (mode and global counts).
        importance_weights: optional per-token weights. # [b, r]

    Returns:
        ``(loss, metrics)`` with metrics ``pg_loss``, ``pg_clipfrac`` (fraction of tokens where the
        clipped term is active), ``pg_clipfrac_lower`` (fraction where the dual clip is active) and
        ``ppo_kl`` (mean of ``old_log_prob - log_prob``).
    """
    settings = PolicyLossSettings(clip_ratio_low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
                                  clip_ratio_high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
                                  clip_ratio_c=clip_ratio_c, aggregation=aggregation,
                                  importance_weights=importance_weights)
    return POLICY_LOSSES.get(name)(old_log_prob, log_prob, advantages, mask, settings)


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
