"""A CUDA graph around a function of fixed buffers: captured once, replayed per call, eager when off.

After vLLM's ``CUDAGraphWrapper`` (``vllm/compilation/cuda_graph.py``): the wrapped function reads and writes
only tensors whose addresses stay put (its input buffers, a cache, the parameters); the wrapper captures it at
the first call, replays the graph afterwards, and captures again only when one of those addresses changed
(``addresses()``, e.g. a parameter given new storage). In-place writes to those tensors, a weight update by the
optimizer included, are read by the replay: nothing else needs a new capture.

The capture itself goes through ``GRAPHS`` (``CudaGraphs``), which a CPU test replaces with a stand-in that
counts captures and replays by calling the function again.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class CudaGraphs:
    """torch's CUDA graphs: ``available`` on a CUDA device; ``capture`` warms ``fn`` up on a side stream, captures
    it and returns ``(graph, output)``; ``graph.replay()`` reruns it into ``output``."""

    warmup_steps = 3  # eager runs on a side stream before capture, as torch's CUDA-graph notes ask

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type == "cuda"

    def capture(self, fn: Callable[[], torch.Tensor]):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_steps):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # as megatron: NCCL's watchdog
                output = fn()
        except BaseException:
            # torch.cuda.graph's __exit__ ends the capture before it restores the stream: a failed capture
            # would leave the capture stream current
            torch.cuda.set_stream(current)
            raise
        return graph, output


GRAPHS = CudaGraphs()


class CUDAGraphWrapper:
    """``fn`` captured in a graph and replayed (``enabled``), or called as it is.

    Args:
        fn: the function of fixed buffers (module docstring); returns one tensor.
        addresses: the addresses ``fn`` reads; a change captures again.
        enabled: capture and replay; False: call ``fn``.
    """

    def __init__(self, fn: Callable[[], torch.Tensor], addresses: Callable[[], tuple], *, enabled: bool):
        self.fn, self.addresses, self.enabled = fn, addresses, enabled
        self.captures = 0
        self._graph, self._output, self._key = None, None, None

    def ready(self) -> None:
        """Capture now if there is no graph of the current addresses (raises what the capture raised)."""
        if not self.enabled:
            return
        key = self.addresses()
        if self._graph is None or key != self._key:
            self._graph = None  # a failed capture leaves none
            self._graph, self._output = GRAPHS.capture(self.fn)
            self._key = key
            self.captures += 1

    def __call__(self) -> torch.Tensor:
        """The function's output; from a graph, one buffer overwritten by the next replay."""
        if not self.enabled:
            return self.fn()
        self.ready()
        self._graph.replay()
        return self._output

    @property
    def graph(self) -> Optional[object]:
        return self._graph
