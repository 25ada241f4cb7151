"""The transport protocol: what the VHDD schedule (`adasum.collectives.vhdd`) asks of whatever
moves bytes between ranks. The schedule decides *what* goes where (fold, levels, gather); a
transport decides *how*: point-to-point batches, NCCL collectives, or direct loads and stores
into peers' symmetric memory.

A transport answers five calls:

* ``exchange(send, recv, peer)``: a paired send and receive with one peer, completed (the fold).
* ``exchange_and_dot(level)``: one reduce-scatter level's exchange: the partner's copy of the
  kept slice lands in ``level.theirs`` and the per-tensor partial sums of the kept pair are added
  into ``level.sums`` (a transport may compute them while the bytes arrive).
* ``all_reduce_sums(sums)``: the small float64 SUM all-reduce of the partial sums.
* ``combine(level)``: the kept slice := the combination of both copies by the schedule's combine op
  (``level.op``: Adasum's pair by default), with the level's sums; on the last level the partner's combined
  slice also lands in the given slice (the gather's first step).
* ``gather(buffer, steps)``: the rest of the gather, in reverse level order.

Two optional parts: ``fusion_buffer(numel, like)`` names where `adasum.all_reduce` should fuse a
list (the symmetric transport's own buffer), and a transport with ``scattered = True`` takes an
`adasum.core.layout.Scattered` buffer, a list of tensors read and written where they lie.

`PointToPoint` builds every step from two primitives, ``post`` (start a paired batch) and
``wait``; subclasses replace single steps (`adasum.transport.c10d.Collectives` the gather,
`adasum.transport.symmetric.SymmetricMemory` every data step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from adasum.kernels import dot_and_norms


class PairRule(Protocol):
    """What a level asks of the schedule's combine op (`adasum.collectives.slices.CombineOp`)."""

    def pair(self, a, b, sums: torch.Tensor, workers_a: int, workers_b: int, lengths: Sequence[int], out,
             *more_outs) -> None:
        """``out = c_a a + c_b b`` per segment, the op's coefficients from the pair's [3, T] sums and worker
        counts; `more_outs` get the same values."""


@dataclass
class Level:
    """One reduce-scatter level as a transport sees it (positions are indices into `buffer`). A transport combines
    through `combine` (or, writing more outputs, ``op.pair``): the coefficients are the op's, never its own."""

    buffer: torch.Tensor
    kept: tuple[int, int]  # the slice this rank keeps and combines
    given: tuple[int, int]  # the slice the partner keeps; this rank sends it
    peer: int  # the partner's group rank
    lower: bool  # this rank's copy is the "a" side (the lower subtree)
    theirs: torch.Tensor  # receive space for the partner's copy of `kept` (kept[1] - kept[0] elements)
    sums: torch.Tensor  # the [3, T] float64 row of this rank's block (zero on entry)
    overlap: Callable[[int, int], tuple[int, list[int]]]  # buffer slice -> (first tensor, lengths inside)
    workers_a: int
    workers_b: int
    last: bool  # the last level: the partner's combined slice must land in `given` too
    op: PairRule  # the combine rule (`adasum.collectives.slices.CombineOp`; Adasum's tree by default)

    def pair(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) over buffer positions [lo, hi) of `kept`: this rank's copy and the partner's."""
        mine, other = self.buffer[lo:hi], self.theirs[lo - self.kept[0] : hi - self.kept[0]]
        return (mine, other) if self.lower else (other, mine)

    def dot(self, lo: int, hi: int) -> None:
        """Add the three sums of buffer positions [lo, hi) of `kept` into `sums`."""
        first, lengths = self.overlap(lo, hi)
        if lengths:
            dot_and_norms(*self.pair(lo, hi), lengths, out=self.sums[:, first : first + len(lengths)])

    def combine(self, lo: int, hi: int) -> None:
        """Combine buffer positions [lo, hi) of `kept` in place by the op (`sums` complete)."""
        first, lengths = self.overlap(lo, hi)
        if lengths:
            sums = self.sums[:, first : first + len(lengths)]
            self.op.pair(*self.pair(lo, hi), sums, self.workers_a, self.workers_b, lengths, self.buffer[lo:hi])


@dataclass(frozen=True)
class GatherStep:
    """One reverse level of the gather: swap `kept` (sent) for `given` (received) with `peer`."""

    kept: tuple[int, int]
    given: tuple[int, int]
    peer: int


CUT_ALIGN = 16
"""Elements: halves and pipeline pieces are cut at multiples of this where they can be (64 bytes of fp32, the
widest 16-byte vector of every dtype), so that the kernels' vector loads survive the cut."""


def aligned_cut(after: int, cut: int) -> int:
    """`cut` rounded down to a multiple of `CUT_ALIGN`, unless that would not leave it past `after`.

    >>> aligned_cut(0, 50), aligned_cut(48, 50)
    (48, 50)
    """
    rounded = cut - cut % CUT_ALIGN
    return rounded if rounded > after else cut


def split(lo: int, hi: int, count: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into `count` consecutive pieces of near-equal size, each inner cut aligned
    (`aligned_cut`) past the previous one.

    >>> split(0, 100, 3)
    [(0, 32), (32, 64), (64, 100)]
    """
    bounds = [lo]
    for i in range(1, count):
        bounds.append(aligned_cut(bounds[-1], lo + (hi - lo) * i // count))
    bounds.append(hi)
    return list(zip(bounds[:-1], bounds[1:]))


class Transport:
    """The protocol (see the module doc). `group` is the process group the schedule runs over."""

    name = "transport"
    scattered = False  # takes an `adasum.core.layout.Scattered` buffer (a list of tensors, no fusion copy)

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None, peer: int) -> None:
        """Send `send` to and receive `recv` from `peer` (either may be None), returning when both are done."""
        raise NotImplementedError

    def exchange_and_dot(self, level: Level) -> None:
        """Swap the level's halves with the partner and add the dot products of `kept` into ``level.sums``."""
        raise NotImplementedError

    def all_reduce_sums(self, sums: torch.Tensor) -> None:
        """SUM all-reduce of the level's small float64 sums over the group."""
        dist.all_reduce(sums, group=self.group)

    def combine(self, level: Level) -> None:
        """Combine the level's `kept` slice in place (on the last level, send it to the partner too)."""
        raise NotImplementedError

    def gather(
        self, buffer: torch.Tensor, steps: Sequence[GatherStep], finals: Sequence[tuple[int, int]] | None
    ) -> None:
        """`steps`: every level in reverse (the last level first); `finals`: the slice each group rank
        holds after the reduce-scatter, when every rank is a leader (else None)."""
        for step in steps:
            self.exchange(buffer[step.kept[0] : step.kept[1]], buffer[step.given[0] : step.given[1]], step.peer)

    def fusion_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor | None:
        """Where `adasum.all_reduce` should fuse a list of `numel` elements like `like` (None: anywhere)."""
        return None

    @property
    def in_place(self) -> Any:
        """The mover that runs a single tensor larger than a round in place
        (`adasum.collectives.slices.InPlaceMover`), or None (such a tensor is a round of its own)."""
        return None

    def round_elements(self, element_size: int) -> int | None:
        """The most elements one run of the schedule should hold, so that the transport's buffers stay within
        the memory budget (`adasum.settings`, ``memory_mb``): a larger layout runs in rounds of whole tensors
        (None: no limit)."""
        return None

    def receive_space(self, kept: tuple[int, int], given: tuple[int, int], like) -> torch.Tensor | None:
        """Where the partner's copy of the `kept` slice of a level lands (`Level.theirs`), for a buffer like
        `like` cut into `kept` and `given` (None: anywhere, the schedule's own workspace)."""
        return None


class PointToPoint(Transport):
    """Every step from paired point-to-point batches (`post`, `wait`), each level's exchange cut
    into pieces of at most `piece_bytes` so the math on one piece overlaps the transfer of the
    next. Subclasses provide `post` and `wait`."""

    name = "p2p"

    def __init__(self, group: dist.ProcessGroup | None, piece_bytes: int, timeout: timedelta | None) -> None:
        super().__init__(group)
        self.piece_bytes = piece_bytes
        self.timeout = timeout

    def post(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], peer: int) -> tuple[list, list]:
        """Start the sends and receives with `peer`: (send works, receive works)."""
        raise NotImplementedError

    def wait(self, works: Sequence) -> None:
        """Wait for `works` (within the transport's timeout)."""
        raise NotImplementedError

    def exchange(self, send, recv, peer):
        """One batch each way with `peer`, waited for."""
        sends, recvs = self.post([] if send is None else [send], [] if recv is None else [recv], peer)
        self.wait(sends + recvs)

    def pieces(self, level: Level) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The level's `kept` and `given` slices cut into the same number of pieces of at most `piece_bytes`."""
        # Both partners cut the same parent segment into the same number of pieces, so their batches pair up.
        (klo, khi), (glo, ghi) = level.kept, level.given
        size = level.buffer.element_size() * max(khi - klo, ghi - glo)
        count = max(1, -(-size // self.piece_bytes))
        return split(klo, khi, count), split(glo, ghi, count)

    def exchange_and_dot(self, level):
        """Piece by piece: the dot products of a received piece while the next one moves."""
        kept, given = self.pieces(level)
        klo = level.kept[0]
        posted = [
            self.post([level.buffer[g0:g1]], [level.theirs[k0 - klo : k1 - klo]], level.peer)
            for (k0, k1), (g0, g1) in zip(kept, given)
        ]
        for (lo, hi), (_, recv_works) in zip(kept, posted):
            self.wait(recv_works)
            level.dot(lo, hi)
        self.wait([w for send_works, _ in posted for w in send_works])

    def combine(self, level):
        """Piece by piece; on the last level each combined piece goes to the partner while the next is combined."""
        kept, given = self.pieces(level)
        gathers = []
        for (lo, hi), (g0, g1) in zip(kept, given):
            level.combine(lo, hi)
            if level.last:  # the gather's first step, overlapped with the math of the next piece
                gathers.append(self.post([level.buffer[lo:hi]], [level.buffer[g0:g1]], level.peer))
        self.wait([w for sends, recvs in gathers for w in sends + recvs])
