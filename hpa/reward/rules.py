"""Rule rewards: ``fn(response_text: str, ground_truth: str, **kwargs) -> float``, chosen by name.

Custom functions with the same signature are loaded from ``package.module:function`` only when the
config sets ``allow_custom_code: true``: loading imports and runs that code with the trainer's
permissions, so it must be code you trust.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from typing import Callable, List, Optional, Sequence

import torch

from hpa.config.errors import ConfigError
from hpa.config.reward import check_custom_function_spec
from hpa.registry import Registry
from hpa.reward.shaping import BaseRewardOutput, RewardInputs

RULE_REWARDS = Registry("rule reward")

RuleFn = Callable[..., float]

# As verl: only the tail is searched; the final answer sits at the end and long texts make regexes slow.
GSM8K_CLIP_CHARS = 300
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip()


def extract_gsm8k_answer(text: str, method: str = "strict") -> Optional[str]:
    """The final answer of a GSM8K-style solution, as verl's ``gsm8k.extract_solution``.

    Only the last ``GSM8K_CLIP_CHARS`` characters are searched.
    ``strict``: the last ``#### <number>`` (the format is part of what is scored).
    ``flexible``: the last number anywhere (the fallback for answers without ``####``), skipping
    matches that are only ``.`` or ``,``.
    Commas and ``$`` are removed in both modes (verl removes them in strict mode only).

    Returns:
        The answer string, or None when there is none.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"unknown GSM8K extraction method {method!r}; valid: strict, flexible")
    text = text[-GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(text)
        return _clean_number(found[-1]) if found else None
    for candidate in reversed(_NUMBER.findall(text)):
        cleaned = _clean_number(candidate)
        if cleaned not in ("", "."):
            return cleaned
    return None


def gsm8k_score(response_text: str, ground_truth: str, *, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` when the extracted answer equals the ground truth (commas and ``$`` removed from
    both), ``format_score`` when an answer was found but is wrong, 0 when none was found."""
    answer = extract_gsm8k_answer(response_text, method)
    if answer is None:
        return 0.0
    return score if answer == _clean_number(ground_truth) else format_score


@RULE_REWARDS.register("gsm8k")
def gsm8k_strict_reward(response_text: str, ground_truth: str, **kwargs) -> float:
    return gsm8k_score(response_text, ground_truth, method="strict", **kwargs)


@RULE_REWARDS.register("gsm8k_flexible")
def gsm8k_flexible_reward(response_text: str, ground_truth: str, **kwargs) -> float:
    return gsm8k_score(response_text, ground_truth, method="flexible", **kwargs)


@RULE_REWARDS.register("exact_match")
def exact_match_reward(response_text: str, ground_truth: str, **kwargs) -> float:
    """1 when the stripped response equals the stripped ground truth, else 0."""
    return float(response_text.strip() == ground_truth.strip())


_PUNCTUATION = re.compile(r"[^\w\s]")
_ARTICLES = frozenset(("a", "an", "the"))


def normalized_words(text: str) -> List[str]:
    """SQuAD's answer normalisation: lower case, punctuation removed, the articles ``a``/``an``/``the`` dropped,
    split on whitespace."""
    return [w for w in _PUNCTUATION.sub(" ", text.lower()).split() if w not in _ARTICLES]


@RULE_REWARDS.register("token_f1")
def token_f1_reward(response_text: str, ground_truth: str, **kwargs) -> float:
    """SQuAD's token F1, a graded score in [0, 1]: the harmonic mean of the precision and recall of the
    response's words against the ground truth's, as multisets (order free) after ``normalized_words``; 1 when
    both are empty, 0 when only one is."""
    said, wanted = normalized_words(response_text), normalized_words(ground_truth)
    if not said or not wanted:
        return float(said == wanted)
    common = sum((Counter(said) & Counter(wanted)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(said), common / len(wanted)
    return 2 * precision * recall / (precision + recall)


# the rules whose score is graded (a partial answer earns part of it): the coverage trust measures the start's
# skill with them (``graded_rule``); with the others an answer counts only when it is the demonstrated one
GRADED_RULES = ("token_f1",)


def graded_rule(names: Sequence[str]) -> Optional[RuleFn]:
    """The graded rule among the run's rule rewards (``reward.rules``), or None when there is none (the
    exact-answer rules: the start's skill stays the exact greedy match). Raises ValueError when there are
    several: which one is the skill would be a guess."""
    graded = [n for n in names if n in GRADED_RULES]
    if len(graded) > 1:
        raise ValueError(f"reward.rules has several graded rules {graded}: keep one, the start's skill reads it")
    return RULE_REWARDS.get(graded[0]) if graded else None


def load_custom_function(spec: str, *, allow_custom_code: bool, key: str = "reward.custom_function") -> RuleFn:
    """Import ``package.module:function`` (it must be importable from ``sys.path``).

    This runs the module's code: only for trusted code, and only with ``allow_custom_code``.

    Raises:
        ConfigError: naming ``key`` when custom code is not allowed, the spec is malformed, the module
            does not import, or the attribute is missing or not callable.
    """
    check_custom_function_spec(key, spec)
    if not allow_custom_code:
        raise ConfigError(key, f"{spec!r} is custom code, which runs with the trainer's permissions; set "
                               "reward.allow_custom_code: true if you trust it, or remove it")
    module_name, attr_path = spec.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(key, f"cannot import module {module_name!r} ({e}); put it on PYTHONPATH or fix "
                               "the module path") from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(key, f"module {module_name!r} has no attribute {attr_path!r}; check the "
                                   "name after the colon")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(key, f"{spec!r} is a {type(obj).__name__}, not a function "
                               "fn(response_text, ground_truth, **kwargs) -> float")
    return obj


class RuleReward:
    """Base reward from rule functions: ``[b, 1] = weight · Σ_fn fn(text, ground_truth)``, and 0 for a row
    whose ground truth is None (a prompt file may mix verifiable prompts with ones only the learned
    reward can judge).

    Args:
        fns: rule functions (from ``RULE_REWARDS`` or ``load_custom_function``).
        weight: multiplies the sum.
    """

    def __init__(self, fns: Sequence[RuleFn], weight: float = 1.0):
        if not fns:
            raise ValueError("RuleReward needs at least one rule function")
        self.fns = list(fns)
        self.weight = weight

    @classmethod
    def from_names(cls, names: Sequence[str], weight: float = 1.0,
                   custom: Optional[RuleFn] = None) -> "RuleReward":
        fns = [RULE_REWARDS.get(n) for n in names] + ([custom] if custom is not None else [])
        return cls(fns, weight)

    def __call__(self, inputs: RewardInputs) -> BaseRewardOutput:
        if inputs.response_texts is None or inputs.ground_truths is None:
            raise ValueError("rule rewards need RewardInputs.response_texts and ground_truths")
        if len(inputs.response_texts) != len(inputs.ground_truths):
            raise ValueError(f"{len(inputs.response_texts)} responses but {len(inputs.ground_truths)} "
                             "ground truths")
        # a prompt without a ground truth (one only the learned reward can judge): every rule abstains, 0
        scores = [self.weight * sum(float(fn(text, truth)) for fn in self.fns) if truth is not None else 0.0
                  for text, truth in zip(inputs.response_texts, inputs.ground_truths)]
        rewards = torch.tensor(scores, dtype=torch.float32, device=inputs.response_mask.device)  # [b]
        return BaseRewardOutput(rewards=rewards.unsqueeze(1), rule=rewards)
