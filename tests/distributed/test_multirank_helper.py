"""The multi-rank helper itself: a test may choose the backend (the gpu-marked vLLM test asks for nccl), and
each rank sees the caller's environment at the call (the ranks are forks of a forkserver started earlier)."""

import os
import pickle

import pytest
import torch

import multirank


def _never_called(groups):
    raise AssertionError("initialize must fail first")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_parallel_kwargs_may_choose_the_backend(tmp_path):
    # one rank, in this process: naming the backend used to pass it to ParallelConfig twice (a TypeError);
    # now nccl reaches initialize, which refuses it on a machine without CUDA
    with pytest.raises(RuntimeError, match="nccl needs CUDA"):
        multirank._worker(0, 1, multirank.free_port(), 1, 1, _never_called, (), {"backend": "nccl"}, str(tmp_path))
    status, message = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    assert status == "error" and "nccl needs CUDA" in message


def _probe(groups):
    return os.environ.get("HPA_MULTIRANK_PROBE"), os.environ.get("HPA_MULTIRANK_GONE")


@pytest.mark.multirank
def test_each_rank_sees_the_callers_environment_at_the_call(monkeypatch):
    monkeypatch.setenv("HPA_MULTIRANK_GONE", "set before the first call")
    assert multirank.run_ranks(_probe, dp=2) == [(None, "set before the first call")] * 2
    monkeypatch.setenv("HPA_MULTIRANK_PROBE", "set later")
    monkeypatch.delenv("HPA_MULTIRANK_GONE")
    assert multirank.run_ranks(_probe, dp=2) == [("set later", None)] * 2
