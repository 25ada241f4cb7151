"""How bytes move between ranks: process-group facts (`groups`), named failures (`errors`), what adasum keeps
per group (`communicator`), the ranks' grid (`topology`), the protocol
the collectives' schedules call (`base`), and its implementations: c10d point-to-point and NCCL
collectives (`c10d`), torch symmetric memory on NVLink (`symmetric`), the slice-parallel movers (`slices`). Each is
a row of the movers' table (`registry`: the built-ins are registered at the end of this module); `select` builds
the one a call names, or the default the group supports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch.distributed as dist

from adasum.settings import current
from adasum.transport.base import Transport
from adasum.transport.c10d import Collectives, PointToPointC10d, post
from adasum.transport.groups import group_timeout, uses_nccl
from adasum.transport.registry import REFUSALS, Need, entry, register_transport, transport_names

__all__ = ["BUILT_IN", "Need", "register_transport", "select", "transport_names"]

BUILT_IN = ("p2p", "collectives", "symmetric", "slices", "one-shot")
"""The transports registered here (`adasum.options.TransportName`), in the table's order. "slices" is the
slice-parallel schedule
(`adasum.collectives.slices`): on symmetric memory inside one NVLink host, elsewhere on c10d point-to-point;
"one-shot" the same schedule with every rank's slice the whole buffer (every rank takes every copy whole and runs
the tree itself)."""

NCCL_PREFERENCE = ("symmetric", "slices", "p2p")
"""The default on NCCL: the first of these the group supports (docs/benchmarks.md: inside one host,
"symmetric" for two ranks, "slices" for more); "collectives" needs a power-of-two group, "symmetric" one too and,
as a default, a group of two (`DEFAULT_SYMMETRIC_WORLD`), "slices" and "symmetric" one host with NVLink, "p2p"
runs everywhere. A buffer small enough for `one_shot` runs "one-shot" instead where "slices" could run. The test
suite puts another transport first (`adasum.settings.Settings.transport_first`, ``ADASUM_TEST_TRANSPORT``):
`preference`."""

DEFAULT_SYMMETRIC_WORLD = 2
"""The group size "symmetric" (VHDD's levels, one peer at a time) is the default for; above it "slices" measured
faster (docs/benchmarks.md, settings)."""


def preference() -> tuple[str, ...]:
    """`NCCL_PREFERENCE` with the settings' ``transport_first`` (if any; a transport's name, checked by
    `adasum.settings.Settings`) put first."""
    first = current().transport_first
    if not first:
        return NCCL_PREFERENCE
    return (first, *(t for t in NCCL_PREFERENCE if t != first))


ONE_SHOT_WORLDS = (2,)
"""The group sizes whose default runs small buffers one-shot: those where it was measured (docs/benchmarks.md,
settings). Larger groups keep the slice schedule for them until one-shot is measured there; named
(``transport="one-shot"``), it runs at any size."""


def one_shot(world: int, nbytes: int | None) -> bool:
    """Whether the default runs a buffer of `nbytes` bytes one-shot over `world` ranks (where "slices" could run
    it): a group size of `ONE_SHOT_WORLDS`, and the copies every rank takes from its peers, ``(world - 1) nbytes``,
    at most the ``one_shot_bytes`` setting. Every rank decides alike: the buffers' sizes are the layout's, the
    setting equal on every rank (`adasum.settings.Settings.shaping`)."""
    return nbytes is not None and world in ONE_SHOT_WORLDS and (world - 1) * nbytes <= current().one_shot_bytes


def _has(requirement: str, need: Need, world: int) -> bool:
    """Whether the group of `need` offers `requirement` (`adasum.transport.registry.Requirement`)."""
    if requirement == "nccl":
        return need.nccl
    if requirement == "power-of-two":
        return need.nccl and need.whole_group
    if requirement == "unplaced":
        return not need.placed
    if requirement == "two-ranks":
        return world == DEFAULT_SYMMETRIC_WORLD
    from adasum.transport import symmetric

    return need.nccl and symmetric.supported(need.group)  # "one-host": collective on its first call


def _default(need: Need, nbytes: int | None) -> str:
    """The default transport's name for `need` (`select`): "p2p" on gloo and under a placement; on NCCL the first
    of `preference()` (after "one-shot" for a small buffer, `one_shot`) whose row's requirements and preferences the
    group meets (a transport the settings put first runs at any group size)."""
    if not need.nccl or need.placed:
        return "p2p"
    from adasum.transport import symmetric

    world = dist.get_world_size(need.group)
    first = current().transport_first
    small = one_shot(world, nbytes) and not first and symmetric.supported(need.group)
    for candidate in ("one-shot",) * small + preference():
        row = entry(candidate)
        wanted = [r for r in (*row.requires, *row.prefers) if not (r == "two-ranks" and candidate == first)]
        if all(_has(r, need, world) for r in wanted):
            return candidate
    return "p2p"


def select(
    group: dist.ProcessGroup | None,
    name: str | None = None,
    *,
    whole_group: bool = True,
    placed: bool = False,
    post_fn: Callable = post,
    piece_elements: tuple[int, int] = (1 << 20, 1 << 25),
    nbytes: int | None = None,
) -> Transport:
    """The transport for a schedule over `group`, built by its row of the table (`adasum.transport.registry`):
    `name` if given, else the fastest the group supports (gloo: "p2p"; NCCL: `preference()`, or "one-shot" for a
    buffer of `nbytes` bytes small enough for `one_shot` where "slices" could run). `whole_group`: every rank of
    the group is a leader of the tree (a power-of-two group, no placement), which "collectives" and "symmetric"
    need; `placed`: the tree runs over a placement inside the group (hierarchical mode), which only the
    VHDD transports serve ("slices" and "one-shot" need every rank, any number of them). Asking for one the group
    cannot run raises ValueError on every rank (its row's first requirement the group lacks)."""
    nccl = uses_nccl(group)
    need = Need(group, nccl, None if nccl else group_timeout(group), 4 * piece_elements[nccl], post_fn,
                whole_group, placed)
    if name is None:
        name = _default(need, nbytes)
    names = transport_names()
    if name not in names:
        raise ValueError(f"transport must be one of {list(names)} or None, got {name!r}; pass one of them or "
                         "register_transport it")
    row = entry(name)
    world = dist.get_world_size(group)
    for requirement in row.requires:
        if not _has(requirement, need, world):
            raise ValueError(f"transport={name!r} {REFUSALS[requirement]}; pass transport=None to let adasum choose")
    return cast(Transport, row.factory(need))


def _slices(need: Need, whole: bool) -> Any:
    """The slice-parallel mover: on symmetric memory where the group runs it, else on c10d point-to-point."""
    if need.nccl:  # symmetric memory loads Triton: never in a CPU process
        from adasum.transport import symmetric

        if symmetric.supported(need.group):
            return symmetric.SymmetricSlices(need.group, whole=whole)
    from adasum.transport.slices import C10dSlices

    return C10dSlices(need.group, need.timeout, whole=whole)


def _symmetric(need: Need) -> Any:
    from adasum.transport import symmetric

    return symmetric.SymmetricMemory(need.group)


register_transport("p2p", lambda need: PointToPointC10d(need.group, need.piece_bytes, need.timeout, need.post_fn))
register_transport("collectives", lambda need: Collectives(need.group, 1 << 62, need.timeout, need.post_fn),
                   requires=("nccl", "power-of-two"))
register_transport("symmetric", _symmetric, requires=("nccl", "power-of-two", "one-host"), prefers=("two-ranks",))
register_transport("slices", lambda need: _slices(need, False), serves="slices", requires=("unplaced",),
                   prefers=("one-host",))
register_transport("one-shot", lambda need: _slices(need, True), serves="slices", requires=("unplaced",),
                   prefers=("one-host",))
