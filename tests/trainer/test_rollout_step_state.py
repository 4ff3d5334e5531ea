"""The rollout stream's part of a checkpoint at ``rollout.max_staleness`` k >= 1 (``RolloutStep.state_dict`` /
``load_state_dict``) without a model: the prompts drawn ahead and the worker's rows for them survive ``torch.save``
and a ``weights_only`` load; under another DP size the global batches are split anew and sampled again; at k = 0
the prompts drawn ahead are skipped with a warning; a rollback counts what the lost policies sampled ahead."""

import io
import logging
import types

import torch

from hpa.rollout.base import RolloutBatch
from hpa.rollout.queue import RolloutQueue
from hpa.rollout.worker import WorkerResult
from hpa.trainer.rollout_step import RolloutStep


def _batch(seed, rows=2):
    g = torch.Generator().manual_seed(seed)
    return RolloutBatch(prompt_ids=torch.randint(1, 9, (rows, 3), generator=g), prompt_mask=torch.ones(rows, 3),
                        response_ids=torch.randint(1, 9, (rows, 4), generator=g),
                        response_mask=torch.tensor([[1.0, 1, 1, 0]] * rows), log_probs=-torch.rand(rows, 4, generator=g),
                        finish_reasons=["stop", "length"][:rows], group_ids=torch.arange(rows), pad_token_id=0,
                        extras={"mask": torch.ones(rows, 4)})


class _Worker:
    def __init__(self, results):
        self.results = dict(results)

    def wait(self, tag):
        return self.results.pop(tag)


def _rollout_step(dp_rank=0, dp_size=1, worker=None):
    step = object.__new__(RolloutStep)  # the state's parts only: no trainer, no model
    step.groups = types.SimpleNamespace(dp_rank=dp_rank, data_parallel_size=dp_size, device=torch.device("cpu"),
                                        dp_group=None)
    step.worker, step.queue = worker, RolloutQueue(1, version=2)
    step.ahead, step.finished, step.restored = {}, {}, {}
    return step


def _saved(ahead, results, dropped=0):
    step = _rollout_step(worker=_Worker(results))
    step.ahead = dict(ahead)
    step.queue.num_dropped_rows = dropped
    buffer = io.BytesIO()
    torch.save(step.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_the_rows_ahead_and_their_prompts_survive_a_checkpoint():
    batches = {3: _batch(0), 4: _batch(1)}
    state = _saved({3: [5, 6], 4: [7, 8]}, {3: WorkerResult(tag=3, version=1, batch=batches[3]),
                                           4: WorkerResult(tag=4, version=2, batch=batches[4])}, dropped=6)
    step = _rollout_step(worker=_Worker({}))
    step.load_state_dict(state)
    assert sorted(step.restored) == [3, 4] and step.queue.num_dropped_rows == 6 and step.queue.version == 2
    for target, version, indices in [(3, 1, [5, 6]), (4, 2, [7, 8])]:
        got_indices, result = step.restored[target]
        assert got_indices == indices and result.version == version and result.tag == target
        want, got = batches[target], result.batch
        for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "log_probs", "group_ids"):
            assert getattr(got, name).equal(getattr(want, name)), name
        assert got.finish_reasons == want.finish_reasons and got.extras["mask"].equal(want.extras["mask"])


def test_under_another_dp_size_the_global_batch_is_split_anew_and_sampled_again(caplog):
    rank0 = _saved({3: [5, 6]}, {3: WorkerResult(tag=3, version=1, batch=_batch(0))}, dropped=2)
    rank1 = _saved({3: [7, 8]}, {3: WorkerResult(tag=3, version=1, batch=_batch(1))}, dropped=4)
    state = {"data_parallel_size": 2, "ranks": [rank0["ranks"][0], rank1["ranks"][0]]}
    with caplog.at_level(logging.WARNING, logger="hpa"):
        one = _rollout_step(worker=_Worker({}))
        one.load_state_dict(state)
    assert one.restored == {3: ([5, 6, 7, 8], None)}  # the prompts again, no rows: sampled by the restored policy
    assert one.queue.num_dropped_rows == 6  # DP rank 0 carries the sum (the metric sums over DP ranks)
    assert "from 2 DP ranks, this run has 1" in caplog.text
    shares = []
    for dp_rank in range(4):
        rank = _rollout_step(dp_rank=dp_rank, dp_size=4, worker=_Worker({}))
        rank.load_state_dict(state)
        shares.append(rank.restored[3])
        assert rank.queue.num_dropped_rows == (6 if dp_rank == 0 else 0)
    assert shares == [([5], None), ([6], None), ([7], None), ([8], None)]


def test_at_max_staleness_zero_the_prompts_drawn_ahead_are_skipped_and_named(caplog):
    state = _saved({3: [5, 6]}, {3: WorkerResult(tag=3, version=1, batch=_batch(0))})
    step = _rollout_step(worker=None)
    with caplog.at_level(logging.WARNING, logger="hpa"):
        step.load_state_dict(state)
    assert step.restored == {} and "steps [3]" in caplog.text and "skipped" in caplog.text
    assert _rollout_step().state_dict()["ranks"] is None  # nothing is ahead at k = 0


def test_a_rollback_counts_the_rows_the_lost_policies_sampled_ahead():
    state = _saved({3: [5, 6]}, {3: WorkerResult(tag=3, version=1, batch=_batch(0))})
    step = _rollout_step(worker=_Worker({}))
    step.queue.num_discarded_rows = 100  # before the rollback; the checkpoint's count (0) is restored
    step.finished = {7: WorkerResult(tag=7, version=6, batch=_batch(2))}  # taken from the worker at a later save
    step.load_state_dict(state)
    assert step.finished == {} and sorted(step.restored) == [3]
    assert step.queue.num_discarded_rows == 2
