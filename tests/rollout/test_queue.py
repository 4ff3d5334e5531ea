"""The versioned rollout queue: the staleness bound over long random runs, drop counting, resume, bad k."""

import io
import random

import pytest
import torch

from hpa.config.errors import ConfigError
from hpa.rollout.queue import RolloutQueue, VersionedRollout, rollout_batch, rollout_entry


def _entry(versions, num_rows=2, width=4, valid=None, tag=0):
    """Rows whose tokens were sampled by ``versions`` (one int, or a per-token list for one row pattern)."""
    if isinstance(versions, int):
        versions = [versions] * width
    versions = torch.tensor([versions] * num_rows, dtype=torch.int64)
    mask = torch.ones(num_rows, width) if valid is None else torch.tensor([valid] * num_rows, dtype=torch.float32)
    return VersionedRollout(rows={"tag": torch.full((num_rows,), tag)}, log_probs=-torch.rand(num_rows, width),
                            versions=versions, mask=mask)


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_no_row_returned_beyond_the_bound(k):
    rng = random.Random(k)
    queue = RolloutQueue(k)
    put = returned = 0
    for _ in range(3000):
        action = rng.random()
        if action < 0.45:
            # a rollout started some versions ago, possibly continued (partial) up to now
            start = max(0, queue.version - rng.randint(0, k + 3))
            split = rng.randint(0, 4)
            per_token = [start] * split + [rng.randint(start, queue.version)] * (4 - split)
            rows = rng.randint(1, 3)
            put += rows
            queue.put(_entry(per_token, num_rows=rows))
        elif action < 0.8:
            for entry in queue.get(max_rows=rng.randint(1, 6)):
                lag = queue.version - entry.versions[entry.mask.bool()]
                assert int(lag.max()) <= k
                returned += entry.num_rows
            assert queue.metrics()["async/lag_max"] <= k
        else:
            queue.advance()
    assert queue.num_put_rows == put
    assert queue.num_returned_rows == returned
    # every row put is returned, dropped or still queued
    assert put == returned + queue.num_dropped_rows + queue.num_queued_rows
    assert queue.num_dropped_rows > 0


def test_drops_are_counted_and_never_returned():
    queue = RolloutQueue(1, version=3)
    queue.put(_entry(3, tag=1))
    queue.put(_entry([2, 2, 3, 3], tag=2))  # a partial rollout: its oldest token counts
    assert not queue.put(_entry([1, 3, 3, 3], tag=3))  # already 2 versions old: dropped at once
    assert queue.num_dropped_rows == 2 and queue.num_dropped_entries == 1
    queue.advance()  # version 4: the partial rollout now lags 2
    assert queue.num_dropped_rows == 4
    (entry,) = queue.get()
    assert int(entry.rows["tag"][0]) == 1
    metrics = queue.metrics()
    assert metrics["async/lag_max"] == 1.0 and metrics["async/lag_frac_1"] == 1.0
    assert metrics["async/dropped_rows"] == 4.0 and metrics["async/queued_rows"] == 0.0
    assert queue.get() == [] and queue.metrics()["async/lag_max"] == 0.0  # a new window


def test_lag_metrics_cover_every_get_since_the_last_report():
    queue = RolloutQueue(2, version=2)
    queue.put(_entry(0, width=2))
    queue.put(_entry(2, width=2))
    queue.get(max_rows=2)
    queue.get(max_rows=2)
    metrics = queue.metrics()
    assert metrics["async/lag_max"] == 2.0 and metrics["async/lag_mean"] == 1.0
    assert (metrics["async/lag_frac_0"], metrics["async/lag_frac_1"], metrics["async/lag_frac_2"]) == (0.5, 0.0, 0.5)


def test_rewind_discards_what_newer_policies_sampled():
    queue = RolloutQueue(1, version=5)
    queue.put(_entry(5))
    assert queue.rewind(3) == 2 and queue.version == 3 and len(queue) == 0
    queue.put(_entry(3))
    assert len(queue.get()) == 1


def test_padding_tokens_do_not_count_for_the_lag():
    queue = RolloutQueue(0, version=5)
    queue.put(_entry([5, 5, 0, 0], valid=[1, 1, 0, 0]))
    (entry,) = queue.get()
    assert queue.metrics()["async/lag_max"] == 0.0


def test_staleness_zero_is_synchronous():
    queue = RolloutQueue(0)
    for step in range(5):
        queue.put(_entry(step, tag=step))
        (entry,) = queue.get()
        assert int(entry.rows["tag"][0]) == step and queue.metrics()["async/lag_max"] == 0.0
        queue.advance()
    queue.put(_entry(queue.version))
    queue.advance()  # sampled, then the weights moved on before training: never trained on at k = 0
    assert queue.get() == [] and queue.num_dropped_rows == 2


def test_get_takes_whole_entries_in_order():
    queue = RolloutQueue(2)
    for tag in range(4):
        queue.put(_entry(0, num_rows=2, tag=tag))
    taken = queue.get(max_rows=5)
    assert [int(e.rows["tag"][0]) for e in taken] == [0, 1]
    assert [int(e.rows["tag"][0]) for e in queue.get(max_rows=1)] == [2]  # at least one entry
    assert len(queue) == 1


def test_state_round_trip_through_torch_save():
    queue = RolloutQueue(2, version=7)
    for tag, version in enumerate([5, 6, 7]):
        queue.put(_entry(version, tag=tag))
    queue.put(_entry(4))  # dropped
    queue.get(max_rows=2)  # its lags are still to report: they travel in the state
    buffer = io.BytesIO()
    torch.save(queue.state_dict(), buffer)
    buffer.seek(0)
    resumed = RolloutQueue(2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.version == 7 and resumed.state_dict()["counters"] == queue.state_dict()["counters"]
    assert resumed.metrics() == queue.metrics()
    for a, b in zip(queue.get(), resumed.get()):
        assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.versions, b.versions)
        assert torch.equal(a.rows["tag"], b.rows["tag"])
    # the resumed run goes on exactly as the uninterrupted one
    for q in (queue, resumed):
        q.advance()
        q.put(_entry(8, tag=9))
    assert queue.metrics() == resumed.metrics()


def test_a_smaller_bound_on_resume_drops_and_counts():
    queue = RolloutQueue(2, version=3)
    queue.put(_entry(1))
    resumed = RolloutQueue(1)
    resumed.load_state_dict(queue.state_dict())
    assert len(resumed) == 0 and resumed.num_dropped_rows == 2


def test_discard_is_deterministic_and_counted():
    queues = [RolloutQueue(1), RolloutQueue(1)]
    for queue in queues:
        queue.put(_entry(0, num_rows=3))
        assert queue.discard() == 3
        assert queue.get() == [] and queue.metrics()["async/discarded_rows"] == 3.0
    assert queues[0].state_dict()["counters"] == queues[1].state_dict()["counters"]


@pytest.mark.parametrize("k", [-1, -5, 1.5, True, "1"])
def test_bad_bound_names_the_key(k):
    with pytest.raises(ConfigError, match=r"rollout\.max_staleness"):
        RolloutQueue(k)


def test_versions_from_the_future_and_backwards_are_refused():
    queue = RolloutQueue(1, version=2)
    with pytest.raises(ValueError, match="version 3 .* version 2"):
        queue.put(_entry(3))
    with pytest.raises(ValueError, match="cannot go back"):
        queue.advance(1)
    with pytest.raises(ValueError, match="int64"):
        VersionedRollout(rows={}, log_probs=torch.zeros(1, 2), versions=torch.zeros(1, 2), mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="rows"):
        VersionedRollout(rows={"x": torch.zeros(3)}, log_probs=torch.zeros(1, 2),
                         versions=torch.zeros(1, 2, dtype=torch.int64), mask=torch.ones(1, 2))


IS = "algorithm.rollout_correction.rollout_is=token"


@pytest.mark.parametrize("overrides,message", [
    (["rollout.max_staleness=-1"], "integer >= 0"),
    (["rollout.max_staleness=1.5"], "type int"),
    (["rollout.max_staleness=2"], "set algorithm.rollout_correction.rollout_is"),
    (["rollout.max_staleness=1", "rollout.engine=vllm", IS], "engine=vllm has none"),
    (["rollout.max_staleness=1", "parallel.tensor_model_parallel_size=2", IS], "cannot share the tensor/pipeline"),
    (["rollout.max_staleness=1", "parallel.pipeline_model_parallel_size=2", IS], "cannot share the tensor/pipeline"),
])
def test_schema_key_refuses_what_the_loop_cannot_do(overrides, message):
    from hpa.config import load_config

    assert load_config(None, []).rollout.max_staleness == 0
    assert load_config(None, ["rollout.max_staleness=2", IS]).rollout.max_staleness == 2
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert err.value.key == "rollout.max_staleness", str(err.value)
    assert "\n" not in str(err.value)


def test_the_cli_refuses_async_vllm_in_one_line(capsys):
    from hpa.cli import main

    code = main(["check-config", "rollout.max_staleness=1", "rollout.engine=vllm", IS])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "rollout.max_staleness" in err and "vllm" in err, err


def test_the_cli_refuses_partial_rollouts_on_vllm_in_one_line(capsys):
    from hpa.cli import main

    code = main(["check-config", "rollout.partial=true", "rollout.max_staleness=1", "rollout.engine=vllm", IS])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "rollout.partial" in err and "vllm" in err and "resume" in err, err


def test_a_rollout_batch_round_trips_through_an_entry():
    from hpa.rollout.queue import rollout_batch, rollout_entry
    from hpa.rollout.base import RolloutBatch

    batch = RolloutBatch(prompt_ids=torch.tensor([[0, 5], [6, 7]]), prompt_mask=torch.tensor([[0, 1], [1, 1]]),
                         response_ids=torch.tensor([[8, 9, 3], [4, 3, 3]]),
                         response_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
                         log_probs=-torch.rand(2, 3), finish_reasons=["length", "stop"], group_ids=torch.tensor([0, 0]),
                         pad_token_id=3, extras={"scores": torch.tensor([0.5, -1.0])})
    entry = rollout_entry(batch, 4)
    assert entry.oldest_version() == entry.newest_version() == 4
    back = rollout_batch(entry)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "log_probs", "group_ids"):
        assert getattr(back, name) is getattr(batch, name)
    assert back.finish_reasons == batch.finish_reasons and back.pad_token_id == 3
    assert back.extras.keys() == {"scores"} and back.extras["scores"] is batch.extras["scores"]


@pytest.mark.parametrize("overrides,message", [
    (["rollout.partial=true"], "means nothing at max_staleness 0"),
    (["rollout.partial=true", "rollout.max_staleness=1", "rollout.engine=vllm", IS], "engine=vllm cannot stop a row"),
    (["rollout.partial=true", "rollout.engine=vllm"], "engine=vllm cannot stop a row"),
])
def test_partial_is_refused_where_no_engine_can_resume_a_row_or_it_means_nothing(overrides, message):
    from hpa.config import load_config

    assert load_config(None, []).rollout.partial is False
    assert load_config(None, ["rollout.partial=true", "rollout.max_staleness=1", IS]).rollout.partial is True
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert err.value.key == "rollout.partial", str(err.value)
    assert "\n" not in str(err.value)


def test_per_token_versions_of_a_partial_rollout_are_the_entrys_and_the_lag_counts_the_oldest():
    from hpa.rollout.base import RolloutBatch
    from hpa.rollout.queue import TOKEN_VERSIONS

    ids = torch.ones((2, 3), dtype=torch.int64)
    batch = RolloutBatch(prompt_ids=ids, prompt_mask=ids, response_ids=ids,
                         response_mask=torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]), log_probs=torch.zeros(2, 3),
                         finish_reasons=["length"] * 2, group_ids=torch.arange(2),
                         extras={TOKEN_VERSIONS: torch.tensor([[3, 4, 4], [3, 4, 4]])})
    entry = rollout_entry(batch, 4)
    assert entry.versions.tolist() == [[3, 4, 4], [3, 4, 4]] and entry.oldest_version() == 3
    assert TOKEN_VERSIONS not in rollout_batch(entry).extras
    queue = RolloutQueue(1, version=4)
    queue.put(entry)
    assert len(queue.get()) == 1 and queue.metrics()["async/lag_max"] == 1.0
    queue = RolloutQueue(0, version=4)  # the version-3 tokens are too old at k = 0
    queue.put(rollout_entry(batch, 4))
    assert queue.get() == [] and queue.num_dropped_rows == 2
    without = RolloutBatch(**{**{k: getattr(batch, k) for k in ("prompt_ids", "prompt_mask", "response_ids",
                                                                 "response_mask", "log_probs", "finish_reasons",
                                                                 "group_ids")}, "extras": {}})
    assert rollout_entry(without, 4).versions.eq(4).all()  # one version for the whole batch, as before
