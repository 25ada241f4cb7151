"""Adasum across processes on torch.distributed: vector-halving, distance-doubling (VHDD).

Bandwidth-optimal like a ring all-reduce (each rank sends 2 N (P-1)/P elements for a power of
two). For P = 2**k + r ranks, the tree of `adasum.tree` applies: ranks 2i+1 (i < r) first hand
their buffer to rank 2i, which combines the pair; the Q = 2**k group leaders then run:

1. Reduce-scatter, levels d = 1, 2, 4, ... < Q: the partner is ``group XOR d``; the current
   segment is halved, the lower group keeps the first half. Each sends the half it gives up and
   receives the partner's copy of the half it keeps. It then holds, for its slice, the vectors of
   both subtrees and computes per tensor the partial ``<a,b>``, ``|a|^2``, ``|b|^2`` over the
   slice. One all-reduce over the whole group of a float64 ``[Q/2d, 3, T]`` array (each rank
   writes only its block's row) sums the partials of the 2d ranks of each block, so every rank of
   a block gets the full dot products, computes the same coefficients and applies them to its
   slice. Slices ignore tensor boundaries.
2. Gather, levels in reverse: partners swap their slices until every leader has the whole buffer;
   then leaders send it to their folded partner.

Every element of the result is computed by exactly one rank and copied to the others, so all
ranks end with bitwise-identical tensors.

Point-to-point exchanges go through ``batch_isend_irecv`` so NCCL pairs a send with its receive.
On NCCL nothing here synchronises the host (all work is stream-ordered on the current stream);
on gloo the exchanges block.

Faults: on gloo every exchange and small all-reduce waits at most the process group's timeout
(a dead peer is usually noticed at once as a closed connection, a stalled one when the timeout
runs out); a failure is re-raised as `adasum.CollectiveError` naming the step, the level, the peer
and the timeout. On NCCL nothing waits on the host here: its watchdog enforces the timeout (see
docs/faults.md).
"""


from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from adasum.core.layout import Layout
from adasum.core.tree import Tree
from adasum.kernels import combine_from_sums, dot_and_norms
from adasum.transport.c10d import exchange as _exchange
from adasum.transport.c10d import post as _post
from adasum.transport.c10d import wait as _wait
from adasum.transport.groups import failures_named, group_timeout


class _Workspace:
    """Reusable host buffers. Large fresh CPU allocations are returned to the OS on free and
    page-fault anew on every call (about as slow as the data exchange itself), so the CPU path keeps
    its fusion and receive buffers; CUDA's caching allocator already does this on GPUs."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        if like.device.type != "cpu":
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        key = (name, like.dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype)
            self._buffers[key] = buf
        return buf[:numel]

    def clear(self) -> None:
        self._buffers.clear()


_workspace = _Workspace()


def clear_workspace() -> None:
    """Free the host buffers kept between calls (fusion and receive buffers of the CPU path)."""
    _workspace.clear()


# Largest piece, in elements, of a level's exchange: (gloo, NCCL)
_PIECE = (1 << 20, 1 << 23)


@functools.lru_cache(maxsize=256)
def _layout(sizes: tuple[int, ...]) -> Layout:
    # layouts repeat call after call (a model's buckets): keep their offsets, not rebuild them
    return Layout(sizes)


def _split(lo: int, hi: int, count: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into `count` consecutive pieces of near-equal size."""
    bounds = [lo + (hi - lo) * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _halves(lo: int, hi: int, lower: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """(kept, given up) halves of [lo, hi); the lower partner keeps the first half."""
    mid = lo + (hi - lo) // 2
    return ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))


def _fold_(
    buffer: torch.Tensor,
    other: torch.Tensor,
    layout: Layout,
    offset: int,
    partial_sums: torch.Tensor | None,
    row: int,
    group: dist.ProcessGroup | None,
) -> None:
    """buffer := adasum(buffer, other) per tensor, both standing for one worker (the fold).

    `buffer` is elements [offset, offset + numel) of the layout. With `partial_sums` (a zeroed
    float64 [rows, 3, T] array; sliced placements only) the partials are summed over the group in
    `row`, so that slices of one tensor held by other ranks count too.
    """
    first, lengths = layout.overlap(offset, offset + buffer.numel())
    sums = dot_and_norms(buffer, other, lengths)
    if partial_sums is not None:
        partial_sums[row, :, first : first + len(lengths)] = sums
        dist.all_reduce(partial_sums, group=group)
        sums = partial_sums[row, :, first : first + len(lengths)]
    combine_from_sums(buffer, other, sums, 1, 1, lengths, out=buffer)


@dataclass(frozen=True)
class Placement:
    """Where one VHDD tree runs inside a larger group (hierarchical mode uses this).

    `peers` are the group ranks of the tree's workers in tree order (the calling rank is one of
    them); the caller's buffer holds elements [offset, offset + numel) of the layout. Other ranks of
    the group run their own trees on other slices of the same layout at the same time; the
    per-tensor partial sums are all-reduced over the whole group, each rank writing its tree
    block's row, so the slices of one tensor add up to whole-tensor dot products. Every rank of the
    group must call with trees of the same size.
    """

    peers: tuple[int, ...]
    offset: int


def adasum_flat_(
    buffer: torch.Tensor,
    sizes: Sequence[int],
    group: dist.ProcessGroup | None = None,
    placement: Placement | None = None,
) -> None:
    """Adasum of a flat buffer across the group, in place, each of `sizes` a tensor of its own.

    Every rank must pass the same sizes and dtype; nothing is checked here (see `all_reduce`).
    A dead or stalled peer raises `adasum.CollectiveError` within the group's timeout (gloo).
    With a `placement`, the buffer is a slice of the layout and the tree runs over
    ``placement.peers`` only (see `Placement`).
    """
    layout = _layout(tuple(int(n) for n in sizes))
    if placement is None:
        peers: Sequence[int] = range(dist.get_world_size(group))
        offset, rank = 0, dist.get_rank(group)
        if layout.numel != buffer.numel():
            raise ValueError(f"sizes add up to {layout.numel} elements, the buffer has {buffer.numel()}")
    else:
        peers, offset = placement.peers, placement.offset
        rank = peers.index(dist.get_rank(group))
        if offset + buffer.numel() > layout.numel:
            raise ValueError(f"the slice ends at {offset + buffer.numel()}, past the layout's {layout.numel} elements")
    world = len(peers)
    if world == 1:
        return
    tree = Tree(world)
    me = tree.group_of(rank)
    tensors = len(layout.sizes)
    partial_shape = (3, tensors)
    timeout = group_timeout(group)
    wait = None if dist.get_backend(group) == "nccl" else timeout
    levels = tree.levels()
    # a sliced placement sums the fold's partials over the group as well (one extra small all-reduce)
    sliced_fold = placement is not None and tree.folded > 0

    def step(what: str):
        """Name the communication inside the block if it fails (CollectiveError)."""
        return failures_named("adasum.all_reduce", what, group, timeout)

    def level(i: int) -> str:
        return f"level {i + 1} of {len(levels)}"

    def fold_sums() -> torch.Tensor:
        return buffer.new_zeros((tree.folded, *partial_shape), dtype=torch.float64)

    if not tree.is_leader(rank):
        leader = peers[tree.leader(me)]
        with step(f"the fold (sending to rank {leader})"):
            _exchange(buffer, None, leader, group, wait)
            if sliced_fold:
                dist.all_reduce(fold_sums(), group=group)
        for i, d in enumerate(levels):
            blocks = tree.groups // (2 * d)
            with step(f"the dot-product all-reduce at {level(i)}"):
                dist.all_reduce(buffer.new_zeros((blocks, *partial_shape), dtype=torch.float64), group=group)
        with step(f"the fold (receiving the result from rank {leader})"):
            _exchange(None, buffer, leader, group, wait)
        return

    follower = None if tree.follower(me) is None else peers[tree.follower(me)]
    if follower is not None:
        received = _workspace.get("recv", buffer.numel(), buffer)
        with step(f"the fold (receiving from rank {follower})"):
            _exchange(None, received, follower, group, wait)
        with step("the fold's dot-product all-reduce"):
            _fold_(buffer, received, layout, offset, fold_sums() if sliced_fold else None, me, group)
        del received
    elif sliced_fold:
        dist.all_reduce(fold_sums(), group=group)

    # Each level's exchange is cut into pieces, each its own send/receive batch, so the math on one
    # piece overlaps the transfer of the next (gloo moves data on its own threads; NCCL on its
    # stream, which the current stream waits on per piece). Both partners cut the same parent
    # segment into the same number of pieces, so their batches pair up.
    piece = _PIECE[dist.get_backend(group) == "nccl"]
    segments = [(0, buffer.numel())]
    for i, d in enumerate(levels):
        lower = (me & d) == 0
        peer = peers[tree.leader(me ^ d)]
        parent = segments[-1]
        (klo, khi), (glo, ghi) = _halves(*parent, lower)
        count = max(1, -(-(parent[1] - parent[0]) // (2 * piece)))
        kept, given = _split(klo, khi, count), _split(glo, ghi, count)
        theirs = _workspace.get("recv", khi - klo, buffer)
        exchange, gather = (
            f"the {phase} exchange at {level(i)} with rank {peer}" for phase in ("reduce-scatter", "gather")
        )
        with step(exchange):
            posted = [
                _post([buffer[g0:g1]], [theirs[k0 - klo : k1 - klo]], peer, group)
                for (k0, k1), (g0, g1) in zip(kept, given)
            ]

        def pair(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
            mine, other = buffer[lo:hi], theirs[lo - klo : hi - klo]
            return (mine, other) if lower else (other, mine)

        block = me // (2 * d)
        sums = buffer.new_zeros((tree.groups // (2 * d), *partial_shape), dtype=torch.float64)
        for (lo, hi), (_, recv_works) in zip(kept, posted):
            with step(exchange):
                _wait(recv_works, wait)
            first, lengths = layout.overlap(offset + lo, offset + hi)
            if lengths:
                dot_and_norms(*pair(lo, hi), lengths, out=sums[block, :, first : first + len(lengths)])
        with step(exchange):
            _wait([w for send_works, _ in posted for w in send_works], wait)
        with step(f"the dot-product all-reduce at {level(i)}"):
            dist.all_reduce(sums, group=group)

        base = block * 2 * d
        workers_a, workers_b = tree.count(base, d), tree.count(base + d, d)
        # The last level's pieces go to the partner as soon as they are computed: the gather's
        # first step, overlapped with the math of the next piece.
        last = d == levels[-1]
        gathers = []
        for (lo, hi), (g0, g1) in zip(kept, given):
            first, lengths = layout.overlap(offset + lo, offset + hi)
            if lengths:
                combine_from_sums(
                    *pair(lo, hi),
                    sums[block, :, first : first + len(lengths)],
                    workers_a,
                    workers_b,
                    lengths,
                    out=buffer[lo:hi],
                )
            if last:
                with step(gather):
                    gathers.append(_post([buffer[lo:hi]], [buffer[g0:g1]], peer, group))
        with step(gather):
            _wait([w for sends, recvs in gathers for w in sends + recvs], wait)
        segments.append((klo, khi))
    # the last level's gather is done; the reverse levels below complete the rest
    segments = segments[:-1]

    for i in reversed(range(len(levels) - 1)):
        d = levels[i]
        lower = (me & d) == 0
        kept, given = _halves(*segments[-2], lower)
        assert kept == segments[-1]
        peer = peers[tree.leader(me ^ d)]
        with step(f"the gather exchange at {level(i)} with rank {peer}"):
            _exchange(buffer[kept[0] : kept[1]], buffer[given[0] : given[1]], peer, group, wait)
        segments.pop()

    if follower is not None:
        with step(f"the fold (sending the result to rank {follower})"):
            _exchange(buffer, None, follower, group, wait)
