"""Bounded caches: what adasum keeps per layout or per call site (a group's plans, its symmetric memory's views of
its peers' buffers, AdaCons' momentum per layout) holds at most `MOST` entries, the least recently used out first,
so that layouts re-made every call keep memory flat.

>>> views = Bounded(most=2)
>>> views["a"], views["b"] = 1, 2
>>> views.get("a")            # used: now the most recent
1
>>> views["c"] = 3            # one too many: the least recently used goes
>>> list(views)
['a', 'c']

`Released` caches are emptied by `adasum.release()` too (`adasum.transport.communicator.release`): state that
belongs to the groups it was made on, kept by objects that outlive them (a reducer's momentum). `DeviceIndices`
is one that holds small int64 index tensors on devices, made once per values: a repeated call reads the same
tensors, with no host-to-device copy (which waits on the host, and which a CUDA graph cannot capture).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from adasum.core.keep import kept
from adasum.transport.communicator import emptied_by_release

K = TypeVar("K")
V = TypeVar("V")

MOST = 512
"""Entries a bounded cache keeps: as many as a group's plans (`adasum.checks.plan.MAX_PLANS`)."""


class Bounded(OrderedDict[K, V]):
    """A dict of at most `most` entries: setting an entry, or reading it with `get`, makes it the most recent;
    setting one beyond `most` drops the least recent. Copies and pickles are bounded alike."""

    def __init__(self, most: int = MOST) -> None:
        super().__init__()
        self.most = most

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.most:
            self.popitem(last=False)

    def get(self, key: K, default: Any = None) -> Any:
        """The entry of `key` (now the most recent), or `default`."""
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]


class Released(Bounded[K, V]):
    """A `Bounded` cache that `adasum.release()` empties (module doc); a copy or an unpickled one too."""

    def __init__(self, most: int = MOST) -> None:
        super().__init__(most)
        emptied_by_release(self)


class DeviceIndices(Released[tuple[tuple[int, ...], torch.device], torch.Tensor]):
    """int64 tensors of given values on devices, one per (values, device), made on first use (a call's first,
    eager run: the capture of a repeat finds them made), at most `MOST`, emptied by `adasum.release()`. A graph
    being captured keeps the ones it reads (`adasum.core.keep.kept`), so an eviction never frees memory a graph
    reads.

    >>> indices = DeviceIndices()
    >>> indices.of([2, 0, 1], torch.device("cpu"))
    tensor([2, 0, 1])
    >>> indices.of((2, 0, 1), torch.device("cpu")) is indices.of([2, 0, 1], torch.device("cpu"))
    True
    """

    def of(self, values: Sequence[int], device: torch.device) -> torch.Tensor:
        """The int64 tensor of `values` on `device` (made once; the same object on every later call)."""
        key = (tuple(values), torch.device(device))
        found = self.get(key)
        if found is None:
            found = self[key] = torch.tensor(key[0], dtype=torch.int64, device=key[1])
        return kept(found)
