"""The movers in one table: every transport a caller may name, what it is made by, which schedule it serves and what
the group must have for it to run. `adasum.transport.select`, the names ``transport=`` accepts
(`adasum.collectives.api.check_transport`) and the schedule switch (`adasum.collectives.vhdd.adasum_flat_`) read
it; a new transport is one file and one `register_transport` line (docs/extension.md).

>>> from adasum.transport.c10d import PointToPointC10d
>>> class Loud(PointToPointC10d):
...     name = "loud"
>>> register_transport("loud", lambda need: Loud(need.group, need.piece_bytes, need.timeout, need.post_fn))
>>> entry("loud").serves, entry("loud").requires
('vhdd', ())
>>> "loud" in transport_names()
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Literal, get_args

import torch.distributed as dist

from adasum.transport.communicator import _registry

Schedule = Literal["vhdd", "slices"]
"""The schedule a mover serves: "vhdd" (the VHDD levels, `adasum.collectives.vhdd`, over the
`adasum.transport.base.Transport` protocol) or "slices" (the slice-parallel schedule, `adasum.collectives.slices`,
over its `SliceMover` protocol)."""

Requirement = Literal["nccl", "power-of-two", "one-host", "unplaced", "two-ranks"]
"""What a group or call may have to offer a mover, checked in the order an entry names them (the "one-host" query is
collective on its first call, so it comes after the local ones):

* "nccl": the group's CUDA tensors go through NCCL (`adasum.transport.groups.uses_nccl`);
* "power-of-two": every rank of the group is a leader of the tree (a power-of-two group, no hierarchical placement);
* "one-host": every rank on one host with NVLink, Triton and torch's symmetric memory
  (`adasum.transport.symmetric.supported`);
* "unplaced": the tree runs over the whole group (no hierarchical placement);
* "two-ranks": a group of `adasum.transport.DEFAULT_SYMMETRIC_WORLD` ranks (a default's measured group size only:
  a transport the settings put first runs at any size)."""

REFUSALS: Mapping[str, str] = MappingProxyType({
    "nccl": "needs NCCL and a power-of-two group (no hierarchical placement)",
    "power-of-two": "needs NCCL and a power-of-two group (no hierarchical placement)",
    "one-host": "needs every rank on one host with NVLink, Triton and torch's symmetric memory",
    "unplaced": "runs the tree over the whole group (no hierarchical placement)",
    "two-ranks": "is the default for groups of two ranks only",
})
"""What a named transport's ValueError says when the group lacks a `Requirement` (after ``transport='name'``)."""


@dataclass(frozen=True)
class Need:
    """What a transport's factory is given: the group, whether NCCL serves it, the timeout its waits take (None on
    NCCL: the stream's), the point-to-point pieces' bytes (`adasum.settings.Settings.piece_elements`), the function
    that starts a paired batch (`adasum.transport.c10d.post`, which fault tests wrap), and whether every rank is a
    leader of the tree and whether the tree runs over a placement."""

    group: dist.ProcessGroup | None
    nccl: bool
    timeout: timedelta | None
    piece_bytes: int
    post_fn: Callable
    whole_group: bool
    placed: bool


@dataclass(frozen=True)
class Entry:
    """One row of the table (`register_transport`)."""

    name: str
    factory: Callable[[Need], Any]
    serves: Schedule
    requires: tuple[Requirement, ...]
    prefers: tuple[Requirement, ...]


def register_transport(
    name: str,
    factory: Callable[[Need], Any],
    *,
    serves: Schedule = "vhdd",
    requires: Sequence[Requirement] = (),
    prefers: Sequence[Requirement] = (),
) -> None:
    """Make `name` a transport ``transport=`` takes: ``factory(need)`` builds it (once per group and choice: its
    `adasum.transport.communicator.Communicator` keeps it) for the `Need` of a group; `serves` is the schedule it moves
    the bytes of (`Schedule`: a "vhdd" mover implements `adasum.transport.base.Transport`, a "slices" one
    `adasum.collectives.slices.SliceMover`); `requires` what the group must have (`Requirement`), else asking for
    it raises ValueError on every rank; `prefers` what it must have besides to be the default where it is in the
    default's order (`adasum.transport.NCCL_PREFERENCE`). The mover's ``name`` must be `name` (the schedule switch
    and the cross-rank check read it). Registering a name again replaces its row."""
    if serves not in get_args(Schedule):
        raise ValueError(f"register_transport: serves must be one of {list(get_args(Schedule))}, got {serves!r}; pass "
                         "one of them")
    unknown = [r for r in (*requires, *prefers) if r not in REFUSALS]
    if unknown:
        raise ValueError(f"register_transport: requirements must be among {list(REFUSALS)}, got {unknown[0]!r}; pass "
                         "only those")
    if not isinstance(name, str) or not name or not callable(factory):
        raise TypeError("register_transport: give a non-empty name and a callable factory")
    with _registry.lock:
        _registry.transports[name] = Entry(name, factory, serves, tuple(requires), tuple(prefers))


def transport_names() -> tuple[str, ...]:
    """The names ``transport=`` takes, in the order they were registered (the built-ins first)."""
    return tuple(_registry.transports)


def entry(name: str) -> Entry:
    """The row of `name` (KeyError where none is registered)."""
    return _registry.transports[name]


def serves(transport: Any) -> Schedule:
    """The schedule a transport object serves: its row's (by its ``name``); an unregistered object is a VHDD
    transport."""
    found = _registry.transports.get(getattr(transport, "name", ""))
    return found.serves if found is not None else "vhdd"
