"""Sampling math: top-k/top-p masks on hand-computed cases, greedy, seeded determinism, log-probs."""

import math

import pytest
import torch

from hpa.rollout.sampling import apply_temperature, filter_logits, sample_tokens, top_k_mask, top_p_mask


def logits_of(probs):
    return torch.tensor(probs, dtype=torch.float64).log().unsqueeze(0)


def test_top_k_mask_hand_case():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, -1.0, 5.0, 5.0]])
    assert top_k_mask(logits, 2).tolist() == [[True, False, False, True], [True, True, False, False]]
    assert not top_k_mask(logits, -1).any()
    assert not top_k_mask(logits, 4).any()
    # Ties at the k-th value are kept.
    assert top_k_mask(torch.tensor([[3.0, 3.0, 1.0]]), 1).tolist() == [[False, False, True]]


def test_top_p_mask_hand_case():
    logits = logits_of([0.2, 0.5, 0.3])
    # sorted 0.5, 0.3, 0.2; mass before: 0, 0.5, 0.8
    assert top_p_mask(logits, 0.7).tolist() == [[True, False, False]]
    assert top_p_mask(logits, 0.5).tolist() == [[True, False, True]]
    assert top_p_mask(logits, 0.81).tolist() == [[False, False, False]]
    assert top_p_mask(logits, 0.1).tolist() == [[True, False, True]]  # the top token is always kept
    assert not top_p_mask(logits, 1.0).any()


def test_filter_applies_top_k_then_top_p():
    logits = logits_of([0.1, 0.4, 0.2, 0.3])
    # top-k 3 keeps 0.4, 0.3, 0.2 (renormalised 4/9, 3/9, 2/9); top-p 0.6: mass before 0, 4/9, 7/9
    out = filter_logits(logits, top_k=3, top_p=0.6)
    assert torch.isinf(out).tolist() == [[True, False, True, False]]


def test_greedy_is_argmax_and_returns_t1_log_probs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 17, generator=g)
    tokens, logp = sample_tokens(logits, temperature=0.0)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])


def test_padded_vocab_columns_are_never_chosen():
    logits = torch.zeros(4, 8)
    logits[:, 6:] = 100.0  # padding columns
    tokens, logp = sample_tokens(logits, temperature=0.0, vocab_size=6)
    assert (tokens < 6).all()
    torch.testing.assert_close(logp, torch.full((4,), -math.log(6)))
    tokens, _ = sample_tokens(logits, temperature=1.0, vocab_size=6, generator=torch.Generator().manual_seed(1))
    assert (tokens < 6).all()


def test_seeded_sampling_is_deterministic_and_seed_dependent():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))

    def draw(seed):
        return sample_tokens(logits, temperature=0.8, top_k=20, top_p=0.9,
                             generator=torch.Generator().manual_seed(seed))

    a, b, c = draw(5), draw(5), draw(6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_samples_respect_filters_and_log_probs_are_temperature_scaled():
    logits = torch.randn(256, 30, generator=torch.Generator().manual_seed(4))
    t = 0.7
    tokens, logp = sample_tokens(logits, temperature=t, top_k=5, top_p=0.8,
                                 generator=torch.Generator().manual_seed(0))
    allowed = ~torch.isinf(filter_logits(apply_temperature(logits, t), 5, 0.8))
    assert allowed.gather(-1, tokens[:, None]).all()
    # Log-probs are those of softmax(logits / T) over the full vocabulary (before truncation).
    torch.testing.assert_close(logp, torch.log_softmax(logits / t, -1).gather(-1, tokens[:, None])[:, 0])


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    tokens, _ = sample_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_bad_arguments():
    with pytest.raises(ValueError):
        top_p_mask(torch.zeros(1, 3), 0.0)
    with pytest.raises(ValueError):
        top_k_mask(torch.zeros(1, 3), 0)
    with pytest.raises(ValueError):
        sample_tokens(torch.zeros(1, 3), temperature=1.0)  # no generator
