"""CUDA-graph capture of whole collectives for repeated calls on the same tensors.

A collective on a GPU issues dozens of launches (NCCL calls, Triton kernels, copies), each costing
the host microseconds: for small and many-tensor layouts that host work, not the data, sets the time.
`Graphs.run(key, fn)` runs `fn` eagerly the first time a key is seen (it warms every cache: tile
tables, staging buffers, NCCL communicators), captures it into a CUDA graph the second time, and
replays the graph from then on. The key names everything the launches depend on: the call's plan
(its layout and configuration, the transport among them) and the tensors' addresses, shapes,
strides and dtypes; so "the same key" means "the same launches", and replaying reads whatever the
tensors hold now. A call made while a run is under way runs eagerly into it (no nested capture).

Each process group's communicator (`adasum.transport.communicator.Communicator`) holds one `Graphs` and
reaches it through `Communicator.capture` (which every entry point's `Communicator.run` calls), the only capture
point of the package. Every rank must take the same path (eager, capture, replay) at the same call, as every rank
calls with its own copies of the same layout; captures are collective (NCCL ops inside a graph pair with their
peers' at replay). If capture fails, the key runs eagerly from then on. ``ADASUM_CUDA_GRAPHS=0`` turns
capture off (`adasum.settings`). Captured graphs are released by `adasum.release()` (and by
``torch.distributed.destroy_process_group``).

A key's graph is captured when *this* rank sees it the second time, and keys hold addresses, which differ
from rank to rank: one rank may replay a call that its peer runs eagerly or captures. That is safe while
both run against the same symmetric buffers; so when a symmetric buffer is outgrown (a collective step that
every rank of its group takes at the same call), the device is drained and every group's graphs are dropped
(`Graphs.clear`, from `adasum.transport.communicator.retire_graphs`; a graph of one group may point into another's
buffers, as the two tiers' do): a graph replayed on
the old buffer against a peer running on the new one would wait at a signal pad the peer never sets (this
hung FSDP2's reductions, whose buffers the caching allocator places differently on each rank).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from adasum.core.keep import keeping
from adasum.settings import current

MAX_GRAPHS = 128  # a BERT-Large DDP model has about 50 buckets; an evicted key is not captured again
_FAILED = object()


def enabled(device: torch.device) -> bool:
    """Whether calls on `device` are captured: a GPU, with the ``cuda_graphs`` setting on."""
    return device.type == "cuda" and current().cuda_graphs


def tensor_key(tensors) -> tuple:
    """What a captured graph of `tensors` depends on: each tensor's address, dtype, shape and strides."""
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in tensors)


class CudaCapture:
    """How `Graphs` captures: CUDA graphs on a GPU. Tests give `Graphs` another object with the same three
    methods (`enabled`, `capturing`, `capture`) to run its logic on the CPU."""

    def enabled(self, device: torch.device) -> bool:
        """Whether calls on `device` are captured (`enabled`)."""
        return enabled(device)

    def capturing(self) -> bool:
        """Whether the current stream is being captured (by anyone: then every call runs into that capture)."""
        return torch.cuda.is_current_stream_capturing()

    def capture(self, fn: Callable[[], None], device: torch.device):
        """A graph of `fn`'s launches (with ``replay()``), captured on a side stream that the current stream then
        waits for; raises if `fn` cannot be captured."""
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
        finally:
            torch.cuda.current_stream(device).wait_stream(stream)
        return graph

    def free(self, graph) -> None:
        """Free `graph`'s device resources now, whatever still refers to it (a traceback's frame may): NCCL waits,
        in the group's destroy, for every graph that holds its work."""
        graph.reset()


class Graphs:
    """The captured graphs of one process group, by key (module doc). Calls made while one of its runs is
    under way (a collective inside a captured hook, the schedule inside a captured list call) run eagerly
    into it: they are neither counted nor captured on their own."""

    def __init__(self, backend: CudaCapture | None = None) -> None:
        self.backend = backend if backend is not None else CudaCapture()
        self._graphs: OrderedDict[Hashable, object] = OrderedDict()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()
        self._running = False
        self._epoch = 0  # advanced whenever a graph is dropped: a `handle` from before may be stale
        self._evicted: weakref.WeakSet = weakref.WeakSet()  # evicted graphs something still refers to (`clear`)

    def run(self, key: Hashable, fn: Callable[[], None], device: torch.device) -> bool:
        """`fn()` eagerly, captured, or replayed (see the module doc and the class doc). Returns whether it ran
        eagerly as the first sighting of a key that could be captured."""
        if self._running or not self.backend.enabled(device) or self.backend.capturing():
            fn()
            return False
        self._running = True
        try:
            return self._run(key, fn, device)
        finally:
            self._running = False

    def _run(self, key: Hashable, fn: Callable[[], None], device: torch.device) -> bool:
        graph = self._graphs.get(key)
        if graph is _FAILED:
            fn()
            return False
        if graph is not None:
            self._graphs.move_to_end(key)
            graph.replay()  # type: ignore[attr-defined]
            return False
        sightings = self._seen.pop(key, 0) + 1
        self._seen[key] = sightings
        while len(self._seen) > 4 * MAX_GRAPHS:
            self._seen.popitem(last=False)
        if sightings < 2:
            fn()
            return True
        keep: list = []  # what the capture read from caches, kept with the graph (`adasum.core.keep`)
        try:
            with keeping(keep):
                graph = self.backend.capture(fn, device)
        except Exception:  # capture is impossible for this key (an op that cannot be captured): run eagerly
            self._graphs[key] = _FAILED
            fn()
            return False
        graph.adasum_keep = keep  # lives and dies with the graph
        self._graphs[key] = graph
        while self.count() > MAX_GRAPHS:  # the oldest goes; its key runs eagerly from then on (no capture thrash)
            oldest = next(k for k, g in self._graphs.items() if g is not _FAILED)
            self._evicted.add(self._graphs[oldest])
            self._graphs[oldest] = _FAILED
            self._epoch += 1
        graph.replay()
        return False

    def handle(self, key: Hashable) -> tuple[object, int] | None:
        """What `launch` replays `key`'s graph from without looking the key up again (a key of many tensors
        costs the host a hash and a deep comparison per look-up), or None where `key` has no captured graph."""
        graph = self._graphs.get(key)
        return None if graph is None or graph is _FAILED else (graph, self._epoch)

    def replayable(self, handle: tuple[object, int]) -> bool:
        """Whether the graph of a `handle` may replay (`launch`): no graph was dropped since it was taken, and no run
        or capture is under way."""
        return handle[1] == self._epoch and not self._running and not self.backend.capturing()

    @staticmethod
    def launch(handle: tuple[object, int]) -> None:
        """Replay the graph of a `handle` that `replayable` has just found replayable (nothing ran in between)."""
        handle[0].replay()  # type: ignore[attr-defined]

    def count(self) -> int:
        """How many graphs are alive."""
        return sum(g is not _FAILED for g in self._graphs.values())

    def clear(self) -> None:
        """Forget every graph and sighting, and free each graph (`CudaCapture.free`), evicted ones that something
        still refers to included; the callers have drained the device first (`adasum.transport.communicator.release`,
        `retire_graphs`)."""
        for graph in [*(g for g in self._graphs.values() if g is not _FAILED), *self._evicted]:
            self.backend.free(graph)
        self._evicted.clear()
        self._graphs.clear()
        self._seen.clear()
        self._epoch += 1
