"""CUDA-graph capture of whole collectives for repeated calls on the same tensors.

A collective on a GPU issues dozens of launches (NCCL calls, Triton kernels, copies), each costing
the host 5-50 us: for small and many-tensor layouts that host work, not the data, sets the time.
`run(key, fn)` runs `fn` eagerly the first time a key is seen (it warms every cache: tile tables,
staging buffers, NCCL communicators), captures it into a CUDA graph the second time, and replays
the graph from then on. The key names everything the launches depend on: the tensors' addresses,
shapes, strides and dtypes, the group and the transport; so "the same key" means "the same
launches", and replaying reads whatever the tensors hold now.

Every rank must take the same path (eager, capture, replay) at the same call, as every rank
calls with its own copies of the same layout; captures are collective (NCCL ops inside a graph
pair with their peers' at replay). If capture fails, the key runs eagerly from then on.
Set ``ADASUM_CUDA_GRAPHS=0`` to turn capture off. Captured graphs (and symmetric buffers) are
released by `release`, which `torch.distributed.destroy_process_group` calls first once adasum
has captured a graph (a process hung in ``destroy_process_group`` with a graph alive).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist

MAX_GRAPHS = 128  # a BERT-Large DDP model has about 50 buckets; an evicted key is not captured again
_FAILED = object()
_graphs: OrderedDict[Hashable, Any] = OrderedDict()  # a torch.cuda.CUDAGraph or _FAILED
_seen: OrderedDict[Hashable, int] = OrderedDict()
_patched = False


def enabled(device: torch.device) -> bool:
    """Whether calls on `device` are captured and replayed (CUDA, unless ``ADASUM_CUDA_GRAPHS=0``)."""
    return device.type == "cuda" and os.environ.get("ADASUM_CUDA_GRAPHS", "1") != "0"


def tensor_key(tensors) -> tuple:
    """What a captured graph depends on for each tensor: address, dtype, shape and strides."""
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in tensors)


def run(key: Hashable, fn: Callable[[], None], device: torch.device) -> None:
    """`fn()` eagerly, captured, or replayed (see the module doc)."""
    if not enabled(device) or torch.cuda.is_current_stream_capturing():
        fn()
        return
    graph = _graphs.get(key)
    if graph is _FAILED:
        fn()
        return
    if graph is not None:
        _graphs.move_to_end(key)
        graph.replay()
        return
    sightings = _seen.pop(key, 0) + 1
    _seen[key] = sightings
    while len(_seen) > 4 * MAX_GRAPHS:
        _seen.popitem(last=False)
    if sightings < 2:
        fn()
        return
    _install_release_hook()
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
        _graphs[key] = _FAILED
        torch.cuda.current_stream(device).wait_stream(stream)
        fn()
        return
    torch.cuda.current_stream(device).wait_stream(stream)
    _graphs[key] = graph
    while count() > MAX_GRAPHS:  # the oldest goes; its key runs eagerly from then on (no capture thrash)
        oldest = next(k for k, g in _graphs.items() if g is not _FAILED)
        _graphs[oldest] = _FAILED
    graph.replay()


def captured(key: Hashable) -> bool:
    """Whether `key` has a live captured graph."""
    graph = _graphs.get(key)
    return graph is not None and graph is not _FAILED


def replay(key: Hashable) -> bool:
    """Replay the graph of `key` if there is one (True), else do nothing (False)."""
    graph = _graphs.get(key)
    if graph is None or graph is _FAILED or torch.cuda.is_current_stream_capturing():
        return False
    graph.replay()
    return True


def count() -> int:
    """How many graphs are alive."""
    return sum(g is not _FAILED for g in _graphs.values())


def release() -> None:
    """Drop every captured graph and the symmetric staging buffers (collective-free, local). For teardown:
    `torch.distributed.destroy_process_group` calls it. Collectives after it are not supported (training a
    second model after it can hang in one rank's DDP hook, in a blocking host-to-device copy of a new tile
    table)."""
    if _graphs and torch.cuda.is_available():
        torch.cuda.synchronize()
    _graphs.clear()
    _seen.clear()
    from adasum.collectives import api

    api._last.clear()
    from adasum.transport import symmetric

    symmetric.release()


def _install_release_hook() -> None:
    global _patched
    if _patched:
        return
    _patched = True
    original = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        release()
        return original(*args, **kwargs)

    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
