"""KL estimators, KL as a reward penalty or a loss, KL controllers, warmup, and the hierarchical KL.

Estimators follow verl 0.9.1 ``core_algos.kl_penalty`` (http://joschu.net/blog/kl-approx.html), with
``logprob`` the policy and ``ref_logprob`` the reference log-prob of the sampled token:

- ``kl``/``k1``: ``logprob - ref_logprob``
- ``abs``: ``|logprob - ref_logprob|``
- ``mse``/``k2``: ``0.5·(logprob - ref_logprob)²``
- ``low_var_kl``/``k3``: ``exp(d) - d - 1`` with ``d = clamp(ref_logprob - logprob, ±20)``, the
  result clamped to ``[-10, 10]``
- ``<name>+`` (straight-through): the value of ``<name>``, the gradient of k2. k1 and k3 are
  unbiased for the KL value but not for its gradient; k2's gradient is. ``k2+``/``mse+`` equal
  ``k2`` in value and gradient; they are accepted so that every verl name works.

KL estimators share one signature (``KL_ESTIMATORS``): ``fn(logprob, ref_logprob) -> kl  # [b, r]``.
Semantic distances share ``fn(policy_pooled, ref_pooled) -> distance  # [b]``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from hpa.algorithms.losses import TOKEN_MEAN, Aggregation
from hpa.algorithms.masked import masked_mean
from hpa.algorithms.schedules import make_schedule
from hpa.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")
KL_CONTROLLERS = Registry("KL controller")
SEMANTIC_DISTANCES = Registry("semantic distance")

Metrics = Dict[str, torch.Tensor]


@KL_ESTIMATORS.register("kl", "k1")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


@KL_ESTIMATORS.register("mse", "k2")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    kld = (torch.exp(log_ratio) - log_ratio - 1).contiguous()
    return torch.clamp(kld, min=-10, max=10)


def _straight_through(forward_fn):
    def estimator(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        value = forward_fn(logprob, ref_logprob)
        surrogate = 0.5 * (logprob - ref_logprob).square()
        return surrogate - surrogate.detach() + value.detach()

    estimator.__doc__ = f"Value of {forward_fn.__name__}, gradient of k2 (straight-through)."
    return estimator


for _name, _fn in (
    ("kl", kl_k1), ("k1", kl_k1), ("abs", kl_abs), ("mse", kl_k2), ("k2", kl_k2), ("low_var_kl", kl_k3), ("k3", kl_k3)
):
    KL_ESTIMATORS.register(_name + "+")(_straight_through(_fn))


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference.

    Args:
        logprob: policy log-probs of the sampled tokens. # [b, r]
        ref_logprob: reference log-probs of the same tokens. # [b, r]
        kind: a name in ``KL_ESTIMATORS`` (see the module docstring).

    Returns:
        The per-token estimate (not masked). # [b, r]
    """
    return KL_ESTIMATORS.get(kind)(logprob, ref_logprob)


def apply_kl_penalty(
    token_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> Tuple[torch.Tensor, Metrics]:
    """KL as a per-token reward penalty: ``rewards = scores - kl_coef · kl·mask`` (verl ``apply_kl_penalty``).

    Unlike verl, the controller is not updated here: the caller passes ``metrics["reward_kl"]``
    (reduced over DP ranks if wanted) and the batch size to ``controller.update``.

    Args:
        token_scores: per-token scores from the reward. # [b, r]
        old_log_prob: rollout policy log-probs. # [b, r]
        ref_log_prob: reference log-probs. # [b, r]
        mask: valid tokens. # [b, r]
        kl_coef: the controller's current value (times the warmup factor).
        kind: a name in ``KL_ESTIMATORS``.

    Returns:
        ``(token_rewards, metrics)``: metrics ``reward_kl`` (per-sequence masked mean of the KL,
        averaged over the batch) and ``reward_kl_coef``.
    """
    with torch.no_grad():
        kld = kl_penalty(old_log_prob, ref_log_prob, kind) * mask  # [b, r]
        token_rewards = token_scores - kl_coef * kld
        current_kl = torch.mean(masked_mean(kld, mask, dim=-1), dim=0)
    metrics = {"reward_kl": current_kl, "reward_kl_coef": torch.tensor(float(kl_coef), dtype=kld.dtype)}
    return token_rewards, metrics


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "low_var_kl",
    aggregation: Aggregation = TOKEN_MEAN,
) -> Tuple[torch.Tensor, Metrics]:
    """KL as a loss term: ``agg(kl_penalty(log_prob, ref_log_prob))``; the caller multiplies by the coefficient.

    Returns:
        ``(loss, {"kl_loss": loss})``.
    """
    loss = aggregation(kl_penalty(log_prob, ref_log_prob, kind), mask)
    return loss, {"kl_loss": loss.detach()}


class FixedKLController:
    """A constant KL coefficient.

    Args:
        kl_coef: the coefficient.
    """

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (same signature as the adaptive controller)."""

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional KL controller (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593), as verl.

    ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) · n_steps / horizon``.

    Args:
        init_kl_coef: starting coefficient.
        target_kl: KL the controller steers to.
        horizon: steps (samples) over which the error is corrected; > 0.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards the target; ``n_steps`` is the batch size (samples), as verl."""
        proportional_error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = state["horizon"]


@KL_CONTROLLERS.register("fixed")
def _fixed(*, kl_coef: float, target_kl: Optional[float], horizon: Optional[int]) -> FixedKLController:
    return FixedKLController(kl_coef)


@KL_CONTROLLERS.register("adaptive")
def _adaptive(*, kl_coef: float, target_kl: Optional[float], horizon: Optional[int]) -> AdaptiveKLController:
    if target_kl is None or horizon is None:
        raise ValueError("the adaptive KL controller needs target_kl and horizon")
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def make_kl_controller(
    name: str, *, kl_coef: float, target_kl: Optional[float] = None, horizon: Optional[int] = None
):
    """Build the KL controller registered as ``name`` (``fixed`` or ``adaptive``)."""
    return KL_CONTROLLERS.get(name)(kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)


def kl_warmup_scale(progress: float, warmup_fraction: float) -> float:
    """0 during the first ``warmup_fraction`` of training, 1 after (the recipe uses 0.2).

    Multiply the KL coefficient by it. Same as the ``warmup_constant`` schedule with start 0, value 1.
    """
    return make_schedule("warmup_constant", value=1.0, start=0.0, warmup_fraction=warmup_fraction)(progress)


@SEMANTIC_DISTANCES.register("mse")
def semantic_mse(policy_pooled: torch.Tensor, ref_pooled: torch.Tensor) -> torch.Tensor:
    """Mean squared difference over the hidden dimension. # [b, h] -> [b]"""
    return (policy_pooled - ref_pooled).square().mean(dim=-1)


@SEMANTIC_DISTANCES.register("cosine")
def semantic_cosine(policy_pooled: torch.Tensor, ref_pooled: torch.Tensor) -> torch.Tensor:
    """``1 - cos(policy, ref)``, in [0, 2]. # [b, h] -> [b]"""
    return 1.0 - torch.nn.functional.cosine_similarity(policy_pooled, ref_pooled, dim=-1, eps=1e-8)


def hierarchical_kl(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    policy_pooled: torch.Tensor,
    ref_pooled: torch.Tensor,
    *,
    lambda_token: float,
    lambda_semantic: float,
    kind: str = "low_var_kl",
    distance: str = "mse",
    aggregation: Aggregation = TOKEN_MEAN,
    row_weights: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """HPA's hierarchical regulariser ``λ_token · token_kl + λ_semantic · semantic_distance``.

    ``token_kl`` aggregates a KL estimator over the response tokens. ``semantic_distance`` is a
    distance (MSE by default, or cosine) between the mean-pooled final hidden states of policy and
    reference; it is not a KL divergence. It is averaged over the non-empty sequences with
    ``aggregation.num_global_seqs`` (or the local count) and ``aggregation.dp_size``.

    Args:
        log_prob: policy log-probs (with grad). # [b, r]
        ref_log_prob: reference log-probs. # [b, r]
        mask: response tokens. # [b, r]
        policy_pooled: policy hidden states mean-pooled over the response (with grad). # [b, h]
        ref_pooled: reference hidden states, pooled the same way. # [b, h]
        lambda_token: weight of the token KL (the recipe: 1.0 -> 0.2).
        lambda_semantic: weight of the semantic distance (the recipe: 0.2 -> 1.0).
        kind: a name in ``KL_ESTIMATORS``.
        distance: a name in ``SEMANTIC_DISTANCES``.
        aggregation: token aggregation (and sequence counts for the semantic term).
        row_weights: ``[b]`` a weight on each row's token KL and semantic distance in the loss (the coverage
            trust's abstention, ``coverage.abstention_kl_weights``), inside the aggregation so the counts it
            normalises by are unchanged; None: 1. The metrics are unweighted.
        token_weights: ``[b, r]`` importance weights of the rollout's tokens (the rollout correction's
            π_old/π_behaviour, ``hpa.algorithms.rollout_correction``): each token's KL is multiplied by its
            weight and each row's semantic distance by the row's mean weight over ``mask`` (its weight, at the
            sequence level), inside the aggregation as ``row_weights``; None: 1. The metrics are unweighted.

    Returns:
        ``(loss, metrics)`` with ``hier_kl``, ``token_kl``, ``semantic_distance`` (the policy's, without
        ``row_weights``: the guard's rollback and the early stop read ``token_kl``), ``lambda_token`` and
        ``lambda_semantic``.
    """
    per_token = kl_penalty(log_prob, ref_log_prob, kind)  # [b, r]
    per_seq = SEMANTIC_DISTANCES.get(distance)(policy_pooled, ref_pooled)  # [b]
    seq_valid = mask.sum(dim=-1) > 0  # [b]
    if row_weights is not None or token_weights is not None:  # the loss weighs; the metrics stay the policy's
        token_terms, seq_terms = per_token, per_seq
        if token_weights is not None:
            tw = token_weights.to(per_token.device, per_token.dtype)  # [b, r]
            token_terms = token_terms * tw
            m = mask.to(tw.dtype)
            row_weight = (tw * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)  # [b], exactly w where all are w
            seq_terms = seq_terms * row_weight.to(per_seq.dtype)
        if row_weights is not None:
            w = row_weights.to(per_token.device, per_token.dtype)  # [b]
            token_terms = token_terms * w[:, None]
            seq_terms = seq_terms * w.to(per_seq.dtype)
        loss = lambda_token * aggregation(token_terms, mask) \
            + lambda_semantic * aggregation.seq_mean(seq_terms, seq_valid)
        with torch.no_grad():  # the metrics only: no autograd graph
            token_kl = aggregation(per_token, mask)
            semantic = aggregation.seq_mean(per_seq, seq_valid)
    else:
        token_kl = aggregation(per_token, mask)
        semantic = aggregation.seq_mean(per_seq, seq_valid)
        loss = lambda_token * token_kl + lambda_semantic * semantic
    measured = lambda_token * token_kl.detach() + lambda_semantic * semantic.detach()
    dtype = loss.dtype
    metrics = {
        "hier_kl": measured,
        "token_kl": token_kl.detach(),
        "semantic_distance": semantic.detach(),
        "lambda_token": torch.tensor(float(lambda_token), dtype=dtype),
        "lambda_semantic": torch.tensor(float(lambda_semantic), dtype=dtype),
    }
    return loss, metrics
