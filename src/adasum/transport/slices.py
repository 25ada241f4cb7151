"""The slice-parallel schedule's movers (`adasum.collectives.slices`): how every rank's copy of a
slice reaches its owner, and how the owner's result reaches every rank.

`C10dSlices` moves them with c10d point-to-point (any backend; on gloo it waits at most the group's
timeout): the scatter is one batch of sends and receives with every peer into a receive workspace
of ``P x slice`` elements, the gather one batch of the finished slice to every peer.
`adasum.transport.symmetric.SymmetricSlices` does the same with loads and stores into peers'
symmetric memory on NVLink.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from adasum.core.layout import Layout
from adasum.settings import current
from adasum.transport.base import Transport
from adasum.transport.c10d import global_rank, wait


def memory_budget_bytes() -> int:
    """The memory a slice-parallel mover's buffers may take per process (the ``memory_mb`` setting, 512 MiB by
    default): a layout larger than they hold runs in rounds of whole tensors through them; a single tensor too
    large for them makes a round of its own, and the buffers grow to it."""
    return int(current().memory_mb * (1 << 20))


def round_elements(world: int, rows: int, element_size: int) -> int:
    """The most elements a round may hold when a mover keeps `rows` rows of one slice each within the budget."""
    row = memory_budget_bytes() // (rows * element_size) - 16  # the aligned cuts make slices up to 16 longer
    return max(1, world * row)


class C10dSlices(Transport):
    """The slice-parallel movers' protocol (`adasum.collectives.slices.SliceMover`) on c10d point-to-point."""

    name = "slices"
    scattered = False

    def __init__(self, group: dist.ProcessGroup | None, timeout: timedelta | None) -> None:
        super().__init__(group)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = timeout
        self._rows: torch.Tensor | None = None

    def round_elements(self, element_size: int) -> int:
        """The most elements one round holds within the memory budget."""
        return round_elements(self.world, self.world, element_size)

    def reserve(self, row: int, like: torch.Tensor) -> None:
        """Grow the receive workspace to rows of `row` elements like `like` before a layout's first round."""
        self._workspace(self.world * row, like)

    def _workspace(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if rows is None or rows.numel() < numel or rows.dtype != like.dtype or rows.device != like.device:
            rows = self._rows = torch.empty(numel, dtype=like.dtype, device=like.device)
        return rows[:numel]

    def _batch(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        ops = [dist.P2POp(dist.isend, t, global_rank(self.group, p), self.group) for t, p in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, global_rank(self.group, p), self.group) for t, p in recvs if t.numel()]
        if ops:
            wait(dist.batch_isend_irecv(ops), self.timeout)

    def rows(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Where every rank's copy of this rank's slice lands: one scratch row per rank."""
        lo, hi = bounds[self.rank]
        size = hi - lo
        space = self._workspace(self.world * size, buffer)
        return [space[j * size : (j + 1) * size] for j in range(self.world)]

    def scatter(self, buffer: torch.Tensor, layout: Layout, bounds: Sequence[tuple[int, int]], landed) -> None:
        """Fill the rows: one batch of sends and receives with every peer, then ``landed`` for the whole slice."""
        lo, hi = bounds[self.rank]
        rows = self.rows(buffer, bounds)
        rows[self.rank].copy_(buffer[lo:hi])
        peers = [j for j in range(self.world) if j != self.rank]
        self._batch([(buffer[bounds[j][0] : bounds[j][1]], j) for j in peers], [(rows[j], j) for j in peers])
        landed(0, hi - lo)

    def all_reduce_sums(self, sums: torch.Tensor) -> None:
        """SUM all-reduce of the small float64 sums over the group."""
        dist.all_reduce(sums, group=self.group)

    def gather(  # type: ignore[override]  # a SliceMover's gather, not the VHDD schedule's
        self, buffer: torch.Tensor, layout: Layout, bounds: Sequence[tuple[int, int]], finish
    ) -> None:
        """Write this rank's result slice, then exchange every rank's slice with every peer."""
        lo, hi = bounds[self.rank]
        finish(0, hi - lo, [buffer[lo:hi]])
        peers = [j for j in range(self.world) if j != self.rank]
        self._batch([(buffer[lo:hi], j) for j in peers], [(buffer[bounds[j][0] : bounds[j][1]], j) for j in peers])
