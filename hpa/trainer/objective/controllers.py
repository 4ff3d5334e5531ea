"""The controllers of the objective: state that each step updates from what the step measured and that
acts on the terms of ``TERMS`` (``hpa.trainer.objective.terms``), saved with the run state.

One protocol (``Controller``): ``name`` (its key in the checkpoint's run state), ``observes`` (the point
of the step whose signals it reads: ``rollouts``, once the step's rollouts are scored, or ``gradients``,
between the two backward passes of a measured update), ``update(signals) -> metrics`` (state in,
metrics out), ``factors()`` (what it sets: a name -> a factor the step reads), ``metrics()``,
``state_dict()`` / ``load_state_dict()``. ``Controllers`` holds a run's controllers; the trainer
updates them at their point and reads their factors, and ``RunState`` saves them as its other parts.
A new controller is its class and one entry of ``CONTROLLERS``.

The factors read by the step: ``reward_kl`` (the in-reward KL coefficient, before its warm-up),
``learned_advantage`` (the weight of the learned component of the advantages) and ``pairs`` (the
balance's factor on the pair stream). A per-row weight is written to the batch instead: the coverage
trust's ``learned_trust``.

The automatic balance of the rollout and pair gradients (``algorithm.hpa.balance``):
A step's gradient is the sum of the rollout group's (PPO, entropy, hierarchical KL, all on rollouts)
and the pair group's (DPO and its anchor, on the offline pairs). Their norms differ by a factor the
weights do not know about (at the SFT start of the demo tasks the PPO term's gradient per unit weight
is about 4× the DPO term's, which β = 0.1 scales down), so ``w_ppo : w_dpo`` is not the split of the
update. For the first ``measure_steps`` steps the two groups run as two backward passes and their
gradient norms are measured with gradient clipping's own reductions; the pair term is then scaled by

    factor = (w_dpo / w_ppo) · Σ ‖g_rollout‖ / Σ ‖g_pairs‖

so that ``w_dpo : w_ppo`` is the ratio of the two groups' gradient norms, and the factor is frozen
(saved in checkpoints). On a measured step the factor already applies (the pair gradients are scaled
before the two are added). The cost: on a measured step, a second pipeline flush (under PP) and one
copy of the grad buffers (4 bytes per parameter of the rank's shard: at 70B over TP 8 × PP 4, about
8.8 GB per GPU for those steps only); the other steps cost nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Protocol

import torch

from hpa.algorithms.coverage import (EmbeddingCache, abstention_kl_weights, bank_center, calibrate, coverage_trust,
                                     knn_distance, trust_metrics, unique_rows)
from hpa.algorithms.gate import TrustGate
from hpa.algorithms.kl import kl_penalty, make_kl_controller
from hpa.algorithms.masked import masked_mean
from hpa.distributed import comm
from hpa.trainer import heldout


@dataclasses.dataclass
class StepSignals:
    """What a controller reads at its point of the step.

    Args:
        batch: the step's scored rollouts (``rollouts``).
        metrics: the step's metrics so far (``reward/learned_mean``, ...).
        weights: the step's ``StepWeights``.
        ctx: the step's ``phases.StepContext``.
        parts: the run's ``setup.RunParts`` (models and data).
        grad_norms: ``rollout`` and ``pairs`` gradient norms (``gradients``).
    """

    batch: object = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    weights: object = None
    ctx: object = None
    parts: object = None
    grad_norms: Mapping[str, float] = dataclasses.field(default_factory=dict)


class Controller(Protocol):
    name: str
    observes: str

    def update(self, signals: StepSignals) -> Dict[str, float]: ...

    def factors(self) -> Dict[str, float]: ...

    def metrics(self) -> Dict[str, float]: ...

    def state_dict(self) -> Dict: ...

    def load_state_dict(self, state: Dict) -> None: ...


class KLCoefficient:
    """The in-reward KL coefficient (``algorithm.kl.controller``): it follows the DP-mean KL between the
    rollout policy and the reference (the checkpoint keeps the controller's own state)."""

    name, observes = "kl_ctrl", "rollouts"

    def __init__(self, cfg, parts=None, ctx=None):
        kl = cfg.algorithm.kl
        self.reward_estimator = kl.reward_estimator
        self.controller = make_kl_controller(kl.controller, kl_coef=kl.init_kl_coef, target_kl=kl.target_kl,
                                             horizon=kl.horizon)

    def update(self, s: StepSignals) -> Dict[str, float]:
        batch = s.batch
        kl = masked_mean(kl_penalty(batch.get("old_log_probs"), batch.get("ref_log_probs"), self.reward_estimator),
                         batch.get("mask"))
        current = comm.all_reduce_mean(kl.reshape(1).double(), s.ctx.groups.dp_group).item()
        self.controller.update(current, batch.batch_size * s.ctx.groups.data_parallel_size)
        return {"actor/kl_coef": s.weights.reward_kl_coef, "actor/reward_kl": current}

    def factors(self) -> Dict[str, float]:
        return {"reward_kl": self.controller.value}

    def metrics(self) -> Dict[str, float]:
        return {}

    def state_dict(self) -> Dict:
        return self.controller.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        self.controller.load_state_dict(state)


@dataclasses.dataclass(frozen=True)
class GateSignal:
    """What a trust-gate signal (``algorithm.hpa.gate.signal``) needs from the run: ``start(gate, parts,
    ctx)`` once, ``measure(signals)`` each step (the held-out NLL, or None)."""

    start: Callable[..., None]
    measure: Callable[[StepSignals], Optional[float]]


def _set_ceiling(gate: TrustGate, parts, ctx) -> None:
    gate.set_ceiling(*heldout.heldout_reward_ceiling(parts.model_reward, parts.heldout_pairs, pad_id=ctx.pad_id))
    logging.getLogger("hpa").info("trust gate: the held-out chosen responses' learned reward is %.4f, margin %.4f",
                                  gate.ceiling, gate.margin)


def _set_sampled_ceiling(gate: TrustGate, parts, ctx) -> None:
    chosen, margin = heldout.heldout_reward_ceiling(parts.model_reward, parts.heldout_pairs, pad_id=ctx.pad_id)
    greedy, sampled = heldout.greedy_and_sampled_reward(parts, ctx)
    gate.set_ceiling(chosen, margin, offset=greedy - sampled)
    logging.getLogger("hpa").info("trust gate: the held-out chosen responses' learned reward is %.4f, margin %.4f; "
                                  "the start policy's greedy responses score %.4f, its sampled ones %.4f: the "
                                  "ceiling on the rollouts' scale is %.4f", chosen, margin, greedy, sampled,
                                  gate.ceiling)


def _set_headroom(gate: TrustGate, parts, ctx) -> None:
    chosen, margin = heldout.heldout_reward_ceiling(parts.model_reward, parts.heldout_pairs, pad_id=ctx.pad_id)
    greedy, sampled = heldout.greedy_and_sampled_reward(parts, ctx)
    gate.set_headroom(chosen, greedy, margin)
    logging.getLogger("hpa").info("trust gate: on the held-out prompts the chosen responses' learned reward is "
                                  "%.4f (margin %.4f), the start policy's greedy responses' %.4f (sampled %.4f): "
                                  "headroom %.4f above the start's own rollouts on the training prompts (the "
                                  "first updates' batches)", chosen, margin, greedy, sampled, gate.headroom)


def _heldout_nll(s: StepSignals) -> float:
    with s.ctx.timer("gate"):
        return heldout.heldout_nll(s.parts.policy.model, s.parts.heldout_pairs, s.ctx)


GATE_SIGNAL_INPUTS: Dict[str, GateSignal] = {
    "reward_ceiling": GateSignal(start=_set_ceiling, measure=lambda s: None),
    "sampled_ceiling": GateSignal(start=_set_sampled_ceiling, measure=lambda s: None),
    "start_rollouts": GateSignal(start=_set_headroom, measure=lambda s: None),
    "heldout_nll": GateSignal(start=lambda gate, parts, ctx: None, measure=_heldout_nll),
}


class TrustGateController:
    """The trust gate (``algorithm.hpa.gate``, ``hpa.algorithms.gate``): the weight of the learned
    component of the advantages, from the signal ``GATE_SIGNAL_INPUTS`` names."""

    name, observes = "trust_gate", "rollouts"

    def __init__(self, cfg, parts, ctx):
        g = cfg.algorithm.hpa.gate
        self.gate = TrustGate(signal=g.signal, slack=g.slack, kp=g.kp, ki=g.ki, reward_ema=g.reward_ema,
                              baseline_steps=g.baseline_steps)
        self.signal = GATE_SIGNAL_INPUTS[g.signal]
        self.signal.start(self.gate, parts, ctx)

    def update(self, s: StepSignals) -> Dict[str, float]:
        # every row's learned reward, also with the coverage trust on: the covered rows' alone (the metric
        # coverage/learned_reward) kept the gate open where it should close (docs/objective.md)
        return self.gate.update(self.signal.measure(s), s.metrics["reward/learned_mean"])

    def factors(self) -> Dict[str, float]:
        return {"learned_advantage": self.gate.gate}

    def metrics(self) -> Dict[str, float]:
        return {}

    def state_dict(self) -> Dict:
        return self.gate.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        self.gate.load_state_dict(state)


class GradientBalance:
    """The factor on the pair term and its measurement.

    Args:
        measure_steps: steps measured before the factor is frozen.
    """

    def __init__(self, measure_steps: int):
        if measure_steps < 1:
            raise ValueError(f"measure_steps must be >= 1, got {measure_steps}")
        self.measure_steps = measure_steps
        self.measured = 0
        self.sum_rollout = 0.0
        self.sum_pairs = 0.0
        self.factor = 1.0

    @property
    def measuring(self) -> bool:
        return self.measured < self.measure_steps

    def record(self, rollout_norm: float, pairs_norm: float, w_ppo: float, w_dpo: float) -> float:
        """Add one measured step (norms as the configured weights give them); returns the factor to use.

        A step with a non-finite norm or no gradient in a group is not counted."""
        if all(math.isfinite(x) for x in (rollout_norm, pairs_norm)) and rollout_norm > 0 and pairs_norm > 0 \
                and w_ppo > 0 and w_dpo > 0:
            self.measured += 1
            self.sum_rollout += rollout_norm
            self.sum_pairs += pairs_norm
            self.factor = (w_dpo / w_ppo) * self.sum_rollout / self.sum_pairs
        return self.factor

    def metrics(self) -> Dict[str, float]:
        return {"hpa/balance_factor": self.factor}

    def state_dict(self) -> Dict[str, float]:
        return {"measured": self.measured, "sum_rollout": self.sum_rollout, "sum_pairs": self.sum_pairs,
                "factor": self.factor}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.measured, self.factor = int(state["measured"]), state["factor"]
        self.sum_rollout, self.sum_pairs = state["sum_rollout"], state["sum_pairs"]


class BalanceController(GradientBalance):
    """``GradientBalance`` as a controller: it reads the two gradient norms of a measured update."""

    name, observes = "balance", "gradients"

    def __init__(self, cfg, parts=None, ctx=None):
        super().__init__(cfg.algorithm.hpa.balance.measure_steps)

    def update(self, s: StepSignals) -> Dict[str, float]:
        self.record(s.grad_norms["rollout"], s.grad_norms["pairs"], s.weights.w_ppo, s.weights.w_dpo)
        return {}

    def factors(self) -> Dict[str, float]:
        return {"pairs": self.factor}


def covered_learned_reward(batch, dp_group) -> float:
    """The learned part of the rollouts' reward (r̂ minus the rule) averaged with their coverage trust as
    weights, over the rows that train and the DP ranks (``coverage/learned_reward``, logged; NaN when no
    row is covered). Not the gate's input: measured as one, it kept the gate open where every row's
    learned reward closed it (docs/objective.md)."""
    valid = batch.get("mask").sum(dim=1) > 0  # [b]
    learned = torch.where(valid, batch.get("raw_rewards").double() - batch.get("rule_scores").double(),
                          torch.zeros((), dtype=torch.float64))  # [b]
    weight = batch.get("learned_trust").double() * valid.double()  # [b]
    sums = torch.stack([(weight * learned).sum(), weight.sum()]).cpu()
    comm.all_reduce_sum(sums, dp_group)
    return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")


class CoverageTrust:
    """The coverage trust (``algorithm.hpa.coverage``, ``hpa.algorithms.coverage``): each rollout row's
    weight of the learned advantage component, written to the batch as ``learned_trust`` ``[b]``.

    At start-up the bank is the first reward model's embeddings of ``data.preference_path`` (the pairs the
    reward models were trained on): of each pair's prompt (``space: prompt``) or chosen sequence
    (``space: sequence``), centred on the bank's mean; the held-out pairs' distances to it give the trust
    ramp's ``low`` and ``high``. The bank is recomputed at every start (frozen reward model, fixed file:
    the same rows; too large for the run state); the two constants are saved, and a restore keeps the
    saved ones, so a resumed run is the uninterrupted one even where a new layout rounds the start-up
    forwards differently. Costs, once, a forward of the first reward model over both pair files and, in
    prompt space, one over each training prompt the first time a step draws it (the reward model is
    frozen: a prompt's embedding is kept, ``EmbeddingCache``); in sequence space one over the rollouts.
    With ``kl_boost`` > 0 it also writes ``kl_weights`` ``[b]``, each row's weight of the hierarchical KL
    (``abstention_kl_weights``).
    """

    name, observes = "coverage", "rollouts"

    def __init__(self, cfg, parts, ctx):
        c = cfg.algorithm.hpa.coverage
        self.k, self.space, self.model_reward, self.pad_id = c.k, c.space, parts.model_reward, ctx.pad_id
        self.kl_boost = c.kl_boost
        self.cache = EmbeddingCache()
        self.dp_group = ctx.groups.dp_group
        self.bank = self._embed_pairs(parts.pairs)  # [m, h]
        self.center = bank_center(self.bank)  # [h]
        held = knn_distance(self._embed_pairs(parts.heldout_pairs), self.bank, self.k, center=self.center)  # [n]
        self.low, self.high = calibrate(held, low_quantile=c.low_quantile, high_quantile=c.high_quantile,
                                        margin=c.margin)
        logging.getLogger("hpa").info("coverage trust (%s space): %d rows in the bank; trust 1 up to distance "
                                      "%.4g, 0 from %.4g", self.space, self.bank.shape[0], self.low, self.high)

    def _embed_pairs(self, examples) -> torch.Tensor:
        if self.space == "prompt":  # every pair's prompt (a prompt with more pairs weighs more), each embedded once
            prompts, where = unique_rows([e.prompt_ids for e in examples])
            return heldout.prompt_embeddings(self.model_reward, prompts, pad_id=self.pad_id)[where]
        return heldout.chosen_embeddings(self.model_reward, examples, pad_id=self.pad_id)

    def trust(self, batch) -> torch.Tensor:
        """The trust of each row of a rollout batch ``[b]``: of its prompt (``space: prompt``, each distinct
        prompt embedded once) or of its prompt + response (``space: sequence``)."""
        if self.space == "prompt":
            rows = [ids[m.bool()].tolist() for ids, m in zip(batch.prompt_ids.cpu(), batch.prompt_mask.cpu())]
            prompts, where = unique_rows(rows)
            embeddings = self.cache.embed(prompts, lambda new: heldout.prompt_embeddings(
                self.model_reward, new, pad_id=self.pad_id))  # [u, h]
        else:
            embeddings = self.model_reward.sequence_embeddings(batch.response_ids, batch.response_mask,
                                                               batch.prompt_ids, batch.prompt_mask)  # [b, h]
            where = torch.arange(embeddings.shape[0])
        trust = coverage_trust(knn_distance(embeddings, self.bank, self.k, center=self.center), self.low, self.high)
        return trust[where].to(batch.response_ids.device)

    def update(self, s: StepSignals) -> Dict[str, float]:
        batch = s.batch
        with s.ctx.timer("coverage"):
            trust = self.trust(batch)  # [b]
        batch.set("learned_trust", trust)
        if self.kl_boost > 0:
            batch.set("kl_weights", abstention_kl_weights(trust, self.kl_boost))
        valid = batch.get("mask").sum(dim=1) > 0  # the rows that train (not dropped by the filter)
        trust = comm.all_gather_cat(trust.float(), self.dp_group)[comm.all_gather_cat(valid.float(), self.dp_group) > 0]
        nan = float("nan")
        metrics = trust_metrics(trust) if trust.numel() else {
            f"coverage/{k}": nan for k in ("trust_mean", "trust_p10", "trust_p90", "far_share")}
        return {**metrics, "coverage/low": self.low, "coverage/high": self.high,
                "coverage/cached": float(len(self.cache)), "coverage/learned_reward": covered_learned_reward(batch, self.dp_group)}

    def factors(self) -> Dict[str, float]:
        return {}

    def metrics(self) -> Dict[str, float]:
        return {}

    def state_dict(self) -> Dict:
        return {"low": self.low, "high": self.high}

    def load_state_dict(self, state: Dict) -> None:
        self.low, self.high = state["low"], state["high"]


@dataclasses.dataclass(frozen=True)
class ControllerEntry:
    """A controller of the registry: its class and whether a run's config turns it on."""

    cls: type
    enabled: Callable[[object], bool]


def _gate_enabled(cfg) -> bool:
    from hpa.config.schema import trust_gate_enabled

    return trust_gate_enabled(cfg)


def _coverage_enabled(cfg) -> bool:
    from hpa.config.schema import coverage_enabled

    return coverage_enabled(cfg)


CONTROLLERS: Dict[str, ControllerEntry] = {
    "kl_ctrl": ControllerEntry(KLCoefficient, lambda cfg: True),
    "trust_gate": ControllerEntry(TrustGateController, _gate_enabled),
    "balance": ControllerEntry(BalanceController, lambda cfg: cfg.algorithm.hpa.balance.enabled),
    "coverage": ControllerEntry(CoverageTrust, _coverage_enabled),
}


class Controllers:
    """A run's controllers (those of ``CONTROLLERS`` its config turns on), in registry order."""

    def __init__(self, cfg, parts, ctx):
        self.items: List[Controller] = [e.cls(cfg, parts, ctx) for e in CONTROLLERS.values() if e.enabled(cfg)]

    def __iter__(self) -> Iterator[Controller]:
        return iter(self.items)

    def at(self, point: str) -> List[Controller]:
        return [c for c in self.items if c.observes == point]

    def update(self, point: str, signals: StepSignals) -> Dict[str, float]:
        """Update the controllers that observe ``point``; their metrics."""
        metrics: Dict[str, float] = {}
        for c in self.at(point):
            metrics.update(c.update(signals))
        return metrics

    def factor(self, name: str) -> float:
        """The product of the controllers' factors ``name`` (1 when none sets it)."""
        value = 1.0
        for c in self.items:
            value = c.factors()[name] * value if name in c.factors() else value
        return value

    def factors(self) -> Dict[str, float]:
        return {k: v for c in self.items for k, v in c.factors().items()}

    def metrics(self) -> Dict[str, float]:
        return {k: v for c in self.items for k, v in c.metrics().items()}

    def parts(self) -> Dict[str, Controller]:
        """Name -> controller: the run state's stateful parts (the checkpoint's keys)."""
        return {c.name: c for c in self.items}
