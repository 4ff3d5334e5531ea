"""Advantage estimators: GAE (with a critic) and group-normalised outcome estimators (without).

Numerics follow verl 0.9.1 ``core_algos`` (``compute_gae_advantage_return``,
``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_outcome_advantage``). Everything runs under ``torch.no_grad``.

Every registry entry has one signature::

    fn(token_rewards, mask, *, values, group_ids, gamma, lam, norm_by_std, epsilon)
        -> (advantages, returns)   # [b, r], [b, r]

Use ``compute_advantages(name, ...)`` to call one by its YAML name.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from hpa.algorithms.masked import masked_whiten
from hpa.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(like.dtype) if mask.dtype == torch.bool else mask


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, whitened over the valid tokens of the batch.

    Iterates backwards over the response. Where ``mask`` is 0 (padding, or observation/tool tokens
    inside a multi-turn response) the token is skipped: ``nextvalues`` and ``lastgaelam`` carry
    across it unchanged, so the TD error jumps from one valid token to the next (verl >= 0.5).

    Args:
        token_rewards: per-token rewards (the outcome score usually on the last valid token). # [b, r]
        values: critic values of the rollout policy. # [b, r]
        mask: valid response tokens, 0/1 or bool. # [b, r]
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``: advantages whitened (unbiased variance, eps 1e-8) over the valid
        tokens; returns = raw (un-whitened) advantages + values. # [b, r], [b, r]
    """
    with torch.no_grad():
        mask = _float_mask(mask, values)
        nextvalues = 0
        lastgaelam = 0
        reversed_advantages = []
        for t in reversed(range(token_rewards.shape[-1])):
            delta = token_rewards[:, t] + gamma * nextvalues - values[:, t]
            candidate = delta + gamma * lam * lastgaelam
            m = mask[:, t]
            nextvalues = values[:, t] * m + (1 - m) * nextvalues
            lastgaelam = candidate * m + (1 - m) * lastgaelam
            reversed_advantages.append(lastgaelam)
        advantages = torch.stack(reversed_advantages[::-1], dim=1)  # [b, r]
        returns = advantages + values
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _group_rows(group_ids) -> list:
    """Row indices of each group, groups in first-seen order, rows in batch order."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    rows = {}
    for i, g in enumerate(group_ids):
        rows.setdefault(g, []).append(i)
    return list(rows.values())


def compute_group_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids,
    *,
    baseline: str = "mean",
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Outcome advantages relative to the other responses to the same prompt (GRPO, Dr.GRPO, RLOO).

    The score of a response is the sum of its token rewards. With ``baseline="mean"`` (GRPO):
    ``A = (s - mean_g) / (std_g + epsilon)`` with the unbiased std, or ``A = s - mean_g`` when
    ``norm_by_std`` is False (Dr.GRPO). A singleton group uses mean 0 and std 1, so its advantage
    is ``s / (1 + epsilon)`` (or ``s``); a tied group gets 0. With ``baseline="leave_one_out"``
    (RLOO): ``A = (s - mean of the other responses) = n/(n-1)·(s - mean_g)``; a singleton keeps
    ``s``. The scalar is broadcast over the valid tokens.

    Args:
        token_rewards: per-token rewards. # [b, r]
        mask: valid response tokens. # [b, r]
        group_ids: the prompt each response came from: a 1-D tensor or sequence of hashables. # [b]
        baseline: ``"mean"`` or ``"leave_one_out"``.
        norm_by_std: divide by the group std (``"mean"`` baseline only).
        epsilon: added to the std.

    Returns:
        ``(advantages, returns)``, equal, as in verl. # [b, r], [b, r]
    """
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"unknown baseline {baseline!r}; valid: 'mean', 'leave_one_out'")
    with torch.no_grad():
        scores = token_rewards.sum(dim=-1)  # [b]
        if len(scores) != len(group_ids):
            raise ValueError(f"group_ids has {len(group_ids)} entries for a batch of {len(scores)}")
        out = scores.clone()
        for rows in _group_rows(group_ids):
            index = torch.tensor(rows, device=scores.device)
            group = scores[index]  # [n]
            n = len(rows)
            if baseline == "mean":
                if n == 1:
                    mean, std = torch.tensor(0.0), torch.tensor(1.0)
                else:
                    mean, std = torch.mean(group), torch.std(group)
                out[index] = (group - mean) / (std + epsilon) if norm_by_std else group - mean
            elif n > 1:
                mean = torch.mean(group)
                out[index] = group * n / (n - 1) - mean * n / (n - 1)
        advantages = out.unsqueeze(-1) * mask
    return advantages, advantages


def compute_reinforce_plus_plus(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over the batch's valid tokens.

    Iterates backwards over the response. Where ``mask`` is 0 (padding, or observation/tool tokens
    inside a multi-turn response) the token is skipped: its reward is ignored, it is not discounted
    over, and the running return carries across it unchanged, so the return of a valid token sums
    the rewards of the later valid tokens only, discounted by their count (as verl 0.9.1).

    Args:
        token_rewards: per-token rewards. # [b, r]
        mask: valid response tokens. # [b, r]
        gamma: discount factor.

    Returns:
        ``(advantages, returns)``: whitened and masked advantages, returns (0 on masked tokens).
        # [b, r], [b, r]
    """
    with torch.no_grad():
        mask = _float_mask(mask, token_rewards)
        returns = torch.zeros_like(token_rewards)
        running = 0
        for t in reversed(range(token_rewards.shape[1])):
            candidate = token_rewards[:, t] + gamma * running
            m = mask[:, t]
            returns[:, t] = candidate * m
            running = candidate * m + running * (1 - m)
        advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("gae")
def _gae(token_rewards, mask, *, values, group_ids, gamma, lam, norm_by_std, epsilon):
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values; pass values=")
    return compute_gae(token_rewards, values, mask, gamma, lam)


def _needs_groups(name, group_ids):
    if group_ids is None:
        raise ValueError(f"advantage estimator {name!r} needs group_ids (the prompt of each response)")


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(token_rewards, mask, *, values, group_ids, gamma, lam, norm_by_std, epsilon):
    _needs_groups("grpo", group_ids)
    return compute_group_advantages(
        token_rewards, mask, group_ids, baseline="mean", norm_by_std=norm_by_std, epsilon=epsilon
    )


@ADVANTAGE_ESTIMATORS.register("rloo")
def _rloo(token_rewards, mask, *, values, group_ids, gamma, lam, norm_by_std, epsilon):
    _needs_groups("rloo", group_ids)
    return compute_group_advantages(token_rewards, mask, group_ids, baseline="leave_one_out")


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def _reinforce_plus_plus(token_rewards, mask, *, values, group_ids, gamma, lam, norm_by_std, epsilon):
    return compute_reinforce_plus_plus(token_rewards, mask, gamma)


def compute_advantages(
    name: str,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: Optional[torch.Tensor] = None,
    group_ids=None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run the advantage estimator registered as ``name``; see the module docstring for the arguments.

    Returns:
        ``(advantages, returns)``. # [b, r], [b, r]
    """
    return ADVANTAGE_ESTIMATORS.get(name)(
        token_rewards,
        mask,
        values=values,
        group_ids=group_ids,
        gamma=gamma,
        lam=lam,
        norm_by_std=norm_by_std,
        epsilon=epsilon,
    )


def compute_component_advantages(
    component_scores: Sequence[torch.Tensor],
    component_weights: Sequence[float],
    mask: torch.Tensor,
    group_ids,
    *,
    offset: Optional[torch.Tensor] = None,
    row_weights: Optional[Sequence[Optional[torch.Tensor]]] = None,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages of several reward components, each normalised within its groups on its own:
    ``A = Σ_c w_c · u_c · (s_c - mean_g) / (std_g + epsilon) + (o - mean_g(o))``, broadcast over the valid
    tokens (``u_c`` a per-row weight, 1 unless given).

    The sum is not normalised again, so a weight (a trust gate's ``1/(1+λ)`` on the learned part) scales
    its component's share of the advantage. A component tied within a group (a rule that abstains on a
    prompt without a ground truth gives every response 0) contributes 0 there.

    Args:
        component_scores: one ``[b]`` score per component (the rule reward, the learned reward).
        component_weights: one weight per component.
        mask: valid response tokens. # [b, r]
        group_ids: the prompt each response came from. # [b]
        offset: ``[b]`` a term added centred within its group but not normalised (the in-reward KL
            penalty ``-coef·Σ_t KL_t``), or None.
        row_weights: one ``[b]`` weight per component, or None per component (1) or for all: applied after
            the within-group normalisation, so a row's weight scales its own advantage only (the coverage
            trust of the learned component, ``hpa.algorithms.coverage``) and never the group's baseline.
        norm_by_std: divide each component by its group std (False: Dr.GRPO).
        epsilon: added to the std.

    Returns:
        ``(advantages, returns)``, equal, as GRPO's. # [b, r], [b, r]
    """
    if len(component_scores) != len(component_weights) or not component_scores:
        raise ValueError(f"{len(component_scores)} components and {len(component_weights)} weights; give one "
                         "weight per component (at least one)")
    row_weights = [None] * len(component_scores) if row_weights is None else list(row_weights)
    if len(row_weights) != len(component_scores):
        raise ValueError(f"{len(row_weights)} row weights for {len(component_scores)} components; give one "
                         "(or None) per component")
    with torch.no_grad():
        ones = torch.ones_like(mask[:, :1], dtype=torch.float32)  # [b, 1]
        total = torch.zeros(mask.shape[0], dtype=torch.float32, device=mask.device)  # [b]
        for scores, weight, rows in zip(component_scores, component_weights, row_weights):
            if weight == 0:
                continue
            a, _ = compute_group_advantages(scores.float()[:, None] * ones, ones, group_ids, baseline="mean",
                                            norm_by_std=norm_by_std, epsilon=epsilon)
            a = a[:, 0] if rows is None else a[:, 0] * rows.to(a.device, torch.float32)
            total = total + weight * a
        if offset is not None:
            a, _ = compute_group_advantages(offset.float()[:, None] * ones, ones, group_ids, baseline="mean",
                                            norm_by_std=False)
            total = total + a[:, 0]
        advantages = total[:, None] * mask
    return advantages, advantages
