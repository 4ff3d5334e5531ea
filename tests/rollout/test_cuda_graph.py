"""``hpa.rollout.cuda_graph``: the wrapper captures once and replays, captures again only when an address it
reads changed, falls through when off; a failed capture leaves the caller's stream current. CPU stand-ins of
torch's CUDA calls (the real capture runs in ``tests/gpu/test_graph_decode.py``)."""

import contextlib

import pytest
import torch

from hpa.rollout import cuda_graph


class FakeGraphs:
    """Captures by running the function once; a replay runs it again into the captured output."""

    def __init__(self):
        self.captures = 0

    @staticmethod
    def available(device):
        return True

    def capture(self, fn):
        self.captures += 1
        out = fn()

        class Graph:
            def replay(self):
                out.copy_(fn())

        return Graph(), out


def test_wrapper_captures_once_per_address_and_replays(monkeypatch):
    fake = FakeGraphs()
    monkeypatch.setattr(cuda_graph, "GRAPHS", fake)
    weight, x = torch.ones(3), torch.zeros(3)
    holder = {"w": weight}
    wrapped = cuda_graph.CUDAGraphWrapper(lambda: holder["w"] * x, lambda: (holder["w"].data_ptr(),), enabled=True)
    for value in (1.0, 2.0, 3.0):
        x.fill_(value)
        assert wrapped().tolist() == [value] * 3
    weight.mul_(2.0)  # in place, as the optimizer: the replay reads it
    assert wrapped().tolist() == [6.0] * 3 and fake.captures == 1 == wrapped.captures
    holder["w"] = torch.ones(3)  # new storage: captured again
    assert wrapped().tolist() == [3.0] * 3 and fake.captures == 2
    off = cuda_graph.CUDAGraphWrapper(lambda: x + 1, lambda: (), enabled=False)
    assert off().tolist() == [4.0] * 3 and fake.captures == 2 and off.captures == 0


def test_a_failed_capture_restores_the_current_stream(monkeypatch):
    """torch.cuda.graph's ``__exit__`` ends the capture before it restores the stream; when that raises, the
    capture stream must not stay current."""
    state = {"current": "default"}

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def stream(s):
        before, state["current"] = state["current"], s.name
        yield
        state["current"] = before

    class FailingGraph:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            state["current"] = "capture"

        def __exit__(self, *exc):
            raise RuntimeError("operation not permitted when stream is capturing")  # capture_end fails

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream(state["current"]))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: state.update(current=s.name))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", FailingGraph)
    with pytest.raises(RuntimeError, match="capturing"):
        cuda_graph.CudaGraphs().capture(lambda: torch.zeros(1))
    assert state["current"] == "default"
