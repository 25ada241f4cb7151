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
   a block gets the full dot products, asks the combine op for the same coefficients and applies
   them to its slice. Slices ignore tensor boundaries.
2. Gather, levels in reverse: partners swap their slices until every leader has the whole buffer;
   then leaders send it to their folded partner.

Every element of the result is computed by exactly one rank and copied to the others, so all
ranks end with bitwise-identical tensors.

The coefficients are the combine op's (`adasum.collectives.slices.CombineOp`, its level form: ``op.pair`` with
the level's sums and worker counts, at the fold and at every level): Adasum's tree (`AdasumTree`, its fused
kernel) unless the caller hands another rule (`adasum_flat_`'s `op`).

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
from typing import cast

import torch
import torch.distributed as dist

from adasum.collectives.slices import (
    AdasumTree,
    CombineOp,
    SliceMover,
    adasum_in_place_,
    adasum_slices_,
    round_tensor,
    rounds,
    runs_in_place,
)
from adasum.core import statistics
from adasum.core.layout import Layout, Scattered
from adasum.core.tree import Tree
from adasum.kernels import dot_and_norms
from adasum.settings import current
from adasum.transport import one_shot, select
from adasum.transport.base import GatherStep, Level, Transport, aligned_cut
from adasum.transport.communicator import communicator
from adasum.transport.errors import failures_named
from adasum.transport.registry import serves
from adasum.transport.topology import Topology


@functools.lru_cache(maxsize=256)
def _layout(sizes: tuple[int, ...]) -> Layout:
    # layouts repeat call after call (a model's buckets): keep their offsets, not rebuild them
    return Layout(sizes)


def _halves(lo: int, hi: int, lower: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """(kept, given up) halves of [lo, hi); the lower partner keeps the first half. The cut is aligned
    (`adasum.transport.base.aligned_cut`: a multiple of 16 elements where the first half stays non-empty), so
    that the halves of a buffer whose tensors have such sizes keep the GPU kernels' vector loads."""
    mid = aligned_cut(lo, lo + (hi - lo) // 2)
    return ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))


def _record_level(sums: torch.Tensor, tree: Tree, d: int) -> None:
    """Record level `d`'s sums, summed over the group, where statistics are recorded (`adasum.core.statistics`)."""
    if statistics.active():
        statistics.record_level(sums, [(tree.count(b, d), tree.count(b + d, d)) for b in range(0, tree.groups, 2 * d)])


def _record_fold(sums: torch.Tensor) -> None:
    """Record the fold's sums (pairs of single workers), summed over the group (sliced placements only)."""
    if statistics.active():
        statistics.record_level(sums, [(1, 1)] * len(sums))


def _fold_(
    buffer: torch.Tensor,
    other: torch.Tensor,
    layout: Layout,
    offset: int,
    partial_sums: torch.Tensor | None,
    row: int,
    group: dist.ProcessGroup | None,
    op: CombineOp,
) -> None:
    """Fold in place: buffer := the op's pair of (buffer, other) per tensor, both standing for one worker.

    `buffer` is elements [offset, offset + numel) of the layout. With `partial_sums` (a zeroed
    float64 [rows, 3, T] array; sliced placements only) the partials are summed over the group in
    `row`, so that slices of one tensor held by other ranks count too.
    """
    first, lengths = layout.overlap(offset, offset + buffer.numel())
    sums = dot_and_norms(buffer, other, lengths)
    if partial_sums is not None:
        partial_sums[row, :, first : first + len(lengths)] = sums
        dist.all_reduce(partial_sums, group=group)
        _record_fold(partial_sums)
        sums = partial_sums[row, :, first : first + len(lengths)]
    op.pair(buffer, other, sums, 1, 1, lengths, buffer)


Placement = Topology.placement
"""A tree over `peers` on the slice of the layout at `offset` (`adasum.transport.topology.Topology.placement`)."""


def transport_for(
    group: dist.ProcessGroup | None, name: str | None, whole_group: bool, placed: bool = False,
    nbytes: int | None = None,
) -> Transport:
    """The transport `adasum.transport.select` picks (for a buffer of `nbytes` bytes, if given: a small one may run
    one-shot), built once per group (its `Communicator`) and choice: the arguments and the settings the choice
    reads (``piece_elements``, ``one_shot_bytes`` through `one_shot`, the default's ``transport_first``). A call's
    plan chooses its movers here (`adasum.collectives.api.Schedule`), once per layout and configuration; the
    schedules below it are handed them."""
    settings = current()
    pieces = settings.piece_elements
    small = name is None and not placed and one_shot(dist.get_world_size(group), nbytes)
    first = settings.transport_first if name is None else ""
    return communicator(group).transport(
        (name, whole_group, placed, pieces, small, first),
        lambda: select(group, name, whole_group=whole_group, placed=placed, piece_elements=pieces,
                       nbytes=nbytes if small else None),
    )


def final_slices(numel: int, world: int, levels: Sequence[int]) -> list[tuple[int, int]]:
    """The slice each of `world` leaders holds after the reduce-scatter (no fold)."""
    out = []
    for me in range(world):
        segment = (0, numel)
        for d in levels:
            segment = _halves(*segment, (me & d) == 0)[0]
        out.append(segment)
    return out


def adasum_flat_(
    buffer: torch.Tensor | Scattered,
    sizes: Sequence[int],
    group: dist.ProcessGroup | None = None,
    placement: Topology | None = None,
    *,
    transport: str | Transport | None = None,
    op: CombineOp | None = None,
) -> None:
    """Adasum of a flat buffer across the group, in place, each of `sizes` a tensor of its own.
    `buffer` may be a `Scattered` list of tensors where the transport takes one (``transport.scattered``).

    Every rank must pass the same sizes and dtype; nothing is checked here (see `all_reduce`).
    A dead or stalled peer raises `adasum.CollectiveError` within the group's timeout (gloo).
    With a `placement` (a `Topology`: hierarchical mode's, FSDP's grid), the buffer is the slice of the layout
    at ``placement.offset`` and the tree runs over ``placement.peers`` only: `peers` are the group ranks of the
    tree's workers in tree order (the calling rank is one of them); other ranks of the group run their own trees on
    other slices of the same layout at the same time; the per-tensor partial sums are all-reduced over the whole
    group, each rank writing its tree block's row, so the slices of one tensor add up to whole-tensor dot
    products. Every rank of the group must call with trees of the same size. `transport` is the mover: the one a
    call's plan chose (`adasum.collectives.api.Schedule.mover`: every entry point passes it, so nothing is chosen
    here), or for a direct call a name ("p2p", "collectives", "symmetric") or None, picked as a plan picks it
    (`transport_for`: the fastest the group and the placement support, see `adasum.transport.select`).
    `op`: the combine rule (`adasum.collectives.slices.CombineOp`; None: Adasum's tree), not `coupled`; the VHDD
    schedule asks its level form (``op.pair``, so the op must be `pairwise`), the slice-parallel one its Gram or
    level form. The same op object call after call keeps a captured CUDA graph replaying (the op is part of its
    key).
    """
    layout = _layout(tuple(int(n) for n in sizes))
    if placement is None:
        peers: Sequence[int] = range(dist.get_world_size(group))
        offset, rank = 0, dist.get_rank(group)
        if layout.numel != buffer.numel():
            raise ValueError(
                f"sizes add up to {layout.numel} elements, the buffer has {buffer.numel()}; pass the sizes of the "
                "tensors the buffer holds, end to end"
            )
    else:
        peers, offset = placement.peers, placement.offset
        rank = peers.index(dist.get_rank(group))
        if offset + buffer.numel() > layout.numel:
            raise ValueError(
                f"the slice ends at {offset + buffer.numel()}, past the layout's {layout.numel} elements; pass a "
                "placement whose offset plus the buffer's length fits within sizes"
            )
    world = len(peers)
    if world == 1:
        return
    if op is not None and op.coupled:
        raise ValueError(
            f"{type(op).__name__} couples tensors (coupled): it runs on combine_slices_, not here; call "
            "adasum.collectives.slices.combine_slices_ with it instead"
        )
    tree = Tree(world)
    if not isinstance(transport, Transport):
        transport = transport_for(group, transport, placement is None and tree.folded == 0, placement is not None,
                                  buffer.numel() * buffer.element_size())
    slice_parallel = serves(transport) == "slices"  # its row of the movers' table (`adasum.transport.registry`)
    if slice_parallel and placement is not None:
        raise ValueError(
            f"transport={transport.name!r} runs the tree over the whole group (no hierarchical placement); pass "
            "another transport (or None) with a placement"
        )
    if isinstance(buffer, Scattered) and not (
        transport.scattered and (tree.folded == 0 or slice_parallel) and placement is None
    ):
        raise ValueError(
            f"the {transport.name} transport takes flat buffers only, not a Scattered list of tensors; pass a flat "
            "buffer (the tensors end to end), or a transport whose .scattered is True"
        )
    if op is not None and not slice_parallel and not op.pairwise:
        raise ValueError(f"the VHDD schedule ({transport.name}) combines pair by pair: {type(op).__name__} has no "
                         "level form (pair_coefficients); run it on the slice-parallel movers (transport='slices')")
    pairs = AdasumTree(tree) if op is None else op  # the VHDD schedule's combine rule
    if isinstance(buffer, Scattered) and buffer.layout.sizes != layout.sizes:
        # the kernels address a Scattered slice tile by tile of its tensors: each segment must be one tensor
        raise ValueError(
            "a Scattered buffer's tensors must be the segments of `sizes`, one tensor per segment; pass "
            "sizes=[t.numel() for t in its tensors]"
        )

    def run() -> None:
        if slice_parallel:
            mover = cast(SliceMover, transport)  # a mover of the slice-parallel schedule
            with failures_named("adasum.all_reduce", "the slice-parallel schedule", group, mover.timeout):
                adasum_slices_(buffer, layout, mover, op=op)
            return
        if placement is not None:
            run_schedule(cast(torch.Tensor, buffer), layout, group, peers, offset, rank, tree, transport, sliced=True,
                         op=pairs)
            return
        # rounds of whole tensors within the transport's memory budget: each an Adasum of its own, since the
        # coefficients are per tensor; a tensor larger than a round runs in place where the transport has an
        # in-place mover (`adasum_in_place_`), else it is a round of its own
        capacity = transport.round_elements(buffer.element_size())
        in_place = transport.in_place
        for first, end, lo, hi in rounds(layout.sizes, capacity):
            if hi <= lo:
                continue
            if runs_in_place(in_place, capacity, lo, hi):
                adasum_in_place_(round_tensor(buffer, first, end, lo, hi), in_place, op=op, column=first,
                                 sizes=None if op is None else layout.sizes[first:end])
                continue
            if (lo, hi) == (0, buffer.numel()):
                part, part_layout = buffer, layout
            else:
                part_layout = _layout(layout.sizes[first:end])
                part = Scattered(buffer.tensors[first:end]) if isinstance(buffer, Scattered) else buffer[lo:hi]
            # a Scattered list stands in for a flat buffer where the transport reads lists in place (checked above)
            run_schedule(cast(torch.Tensor, part), part_layout, group, peers, 0, rank, tree, transport, sliced=False,
                         op=pairs)

    if buffer.device.type != "cuda":
        run()
        return
    # the schedule's plan (transport, dtype, layout, placement) and where the buffer lies; inside a captured list
    # call or hook this runs eagerly into that capture (`Communicator.capture`)
    schedule = ("adasum_flat_", transport.name, buffer.dtype, buffer.numel(), layout.sizes, placement, op)
    where = buffer.key if isinstance(buffer, Scattered) else buffer.data_ptr()
    communicator(group).capture(schedule, where, run, buffer.device)


def run_schedule(
    buffer: torch.Tensor,
    layout: Layout,
    group: dist.ProcessGroup | None,
    peers: Sequence[int],
    offset: int,
    rank: int,
    tree: Tree,
    transport: Transport,
    sliced: bool,
    op: CombineOp | None = None,
) -> None:
    """The VHDD schedule (module doc) on `transport`: fold, levels, gather. Its arguments, in one place (the
    transport's protocol, `adasum.transport.base`, and `adasum_flat_` refer here):

    * `buffer`: this rank's flat copy (or a `Scattered` list where the transport reads lists in place), combined in
      place; every rank's is the same length.
    * `layout`: the tensors' sizes end to end (`adasum.core.layout.Layout`); each tensor gets its own coefficients,
      so the float64 sums are per tensor ([3, T] per block of a level).
    * `group`: the process group every rank of the schedule is in; the level sums are all-reduced over all of it.
    * `peers`: the group ranks of the tree's workers in tree order (every rank of the group, or a placement's
      peers: `adasum.transport.topology.Topology`); `rank` is this rank's index among them.
    * `offset`: where `buffer` starts in `layout` (0 unless a placement runs the tree on a slice of it).
    * `tree`: the tree over ``len(peers)`` workers (`adasum.core.tree.Tree`: the fold of the ranks past the largest
      power of two, then the levels).
    * `transport`: how the bytes move (`adasum.transport.base.Transport`: exchange, exchange_and_dot,
      all_reduce_sums, combine, gather).
    * `sliced`: the buffer is one slice of a tensor layout that other trees of the group share (a placement): the
      fold's sums are all-reduced over the group too.
    * `op`: the combine rule (`adasum.collectives.slices.CombineOp`, a `pairwise` one; None: Adasum's tree,
      `AdasumTree`, served by the fused combine kernel). The schedule asks it for each pair's combination from the
      pair's complete ``[3, T]`` sums (``op.pair(a, b, sums, workers_a, workers_b, lengths, out, ...)``: at the
      fold with one worker a side, at level d with the workers of the two subtrees, `adasum.core.tree.Tree.count`),
      once per piece of the slice this rank keeps; ranks of one block ask with the same sums."""
    op = AdasumTree(tree) if op is None else op
    me = tree.group_of(rank)
    partial_shape = (3, len(layout.sizes))
    timeout = getattr(transport, "timeout", None)
    levels = tree.levels()
    # a sliced placement sums the fold's partials over the group as well (one extra small all-reduce)
    sliced_fold = sliced and tree.folded > 0

    def step(what: str):
        """Name the communication inside the block if it fails (CollectiveError)."""
        return failures_named("adasum.all_reduce", what, group, timeout)

    def level_name(i: int) -> str:
        return f"level {i + 1} of {len(levels)}"

    def fold_sums() -> torch.Tensor:
        return buffer.new_zeros((tree.folded, *partial_shape), dtype=torch.float64)

    if not tree.is_leader(rank):
        leader = peers[tree.leader(me)]
        with step(f"the fold (sending to rank {leader})"):
            transport.exchange(buffer, None, leader)
            if sliced_fold:
                transport.all_reduce_sums(sums := fold_sums())
                _record_fold(sums)
        for i, d in enumerate(levels):
            blocks = tree.groups // (2 * d)
            with step(f"the dot-product all-reduce at {level_name(i)}"):
                transport.all_reduce_sums(sums := buffer.new_zeros((blocks, *partial_shape), dtype=torch.float64))
            _record_level(sums, tree, d)
        with step(f"the fold (receiving the result from rank {leader})"):
            transport.exchange(None, buffer, leader)
        return

    workspace = communicator(group).workspace
    folded = tree.follower(me)
    follower = None if folded is None else peers[folded]
    if follower is not None:
        received = workspace.get("recv", buffer.numel(), buffer)
        with step(f"the fold (receiving from rank {follower})"):
            transport.exchange(None, received, follower)
        with step("the fold's dot-product all-reduce"):
            _fold_(buffer, received, layout, offset, fold_sums() if sliced_fold else None, me, group, op)
        del received
    elif sliced_fold:
        transport.all_reduce_sums(sums := fold_sums())
        _record_fold(sums)

    def overlap(lo: int, hi: int) -> tuple[int, list[int]]:
        return layout.overlap(offset + lo, offset + hi)

    segments = [(0, buffer.numel())]
    gather_steps = []
    for i, d in enumerate(levels):
        lower = (me & d) == 0
        peer = peers[tree.leader(me ^ d)]
        kept, given = _halves(*segments[-1], lower)
        block = me // (2 * d)
        sums = buffer.new_zeros((tree.groups // (2 * d), *partial_shape), dtype=torch.float64)
        base = block * 2 * d
        theirs = transport.receive_space(kept, given, buffer)
        level = Level(
            buffer=buffer, kept=kept, given=given, peer=peer, lower=lower,
            theirs=workspace.get("recv", kept[1] - kept[0], buffer) if theirs is None else theirs,
            sums=sums[block], overlap=overlap,
            workers_a=tree.count(base, d), workers_b=tree.count(base + d, d), last=d == levels[-1], op=op,
        )
        with step(f"the reduce-scatter exchange at {level_name(i)} with rank {peer}"):
            transport.exchange_and_dot(level)
        with step(f"the dot-product all-reduce at {level_name(i)}"):
            transport.all_reduce_sums(sums)
        _record_level(sums, tree, d)
        with step(f"the gather exchange at {level_name(i)} with rank {peer}" if level.last else "the combination"):
            transport.combine(level)
        gather_steps.append(GatherStep(kept, given, peer))
        segments.append(kept)

    steps = gather_steps[::-1]
    where = f"at {level_name(0)}" if len(levels) == 1 else f"from {level_name(len(levels) - 1)} to level 1"
    with step(f"the gather exchange {where}"):
        finals = final_slices(buffer.numel(), tree.groups, levels) if tree.folded == 0 else None
        transport.gather(buffer, steps, finals)

    if follower is not None:
        with step(f"the fold (sending the result to rank {follower})"):
            transport.exchange(buffer, None, follower)
