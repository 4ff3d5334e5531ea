"""The coverage estimator: how far to trust the reward models on a prompt (or a prompt + response), from how far
it lies from the pairs they were trained on (``hpa.algorithms.coverage`` holds the math and the constants).

``CoverageEstimator`` owns the bank (the first reward model's embeddings of the training pairs, centred on their
mean), the calibration (the trust ramp's ``low`` and ``high`` from the held-out pairs' distances to the bank) and
``trust(prompts)``; the coverage controller (``hpa.trainer.objective.controllers.coverage``) and the start-up
probes (``hpa.trainer.startup_probes``) read it. It knows nothing of a run: no step, no DP group, no timer.
"""

from __future__ import annotations

import logging
from typing import Dict, Sequence

import torch

from hpa.algorithms.coverage import (COVERAGE_HIGH_QUANTILE, COVERAGE_K, COVERAGE_LOW_QUANTILE, COVERAGE_SPACE,
                                     EmbeddingCache, bank_center, calibrate, coverage_trust, knn_distance,
                                     unique_rows)
from hpa.reward.embeddings import chosen_embeddings, prompt_embeddings

logger = logging.getLogger("hpa")


class CoverageEstimator:
    """The bank of the reward models' training pairs, its calibration on the held-out pairs, and the trust of a
    prompt (``trust``) or of a rollout batch's rows (``batch_trust``).

    The bank is the first reward model's embeddings of each training pair's prompt (``space: prompt``; a prompt
    with more pairs weighs more) or chosen sequence (``space: sequence``). It is recomputed at every start
    (frozen reward model, fixed file: the same rows; too large for the run state); the calibration
    (``state_dict``: ``low``, ``high``) is saved, and a restore keeps the saved one, so a resumed run is the
    uninterrupted one even where a new layout rounds the start-up forwards differently. A prompt's embedding is
    kept once computed (``EmbeddingCache``): the reward model is frozen.

    Args:
        model_reward: the reward-model ensemble (its first model's ``sequence_embeddings``).
        pairs: the training preference pairs (``data.preference_path``): the bank.
        heldout_pairs: the held-out pairs (``data.heldout_preference_path``): the calibration.
        pad_id: the tokenizer's pad id.
        margin: ``algorithm.hpa.trust.margin``, the factor on the high quantile.
        space: ``prompt`` or ``sequence`` (``COVERAGE_SPACE``; an argument for the tests and probes).
        k: neighbours averaged (``COVERAGE_K``; an argument for the tests).
    """

    def __init__(self, model_reward, pairs: Sequence, heldout_pairs: Sequence, *, pad_id: int, margin: float,
                 space: str = COVERAGE_SPACE, k: int = COVERAGE_K):
        if space not in ("prompt", "sequence"):
            raise ValueError(f"the coverage space must be 'prompt' or 'sequence', got {space!r}")
        self.model_reward, self.pad_id, self.space, self.k = model_reward, pad_id, space, k
        self.cache = EmbeddingCache()
        self.bank = self._embed_pairs(pairs)  # [m, h]
        self.center = bank_center(self.bank)  # [h]
        held = knn_distance(self._embed_pairs(heldout_pairs or ()), self.bank, self.k, center=self.center)  # [n]
        self.low, self.high = calibrate(held, low_quantile=COVERAGE_LOW_QUANTILE,
                                        high_quantile=COVERAGE_HIGH_QUANTILE, margin=margin)
        logger.info("coverage trust (%s space): %d rows in the bank; trust 1 up to distance %.4g, 0 from %.4g",
                    self.space, self.bank.shape[0], self.low, self.high)

    def _embed_pairs(self, examples) -> torch.Tensor:
        if self.space == "prompt":  # every pair's prompt, each distinct one embedded once
            prompts, where = unique_rows([e.prompt_ids for e in examples])
            return prompt_embeddings(self.model_reward, prompts, pad_id=self.pad_id)[where]
        return chosen_embeddings(self.model_reward, examples, pad_id=self.pad_id)

    def _ramp(self, embeddings: torch.Tensor) -> torch.Tensor:
        return coverage_trust(knn_distance(embeddings, self.bank, self.k, center=self.center), self.low, self.high)

    def trust(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The trust of each prompt (token ids) alone, each distinct prompt embedded once (and kept). # -> [n]"""
        distinct, where = unique_rows(prompts)
        embeddings = self.cache.embed(distinct, lambda new: prompt_embeddings(
            self.model_reward, new, pad_id=self.pad_id))  # [u, h]
        return self._ramp(embeddings)[where]

    def batch_trust(self, batch) -> torch.Tensor:
        """The trust of each row of a rollout batch ``[b]``, on the batch's device: of its prompt (``space:
        prompt``) or of its prompt + response (``space: sequence``)."""
        if self.space == "prompt":
            # one read of the device for both
            ids, masks = torch.stack([batch.prompt_ids, batch.prompt_mask.to(batch.prompt_ids.dtype)]).cpu()
            return self.trust([i[m.bool()].tolist() for i, m in zip(ids, masks)]).to(batch.response_ids.device)
        embeddings = self.model_reward.sequence_embeddings(batch.response_ids, batch.response_mask,
                                                           batch.prompt_ids, batch.prompt_mask)  # [b, h]
        return self._ramp(embeddings).to(batch.response_ids.device)

    def state_dict(self) -> Dict[str, float]:
        return {"low": self.low, "high": self.high}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.low, self.high = state["low"], state["high"]
