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
belongs to the groups it was made on, kept by objects that outlive them (a reducer's momentum).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, TypeVar

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
