"""Model-backed scores of ``(prompt, response)`` texts for the data tools, computed in batches.

``data_tools.clean_preferences`` (reward margin, log-prob gap, embedding similarity) and
``data_tools.synth_preferences`` (rewards of sampled responses) share this layer. It sits at the
trainer level because it loads checkpoints and runs the training forward.

What each score is (decided here, once):

- ``reward``: r̂ = mean over K of the base reward ``build_reward(cfg.reward, model_reward).base``,
  i.e. the heads of the reward models in ``reward.model_paths`` plus the rule rewards of
  ``reward.rules`` / ``reward.custom_function`` (which need a ground truth); ``reward_std`` is σ, the
  population std over K. No shaping: the σ penalty, diversity, length and copy terms belong to a
  training step, not to a single response.
- ``log_prob``: the summed log-prob of the response tokens given the prompt under the policy of
  ``model.policy_path``, at temperature 1 over the tokenizer's vocabulary, EOS included when
  ``data.append_eos``: the sequence log-prob DPO works with.
- ``embedding``: the final hidden state of the first reward model, mean-pooled over the response
  tokens, computed from the response alone (no prompt), so that a shared prompt does not make two
  responses look alike.

Texts are tokenised as ``PreferenceDataset`` tokenises them (chat template, prompt truncation,
response length policy, EOS), so the scores are those of the pairs the trainer would see. An item the
data policy skips (too long under ``skip``) is not scored; it comes back in ``skipped`` with the
reason.

Layout: items are DP-sharded round-robin (item ``i`` on DP rank ``i % dp``) and every rank of a
TP×PP model replica scores the same rows; the results are gathered over DP, so every rank returns
all of them. Forward-only scoring runs no DP collective, so ranks may score different numbers of
chunks; the final gather is the only DP collective.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hpa.config.errors import ConfigError
from hpa.data.collate import pad_left, pad_right
from hpa.data.preferences import encode_response
from hpa.data.prompts import SkipRecord, encode_prompt, fit_prompt
from hpa.data.tokenizer import Tokenizer, build_tokenizer, check_model_vocab
from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.reward import RewardInputs, build_reward, ensemble_mean_std
from hpa.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutBatch, decode_responses
from hpa.engine.batching import Batching
from hpa.engine.collate import chunks
from hpa.engine.forward import sequence_log_probs
from hpa.models import build_policy
from hpa.models.weights import load_model_weights
from hpa.reward.model import ModelReward, tokenizer_record

SCORE_NAMES = ("reward", "reward_std", "log_prob")


def needs_ground_truth(reward_cfg) -> bool:
    """Whether the reward of a ``reward`` config section reads ground truths (rule or custom rewards)."""
    return bool(reward_cfg.rules) or reward_cfg.custom_function is not None


def rollout_batch(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], *, pad_id: int,
                  eos_id: int, device: torch.device = torch.device("cpu")) -> RolloutBatch:
    """A ``RolloutBatch`` of given token ids (left-padded prompts, right-padded responses).

    The sampled log-probs are zeros (nothing was sampled); a row's finish reason is ``stop`` when it
    ends with EOS, else ``length``.
    """
    prompts, prompt_mask = pad_left(prompt_ids, pad_id)  # [b, p]
    responses, response_mask = pad_right(response_ids, pad_id)  # [b, r]
    b = len(response_ids)
    return RolloutBatch(prompt_ids=prompts.to(device), prompt_mask=prompt_mask.to(device),
                        response_ids=responses.to(device), response_mask=response_mask.float().to(device),
                        log_probs=torch.zeros(responses.shape, device=device),
                        finish_reasons=[FINISH_STOP if r and r[-1] == eos_id else FINISH_LENGTH for r in response_ids],
                        group_ids=torch.arange(b, device=device), pad_token_id=pad_id)


@dataclasses.dataclass
class TextScores:
    """Scores of a list of items, by item index; None where the score was not asked for.

    Attributes:
        reward, reward_std, log_prob: one float per item (None for a skipped item).
        embedding: one ``[h]`` list per item (None for a skipped item).
        skipped: item index -> ``(reason, message)`` for the items the data policy does not score.
    """

    reward: Optional[List[Optional[float]]] = None
    reward_std: Optional[List[Optional[float]]] = None
    log_prob: Optional[List[Optional[float]]] = None
    embedding: Optional[List[Optional[List[float]]]] = None
    skipped: Dict[int, Tuple[str, str]] = dataclasses.field(default_factory=dict)


class Scorer:
    """Loads the models a config names and scores batches of responses (see the module docstring).

    Args:
        cfg: the root ``Config``; uses ``reward`` (sources), ``model`` (architecture, ``policy_path``),
            ``parallel``, ``data`` (tokenizer and length policy) and ``trainer.micro_batch_size``.
        groups: ``ParallelGroups`` matching ``cfg.parallel``.
        reward: load the reward sources of ``cfg.reward`` (a ConfigError when there are none).
        log_prob: load the policy of ``model.policy_path`` (a ConfigError when it is unset).
        embedding: compute reward-model embeddings (a ConfigError without ``reward.model_paths``).
        tokenizer: the tokenizer (default: built from ``cfg.data``).
        batch_size: rows per forward call on each DP rank (split into micro-batches of
            ``trainer.micro_batch_size``).
    """

    def __init__(self, cfg, groups: ParallelGroups, *, reward: bool = True, log_prob: bool = False,
                 embedding: bool = False, tokenizer: Optional[Tokenizer] = None, batch_size: int = 256):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.cfg, self.groups, self.batch_size = cfg, groups, batch_size
        self.tokenizer = tokenizer or build_tokenizer(cfg.data.tokenizer_kind, cfg.data.tokenizer_path)
        check_model_vocab(self.tokenizer, cfg.model.vocab_size)
        mbs = cfg.trainer.micro_batch_size
        self.model_reward = None
        if embedding and not cfg.reward.model_paths:
            raise ConfigError("reward.model_paths", "embedding similarity reads a reward model's hidden states; "
                                                    "list a reward model (the reward_model/ directory of an "
                                                    "'hpa train-rm' run) or use edit similarity")
        if (reward or embedding) and cfg.reward.model_paths:
            self.model_reward = ModelReward.from_config(cfg.reward, cfg.model, cfg.parallel, groups,
                                                        batching=Batching(micro_batch_size=mbs,
                                                                          pad_id=self.tokenizer.pad_id),
                                                        with_embeddings=embedding,
                                                        tokenizer=tokenizer_record(self.tokenizer))
        self.reward = build_reward(cfg.reward, self.model_reward).base if reward else None
        self.needs_ground_truth = reward and needs_ground_truth(cfg.reward)
        self.embedding = embedding
        self.policy = None
        if log_prob:
            if not cfg.model.policy_path:
                raise ConfigError("model.policy_path", "the log-prob scores need a policy checkpoint; set it "
                                                       "(e.g. <run_dir>/sft)")
            self.policy = build_policy(cfg.model, cfg.parallel, groups)
            load_model_weights(self.policy, cfg.model.policy_path, groups)
            self.policy.eval()

    # ---------------------------------------------------------------------------- tokenisation

    def encode_prompt(self, prompt: str) -> List[int]:
        """Prompt ids as the datasets make them; raises ``SkipRecord`` when the data policy skips it."""
        d = self.cfg.data
        ids, _ = fit_prompt(encode_prompt(self.tokenizer, prompt, d.apply_chat_template), d.max_prompt_length,
                            d.prompt_truncation)
        return ids

    def encode_response(self, response: str) -> List[int]:
        """Response ids as ``PreferenceDataset`` makes them (EOS when ``data.append_eos``)."""
        d = self.cfg.data
        ids = encode_response(self.tokenizer, response, key="response", max_response_length=d.max_response_length,
                              response_truncation=d.response_truncation, append_eos=d.append_eos)
        if not ids:
            raise SkipRecord("empty_response", "the response has no tokens", key="response")
        return ids

    def batch(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]) -> RolloutBatch:
        return rollout_batch(prompt_ids, response_ids, pad_id=self.tokenizer.pad_id, eos_id=self.tokenizer.eos_id,
                             device=self.groups.device)

    # ------------------------------------------------------------------------- one local batch

    def score_batch(self, batch: RolloutBatch, texts: Optional[Sequence[str]] = None,
                    ground_truths: Optional[Sequence[Optional[str]]] = None) -> Dict[str, torch.Tensor]:
        """Scores of one batch on this rank (no DP communication).

        Every rank of a model replica must call it with the same batch.

        Args:
            batch: prompts and responses (e.g. straight from a rollout engine).
            texts: the response texts (rule rewards read them); default: decoded from the batch.
            ground_truths: one per row; required when rule rewards are configured.

        Returns:
            ``reward [b]`` and ``reward_std [b]`` (with a reward), ``log_prob [b]`` (with a policy),
            on the CPU.
        """
        out: Dict[str, torch.Tensor] = {}
        with torch.no_grad():
            if self.reward is not None:
                if self.needs_ground_truth and (ground_truths is None or any(t is None for t in ground_truths)):
                    raise ValueError(f"the rule rewards (reward.rules={list(self.cfg.reward.rules)}, "
                                     f"reward.custom_function={self.cfg.reward.custom_function}) need a ground "
                                     "truth for every response; give them, or score with reward.model_paths only")
                if texts is None:
                    texts = decode_responses(self.tokenizer, batch)
                inputs = RewardInputs(response_ids=batch.response_ids, response_mask=batch.response_mask,
                                      prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
                                      response_texts=list(texts),
                                      ground_truths=list(ground_truths) if ground_truths is not None
                                      else [""] * batch.batch_size)
                mean, std = ensemble_mean_std(self.reward(inputs).rewards)  # [b], [b]
                out["reward"], out["reward_std"] = mean.cpu(), std.cpu()
            if self.policy is not None:
                out["log_prob"] = self.sequence_log_prob(batch)
        return out

    def batch_rewards(self, batch: RolloutBatch, texts: Sequence[str],
                      ground_truths: Sequence[Optional[str]]) -> torch.Tensor:
        """r̂ of every row ``[b]``: the ``reward_fn`` of ``data_tools.synth_preferences.synthesize``."""
        if self.reward is None:
            raise ValueError("this Scorer was built without reward=True")
        return self.score_batch(batch, texts, ground_truths)["reward"]

    def sequence_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        """Summed response-token log-probs under the policy at temperature 1: ``[b]`` on the CPU."""
        ts = batch.training_sequences()
        with torch.no_grad():
            logp = sequence_log_probs(self.policy, ts, batch.response_mask, self.groups,
                                      batching=Batching(micro_batch_size=self.cfg.trainer.micro_batch_size,
                                                        pad_id=self.tokenizer.pad_id),
                                      vocab_size=self.tokenizer.vocab_size, temperature=1.0)["log_probs"]  # [b, r]
        return (logp.cpu() * batch.response_mask.cpu()).sum(dim=1)  # [b]

    def embed_batch(self, response_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Reward-model embeddings of responses scored alone: ``[b, h]`` on the CPU."""
        responses, mask = pad_right(response_ids, self.tokenizer.pad_id)  # [b, r]
        with torch.no_grad():
            out = self.model_reward(RewardInputs(response_ids=responses, response_mask=mask.float()))
        return out.embeddings.cpu()  # [b, h]

    # ------------------------------------------------------------------- lists of texts (DP)

    def score_texts(self, prompts: Sequence[str], responses: Sequence[str],
                    ground_truths: Optional[Sequence[Optional[str]]] = None) -> TextScores:
        """``reward``/``reward_std``/``log_prob`` of every ``(prompt, response)`` item, on every rank.

        Every rank passes the same lists; see the module docstring for the layout.
        """
        if len(prompts) != len(responses) or ground_truths is not None and len(ground_truths) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses"
                             + ("" if ground_truths is None else f" and {len(ground_truths)} ground truths")
                             + "; give one of each per item")

        def encode(i):
            return self.encode_prompt(prompts[i]), self.encode_response(responses[i])

        def score(index, encoded):
            batch = self.batch([e[0] for e in encoded], [e[1] for e in encoded])
            truths = None if ground_truths is None else [ground_truths[i] for i in index]
            out = self.score_batch(batch, [responses[i] for i in index], truths)
            return {name: out[name].tolist() for name in SCORE_NAMES if name in out}

        values, skipped = self._sharded(len(prompts), encode, score)
        names = (["reward", "reward_std"] if self.reward is not None else []) + \
            (["log_prob"] if self.policy is not None else [])
        return TextScores(skipped=skipped, **{n: [v[n] if v is not None else None for v in values] for n in names})

    def embed_texts(self, responses: Sequence[str]) -> TextScores:
        """``embedding`` of every response (scored alone), on every rank; every rank passes the same list."""
        if self.model_reward is None or not self.embedding:
            raise ValueError("this Scorer was built without embedding=True")

        def score(index, encoded):
            return {"embedding": self.embed_batch(encoded).tolist()}

        values, skipped = self._sharded(len(responses), lambda i: self.encode_response(responses[i]), score)
        return TextScores(embedding=[v["embedding"] if v is not None else None for v in values], skipped=skipped)

    def _sharded(self, num_items: int, encode: Callable, score: Callable):
        """This DP rank's items encoded, scored in chunks of ``batch_size``, gathered over DP.

        Returns a per-item dict of score name -> value (None where skipped) and the skipped items.
        """
        g = self.groups
        mine: List[int] = []
        encoded = []
        skipped: Dict[int, Tuple[str, str]] = {}
        for i in range(g.dp_rank, num_items, g.data_parallel_size):
            try:
                encoded.append(encode(i))
                mine.append(i)
            except SkipRecord as skip:
                skipped[i] = (skip.reason, skip.message)
        local: Dict[int, Dict[str, object]] = {}
        for rows in chunks(len(mine), self.batch_size):
            index = [mine[j] for j in rows]
            out = score(index, [encoded[j] for j in rows])
            for k, i in enumerate(index):
                local[i] = {name: column[k] for name, column in out.items()}
        values: List[Optional[Dict[str, object]]] = [None] * num_items
        all_skipped: Dict[int, Tuple[str, str]] = {}
        for part_values, part_skipped in comm.all_gather_objects((local, skipped), g.dp_group):
            for i, v in part_values.items():
                values[i] = v
            all_skipped.update(part_skipped)
        if any(values[i] is None for i in range(num_items) if i not in all_skipped):
            raise RuntimeError("scoring: the gathered scores do not cover every item")
        return values, all_skipped
