"""The ``algorithm`` section: advantage, PPO, DPO, KL and HPA-mixing settings.

Defaults are the HPA recipe (listed in docs/design.md). Names chosen from registries in
``hpa.algorithms`` are validated against the tuples below, not by importing ``hpa.algorithms``
(config is the lowest layer); a test keeps each tuple equal to its registry's ``names()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional, Tuple

from hpa.config.errors import ConfigError, check_choice, check_range

ADVANTAGE_ESTIMATOR_NAMES = ("gae", "grpo", "reinforce_plus_plus", "rloo")
POLICY_LOSS_NAMES = ("cispo", "geo_mean", "gspo", "vanilla")
LOSS_AGG_MODE_NAMES = (
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-mean",
    "token-sum",
)
KL_ESTIMATOR_NAMES = (
    "abs", "abs+", "k1", "k1+", "k2", "k2+", "k3", "k3+", "kl", "kl+", "low_var_kl", "low_var_kl+", "mse", "mse+",
)
KL_CONTROLLER_NAMES = ("adaptive", "fixed")
DPO_LOSS_NAMES = ("hinge", "ipo", "robust", "sigmoid")
SCHEDULE_NAMES = ("constant", "cosine", "linear", "piecewise", "warmup_constant")
ROLLOUT_IS_LEVEL_NAMES = ("sequence", "token")
ROLLOUT_RS_LEVEL_NAMES = ("geometric", "sequence", "token")
SEMANTIC_DISTANCE_NAMES = ("cosine", "mse")
ROLLOUT_FILTER_NAMES = ("dapo_groups", "none", "reward_above_mean_std")
# hpa.algorithms.gate.GATE_SIGNALS, and the signals the reward models compute
GATE_SIGNALS = ("heldout_nll", "reward_ceiling", "sampled_ceiling", "start_rollouts")
GATE_SIGNALS_ON_REWARD_MODELS = ("reward_ceiling", "sampled_ceiling", "start_rollouts")
ROLLOUT_FILTER_SCOPES = ("batch", "group")
ROLLOUT_FILTER_METRICS = ("raw", "shaped")
# estimators that whiten advantages over a rank's own rows: a rank whose rows are all filtered out has none
WHITENING_ESTIMATORS = ("gae", "reinforce_plus_plus")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """A value as a function of progress ``p = step / total_steps``; ``make_schedule(**asdict(cfg))``.

    Attributes:
        name: constant | linear | cosine | warmup_constant | piecewise.
        value: constant value; the value after the warmup of ``warmup_constant``.
        start: value at p = 0 (linear, cosine); the value during the warmup (warmup_constant).
        end: value at p = 1 (linear, cosine).
        warmup_fraction: progress until which ``warmup_constant`` holds ``start``.
        boundaries: strictly increasing progress points of ``piecewise``.
        values: ``len(boundaries) + 1`` values of ``piecewise``.
    """

    name: str = "constant"
    value: float = 0.0
    start: float = 0.0
    end: float = 0.0
    warmup_fraction: float = 0.0
    boundaries: Tuple[float, ...] = ()
    values: Tuple[float, ...] = ()

    def __post_init__(self):
        check_choice("name", self.name, SCHEDULE_NAMES)
        check_range("warmup_fraction", self.warmup_fraction, low=0.0, high=1.0)
        if self.name == "piecewise":
            if len(self.values) != len(self.boundaries) + 1:
                raise ConfigError(
                    "values",
                    f"piecewise needs one more value than boundaries; got {len(self.values)} values "
                    f"for {len(self.boundaries)} boundaries",
                )
            for b in self.boundaries:
                check_range("boundaries", b, low=0.0, high=1.0)
            if any(b2 <= b1 for b1, b2 in zip(self.boundaries, self.boundaries[1:])):
                raise ConfigError("boundaries", f"must be strictly increasing, got {self.boundaries}")

    def used_values(self) -> Tuple[float, ...]:
        """The numbers this schedule can return."""
        return {
            "constant": (self.value,),
            "linear": (self.start, self.end),
            "cosine": (self.start, self.end),
            "warmup_constant": (self.start, self.value),
            "piecewise": self.values,
        }[self.name]


def _check_non_negative(key: str, schedule: ScheduleConfig) -> None:
    if any(v < 0 for v in schedule.used_values()):
        raise ConfigError(key, f"a weight schedule must stay >= 0; got {schedule.used_values()}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How advantages are estimated.

    Attributes:
        estimator: gae (needs a critic) | grpo | rloo | reinforce_plus_plus.
        gamma: discount factor (gae, reinforce_plus_plus).
        lam: GAE lambda.
        norm_by_std: GRPO divides by the group std (False: Dr.GRPO).
        epsilon: added to the GRPO group std.
        per_component: group-normalise the rule reward and the learned part of the shaped reward
            (reward models, σ, diversity, length and copy terms) separately and add them with their
            shares of the reward weights, so the trust gate (``algorithm.hpa.trust``) can scale the
            learned part alone; a rule that abstains on a prompt contributes 0. None (default): on with
            ``grpo`` when reward models are configured (``reward.model_paths``: a learned reward to
            gate), off otherwise; true needs ``grpo``.
    """

    estimator: str = "gae"
    gamma: float = 0.99
    lam: float = 0.95
    norm_by_std: bool = True
    epsilon: float = 1e-6
    per_component: Optional[bool] = None

    def __post_init__(self):
        check_choice("estimator", self.estimator, ADVANTAGE_ESTIMATOR_NAMES)
        check_range("gamma", self.gamma, low=0.0, high=1.0)
        check_range("lam", self.lam, low=0.0, high=1.0)
        check_range("epsilon", self.epsilon, low=0.0, low_open=True)
        if self.per_component is True and self.estimator != "grpo":
            raise ConfigError("per_component", f"needs estimator: grpo (group-normalised components), got "
                                               f"estimator: {self.estimator}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """The PPO policy and value losses.

    Attributes:
        policy_loss: vanilla (clipped surrogate with dual-clip) | gspo (sequence-level ratio; aggregated
            by loss_agg_mode, as verl; the paper's form is seq-mean-token-mean) | cispo (clipped, detached IS weight times log-prob) |
            geo_mean (GMPO: geometric mean of log-space-clipped token ratios; a mean over sequences, as
            verl, whatever loss_agg_mode). loss_agg_mode still aggregates the entropy and KL terms.
        clip_ratio: symmetric clip ε (0.18 on math tasks in the recipe).
        clip_ratio_low: lower-side ε; None uses clip_ratio. Below 1, except with cispo, where 1 or more
            turns the lower bound off (the paper bounds only the upper side).
        clip_ratio_high: upper-side ε (e.g. 0.28 for clip-higher); None uses clip_ratio.
        clip_ratio_c: dual-clip constant for negative advantages, > 1.
        value_clip: ε of the value clip around the old values.
        loss_agg_mode: how per-token losses become a scalar.
        loss_scale_factor: divisor of seq-mean-token-sum-norm; None uses the padded response length.
        entropy_coef: schedule of the entropy-bonus coefficient.

    The truncated importance weight of the rollouts (``rollout_is_threshold`` here before) is
    ``algorithm.rollout_correction``.
    """

    policy_loss: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    value_clip: float = 0.2
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    entropy_coef: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(name="constant", value=0.01))

    def __post_init__(self):
        check_choice("policy_loss", self.policy_loss, POLICY_LOSS_NAMES)
        check_range("clip_ratio", self.clip_ratio, low=0.0, high=1.0, low_open=True, high_open=True)
        if self.clip_ratio_low is not None:
            if self.policy_loss == "cispo":  # a weight, not a trust region: >= 1 leaves it unbounded below
                check_range("clip_ratio_low", self.clip_ratio_low, low=0.0, low_open=True)
            else:
                check_range("clip_ratio_low", self.clip_ratio_low, low=0.0, high=1.0, low_open=True,
                            high_open=True)
        if self.clip_ratio_high is not None:
            check_range("clip_ratio_high", self.clip_ratio_high, low=0.0, low_open=True)
        if not self.clip_ratio_c > 1.0:
            raise ConfigError("clip_ratio_c", f"dual-clip needs a value > 1 (the recipe uses 3.0), got {self.clip_ratio_c}")
        check_range("value_clip", self.value_clip, low=0.0, low_open=True)
        check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODE_NAMES)
        if self.loss_scale_factor is not None:
            check_range("loss_scale_factor", self.loss_scale_factor, low=0.0, low_open=True)
        _check_non_negative("entropy_coef", self.entropy_coef)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """Off-policy correction of the rollouts (``hpa.algorithms.rollout_correction``): verl's rollout-correction
    options, names and semantics as of v0.7.0 (``algorithm.rollout_correction``, decoupled mode), every one
    off by default (verl's ``rollout_is`` defaults to ``sequence``; here null, so a run without the section
    is the uncorrected one). Each is computed per token from ``log π_old − log π_behaviour``: π_old is the
    trainer's forward before the update (the proximal policy, which the PPO ratio is clipped around),
    π_behaviour the log-probs the rollout engine recorded when it sampled (another engine's numerics, or an
    older policy at ``rollout.max_staleness`` k >= 1). The weights multiply each rollout token's PPO loss
    and its token KL, and the semantic distance of its row (by the row's mean weight); rejected and vetoed
    tokens leave the loss mask of every rollout term (PPO, entropy, KL, value loss) after the advantages
    are computed. See docs/objective.md, "Where each term's samples come from". The fields are those of
    ``hpa.algorithms.rollout_correction.RolloutCorrection``, which the step builds from this one (the config layer
    may not import the algorithms, so the list is written twice; a test holds the two equal).

    Attributes:
        rollout_is: importance-weight level: ``token`` (each token's ratio; low variance, biased) |
            ``sequence`` (the row's product of ratios; unbiased, high variance) | null (no weights).
        rollout_is_threshold: truncation cap of the weights (verl: 1.5-5 per token, 2-10 per sequence).
        rollout_rs: rejection level: ``token`` | ``sequence`` (product of ratios) | ``geometric``
            (geometric mean of the row's ratios; thresholds near 1, e.g. 1.001) | null (no rejection).
            A token (or a whole row) whose ratio lies outside ``[rollout_rs_threshold_lower,
            rollout_rs_threshold]`` leaves the loss.
        rollout_rs_threshold: upper bound of an accepted ratio; required with ``rollout_rs``.
        rollout_rs_threshold_lower: lower bound, at most ``rollout_rs_threshold``; null: its reciprocal.
        rollout_token_veto_threshold: a row with any token whose ratio is below this leaves the loss whole
            (verl: 1e-4 to 1e-6); null: no veto.
    """

    rollout_is: Optional[str] = None
    rollout_is_threshold: float = 2.0
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[float] = None
    rollout_rs_threshold_lower: Optional[float] = None
    rollout_token_veto_threshold: Optional[float] = None

    def __post_init__(self):
        if self.rollout_is is not None:
            check_choice("rollout_is", self.rollout_is, ROLLOUT_IS_LEVEL_NAMES)
        check_range("rollout_is_threshold", self.rollout_is_threshold, low=0.0, low_open=True)
        if self.rollout_rs is not None:
            check_choice("rollout_rs", self.rollout_rs, ROLLOUT_RS_LEVEL_NAMES)
            if self.rollout_rs_threshold is None:
                raise ConfigError("rollout_rs_threshold", f"must be set with rollout_rs: {self.rollout_rs} "
                                                          "(e.g. 2.0; 1.001 for geometric)")
        for key in ("rollout_rs_threshold", "rollout_rs_threshold_lower", "rollout_token_veto_threshold"):
            if getattr(self, key) is not None:
                check_range(key, getattr(self, key), low=0.0, low_open=True)
        if self.rollout_rs_threshold_lower is not None and self.rollout_rs_threshold is not None \
                and self.rollout_rs_threshold_lower > self.rollout_rs_threshold:
            raise ConfigError("rollout_rs_threshold_lower", f"{self.rollout_rs_threshold_lower} exceeds "
                                                            f"rollout_rs_threshold ({self.rollout_rs_threshold})")

    @property
    def enabled(self) -> bool:
        """Whether any option is on (the trainer then needs π_old before the update)."""
        return self.rollout_is is not None or self.rollout_rs is not None \
            or self.rollout_token_veto_threshold is not None

    @property
    def rejects(self) -> bool:
        """Whether tokens or rows can leave the loss (rejection or veto)."""
        return self.rollout_rs is not None or self.rollout_token_veto_threshold is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig:
    """The offline preference loss.

    Attributes:
        loss: sigmoid | ipo | hinge | robust.
        beta: β (τ for IPO).
        label_smoothing: assumed label-flip rate ε (sigmoid: conservative DPO; robust: rDPO).
        rpo_alpha: the preference anchor (RPO, TRL's ``rpo_alpha``): adds α times the chosen responses'
            NLL per token to the DPO term; None is off; 1.0 (default) is RPO's recommendation.
    """

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: Optional[float] = 1.0

    def __post_init__(self):
        check_choice("loss", self.loss, DPO_LOSS_NAMES)
        check_range("beta", self.beta, low=0.0, low_open=True)
        check_range("label_smoothing", self.label_smoothing, low=0.0, high=0.5, high_open=True)
        if self.rpo_alpha is not None:
            check_range("rpo_alpha", self.rpo_alpha, low=0.0)
        if self.label_smoothing != 0.0 and self.loss not in ("sigmoid", "robust"):
            raise ConfigError(
                "label_smoothing",
                f"loss {self.loss!r} does not use label smoothing; set it to 0 or use 'sigmoid' or 'robust'",
            )


DEFAULT_REPLAY_COEF = 0.5  # algorithm.replay.coef where data.sft_path is given and the key is left unset


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """SFT replay: the supervised examples of ``data.sft_path`` (those that made the start) replayed in every
    step, their NLL per token added to the offline stream: InstructGPT's PPO-ptx (Ouyang et al. 2022, with
    the SFT data in place of pre-training text) and OpenRLHF's ``ptx_coef``. Where the preference pairs
    and the reward models have no support (a prompt kind without pairs), the step's only signal is then the
    demonstrations, not the learned reward's extrapolation (docs/objective.md, "SFT replay").

    The term is ``w_dpo · b · coef · NLL_replay``: it rides with the pair stream, under its weight and the
    automatic balance's factor ``b``, as the RPO anchor does; ``w_dpo = 0`` weights it 0.
    Each step draws ``trainer.replay_batch_size`` examples (over all DP ranks). Not OpenRLHF's numerics: its
    actor adds ``ptx_coef ×`` the token-mean LM loss of a pre-training batch on every token, with a weight of
    its own; here the NLL is over the response tokens only (the prompt is context, as in ``hpa sft``), per
    token over the whole step's replayed responses, and weighted with the pair stream.

    Attributes:
        coef: γ, the weight of the replayed examples' NLL per token next to the DPO loss; 0 is off. None
            (default): ``DEFAULT_REPLAY_COEF`` (0.5) when ``data.sft_path`` is given, else 0; the root
            ``Config`` resolves it, so a loaded config always holds a number (chosen in
            experiments/replay-and-hold-min-skill.md).
    """

    coef: Optional[float] = None

    def __post_init__(self):
        if self.coef is not None:
            check_range("coef", self.coef, low=0.0)

    @property
    def enabled(self) -> bool:
        return self.coef is not None and self.coef > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLConfig:
    """KL to the reference: estimator, where it is applied, and its coefficient.

    Attributes:
        estimator: estimator of the KL loss and the token part of the hierarchical KL.
        reward_estimator: estimator of the per-token reward penalty.
        use_kl_in_reward: subtract coef·KL from the token rewards.
        use_kl_loss: add the KL loss term.
        controller: adaptive | fixed.
        init_kl_coef: starting (or fixed) coefficient.
        target_kl: target of the adaptive controller (0.01 beyond 32 nodes in the recipe).
        horizon: horizon of the adaptive controller.
        warmup_fraction: the coefficient is 0 for this first fraction of training.
    """

    estimator: str = "low_var_kl"
    reward_estimator: str = "kl"
    use_kl_in_reward: bool = False
    use_kl_loss: bool = True
    controller: str = "adaptive"
    init_kl_coef: float = 0.001
    target_kl: float = 0.015
    horizon: int = 10000
    warmup_fraction: float = 0.2

    def __post_init__(self):
        check_choice("estimator", self.estimator, KL_ESTIMATOR_NAMES)
        check_choice("reward_estimator", self.reward_estimator, KL_ESTIMATOR_NAMES)
        check_choice("controller", self.controller, KL_CONTROLLER_NAMES)
        check_range("init_kl_coef", self.init_kl_coef, low=0.0)
        check_range("target_kl", self.target_kl, low=0.0, low_open=True)
        if self.horizon <= 0:
            raise ConfigError("horizon", f"must be a positive number of samples, got {self.horizon}")
        check_range("warmup_fraction", self.warmup_fraction, low=0.0, high=1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """Automatic balance of the rollout (PPO, entropy, KL) and pair (DPO, anchor) gradients.

    For the first ``measure_steps`` steps the two groups of micro-batches run as two backward passes;
    the norms of their gradients (with gradient clipping's reductions) give the factor on the pair
    term that makes ``w_dpo : w_ppo`` the ratio of the two gradients' norms, then the factor is frozen.

    Attributes:
        enabled: on by default (the recipe has no balance).
        measure_steps: steps measured (the factor is the ratio of the summed norms).
    """

    enabled: bool = True
    measure_steps: int = 10

    def __post_init__(self):
        check_range("measure_steps", self.measure_steps, low=1)


TRUST_REGIMES = ("auto", "coverage", "gate", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrustConfig:
    """How far the learned reward is trusted: one named regime and its few numbers (docs/objective.md).

    Two controllers act on the learned component of the advantage (per-component advantages): the trust gate
    (``hpa.algorithms.gate``) weights it ``1/(1+λ)`` for the whole step, λ rising while the rollouts' learned
    reward climbs past what the held-out pairs (``data.heldout_preference_path``) support; the coverage trust
    (``hpa.algorithms.coverage``) weights it per row by how close the row's prompt lies to the pairs the
    reward models were trained on, and holds the rows no pair covers near the start (a heavier KL) where the
    start does them well, else releases the hold (a lighter KL, heavier pairs). Their other constants are
    module constants of those modules, each with the record that chose it.

    Attributes:
        regime: auto (default): each controller runs where its inputs are given (the gate with per-component
            advantages and held-out pairs, and reward models for a signal that reads them; the coverage trust
            with per-component advantages, reward models and held-out pairs); gate: the gate alone;
            coverage: the coverage trust alone (both need their inputs); off: neither.
        signal: what the gate compares: start_rollouts (default; the start's own rollouts plus the held-out
            headroom, experiments/start-rollouts-and-coverage.md), sampled_ceiling, reward_ceiling (the held-out
            chosen responses' learned reward), or heldout_nll (the held-out chosen NLL; needs no reward model).
        slack: the gate's violation that costs nothing (margins above the ceiling; relative NLL regression).
        margin: the coverage trust reaches 0 at this times the held-out pairs' 95 % distance (>= 1).
        kl_boost: the far rows' KL to the reference counts ``1 + kl_boost`` times where the hold is kept; 0: no
            hold (experiments/far-rows-kl-boost.md).
        hold_min_skill: the start's greedy exact-match share on the uncovered demonstrations (``data.sft_path``)
            below which the hold is released for the run (a WARNING); where ``reward.rules`` has a graded rule
            (``token_f1``) the skill is its mean score of the greedy answers against the demonstrations, so
            answers worded otherwise count (experiments/freetext-family.md); null: always hold
            (experiments/replay-and-hold-min-skill.md).
        released_kl: where the hold is released, every row's KL weighs ``w_kl`` times this
            (experiments/released-kl.md).
        released_pairs: where the hold is released, the pair stream weighs this many times more (> 0;
            experiments/released-pairs.md).
    """

    regime: str = "auto"
    signal: str = "start_rollouts"
    slack: float = 0.02
    margin: float = 2.0
    kl_boost: float = 100.0
    hold_min_skill: Optional[float] = 0.6
    released_kl: float = 0.25
    released_pairs: float = 2.0

    def __post_init__(self):
        check_choice("regime", self.regime, TRUST_REGIMES)
        check_choice("signal", self.signal, GATE_SIGNALS)
        check_range("slack", self.slack, low=0.0)
        check_range("margin", self.margin, low=1.0)
        check_range("kl_boost", self.kl_boost, low=0.0)
        if self.hold_min_skill is not None:
            check_range("hold_min_skill", self.hold_min_skill, low=0.0, high=1.0)
        check_range("released_kl", self.released_kl, low=0.0)
        check_range("released_pairs", self.released_pairs, low=0.0, low_open=True)  # 0: no pairs where released


@dataclasses.dataclass(frozen=True, kw_only=True)
class HPAConfig:
    """Mixing weights and hierarchical-KL weights, each a schedule of training progress.

    Attributes:
        w_ppo: weight of the PPO loss.
        w_dpo: weight of the DPO loss.
        w_kl: weight of the hierarchical KL.
        lambda_token: weight of the token KL inside the hierarchical KL (1.0 -> 0.2).
        lambda_semantic: weight of the semantic distance (0.2 -> 1.0).
        semantic_distance: mse | cosine, between mean-pooled final hidden states.
        balance: the automatic balance of the rollout and pair gradients.
        trust: how far the learned reward is trusted (the trust gate and the coverage trust).
    """

    w_ppo: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(name="constant", value=0.4))
    w_dpo: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(name="constant", value=0.4))
    w_kl: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(name="constant", value=0.2))
    lambda_token: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(name="linear", start=1.0, end=0.2))
    lambda_semantic: ScheduleConfig = field(
        default_factory=lambda: ScheduleConfig(name="linear", start=0.2, end=1.0)
    )
    semantic_distance: str = "mse"
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)

    def __post_init__(self):
        for key in ("w_ppo", "w_dpo", "w_kl", "lambda_token", "lambda_semantic"):
            _check_non_negative(key, getattr(self, key))
        check_choice("semantic_distance", self.semantic_distance, SEMANTIC_DISTANCE_NAMES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutFilterConfig:
    """Which rollouts of a step train, decided between scoring and the advantages (``hpa.algorithms.filters``).

    A dropped row stays in the batch with an all-zero loss mask, so advantages, the KL and the loss
    normalisation (global counts over the DP ranks) are those of the kept rows; a rank may keep none.

    Attributes:
        name: none | reward_above_mean_std (the HPA recipe: keep reward > mean + k·std) | dapo_groups
            (DAPO's dynamic sampling: drop the prompts whose responses all score the same, generate more
            prompts until the batch is full or ``max_refill_rounds`` extra rounds were generated).
        k: the recipe's k (reward_above_mean_std).
        scope: batch (mean and std over the whole step's rows, all DP ranks) | group (over the responses to
            the same prompt) (reward_above_mean_std).
        metric: the reward filtered on: shaped (the reward PPO trains on) | raw (r̂: rule and reward-model
            score before shaping, DAPO's accuracy). None: shaped for reward_above_mean_std, raw for
            dapo_groups (the shaping terms almost never tie, so DAPO on them would keep everything).
        max_refill_rounds: dapo_groups: extra generation rounds at most per step (verl's
            max_num_gen_batches counts the first round too: 10 there is 9 here); 0: drop, never refill.
    """

    name: str = "none"
    k: float = 1.0
    scope: str = "batch"
    metric: Optional[str] = None
    max_refill_rounds: int = 9

    def __post_init__(self):
        check_choice("name", self.name, ROLLOUT_FILTER_NAMES)
        check_choice("scope", self.scope, ROLLOUT_FILTER_SCOPES)
        if self.metric is not None:
            check_choice("metric", self.metric, ROLLOUT_FILTER_METRICS)
        if self.max_refill_rounds < 0:
            raise ConfigError("max_refill_rounds", f"must be >= 0 (0: never refill), got {self.max_refill_rounds}")

    @property
    def resolved_metric(self) -> str:
        """``metric``, or the filter's own default."""
        if self.metric is not None:
            return self.metric
        return "raw" if self.name == "dapo_groups" else "shaped"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The ``algorithm`` section."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    hpa: HPAConfig = field(default_factory=HPAConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    rollout_filter: RolloutFilterConfig = field(default_factory=RolloutFilterConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self):
        if self.rollout_filter.name != "none" and self.advantage.estimator in WHITENING_ESTIMATORS:
            raise ConfigError(
                "rollout_filter.name",
                f"{self.rollout_filter.name!r} can leave a DP rank with no rows in the loss, and "
                f"algorithm.advantage.estimator={self.advantage.estimator!r} whitens advantages over each "
                f"rank's own rows (it needs at least two); use algorithm.advantage.estimator=grpo or rloo with a "
                f"rollout filter, or algorithm.rollout_filter.name=none")
