"""The multi-rank helper itself: a test may choose the backend (the gpu-marked vLLM test asks for nccl)."""

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
