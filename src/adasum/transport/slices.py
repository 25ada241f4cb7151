"""The slice-parallel schedule's movers (`adasum.collectives.slices`): how every rank's copy of a
slice reaches its owner, and how the owner's result reaches every rank.

`C10dSlices` moves them with c10d point-to-point (any backend; on gloo it waits at most the group's
timeout): the scatter is one batch of sends and receives with every peer into a receive workspace
of ``P x slice`` elements, the gather one batch of the finished slice to every peer; one-shot (``whole``), the
slice is the whole round and the gather moves nothing.
`adasum.transport.symmetric.SymmetricSlices` does the same with loads and stores into peers'
symmetric memory on NVLink. Their in-place movers (`C10dInPlace`, `adasum.transport.symmetric.SymmetricInPlace`:
`InPlace`) run a single tensor larger than a round through a ring of fixed size.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from adasum.core.keep import kept
from adasum.settings import current
from adasum.transport.base import CUT_ALIGN, Transport
from adasum.transport.c10d import wait
from adasum.transport.topology import global_rank

RESERVED_BYTES = 32 << 20
"""Of the memory budget, what the buffers leave for everything else adasum keeps on a device (captured graphs, tile
address tables, the float64 sums): at most this, and at most an eighth of the budget."""


def memory_budget_bytes() -> int:
    """The device memory adasum may keep per process (the ``memory_mb`` setting, 512 MiB by default): the movers'
    buffers take `buffer_bytes` of it, `RESERVED_BYTES` is left for the rest."""
    return int(current().memory_mb * (1 << 20))


def buffer_bytes(purpose: str = "rows") -> int:
    """The bytes of the budget a purpose's buffers may take: "rows" (a round's rows, staging and receive
    buffers: three quarters of what the buffers take) or "ring" (the in-place movers' ring and spare rows: the
    rest). A layout larger than the rows runs in rounds of whole tensors through them; a single tensor larger
    than a round runs in place through the ring (`InPlace`), where the transport has one."""
    budget = memory_budget_bytes()
    buffers = budget - min(RESERVED_BYTES, budget // 8)
    rows = buffers * 3 // 4
    return rows if purpose == "rows" else buffers - rows


def round_elements(world: int, rows: int, element_size: int, whole: bool = False) -> int:
    """The most elements a round may hold when a mover keeps `rows` rows of one slice each within the budget (`whole`:
    one-shot, a row holds the whole round)."""
    row = buffer_bytes() // (rows * element_size) - 16  # the aligned cuts make slices up to 16 longer
    return max(1, row if whole else world * row)


def batch(
    group: dist.ProcessGroup | None,
    timeout: timedelta | None,
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
) -> None:
    """One batch of point-to-point sends and receives of (tensor, group rank) pairs (empty ones left out), waited
    for within `timeout` (None: on the stream, NCCL)."""
    ops = [dist.P2POp(dist.isend, t, global_rank(group, p), group) for t, p in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, global_rank(group, p), group) for t, p in recvs if t.numel()]
    if ops:
        wait(dist.batch_isend_irecv(ops), timeout)


class InPlace:
    """What the in-place movers share (`adasum.collectives.slices.InPlaceMover`): the cut and where the rows lie.

    A buffer of N elements is cut into P slices of L elements (a multiple of `CUT_ALIGN`), the last taking the
    rest: ``L + t`` with t < 16 P. Rank r's rows are the first L elements of every rank's slice *in r's own
    buffer*: its own slice, and, for j != r, where its copy of slice j was (sent to rank j first). The last rank's
    slice is t longer than the room another slice leaves: those t elements of every rank's copy land in small
    spare rows (``spare`` elements each), a second part. Pieces of `piece` elements (the ring's) cut the L
    elements the same way on every rank."""

    name = "slices"
    scattered = False
    ahead = 1  # one round in flight (`adasum.collectives.slices.SliceMover`)
    whole = False  # slices cut by `cut`, not one-shot

    def __init__(self, world: int, rank: int) -> None:
        self.world = world
        self.rank = rank

    @property
    def spare(self) -> int:
        """Elements of one spare row: the longest tail the cut leaves."""
        return CUT_ALIGN * self.world

    def cut(self, numel: int) -> list[tuple[int, int]] | None:
        """P slices of L elements, the last taking the rest (None: L would be 0)."""
        width = numel // self.world // CUT_ALIGN * CUT_ALIGN
        if width == 0:
            return None
        return [(r * width, (r + 1) * width) for r in range(self.world - 1)] + [((self.world - 1) * width, numel)]

    def round_elements(self, element_size: int, ahead: int = 1) -> None:
        """No limit: the ring's size does not depend on the buffer's."""
        return None

    def reserve(self, row: int, like, ahead: int = 1) -> None:
        """Nothing: the ring is made on first use, at a fixed size."""

    def piece_elements(self, slots: int, element_size: int) -> int:
        """Elements of one piece when the ring holds `slots` rows of a piece in the ring's share of the budget,
        besides the spare rows."""
        room = buffer_bytes("ring") // element_size - (self.world + 1) * self.spare
        return max(CUT_ALIGN, room // slots // CUT_ALIGN * CUT_ALIGN)

    def widths(self, bounds: Sequence[tuple[int, int]]) -> tuple[int, int]:
        """(L, t) of a cut (class doc)."""
        width = bounds[0][1] - bounds[0][0]
        return width, bounds[-1][1] - bounds[-1][0] - width

    def all_reduce_sums(self, sums: torch.Tensor) -> None:
        """SUM all-reduce of the small float64 sums over the group."""
        dist.all_reduce(sums, group=self.group)  # type: ignore[attr-defined]  # movers are Transports

    def pieces(self, width: int, piece: int) -> list[tuple[int, int]]:
        """The L elements of a slice in pieces of `piece` elements."""
        return [(p, min(p + piece, width)) for p in range(0, width, piece)]

    def parts(self, flat: torch.Tensor, bounds: Sequence[tuple[int, int]], spare: Sequence[torch.Tensor]):
        """The rows (class doc): the first L elements of every slice of `flat`, and on the last rank the tails in
        `spare` (one row per rank; its own tail where it lies)."""
        width = bounds[0][1] - bounds[0][0]
        parts = [(0, [flat[lo : lo + width] for lo, _ in bounds])]
        lo, hi = bounds[self.rank]
        if hi - lo > width:
            tails = [spare[j][: hi - lo - width] for j in range(self.world)]
            tails[self.rank] = flat[lo + width : hi]
            parts.append((width, tails))
        return parts


class C10dInPlace(InPlace, Transport):
    """`InPlace` on c10d point-to-point: each piece is one batch of sends of this rank's copies and receives of
    the owners' into a ring of ``P - 1`` pieces, copied into the buffer once the batch is done; the gather sends
    this rank's slice to every peer and receives theirs where they belong."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: timedelta | None) -> None:
        Transport.__init__(self, group)
        InPlace.__init__(self, dist.get_world_size(group), dist.get_rank(group))
        self.timeout = timeout
        self._space: torch.Tensor | None = None
        self._parts: list | None = None

    def _ring(self, like: torch.Tensor) -> torch.Tensor:
        piece = self.piece_elements(self.world - 1, like.element_size())
        numel = (self.world - 1) * piece + self.world * self.spare
        space = self._space
        if space is None or space.numel() != numel or space.dtype != like.dtype or space.device != like.device:
            space = self._space = torch.empty(numel, dtype=like.dtype, device=like.device)
        return kept(space)  # a graph captured on it keeps it when a larger one replaces it (`adasum.core.keep`)

    def _batch(self, sends, recvs) -> None:
        batch(self.group, self.timeout, sends, recvs)

    def rows(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]]):
        """The rows in `buffer` and the spare rows (`InPlace.parts`)."""
        space = self._ring(buffer)
        spare = [space[j * self.spare : (j + 1) * self.spare] for j in range(self.world)]
        self._parts = self.parts(buffer, bounds, spare)
        return self._parts

    def scatter(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]], landed) -> None:
        """Piece by piece: send this rank's copies of the other slices, receive the owners' copies of this rank's
        into the ring, copy them where the sent ones were; the tails of the last slice first."""
        assert self._parts is not None  # `rows` came first
        me, last = self.rank, self.world - 1
        width, tail = self.widths(bounds)
        peers = [j for j in range(self.world) if j != me]
        if tail:  # every rank's copy of the last slice's tail goes to the spare rows of the last rank
            spare = self._parts[1][1] if me == last else []
            self._batch([] if me == last else [(buffer[bounds[last][0] + width : bounds[last][1]], last)],
                        [(spare[j], j) for j in peers] if me == last else [])
        space = self._ring(buffer)
        piece = self.piece_elements(self.world - 1, buffer.element_size())
        start = self.world * self.spare
        for p0, p1 in self.pieces(width, piece):
            ring = [space[start + k * piece : start + k * piece + p1 - p0] for k in range(len(peers))]
            self._batch([(buffer[bounds[j][0] + p0 : bounds[j][0] + p1], j) for j in peers], list(zip(ring, peers)))
            for k, j in enumerate(peers):
                buffer[bounds[j][0] + p0 : bounds[j][0] + p1].copy_(ring[k])
            landed(p0, p1)
        if tail and me == last:
            landed(width, width + tail)

    def gather(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]], finish) -> None:  # type: ignore[override]
        """Write this rank's result slice, then exchange every rank's slice with every peer (each lands where the
        rows were)."""
        lo, hi = bounds[self.rank]
        finish(0, hi - lo, [buffer[lo:hi]])
        peers = [j for j in range(self.world) if j != self.rank]
        self._batch([(buffer[lo:hi], j) for j in peers], [(buffer[bounds[j][0] : bounds[j][1]], j) for j in peers])


class C10dSlices(Transport):
    """The slice-parallel movers' protocol (`adasum.collectives.slices.SliceMover`) on c10d point-to-point; with
    `whole`, one-shot (every rank receives every peer's whole round)."""

    name = "slices"
    whole = False  # one-shot (`adasum.collectives.slices`): set by the constructor
    scattered = False
    ahead = 1  # one round in flight: a round's receives are waited for before its tree

    def __init__(self, group: dist.ProcessGroup | None, timeout: timedelta | None, whole: bool = False) -> None:
        super().__init__(group)
        if whole:
            self.whole, self.name = True, "one-shot"
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = timeout
        self._rows: torch.Tensor | None = None
        self._in_place: C10dInPlace | None = None

    def round_elements(self, element_size: int, ahead: int = 1) -> int:
        """The most elements one round holds within the memory budget (one round in flight; one-shot, a row holds
        the whole round)."""
        return round_elements(self.world, self.world, element_size, self.whole)

    @property
    def in_place(self) -> C10dInPlace:
        """The mover of a single tensor larger than a round (made on first use)."""
        if self._in_place is None:
            self._in_place = C10dInPlace(self.group, self.timeout)
        return self._in_place

    def reserve(self, row: int, like: torch.Tensor, ahead: int = 1) -> None:
        """Grow the receive workspace to rows of `row` elements like `like` before a layout's first round."""
        self._workspace(self.world * row, like)

    def _workspace(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if rows is None or rows.numel() < numel or rows.dtype != like.dtype or rows.device != like.device:
            rows = self._rows = torch.empty(numel, dtype=like.dtype, device=like.device)
        return kept(rows)[:numel]  # a graph captured on it keeps it when a larger one replaces it

    def _batch(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        batch(self.group, self.timeout, sends, recvs)

    def rows(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]]):
        """Where every rank's copy of this rank's slice lands: one scratch row per rank (one part)."""
        lo, hi = bounds[self.rank]
        size = hi - lo
        space = self._workspace(self.world * size, buffer)
        return [(0, [space[j * size : (j + 1) * size] for j in range(self.world)])]

    def scatter(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]], landed) -> None:
        """Fill the rows: one batch of sends and receives with every peer, then ``landed`` for the whole slice."""
        lo, hi = bounds[self.rank]
        rows = self.rows(buffer, bounds)[0][1]
        rows[self.rank].copy_(buffer[lo:hi])
        peers = [j for j in range(self.world) if j != self.rank]
        self._batch([(buffer[bounds[j][0] : bounds[j][1]], j) for j in peers], [(rows[j], j) for j in peers])
        landed(0, hi - lo)

    def all_reduce_sums(self, sums: torch.Tensor) -> None:
        """SUM all-reduce of the small float64 sums over the group."""
        dist.all_reduce(sums, group=self.group)

    def discard(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> None:
        """Nothing: a round's receives into the rows are posted only once this rank has read the round before."""

    def gather(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]], finish) -> None:  # type: ignore[override]
        """Write this rank's result slice, then exchange every rank's slice with every peer (one-shot: every rank
        wrote the whole round)."""
        lo, hi = bounds[self.rank]
        finish(0, hi - lo, [buffer[lo:hi]])
        if self.whole:
            return
        peers = [j for j in range(self.world) if j != self.rank]
        self._batch([(buffer[lo:hi], j) for j in peers], [(buffer[bounds[j][0] : bounds[j][1]], j) for j in peers])
