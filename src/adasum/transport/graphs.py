"""CUDA-graph capture of whole collectives for repeated calls on the same tensors.

A collective on a GPU issues dozens of launches (NCCL calls, Triton kernels, copies), each costing
the host 5-50 us: for small and many-tensor layouts that host work, not the data, sets the time.
`Graphs.run(key, fn)` runs `fn` eagerly the first time a key is seen (it warms every cache: tile
tables, staging buffers, NCCL communicators), captures it into a CUDA graph the second time, and
replays the graph from then on. The key names everything the launches depend on: the tensors'
addresses, shapes, strides and dtypes, and the transport; so "the same key" means "the same
launches", and replaying reads whatever the tensors hold now.

Each process group's communicator (`adasum.transport.groups.Communicator`) holds one `Graphs`: the
only capture point of the package. Every rank must take the same path (eager, capture, replay) at
the same call, as every rank calls with its own copies of the same layout; captures are collective
(NCCL ops inside a graph pair with their peers' at replay). If capture fails, the key runs eagerly
from then on. ``ADASUM_CUDA_GRAPHS=0`` turns capture off (`adasum.settings`). Captured graphs are
released by `adasum.release()` (and by ``torch.distributed.destroy_process_group``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from adasum.settings import current

MAX_GRAPHS = 128  # a BERT-Large DDP model has about 50 buckets; an evicted key is not captured again
_FAILED = object()


def enabled(device: torch.device) -> bool:
    """Whether calls on `device` are captured: a GPU, with the ``cuda_graphs`` setting on."""
    return device.type == "cuda" and current().cuda_graphs


def tensor_key(tensors) -> tuple:
    """What a captured graph of `tensors` depends on: each tensor's address, dtype, shape and strides."""
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in tensors)


class Graphs:
    """The captured graphs of one process group, by key (module doc)."""

    def __init__(self) -> None:
        self._graphs: OrderedDict[Hashable, object] = OrderedDict()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()

    def run(self, key: Hashable, fn: Callable[[], None], device: torch.device) -> None:
        """`fn()` eagerly, captured, or replayed (see the module doc)."""
        if not enabled(device) or torch.cuda.is_current_stream_capturing():
            fn()
            return
        graph = self._graphs.get(key)
        if graph is _FAILED:
            fn()
            return
        if graph is not None:
            self._graphs.move_to_end(key)
            graph.replay()  # type: ignore[attr-defined]
            return
        sightings = self._seen.pop(key, 0) + 1
        self._seen[key] = sightings
        while len(self._seen) > 4 * MAX_GRAPHS:
            self._seen.popitem(last=False)
        if sightings < 2:
            fn()
            return
        self._capture(key, fn, device)

    def _capture(self, key: Hashable, fn: Callable[[], None], device: torch.device) -> None:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        # capture_begin/end rather than torch.cuda.graph(), which synchronises the device and runs the
        # garbage collector on entry (tens of ms with a large model alive)
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    fn()
                finally:
                    graph.capture_end()
        except Exception:  # capture is impossible for this key (an op that cannot be captured): run eagerly
            self._graphs[key] = _FAILED
            torch.cuda.current_stream(device).wait_stream(stream)
            fn()
            return
        torch.cuda.current_stream(device).wait_stream(stream)
        self._graphs[key] = graph
        while self.count() > MAX_GRAPHS:  # the oldest goes; its key runs eagerly from then on (no capture thrash)
            oldest = next(k for k, g in self._graphs.items() if g is not _FAILED)
            self._graphs[oldest] = _FAILED
        graph.replay()

    def captured(self, key: Hashable) -> bool:
        """Whether `key` has a captured graph."""
        graph = self._graphs.get(key)
        return graph is not None and graph is not _FAILED

    def replay(self, key: Hashable) -> bool:
        """Replay the graph of `key` if there is one (True), else do nothing (False)."""
        graph = self._graphs.get(key)
        if graph is None or graph is _FAILED or torch.cuda.is_current_stream_capturing():
            return False
        graph.replay()  # type: ignore[attr-defined]
        return True

    def count(self) -> int:
        """How many graphs are alive."""
        return sum(g is not _FAILED for g in self._graphs.values())

    def clear(self) -> None:
        """Forget every graph and sighting."""
        self._graphs.clear()
        self._seen.clear()
