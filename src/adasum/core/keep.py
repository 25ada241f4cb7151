"""What a CUDA graph being captured reads from device memory that a cache owns: kept as long as the graph.

A captured graph holds the addresses its kernels read (tile tables, address tables, a transport's workspace), not
the tensors. Caches that hand such tensors out (bounded ones evict; a growing workspace replaces its tensor) pass
each through `kept`, and the capture point (`adasum.transport.graphs.Graphs`) collects what was handed out while
it captured (`keeping`) and keeps it with the graph: a graph never reads memory that was freed and reused.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")

_KEEP: contextvars.ContextVar[list | None] = contextvars.ContextVar("adasum_capture_keep", default=None)


def kept(value: T) -> T:
    """`value` (device tensors a kernel will read), recorded for the graph being captured, if any."""
    keep = _KEEP.get()
    if keep is not None:
        keep.append(value)
    return value


@contextlib.contextmanager
def keeping(into: list) -> Iterator[list]:
    """Collect into `into` what `kept` is given inside the block (a capture)."""
    token = _KEEP.set(into)
    try:
        yield into
    finally:
        _KEEP.reset(token)
