"""The c10d transports: paired sends and receives through ``batch_isend_irecv`` (NCCL pairs a send
with its receive only inside one batch), waits bounded by the group's timeout on gloo and left to
the stream on NCCL (`PointToPointC10d`); and the same with the gather as one NCCL
all-gather into one tensor (`Collectives`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from adasum.transport.base import GatherStep, Level, PointToPoint
from adasum.transport.topology import global_rank

# the collectives into and out of one tensor: torch >= 2.13 names them ``*_single`` (its old names warn)
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def post(
    sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], peer: int, group: dist.ProcessGroup | None
) -> tuple[list, list]:
    """Start sending `sends` to and receiving `recvs` from `peer` (a group rank) as one batch, so
    NCCL pairs them; empty tensors are skipped. Returns the send and the receive works (None for
    a skipped receive)."""
    peer = global_rank(group, peer)
    p2p = [dist.P2POp(dist.isend, t, peer, group) for t in sends if t.numel() > 0]
    p2p += [dist.P2POp(dist.irecv, t, peer, group) for t in recvs if t.numel() > 0]
    works = list(dist.batch_isend_irecv(p2p)) if p2p else []
    if len(works) != len(p2p):
        # NCCL coalesces a batch into one work: every receive then waits for the whole batch
        return works, [works[0] if t.numel() > 0 else None for t in recvs]
    n_send = sum(1 for t in sends if t.numel() > 0)
    send_works, recv_iter = works[:n_send], iter(works[n_send:])
    recv_works = [next(recv_iter) if t.numel() > 0 else None for t in recvs]
    return send_works, recv_works


def wait(works, timeout: timedelta | None = None) -> None:
    """Wait for `works`; with a `timeout` (gloo) each wait gives up after it, None (NCCL) leaves the
    waiting to the stream: an explicit timeout there would block the host until the kernels finish."""
    for work in works:
        if work is not None:
            work.wait() if timeout is None else work.wait(timeout)


class PointToPointC10d(PointToPoint):
    """`PointToPoint` over torch.distributed: gloo and NCCL. `post_fn` is `post` unless a caller
    (a fault test) wraps it."""

    name = "p2p"

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        piece_bytes: int,
        timeout: timedelta | None,
        post_fn: Callable = post,
    ) -> None:
        super().__init__(group, piece_bytes, timeout)
        self._post = post_fn

    def post(self, sends, recvs, peer):
        """One ``batch_isend_irecv`` with `peer`."""
        return self._post(sends, recvs, peer, self.group)

    def wait(self, works):
        """Wait for `works` within the timeout, naming the peer that failed."""
        wait(works, self.timeout)

    def gather(self, buffer: torch.Tensor, steps: Sequence[GatherStep], finals=None) -> None:
        """The gather's levels but the last one, whose swap went out during `combine`."""
        # the last level's swap (steps[0]) went out piece by piece during `combine`
        super().gather(buffer, steps[1:], finals)


class Collectives(PointToPointC10d):
    """NCCL: each level's exchange as whole-half batches (few pieces: NCCL's point-to-point runs
    at full speed on large messages), and the whole gather as one all-gather into one tensor
    (`all_gather_single`). Every rank of the group must be a leader of the tree (a power-of-two world, no
    placement)."""

    name = "collectives"

    def combine(self, level: Level) -> None:
        """Combine the level's `kept` pieces; the gather runs after, as one collective."""
        kept, _ = self.pieces(level)
        for lo, hi in kept:
            level.combine(lo, hi)

    def gather(self, buffer: torch.Tensor, steps: Sequence[GatherStep], finals=None) -> None:
        """`finals[j]`: the slice that group rank j holds at the end of the reduce-scatter."""
        assert finals is not None
        world = len(finals)
        rank = dist.get_rank(self.group)
        width = max(hi - lo for lo, hi in finals)
        lo, hi = finals[rank]
        in_place = all(f == (j * width, (j + 1) * width) for j, f in enumerate(finals)) and buffer.numel() == (
            world * width
        )
        if in_place:  # each slice already sits at its rank's position (2 ranks, an even count)
            all_gather_single(buffer, buffer[lo:hi], group=self.group)
            return
        staged = buffer.new_empty(world * width)
        mine = staged[rank * width : rank * width + width]
        mine[: hi - lo].copy_(buffer[lo:hi])
        all_gather_single(staged, mine, group=self.group)
        for j, (flo, fhi) in enumerate(finals):
            if j != rank and fhi > flo:
                buffer[flo:fhi].copy_(staged[j * width : j * width + fhi - flo])
