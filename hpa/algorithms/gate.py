"""The trust gate on the learned reward: a PI Lagrangian controller.

A learned reward can be exploited (reward hacking) while the verifiable (rule) reward cannot. The gate
decides how far to trust the learned part of the advantage from a signal that needs no gold labels,
read on held-out preference pairs (never trained on). Four signals (``algorithm.hpa.trust.signal``):

- ``reward_ceiling``: the reward models are validated only up to the responses people
  preferred. The ceiling is the learned reward of the held-out pairs' chosen responses (their mean),
  the unit is the mean margin by which the reward models prefer chosen over rejected there; once the
  policy's rollouts score above the ceiling, the learned reward pays for something no preference
  supports (extrapolation, where a proxy comes apart from the goal), so the constraint
  "learned reward <= ceiling" is enforced by the multiplier (Moskovitz et al., ICLR 2024, constrain each
  component reward at a threshold; here the threshold comes from held-out preferences, not gold labels):

      e_t = (R_t - ceiling) / margin - slack      (R_t: the learned reward's EMA over the steps)

- ``sampled_ceiling`` (the default before ``start_rollouts``): the same constraint with the ceiling moved onto the
  rollouts' scale. The ceiling is a score of chosen responses, the kind a policy gives greedily; the rollouts are sampled (temperature,
  top-p), and sampled responses score lower than greedy ones of the same policy, so a policy whose greedy
  answers are already above the ceiling can keep its sampled rollouts below it for a whole run (measured
  on re-drawn hackable tasks: the gate never closed). At start-up the reward models score the start
  policy's greedy responses and its sampled ones (``rollout.*``, ``rollout.n`` per prompt) on the held-out
  pairs' prompts, and the ceiling is lowered by the difference (the offset, ``gate/offset``):

      e_t = (R_t - (ceiling - offset)) / margin - slack

- ``start_rollouts`` (default): like with like. Both ceilings above compare a level measured on the
  held-out pairs' prompts with the rollouts' learned reward on the training prompts, two distributions
  whose scores differ by more than the whole margin (measured on re-drawn hackable tasks: the held-out
  chosen responses 0.92, the first step's rollouts 0.03; the gate stayed open while the policy was
  hacked). Here the baseline is the learned reward of the start policy's own rollouts on the training
  prompts, sampled as every step's are: the mean over the first updates' rollout batches
  (``baseline_steps``, 5: the policy has barely moved under the learning rate's warm-up; the gate is open
  until then), no extra forward. The headroom above it is what the held-out preferences support, measured on
  one set of prompts: the chosen responses' learned reward minus the start policy's greedy responses'
  to the same held-out prompts, never below 0 (a start whose answers already out-score the chosen ones
  may not raise the learned reward at all)::

      ceiling = baseline + max(0, chosen - greedy)
      e_t = (R_t - ceiling) / margin - slack

  The baseline is measured before the first update (``set_baseline``): the start policy
  samples its rollouts to up to 1,024 training prompts (``baseline_prompts``), as every step samples. Five
  batches were too few: one batch's mean learned reward moves by a quarter of a reward unit from step to step
  on the demo tasks (the mix of prompt kinds), so the mean of five lay up to a margin or more from the
  start's level, and by that draw the gate stayed open, or shut, for a whole run
  (experiments/gate-baseline-at-start-up.md).

- ``heldout_nll``: the policy's per-token NLL of the held-out chosen responses against its best value
  so far, counted only while the learned reward rises:

      e_t = (nll_t - best_t) / best_t - slack     (clipped at 0 while the learned reward is not rising)

  Measured on the hackable demo task it does not close (experiments/demo-tables.md, the hackable task): the DPO
  term's anchor keeps lowering that NLL while PPO exploits the reward elsewhere.

All feed the same PI form of the Lagrangian method (Stooke et al., ICML 2020), one multiplier for the
learned component:

    I_t = max(0, I_{t-1} + e_t)
    λ_t = max(0, kp·e_t + ki·I_t)
    gate_t = 1 / (1 + λ_t)

the gate closes in proportion to a violation and keeps closing while it lasts (the integral), and
reopens as the signal recovers (a negative error drains the integral). Both errors are relative (to the
best NLL, to the reward models' own preference margin), so the constants do not depend on the model or
the scale of its rewards: with kp = 10, a violation 0.1 beyond the slack halves the learned component
at once, and with ki = 1 each step it persists adds 0.1 to λ.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

# The gate's constants (``algorithm.hpa.trust`` keeps only ``signal`` and ``slack`` as keys), each a default a
# sweep or the design chose, no user has a reason to move:
# the PI gains: relative errors make them model-free; a violation 0.1 beyond the slack halves the learned
# component at once, each step it lasts adds 0.1 to λ (the values experiments/demo-tables.md ran with)
GATE_KP, GATE_KI = 10.0, 1.0
# the learned reward's EMA factor: one batch's mean moves by a quarter of a reward unit between steps on the demo
# tasks, about ten steps of memory smooth it (the value experiments/demo-tables.md ran with)
GATE_REWARD_EMA = 0.9
# start_rollouts: the start policy samples ``rollout.n`` responses to this many training prompts (evenly spaced;
# all of them when fewer) at the first update, their mean learned reward the baseline
# (experiments/gate-baseline-at-start-up.md)
GATE_BASELINE_PROMPTS = 1024
# the baseline from the first updates' batches instead (``baseline_prompts`` 0, the behaviour before the record
# above): still read from a checkpoint saved while counting them
GATE_BASELINE_STEPS = 5
# start_rollouts: the headroom above the baseline is this times what the held-out pairs support
# (experiments/start-rollouts-and-coverage.md)
GATE_HEADROOM_SCALE = 1.0


class TrustGate:
    """The state and update of the gate (plain floats; every DP rank updates it with the same inputs).

    Args:
        signal: a name of ``GATE_SIGNALS`` (see the module docstring).
        slack: violation that costs nothing (margins above the ceiling; relative NLL regression).
        kp: proportional gain.
        ki: integral gain.
        reward_ema: smoothing factor of the learned reward (EMA).
        baseline_steps: start_rollouts: the first updates whose rollouts' mean learned reward is the baseline
            (one batch's mean moves by about half a margin from step to step on the demo tasks).
        headroom_scale: start_rollouts: the headroom is this times ``max(0, chosen - greedy)`` (0: the
            ceiling is the baseline).
    """

    def __init__(self, *, signal: str = "start_rollouts", slack: float = 0.02, kp: float = GATE_KP,
                 ki: float = GATE_KI, reward_ema: float = GATE_REWARD_EMA, baseline_steps: int = GATE_BASELINE_STEPS,
                 headroom_scale: float = GATE_HEADROOM_SCALE):
        if signal not in GATE_SIGNALS:
            raise ValueError(f"TrustGate signal must be one of {GATE_SIGNALS}, got {signal!r}")
        if slack < 0 or kp < 0 or ki < 0 or not 0 <= reward_ema < 1:
            raise ValueError(f"TrustGate needs slack, kp, ki >= 0 and 0 <= reward_ema < 1; got slack={slack}, "
                             f"kp={kp}, ki={ki}, reward_ema={reward_ema}")
        if baseline_steps < 1:
            raise ValueError(f"TrustGate needs baseline_steps >= 1, got {baseline_steps}")
        if not (math.isfinite(headroom_scale) and headroom_scale >= 0):
            raise ValueError(f"TrustGate needs a finite headroom_scale >= 0, got {headroom_scale}")
        self.headroom_scale = float(headroom_scale)
        self.signal, self.slack, self.kp, self.ki, self.reward_ema = signal, slack, kp, ki, reward_ema
        self.baseline_steps = baseline_steps
        self.baseline_sum, self.baseline_count = 0.0, 0  # start_rollouts: the first updates' learned reward
        self.ceiling: Optional[float] = None  # reward_ceiling: the held-out chosen responses' learned reward
        self.margin: Optional[float] = None  # and the mean chosen - rejected margin there (the unit)
        self.offset = 0.0  # sampled_ceiling: the start policy's greedy - sampled learned reward (lowers the ceiling)
        self.headroom: Optional[float] = None  # start_rollouts: max(0, chosen - greedy) on the held-out prompts
        self.baseline: Optional[float] = None  # start_rollouts: the first update's rollouts' learned reward
        self.best: Optional[float] = None  # the lowest held-out NLL seen
        self.reward_at_best: Optional[float] = None  # the learned-reward EMA when it was seen
        self.reward: Optional[float] = None  # the learned-reward EMA
        self.integral = 0.0
        self.lam = 0.0

    @property
    def needs_baseline(self) -> bool:
        """start_rollouts: no baseline yet and none being counted from the first updates' rollouts (a fresh
        run; a restored state brings its own)."""
        return self.signal == "start_rollouts" and self.baseline is None and not self.baseline_count

    @property
    def gate(self) -> float:
        """The weight of the learned component, ``1/(1+λ)``."""
        return 1.0 / (1.0 + self.lam)

    def set_ceiling(self, chosen_reward: float, margin: float, offset: float = 0.0) -> None:
        """reward_ceiling: the learned reward of the held-out chosen responses (mean) and the mean margin
        over the rejected ones. A margin <= 0 (the reward models do not rank the held-out pairs) makes
        any reward above the ceiling a full violation: the unit falls back to 1e-3. sampled_ceiling: the
        ``offset`` (greedy - sampled) lowers the ceiling."""
        if not (math.isfinite(chosen_reward) and math.isfinite(margin) and math.isfinite(offset)):
            raise ValueError(f"the held-out ceiling must be finite, got reward {chosen_reward}, margin {margin}, "
                             f"offset {offset}")
        self.ceiling, self.margin, self.offset = float(chosen_reward) - float(offset), float(margin), float(offset)

    def set_headroom(self, chosen_reward: float, greedy_reward: float, margin: float) -> None:
        """start_rollouts: the headroom ``headroom_scale · max(0, chosen - greedy)``, both scored on the
        held-out pairs' prompts, and the unit (the mean chosen - rejected margin there). The ceiling is set by
        the first update, from the start policy's rollouts (``baseline``)."""
        if not all(math.isfinite(x) for x in (chosen_reward, greedy_reward, margin)):
            raise ValueError(f"the start_rollouts headroom must be finite, got chosen {chosen_reward}, greedy "
                             f"{greedy_reward}, margin {margin}")
        self.headroom = self.headroom_scale * max(0.0, float(chosen_reward) - float(greedy_reward))
        self.margin = float(margin)

    def set_baseline(self, baseline: float) -> None:
        """start_rollouts: the baseline measured before the first update (the start policy's sampled rollouts
        on the training prompts, ``GATE_BASELINE_PROMPTS``): the ceiling is known at once and
        the EMA starts there, so the comparison starts at 0 excess; needs ``set_headroom`` first."""
        if self.headroom is None:
            raise RuntimeError("the start_rollouts gate needs set_headroom() before set_baseline()")
        if not math.isfinite(baseline):
            raise ValueError(f"the start_rollouts baseline must be finite, got {baseline}")
        self.baseline = self.reward = float(baseline)
        self.ceiling = self.baseline + self.headroom

    def update(self, nll: Optional[float], learned_reward: float) -> Dict[str, float]:
        """One step: the held-out NLL of the current policy (heldout_nll; None for reward_ceiling) and the
        mean learned reward of its rollouts.

        Returns:
            ``gate/*`` metrics: ``error``, ``integral``, ``lambda``, ``gate``, ``reward_ema`` (the smoothed
            learned reward) and, per signal, ``ceiling``, ``margin``, ``excess`` (margins above the ceiling,
            before the slack) or ``nll``, ``best_nll``, ``regression`` (relative, before the slack),
            ``rising`` (1 when the learned reward is above its value at the best NLL).
        """
        return _UPDATES[self.signal](self, nll, learned_reward)

    def _update_nll(self, nll: Optional[float], learned_reward: float) -> Dict[str, float]:
        if not (nll is not None and math.isfinite(nll) and math.isfinite(learned_reward)):
            return self.metrics(nll, float("nan"), float("nan"), float("nan"))  # nothing learned from a bad step
        self._smooth(learned_reward)
        if self.best is None or nll < self.best:
            self.best, self.reward_at_best = nll, self.reward
        regression = (nll - self.best) / max(abs(self.best), 1e-8)
        error = regression - self.slack
        rising = self.reward > self.reward_at_best
        if not rising:
            error = min(error, 0.0)
        self._control(error)
        return self.metrics(nll, regression, error, float(rising))

    def _smooth(self, learned_reward: float) -> None:
        a = self.reward_ema
        self.reward = learned_reward if self.reward is None else a * self.reward + (1 - a) * learned_reward

    def _control(self, error: float) -> None:
        self.integral = max(0.0, self.integral + error)
        self.lam = max(0.0, self.kp * error + self.ki * self.integral)

    def _update_start(self, learned_reward: float) -> Dict[str, float]:
        if self.headroom is None:
            raise RuntimeError("the start_rollouts gate needs set_headroom() before its first update")
        if self.ceiling is None:
            # the first updates' rollouts: the start policy's (the learning rate is still warming up), on
            # the signal's own prompts; their mean is the baseline, the gate stays open until it is known
            if math.isfinite(learned_reward):
                self.baseline_sum += float(learned_reward)
                self.baseline_count += 1
                self._smooth(learned_reward)
            if self.baseline_count < self.baseline_steps:
                return {"gate/gate": self.gate, "gate/lambda": self.lam, "gate/headroom": self.headroom,
                        "gate/reward_ema": self.reward if self.reward is not None else float("nan")}
            self.baseline = self.baseline_sum / self.baseline_count
            self.ceiling = self.baseline + self.headroom
            self.reward = self.baseline  # the EMA restarts at the baseline: the comparison starts at 0 excess
            learned_reward = self.baseline
        return {**self._update_ceiling(learned_reward), "gate/baseline": self.baseline, "gate/headroom": self.headroom}

    def _update_ceiling(self, learned_reward: float) -> Dict[str, float]:
        if self.ceiling is None:
            raise RuntimeError("the reward_ceiling gate needs set_ceiling() before its first update")
        excess = error = float("nan")
        if math.isfinite(learned_reward):
            self._smooth(learned_reward)
            excess = (self.reward - self.ceiling) / max(self.margin, 1e-3)
            error = excess - self.slack
            self._control(error)
        return {"gate/ceiling": self.ceiling, "gate/margin": self.margin, "gate/offset": self.offset,
                "gate/excess": excess,
                "gate/error": error, "gate/integral": self.integral, "gate/lambda": self.lam, "gate/gate": self.gate,
                "gate/reward_ema": self.reward if self.reward is not None else float("nan")}

    def metrics(self, nll: float, regression: float, error: float, rising: float) -> Dict[str, float]:
        return {"gate/nll": nll, "gate/best_nll": self.best if self.best is not None else float("nan"),
                "gate/regression": regression, "gate/error": error, "gate/rising": rising,
                "gate/integral": self.integral, "gate/lambda": self.lam, "gate/gate": self.gate,
                "gate/reward_ema": self.reward if self.reward is not None else float("nan")}

    def state_dict(self) -> Dict[str, Optional[float]]:
        return {"best": self.best, "reward_at_best": self.reward_at_best, "reward": self.reward,
                "integral": self.integral, "lam": self.lam, "ceiling": self.ceiling, "margin": self.margin,
                "offset": self.offset, "headroom": self.headroom, "baseline": self.baseline,
                "baseline_sum": self.baseline_sum, "baseline_count": self.baseline_count}

    def load_state_dict(self, state: Dict[str, Optional[float]]) -> None:
        self.best, self.reward_at_best, self.reward = state["best"], state["reward_at_best"], state["reward"]
        self.integral, self.lam = state["integral"], state["lam"]
        self.ceiling, self.margin = state.get("ceiling", self.ceiling), state.get("margin", self.margin)
        self.offset = state.get("offset", self.offset)
        # start_rollouts: a checkpoint from before it keeps the headroom measured at this start
        self.headroom = state.get("headroom", self.headroom)
        self.baseline = state.get("baseline", self.baseline)
        self.baseline_sum = state.get("baseline_sum", self.baseline_sum)
        self.baseline_count = int(state.get("baseline_count", self.baseline_count))


# each signal's update (the names are ``algorithm.hpa.trust.signal``'s)
_UPDATES = {"heldout_nll": lambda gate, nll, reward: gate._update_nll(nll, reward),
            "reward_ceiling": lambda gate, nll, reward: gate._update_ceiling(reward),
            "sampled_ceiling": lambda gate, nll, reward: gate._update_ceiling(reward),
            "start_rollouts": lambda gate, nll, reward: gate._update_start(reward)}
GATE_SIGNALS = tuple(sorted(_UPDATES))
