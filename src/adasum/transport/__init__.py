"""How bytes move between ranks: process-group facts and named failures (`groups`), the protocol
the collectives' schedules call (`base`), and its implementations: c10d point-to-point and NCCL
collectives (`c10d`), torch symmetric memory on NVLink (`symmetric`). `select` picks one."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from adasum.options import TransportName, choices
from adasum.settings import current
from adasum.transport.base import Transport
from adasum.transport.c10d import Collectives, PointToPointC10d, post
from adasum.transport.groups import group_timeout, uses_nccl

TRANSPORTS = choices(TransportName)
"""The transports a caller may name (``transport=``). "slices" is the slice-parallel schedule
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
    """The transport for a schedule over `group`: `name` if given, else the fastest the group
    supports (gloo: "p2p"; NCCL: `preference()`, or "one-shot" for a buffer of `nbytes` bytes small enough for
    `one_shot` where "slices" could run). `whole_group`: every rank of the group is a
    leader of the tree (a power-of-two group, no placement), which "collectives" and "symmetric"
    need; `placed`: the tree runs over a placement inside the group (hierarchical mode), which only the
    VHDD transports serve ("slices" and "one-shot" need every rank, any number of them). Asking for one the group
    cannot run raises ValueError on every rank."""
    nccl = uses_nccl(group)
    if name is None:
        name = "p2p"
        if nccl and not placed:
            from adasum.transport import symmetric

            world = dist.get_world_size(group)
            small = one_shot(world, nbytes) and not current().transport_first and symmetric.supported(group)
            for candidate in ("one-shot",) * small + preference():
                needs_whole = candidate in ("symmetric", "collectives")
                needs_host = candidate in ("symmetric", "slices")
                named = candidate == current().transport_first
                sized = candidate != "symmetric" or world == DEFAULT_SYMMETRIC_WORLD or named
                if sized and (whole_group or not needs_whole) and (not needs_host or symmetric.supported(group)):
                    name = candidate
                    break
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {list(TRANSPORTS)} or None, got {name!r}")
    timeout = None if nccl else group_timeout(group)
    if name in ("slices", "one-shot"):
        if placed:
            raise ValueError(f"transport={name!r} runs the tree over the whole group (no hierarchical placement)")
        from adasum.transport import symmetric

        whole = name == "one-shot"
        if nccl and symmetric.supported(group):
            return symmetric.SymmetricSlices(group, whole=whole)
        from adasum.transport.slices import C10dSlices

        return C10dSlices(group, timeout, whole=whole)
    if name == "p2p":
        return PointToPointC10d(group, 4 * piece_elements[nccl], timeout, post_fn)
    if not nccl or not whole_group:
        raise ValueError(f"transport={name!r} needs NCCL and a power-of-two group (no hierarchical placement)")
    if name == "collectives":
        return Collectives(group, 1 << 62, timeout, post_fn)
    from adasum.transport import symmetric

    if not symmetric.supported(group):
        raise ValueError("transport='symmetric' needs every rank on one host with NVLink, Triton and torch's "
                         "symmetric memory")
    return symmetric.SymmetricMemory(group)
