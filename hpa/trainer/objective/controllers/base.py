"""The controller protocol: the base class every controller extends, what a controller reads at its point of
the step (``StepSignals``) and what it is built from at start-up (``ControllerInputs``)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, Mapping, Optional, Sequence

from hpa.distributed.groups import ParallelGroups
from hpa.rollout.base import RolloutBatch
from hpa.trainer.objective.weights import StepFactors, StepWeights


@dataclasses.dataclass(frozen=True)
class StepSignals:
    """What a controller reads at its point of the step: what the step measured, not the run.

    Args:
        batch: the step's scored, filtered rollouts (``rollouts``).
        metrics: the step's metrics so far (``reward/learned_mean``, ...).
        weights: the step's ``StepWeights``.
        grad_norms: ``rollout`` and ``pairs`` gradient norms of a measured update (``gradients``).
    """

    batch: Optional[RolloutBatch] = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    weights: Optional[StepWeights] = None
    grad_norms: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ControllerInputs:
    """What a controller may read of the run (its own config section comes apart): at start-up, and for what
    it measures on the run's models later (the held-out NLL each step, the gate's baseline at the first update).

    Args:
        groups: the run's parallel groups (a controller reduces its measurements over DP).
        pad_id: the tokenizer's pad id.
        timer: ``timer(name)`` adds a block's wall time to ``timing_s/<name>``.
        tokenizer: the run's tokenizer.
        prompts: the training prompts (``data.prompt_path``).
        pairs: the training preference pairs (``data.preference_path``).
        heldout_pairs: the held-out pairs (``data.heldout_preference_path``), None when the run reads none.
        model_reward: the reward-model ensemble, None without reward models.
        generate: ``(prompt_ids, SamplingParams) -> RolloutBatch`` on the policy's current weights.
        policy_nll: the policy's NLL per token of a pair set's chosen responses (the same on every rank).
        demonstrations: the SFT examples of ``data.sft_path`` (what the start was trained on), None when the
            run reads none.
    """

    groups: ParallelGroups
    pad_id: int
    timer: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()
    tokenizer: object = None
    prompts: Sequence = ()
    pairs: Sequence = ()
    heldout_pairs: Optional[Sequence] = None
    model_reward: Optional[object] = None
    generate: Optional[Callable] = None
    policy_nll: Optional[Callable[[Sequence], float]] = None
    demonstrations: Optional[Sequence] = None


class Controller:
    """State that each step updates from what the step measured and that acts on the step's factors.

    A controller sets ``name`` (its key in the checkpoint's run state) and ``observes`` (the point whose
    signals it reads: ``rollouts``, once the step's rollouts are scored, ``updated_rollouts``, once the policy
    update has given an on-policy step's old log-probs, or ``gradients``, between the two backward passes of
    a measured update), and overrides ``update``; the rest has defaults: it sets no
    factor, logs nothing beyond its updates' metrics, has no state and always measures.
    """

    name: str = ""
    observes: str = "rollouts"

    def update(self, signals: StepSignals) -> Dict[str, float]:
        """State in (the step's signals), metrics out."""
        raise NotImplementedError(f"{type(self).__name__} does not update")

    def act(self, factors: StepFactors) -> StepFactors:
        """The step's factors with this controller's applied."""
        return factors

    def measuring(self) -> bool:
        """Whether it reads its signal this step (a measured update runs only while one does)."""
        return True

    def metrics(self) -> Dict[str, float]:
        """Logged after every update of the policy."""
        return {}

    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state: Dict) -> None:
        pass
