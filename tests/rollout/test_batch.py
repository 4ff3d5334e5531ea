"""RolloutBatch helpers: training sequences, row selection, concat, consistency metric; registry."""

import pytest
import torch

from hpa.rollout import (ROLLOUT_ENGINES, RolloutBatch, SamplingParams, build_rollout_engine,
                         logprob_consistency, prompt_token_lists)

PAD = 0


def make_batch():
    # prompts [5, 6] and [7, 8, 9]; responses [11, 12, 13] (length) and [21] (stop)
    return RolloutBatch(
        prompt_ids=torch.tensor([[PAD, 5, 6], [7, 8, 9]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        response_ids=torch.tensor([[11, 12, 13], [21, PAD, PAD]]),
        response_mask=torch.tensor([[1.0, 1, 1], [1, 0, 0]]),
        log_probs=torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0, 0]]),
        finish_reasons=["length", "stop"], group_ids=torch.tensor([0, 1]), pad_token_id=PAD)


def test_training_sequences_layout():
    seq = make_batch().training_sequences()
    assert seq.input_ids.tolist() == [[5, 6, 11, 12, 13, PAD], [7, 8, 9, 21, PAD, PAD]]
    assert seq.labels.tolist() == [[6, 11, 12, 13, PAD, PAD], [8, 9, 21, PAD, PAD, PAD]]
    assert seq.position_ids.tolist() == [list(range(6))] * 2
    assert seq.response_mask.tolist() == [[0, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0]]
    # The logits at response_index predict the response token.
    labels_at = seq.to_response(seq.labels)
    assert labels_at[0].tolist() == [11, 12, 13] and labels_at[1, 0] == 21
    per_pos = torch.arange(12.0).view(2, 6, 1).expand(2, 6, 3)
    assert seq.to_response(per_pos).shape == (2, 3, 3)


def test_select_and_extras():
    batch = make_batch().set("advantages", torch.tensor([[1.0, 2, 3], [4, 0, 0]]))
    sub = batch.select(torch.tensor([False, True]))
    assert sub.batch_size == 1 and sub.finish_reasons == ["stop"] and sub.group_ids.tolist() == [1]
    assert sub.get("advantages").tolist() == [[4, 0, 0]]
    assert batch.select([1, 0]).response_lengths.tolist() == [1, 3]
    assert batch.select(slice(0, 1)).prompt_lengths.tolist() == [2]
    with pytest.raises(ValueError):
        batch.set("values", torch.zeros(3))
    with pytest.raises(KeyError):
        batch.get("rewards")


def test_concat_repads():
    a, b = make_batch(), make_batch().select([1])
    b = RolloutBatch(prompt_ids=b.prompt_ids[:, 1:], prompt_mask=b.prompt_mask[:, 1:],
                     response_ids=b.response_ids[:, :1], response_mask=b.response_mask[:, :1],
                     log_probs=b.log_probs[:, :1], finish_reasons=b.finish_reasons, group_ids=b.group_ids + 2,
                     pad_token_id=PAD)
    cat = RolloutBatch.concat([a, b])
    assert cat.prompt_ids.tolist()[-1] == [PAD, 8, 9] and cat.prompt_mask.tolist()[-1] == [0, 1, 1]
    assert cat.response_ids.tolist()[-1] == [21, PAD, PAD]
    assert cat.group_ids.tolist() == [0, 1, 3]


def test_logprob_consistency_metric():
    rollout = torch.tensor([[-1.0, -2.0, -3.0]])
    train = torch.tensor([[-1.5, -2.0, -9.0]])
    m = logprob_consistency(rollout, train, torch.tensor([[1.0, 1.0, 0.0]]))
    assert m == {"rollout/logprob_diff_mean": pytest.approx(0.25), "rollout/logprob_diff_max": pytest.approx(0.5)}


def test_sampling_params_from_config_and_validation():
    from hpa.config.schema import RolloutConfig

    p = SamplingParams.from_config(RolloutConfig(n=3, temperature=0.5, top_k=7), seed=9)
    assert (p.n, p.temperature, p.top_k, p.seed) == (3, 0.5, 7, 9)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"max_new_tokens must be >= 1, got {bad}"):
            SamplingParams(max_new_tokens=bad)


def test_prompt_token_lists_refuses_no_prompt_or_an_empty_one():
    with pytest.raises(ValueError, match="empty prompt"):
        prompt_token_lists([[1], []])
    with pytest.raises(ValueError, match="at least one prompt"):
        prompt_token_lists([])


def test_registry_names_and_unknown_engine():
    from types import SimpleNamespace

    assert ROLLOUT_ENGINES.names() == ("megatron", "vllm")
    with pytest.raises(ValueError, match="valid: megatron, vllm"):
        build_rollout_engine(SimpleNamespace(engine="sglang"), None, None, None)
