"""Reward-hacking monitor: watches per-step reward statistics over a rolling window of steps.

Three signals, each an alert string when it fires:
- divergence: the raw reward trends up while the held-out/rule score trends down. A trend is the mean
  of the newer half of the window minus the mean of the older half; it needs a full window.
- length growth: mean response length over the latest window / mean over the first full window
  (the baseline, fixed once the first window fills) exceeds the threshold.
- copying: mean copy rate over the latest window exceeds the threshold.
"""

from __future__ import annotations

import collections
from typing import Deque, Dict, List, Optional, Tuple


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


class RewardHackingMonitor:
    """Args as in ``hpa.config.reward.MonitorConfig``."""

    def __init__(self, *, window: int = 50, length_ratio_threshold: float = 1.5,
                 copy_rate_threshold: float = 0.5, divergence_tolerance: float = 0.0):
        if window < 2:
            raise ValueError(f"monitor window must be >= 2, got {window}")
        self.window = window
        self.length_ratio_threshold = length_ratio_threshold
        self.copy_rate_threshold = copy_rate_threshold
        self.divergence_tolerance = divergence_tolerance
        self._raw: Deque[float] = collections.deque(maxlen=window)
        self._heldout: Deque[Optional[float]] = collections.deque(maxlen=window)
        self._length: Deque[float] = collections.deque(maxlen=window)
        self._copy: Deque[float] = collections.deque(maxlen=window)
        self._length_baseline: Optional[float] = None

    @classmethod
    def from_config(cls, cfg) -> "RewardHackingMonitor":
        """Build from a ``hpa.config.reward.MonitorConfig``."""
        return cls(window=cfg.window, length_ratio_threshold=cfg.length_ratio_threshold,
                   copy_rate_threshold=cfg.copy_rate_threshold, divergence_tolerance=cfg.divergence_tolerance)

    def _trend(self, values) -> float:
        values = list(values)
        half = len(values) // 2
        return _mean(values[-half:]) - _mean(values[:half])

    def update(self, *, raw_reward_mean: float, mean_response_length: float, copy_rate: float = 0.0,
               heldout_score: Optional[float] = None) -> Tuple[List[str], Dict[str, float]]:
        """Record one step and check the signals.

        Args:
            raw_reward_mean: mean raw (model) reward of the step (``reward/raw_mean``).
            mean_response_length: mean response length in tokens.
            copy_rate: mean copy rate of the step (``reward/copy_rate``).
            heldout_score: a held-out or rule score for the step, when one was measured; the divergence
                check needs it on every step of the window.

        Returns:
            (alerts, metrics): alert strings (empty when healthy) and ``hacking/*`` scalars.
        """
        self._raw.append(float(raw_reward_mean))
        self._heldout.append(None if heldout_score is None else float(heldout_score))
        self._length.append(float(mean_response_length))
        self._copy.append(float(copy_rate))
        full = len(self._raw) == self.window
        if full and self._length_baseline is None:
            self._length_baseline = _mean(self._length)

        alerts: List[str] = []
        metrics: Dict[str, float] = {"hacking/window_full": float(full)}

        copy_mean = _mean(self._copy)
        metrics["hacking/copy_rate"] = copy_mean
        if copy_mean > self.copy_rate_threshold:
            alerts.append(f"copy rate {copy_mean:.3f} over the last {len(self._copy)} steps exceeds "
                          f"{self.copy_rate_threshold}: responses copy the prompt")

        if self._length_baseline is not None and self._length_baseline > 0:
            ratio = _mean(self._length) / self._length_baseline
            metrics["hacking/length_ratio"] = ratio
            if ratio > self.length_ratio_threshold:
                alerts.append(f"mean response length grew {ratio:.2f}x over the first window "
                              f"(threshold {self.length_ratio_threshold}): the policy may be padding")

        if full:
            raw_trend = self._trend(self._raw)
            metrics["hacking/raw_reward_trend"] = raw_trend
            if all(h is not None for h in self._heldout):
                heldout_trend = self._trend(self._heldout)
                metrics["hacking/heldout_trend"] = heldout_trend
                if raw_trend > self.divergence_tolerance and heldout_trend < -self.divergence_tolerance:
                    alerts.append(f"raw reward rises ({raw_trend:+.4f}) while the held-out score falls "
                                  f"({heldout_trend:+.4f}) over the last {self.window} steps: "
                                  "the reward model is likely being exploited")

        metrics["hacking/alert_count"] = float(len(alerts))
        return alerts, metrics

    def state_dict(self) -> Dict[str, object]:
        return {"raw": list(self._raw), "heldout": list(self._heldout), "length": list(self._length),
                "copy": list(self._copy), "length_baseline": self._length_baseline}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        for buffer, key in ((self._raw, "raw"), (self._heldout, "heldout"), (self._length, "length"),
                            (self._copy, "copy")):
            buffer.clear()
            buffer.extend(state[key])
        self._length_baseline = state["length_baseline"]
