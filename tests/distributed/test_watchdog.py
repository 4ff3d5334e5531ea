"""A hung collective is named: the phase this rank was in and the rank it waited for."""

import json
import time

import pytest
import torch

from hpa.distributed.watchdog import EXIT_COLLECTIVE_FAILURE, StepProgress, is_collective_failure
from multirank import run_ranks


class FakeStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        return [self.data[k] for k in keys]

    def set_timeout(self, timeout):
        pass


def progress_on(store, rank, world_size):
    return StepProgress(rank, world_size, 0.5, store=store)


TIMEOUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for recv operation "
                       "to complete")


def test_the_rank_that_never_reached_the_phase_is_named():
    store = FakeStore()
    ranks = [progress_on(store, r, 3) for r in range(3)]
    for p in ranks:
        p.step = 4
    with ranks[2].phase("step"), ranks[2].phase("rollout"):
        pass
    with ranks[1].phase("step"), ranks[1].phase("rollout"):
        pass
    with ranks[0].phase("step"):
        with ranks[0].phase("rollout"):
            pass
        with pytest.raises(RuntimeError):
            with ranks[0].phase("reference"):
                raise TIMEOUT
    assert ranks[0].where() == "step 4, phase 'step/reference'"
    with ranks[1].phase("step"):  # rank 1 got as far as rank 0; rank 2 is still in rollout
        with ranks[1].phase("reference"):
            pass
    store.data["hpa/progress/2"] = json.dumps({**json.loads(store.data["hpa/progress/2"]), "step": 4}).encode()
    message = ranks[0].collective_failure_message(TIMEOUT)
    assert message.startswith("rank 0: a collective in step 4, phase 'step/reference' failed after waiting up to "
                              "parallel.timeout_minutes=0.5: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out")
    assert "It waited for rank 2 (last seen entering step 4, phase 'step/rollout'," in message
    assert "rank 1 (" not in message
    assert f"Exiting with status {EXIT_COLLECTIVE_FAILURE}" in message


def test_a_rank_stuck_inside_the_same_phase_and_unknown_ranks():
    store = FakeStore()
    a, b, c = (progress_on(store, r, 3) for r in range(3))
    with b.phase("update_actor"):
        pass
    with pytest.raises(RuntimeError), a.phase("update_actor"):
        raise TIMEOUT
    message = a.collective_failure_message(TIMEOUT)
    assert "Every other rank reached this phase; the one that stopped answering is inside it: rank 1 (last seen " \
           "entering step 0, phase 'update_actor'" in message
    assert "Ranks [2] published no position." in message
    lonely = progress_on(FakeStore(), 0, 2)
    assert "The other ranks' positions cannot be read (rank 0 serves them and may be gone): it waited for one " \
           "of ranks [1]" in lonely.collective_failure_message(TIMEOUT)


def test_which_errors_are_collective_failures():
    assert is_collective_failure(TIMEOUT)
    assert is_collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1"))
    assert is_collective_failure(RuntimeError("Application timeout caused pair closure"))
    assert not is_collective_failure(RuntimeError("CUDA out of memory"))
    assert not is_collective_failure(ValueError("timed out"))


def hang_worker(groups, max_hang_s):
    import torch.distributed as dist

    from hpa.distributed import comm

    store = dist.distributed_c10d._get_default_store()
    progress = StepProgress(groups.rank, groups.world_size, 0.1)
    progress.step = 2
    with progress.phase("step"):
        with progress.phase("rollout"):
            comm.all_reduce_sum(torch.ones(1), None)
        if groups.rank == 0:  # rank 0 serves the store: it answers while this thread sleeps
            deadline = time.monotonic() + max_hang_s
            while not store.check(["test/done"]) and time.monotonic() < deadline:
                time.sleep(1.0)
            return None
        start = time.monotonic()
        try:
            with progress.phase("reference"):
                comm.all_reduce_sum(torch.ones(1), None)
        except RuntimeError as exc:
            result = is_collective_failure(exc), time.monotonic() - start, progress.collective_failure_message(exc)
        else:
            result = "the collective did not fail"
        store.set("test/done", "1")
    return result


@pytest.mark.multirank
def test_gloo_timeout_names_the_phase_and_the_hung_rank_2ranks():
    """Rank 0 stops answering; rank 1's all-reduce fails after parallel.timeout_minutes (6 s) and its
    message names its phase and rank 0, read from the store that rank 0's process still serves."""
    _, (recognised, waited, message) = run_ranks(hang_worker, dp=2, args=(300.0,),
                                                 parallel_kwargs={"timeout_minutes": 0.1})
    assert recognised
    assert 5.5 < waited < 120.0
    assert message.startswith("rank 1: a collective in step 2, phase 'step/reference' failed")
    assert "Timed out" in message
    assert "It waited for rank 0 (last seen entering step 2, phase 'step/rollout'" in message
