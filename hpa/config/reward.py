"""Config of the ``reward`` YAML section: reward sources, shaping, the hacking monitor. (Which rollouts train
is ``algorithm.rollout_filter``.)

The name tuples below are the valid choices; they must equal the names of the matching registries in
``hpa.reward`` (a test checks this). This module does not import ``hpa.reward``: config is the lowest layer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Tuple

from hpa.config.errors import ConfigError, check_choice, check_range

# == hpa.reward.rules.RULE_REWARDS.names()
RULE_REWARD_NAMES: Tuple[str, ...] = ("exact_match", "gsm8k", "gsm8k_flexible", "token_f1")
# == hpa.reward.shaping.TARGET_LENGTH_MODES.names()
TARGET_LENGTH_MODES: Tuple[str, ...] = ("above", "two_sided")
# == hpa.reward.shaping.COPY_PENALTY_MODES.names()
COPY_PENALTY_MODES: Tuple[str, ...] = ("linear", "step")
# == hpa.reward.shaping.EMBEDDING_SOURCES
DIVERSITY_SOURCES: Tuple[str, ...] = ("policy", "reward_model")

# == hpa.reward.train_rm.BOOTSTRAP_KINDS.names()
BOOTSTRAP_KINDS: Tuple[str, ...] = ("multinomial", "poisson")

# "package.module:function" (dotted identifiers on both sides of one colon).
CUSTOM_FUNCTION_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapingConfig:
    """UncertaintyAwareReward: ``r = r̂ − alpha·σ + beta·diversity − length_penalty − copy_penalty``.

    Args:
        alpha: weight of the ensemble std σ (0 switches it off).
        beta: weight of the diversity bonus (0 switches it off and no embeddings are needed).
        diversity_bank_size: number of recent response embeddings kept (FIFO, same on every DP rank).
        diversity_source: where the mean-pooled embedding comes from: ``reward_model`` or ``policy``.
        overlong_buffer_len: DAPO overlong buffer length L in tokens; 0 switches it off.
        overlong_penalty_factor: penalty at the maximum length (linear from 0 at ``max_len − L``).
        max_response_length: maximum response length; required when the overlong buffer is on.
        target_length: target response length in tokens; None switches the target penalty off.
        target_length_coef: penalty per token away from the target.
        target_length_mode: ``two_sided`` (|len − target|) or ``above`` (only len > target).
        copy_ngram: n of the n-grams compared between response and prompt.
        copy_threshold: copy rate (fraction of response n-grams found in the prompt) tolerated free.
        copy_coef: penalty scale; 0 switches the copy penalty off.
        copy_mode: ``linear`` (coef·max(0, rate − threshold)) or ``step`` (coef when rate > threshold).
        normalize: running (Welford) normalisation of the shaped reward over all steps and DP ranks.
        clip: clip the (normalised) reward to [−clip, clip]; None switches clipping off.
    """

    alpha: float = 0.5
    beta: float = 0.2
    diversity_bank_size: int = 1024
    diversity_source: str = "reward_model"
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    max_response_length: Optional[int] = None
    target_length: Optional[int] = None
    target_length_coef: float = 0.0
    target_length_mode: str = "two_sided"
    copy_ngram: int = 4
    copy_threshold: float = 0.5
    copy_coef: float = 1.0
    copy_mode: str = "linear"
    normalize: bool = False
    clip: Optional[float] = None

    def __post_init__(self):
        check_range("alpha", self.alpha, low=0.0)
        check_range("beta", self.beta, low=0.0)
        check_range("diversity_bank_size", self.diversity_bank_size, low=1)
        check_choice("diversity_source", self.diversity_source, DIVERSITY_SOURCES)
        check_range("overlong_buffer_len", self.overlong_buffer_len, low=0)
        check_range("overlong_penalty_factor", self.overlong_penalty_factor, low=0.0)
        if self.max_response_length is not None:
            check_range("max_response_length", self.max_response_length, low=1)
        if self.overlong_buffer_len > 0:
            if self.max_response_length is None:
                raise ConfigError("max_response_length", "the overlong buffer (overlong_buffer_len > 0) "
                                  "needs max_response_length; set it to the rollout's maximum response "
                                  "length, or set overlong_buffer_len: 0")
            if self.overlong_buffer_len > self.max_response_length:
                raise ConfigError("overlong_buffer_len", f"{self.overlong_buffer_len} exceeds "
                                  f"max_response_length={self.max_response_length}, so every response "
                                  "would be penalised; make it smaller than max_response_length")
        if self.target_length is not None:
            check_range("target_length", self.target_length, low=1)
        check_range("target_length_coef", self.target_length_coef, low=0.0)
        check_choice("target_length_mode", self.target_length_mode, TARGET_LENGTH_MODES)
        check_range("copy_ngram", self.copy_ngram, low=1)
        check_range("copy_threshold", self.copy_threshold, low=0.0, high=1.0)
        check_range("copy_coef", self.copy_coef, low=0.0)
        check_choice("copy_mode", self.copy_mode, COPY_PENALTY_MODES)
        if self.clip is not None:
            check_range("clip", self.clip, low=0.0, low_open=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """Reward-hacking monitor on the adversarial validation set (``data.adversarial_prompt_path``),
    evaluated every ``trainer.eval_interval`` steps; the first evaluation is the baseline.

    Args:
        gap_threshold: alert when (mean model reward − mean gold score) on the set has grown by more
            than this over the baseline.
        length_ratio_threshold: alert when the mean response length exceeds this many times the
            baseline's.
        copy_rate_threshold: alert when the mean n-gram copy rate of the responses exceeds this.
    """

    gap_threshold: float = 0.5
    length_ratio_threshold: float = 1.5
    copy_rate_threshold: float = 0.5

    def __post_init__(self):
        check_range("gap_threshold", self.gap_threshold, low=0.0, low_open=True)
        check_range("length_ratio_threshold", self.length_ratio_threshold, low=1.0, low_open=True)
        check_range("copy_rate_threshold", self.copy_rate_threshold, low=0.0, high=1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardModelTrainingConfig:
    """``hpa train-rm``: Bradley-Terry training of the reward model ensemble (``reward.num_heads`` heads).

    Batch sizes, steps, seed and run directory come from the ``trainer`` section
    (``preference_batch_size`` pairs per step over all DP ranks, ``micro_batch_size`` pairs per
    micro-batch, ``total_steps``, ``eval_interval``), the learning rate from ``optim``.

    Args:
        bootstrap: give every head its own bootstrap resample of the pairs (integer per-pair weights,
            drawn once per pair and head from ``trainer.seed``); False: every head sees every pair once.
        bootstrap_kind: ``poisson`` (independent Poisson(1) counts) or ``multinomial`` (N draws with
            replacement per head, the classic bootstrap).
        margin: m in ``−log σ(r_chosen − r_rejected − m)``; 0 is the plain Bradley-Terry loss.
        eval_fraction: fraction of the preference pairs held out for evaluation (a seeded, fixed
            split); ignored when ``eval_path`` is set.
        eval_path: a separate preference file for evaluation; None: hold out ``eval_fraction``.
        init_path: start from these reward model weights (a ``reward_model/`` directory) instead of
            a random initialisation; None: random.
        backbone_path: start the backbone from a policy checkpoint (usually the SFT model, as
            InstructGPT-style reward models do), with freshly initialised heads; exclusive with
            ``init_path``.
    """

    bootstrap: bool = True
    bootstrap_kind: str = "poisson"
    margin: float = 0.0
    eval_fraction: float = 0.05
    eval_path: Optional[str] = None
    init_path: Optional[str] = None
    backbone_path: Optional[str] = None

    def __post_init__(self):
        check_choice("bootstrap_kind", self.bootstrap_kind, BOOTSTRAP_KINDS)
        check_range("margin", self.margin, low=0.0)
        check_range("eval_fraction", self.eval_fraction, low=0.0, high=1.0, high_open=True)
        if self.init_path is not None and self.backbone_path is not None:
            raise ConfigError("backbone_path", "set init_path (a whole reward model) or backbone_path (a policy "
                                               "checkpoint's backbone), not both")
        for key in ("eval_path", "init_path", "backbone_path"):
            if getattr(self, key) == "":
                raise ConfigError(key, "is an empty string; leave it out (null) or give a path")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """The ``reward`` section.

    The base reward is the sum of the reward model(s) (K = len(model_paths)·num_heads values per
    response), ``rule_weight`` times each named rule and the custom function; rules add the same value
    to every head, so they move r̂ and leave σ unchanged.

    Args:
        model_paths: reward model checkpoints; several models form an ensemble.
        num_heads: ensemble heads per reward model.
        rules: names of rule rewards (``hpa.reward.rules.RULE_REWARDS``).
        rule_weight: weight of each rule reward and of the custom function.
        custom_function: ``package.module:function`` with signature
            ``fn(response_text: str, ground_truth: str, **kwargs) -> float``.
        allow_custom_code: must be true for ``custom_function``: it imports and runs that code as is,
            with the trainer's permissions. Only point it at code you trust.
    """

    model_paths: Tuple[str, ...] = ()
    num_heads: int = 1
    rules: Tuple[str, ...] = ()
    rule_weight: float = 1.0
    custom_function: Optional[str] = None
    allow_custom_code: bool = False
    shaping: ShapingConfig = dataclasses.field(default_factory=ShapingConfig)
    monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)
    training: RewardModelTrainingConfig = dataclasses.field(default_factory=RewardModelTrainingConfig)

    def __post_init__(self):
        for i, path in enumerate(self.model_paths):
            if not path:
                raise ConfigError(f"model_paths[{i}]", "empty path; remove it or give a checkpoint path")
        check_range("num_heads", self.num_heads, low=1)
        for i, name in enumerate(self.rules):
            check_choice(f"rules[{i}]", name, RULE_REWARD_NAMES)
        if len(set(self.rules)) != len(self.rules):
            raise ConfigError("rules", f"{self.rules} names a rule twice; list each rule once")
        if self.custom_function is not None:
            check_custom_function_spec("custom_function", self.custom_function)
            if not self.allow_custom_code:
                raise ConfigError("custom_function", f"{self.custom_function!r} is custom code, which "
                                  "runs with the trainer's permissions; set allow_custom_code: true if you "
                                  "trust it, or remove custom_function")


def check_diversity_source(shaping: ShapingConfig, has_reward_model: bool) -> None:
    """Raise a ConfigError when the diversity bonus (``beta > 0``) reads reward-model embeddings but there
    is no reward model to give them.

    Both the whole-config validation (``reward.model_paths`` empty) and ``hpa.reward.build_reward`` (no
    reward model passed) call this, so a bare ``reward`` section fails with the same message.
    """
    if shaping.beta > 0 and shaping.diversity_source == "reward_model" and not has_reward_model:
        raise ConfigError("reward.shaping.diversity_source", "'reward_model' embeddings need a reward model "
                          "(reward.model_paths); set it to 'policy' or reward.shaping.beta: 0")


def check_custom_function_spec(key: str, spec: str) -> None:
    """Raise a ConfigError unless ``spec`` reads ``package.module:function``."""
    if not isinstance(spec, str) or not CUSTOM_FUNCTION_PATTERN.match(spec):
        raise ConfigError(key, f"{spec!r} is not of the form 'package.module:function' (a dotted module "
                               "path importable from sys.path, one colon, then the function name), "
                               "e.g. 'my_rewards.math:score'")
