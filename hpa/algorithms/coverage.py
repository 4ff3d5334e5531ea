"""Coverage of the reward models' preference data: how far a prompt (or a sequence) lies from the pairs the
reward models were trained on, and how far to trust their score there (``algorithm.hpa.trust``, on by
default; measured in experiments/start-rollouts-and-coverage.md).

A reward model is validated only near its training data; far from it the learned reward extrapolates and a
policy can exploit it. The distance is the k-nearest-neighbour cosine distance in the reward model's own
pooled embedding space, centred on the bank's mean (OOD detection by kNN distance on normalised features,
Sun et al., ICML 2022), gold free. It is calibrated on held-out preference pairs, which come from the same
distribution as the training pairs but were never trained on, so their distances say what "in
distribution" looks like:

    trust(d) = 1                                  for d <= low  (the held-out distances' low quantile)
             = (high - d) / (high - low)          in between
             = 0                                  for d >= high (the high quantile times a margin)

Defaults: low = the held-out median (half of the in-distribution pairs are trusted fully, the other half
still mostly: a rollout as close to the data as a typical held-out pair is not down-weighted), high = the
95th percentile x 2 (twice as far as all but 5 % of the held-out pairs is beyond what the data supports;
the margin keeps the in-distribution tail above 0). Why these values: docs/objective.md.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hpa.algorithms.kl import kl_k3


def knn_distance(queries: torch.Tensor, bank: torch.Tensor, k: int, *, chunk_size: int = 4096,
                 center: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The mean cosine distance of each query to its ``k`` nearest rows of ``bank``.

    Both sides are L2-normalised, so the distance ``1 - cos`` lies in [0, 2]. The bank is read in chunks
    of ``chunk_size`` rows, keeping a running top-k, so memory is ``O(n·(chunk_size + k))`` whatever ``m``.

    Args:
        queries: embeddings to score. # [n, h]
        bank: embeddings of the covered data. # [m, h]
        k: neighbours averaged (``min(k, m)`` when the bank is smaller).
        chunk_size: bank rows per similarity matmul.
        center: subtracted from both sides before the normalisation (the bank's mean, ``bank_center``):
            a transformer's pooled states share one large common direction, which on its own makes every
            cosine distance tiny; removed, the distances spread. # [h]

    Returns:
        the mean distance to the k nearest bank rows. # [n]
    """
    if queries.dim() != 2 or bank.dim() != 2 or queries.shape[1] != bank.shape[1]:
        raise ValueError(f"queries [n, h] and bank [m, h] must share h; got {tuple(queries.shape)} and "
                         f"{tuple(bank.shape)}")
    if bank.shape[0] == 0:
        raise ValueError("the coverage bank is empty: give at least one preference pair")
    if k < 1 or chunk_size < 1:
        raise ValueError(f"k and chunk_size must be >= 1, got k={k}, chunk_size={chunk_size}")
    k = min(k, bank.shape[0])
    with torch.no_grad():
        shift = center.float().to(queries.device) if center is not None else 0.0
        q = torch.nn.functional.normalize(queries.float() - shift, dim=1)  # [n, h]
        best = q.new_full((q.shape[0], 0), -2.0)  # the k highest similarities so far [n, <=k]
        for start in range(0, bank.shape[0], chunk_size):
            b = torch.nn.functional.normalize(bank[start:start + chunk_size].float().to(q.device) - shift, dim=1)
            best = torch.cat([best, q @ b.T], dim=1).topk(min(k, best.shape[1] + b.shape[0]), dim=1).values
        return 1.0 - best.mean(dim=1)


def bank_center(bank: torch.Tensor) -> torch.Tensor:
    """The mean row of the bank, the ``center`` of ``knn_distance``. # [m, h] -> [h]"""
    return bank.float().mean(dim=0)


def unique_rows(rows: Sequence[Sequence[int]]) -> Tuple[List[List[int]], torch.Tensor]:
    """The distinct token sequences of ``rows`` in first-seen order and, for each row, the index of its
    sequence there (``[n]``, long): a prompt is embedded and scored once however many rows share it."""
    index: Dict[Tuple[int, ...], int] = {}
    where = [index.setdefault(tuple(r), len(index)) for r in rows]
    return [list(r) for r in index], torch.tensor(where, dtype=torch.long)


# The coverage trust's constants (``algorithm.hpa.trust`` keeps ``margin``, ``kl_boost`` and the release's
# numbers as keys), each chosen on the demo tasks with no reason for a user to move it:
# prompt space: each prompt alone against every pair's prompt, one trust per prompt (as a rule abstains per
# prompt); it separates the hackable tasks' uncovered kind best (experiments/start-rollouts-and-coverage.md);
# ``sequence`` (prompt + response against the chosen sequences) stays for the tests and probes
COVERAGE_SPACE = "prompt"
# neighbours whose mean cosine distance is a row's distance (chosen on the reward models of five hackable tasks,
# experiments/redrawn-tasks.md)
COVERAGE_K = 5
# trust 1 up to the held-out pairs' median distance, 0 from ``margin`` times their 95 % quantile (chosen with
# COVERAGE_K, experiments/redrawn-tasks.md)
COVERAGE_LOW_QUANTILE, COVERAGE_HIGH_QUANTILE = 0.5, 0.95
# the boost holds only the rows with trust 0; a partly covered row learns what its pairs teach
# (experiments/hold-shape.md; ``linear``, the shape before, stays for the tests)
KL_BOOST_SHAPE = "far"
# the adaptive boost's KL target: None, a fixed boost; no target passed the choose rule
# (experiments/hold-size-probes.md)
KL_BOOST_TARGET = None


def calibrate(heldout_distances: torch.Tensor, *, low_quantile: float = COVERAGE_LOW_QUANTILE,
              high_quantile: float = COVERAGE_HIGH_QUANTILE, margin: float = 2.0) -> Tuple[float, float]:
    """The distances where trust starts to fall and where it reaches 0, from held-out pairs' distances.

    Args:
        heldout_distances: ``knn_distance`` of the held-out pairs to the bank. # [n]
        low_quantile: trust is 1 up to this quantile of the held-out distances.
        high_quantile: trust is 0 from this quantile times ``margin``.
        margin: >= 1; the factor on the high quantile.

    Returns:
        ``(low, high)``, with ``high > low`` (a degenerate calibration, all distances equal, gets a high
        of ``low + 1e-6``).
    """
    if heldout_distances.numel() == 0:
        raise ValueError("the coverage calibration needs held-out pairs; data.heldout_preference_path has none")
    if not 0 <= low_quantile < high_quantile <= 1 or margin < 1:
        raise ValueError(f"need 0 <= low_quantile < high_quantile <= 1 and margin >= 1; got {low_quantile}, "
                         f"{high_quantile}, {margin}")
    d = heldout_distances.double()
    low = float(torch.quantile(d, low_quantile))
    high = float(torch.quantile(d, high_quantile)) * margin
    return low, max(high, low + 1e-6)


def coverage_trust(distances: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``1`` at or below ``low``, falling linearly to ``0`` at ``high``, clamped to [0, 1]. # [n] -> [n]"""
    if not high > low:
        raise ValueError(f"the trust ramp needs high > low, got low={low}, high={high}")
    return ((high - distances.float()) / (high - low)).clamp(0.0, 1.0)


# ``trust_stats``' entries, logged as ``coverage/<name>``
TRUST_METRICS = ("trust_mean", "trust_p10", "trust_p90", "far_share")


def trust_stats(trust: torch.Tensor, valid: torch.Tensor, far: torch.Tensor) -> torch.Tensor:
    """The trust's mean, 10th and 90th percentiles and the share of far rows (``TRUST_METRICS``), over the
    rows with ``valid`` set, computed where the trust lives (no host read): float64, NaN where no row is
    valid. ``far`` ``[n]`` bool: the far rows (``far_rows``: trust 0 and no rule judging them).
    # [n], [n] bool, [n] bool -> [4]"""
    valid = valid.to(trust.device).bool()
    far = far.to(trust.device).bool()
    t = trust.double()
    rows = valid.double().sum()
    kept = torch.where(valid, t, torch.full_like(t, float("nan")))
    return torch.stack([(t * valid).sum() / rows, torch.nanquantile(kept, 0.1), torch.nanquantile(kept, 0.9),
                        (far & valid).double().sum() / rows])


def abstention_kl_weights(trust: torch.Tensor, boost: float, judged: Optional[torch.Tensor] = None, *,
                          shape: str) -> torch.Tensor:
    """Each row's weight of the KL to the reference: where the learned reward has no support its advantage
    is 0 (the trust) and nothing else says what to do there, so the policy is held closer to the start,
    which is what the start did well. ``shape`` ``linear``: ``1 + boost·(1 - trust)``, a partly covered row
    held in proportion; ``far``: ``1 + boost`` only where the trust is 0 (no support at all), every row
    with some support keeps 1 and learns what its pairs teach. A row a rule reward judges (``judged``
    ``[b]`` bool: its prompt has a ground truth) keeps weight 1: the rule says what to do there. # [b] -> [b]"""
    if boost < 0:
        raise ValueError(f"the abstention KL boost must be >= 0, got {boost}")
    if shape == "far":
        return 1.0 + boost * far_rows(trust, judged).float()
    if shape != "linear":
        raise ValueError(f"the abstention KL boost's shape must be 'linear' or 'far', got {shape!r}")
    far = 1.0 - trust.float().clamp(0.0, 1.0)
    if judged is not None:
        far = torch.where(judged.to(far.device).bool(), torch.zeros_like(far), far)
    return 1.0 + boost * far


# the adaptive boost (``adapt_kl_boost``): the most its logarithm moves in one step, and its floor (a far row's
# KL weight 1.01: released)
KL_BOOST_RATE = 0.2
KL_BOOST_FLOOR = 0.01


def far_rows(trust: torch.Tensor, judged: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows no reward supports: trust 0 and no rule judging them (``abstention_kl_weights``' far rows
    under shape ``far``). # [b] -> [b] bool"""
    far = trust <= 0
    if judged is not None:
        far = far & ~judged.to(far.device).bool()
    return far


def far_kl_sums(old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor,
                far: torch.Tensor) -> torch.Tensor:
    """How far the policy that sampled the rollouts has moved from the reference where no reward has
    support: the k3 (``low_var_kl``) estimate per sampled token of the far rows, as ``[sum, tokens]``
    (float64, to be summed over DP ranks; the mean is ``sum / tokens``). # [b, r] x3, [b] -> [2]"""
    kl = kl_k3(old_log_probs.double(), ref_log_probs.double())  # [b, r]
    m = mask.double() * far.to(mask.device).double()[:, None]
    return torch.stack([(kl * m).sum(), m.sum()])


def adapt_kl_boost(boost: float, far_kl: float, target: float, *, ceiling: float) -> float:
    """One step of the adaptive boost: its logarithm moves by ``KL_BOOST_RATE · clip(far_kl / target - 1,
    -1, 1)``, so the hold grows where the far rows drift past ``target`` and is released where they do
    not, within ``[KL_BOOST_FLOOR, ceiling]``. A NaN ``far_kl`` (no far row this step) leaves it."""
    if not target > 0:
        raise ValueError(f"the far rows' KL target must be > 0, got {target}")
    if far_kl != far_kl:
        return boost
    error = max(-1.0, min(1.0, far_kl / target - 1.0))
    return min(ceiling, max(KL_BOOST_FLOOR, max(boost, KL_BOOST_FLOOR) * math.exp(KL_BOOST_RATE * error)))


class EmbeddingCache:
    """Embeddings of token sequences under a frozen model, each computed once per run: the coverage trust
    reads the same training prompts again each epoch, and the reward model does not change. At most
    ``limit`` rows are kept (``[limit, h]`` floats); beyond it the new ones are computed every time."""

    def __init__(self, limit: int = 65_536):
        self.rows: Dict[Tuple[int, ...], torch.Tensor] = {}
        self.limit = limit

    def __len__(self) -> int:
        return len(self.rows)

    def embed(self, sequences: Sequence[Sequence[int]],
              compute: Callable[[List[List[int]]], torch.Tensor]) -> torch.Tensor:
        """The embeddings of ``sequences`` (``[n, h]``), ``compute`` called once on those not seen yet."""
        keys = [tuple(q) for q in sequences]
        new = list(dict.fromkeys(k for k in keys if k not in self.rows))
        fresh: Dict[Tuple[int, ...], torch.Tensor] = {}
        if new:
            fresh = dict(zip(new, compute([list(k) for k in new]).detach()))  # len(new) rows of [h]
            for key in new[:max(0, self.limit - len(self.rows))]:
                self.rows[key] = fresh[key]
        return torch.stack([fresh[k] if k in fresh else self.rows[k] for k in keys]) if keys else torch.zeros(0, 0)
