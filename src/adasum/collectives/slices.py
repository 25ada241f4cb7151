"""Slice-parallel Adasum: the tree of `adasum.core.tree` with the traffic of a two-shot all-reduce
(SPEC 1.4b), for any number of ranks.

Per round (a run of whole tensors of the layout, at most what the mover's buffers hold):

1. The round is cut into P aligned slices; rank r owns slice r. The mover brings every rank's
   copy of slice r to rank r (`SliceMover.scatter`: a reduce-scatter without the reduction,
   ``N (P-1)/P`` elements in per rank).
2. Rank r runs the whole tree on its slice (`adasum.core.gram`): one pass adds its slice's share of every
   tensor's Gram matrix of the P copies (``<x_i, x_j>``, float64) into one ``[P, P, T]`` array, one small SUM
   all-reduce over the group gives every rank the whole tensors' Gram matrices, every rank computes from them
   the tree's coefficients level by level (the fold of pairs ``(2i, 2i+1)`` first when P is not a power of
   two, then the power-of-two levels) and so the root's weight of each copy, and one pass writes its slice of
   ``sum_j w_j x_j``. Level by level (float64 tensors and two ranks, `by_gram`) the tree takes a pass of
   sums, an all-reduce and a combination pass per level.
3. The mover hands slice r's result to every rank (`SliceMover.gather`).

**One-shot** (a mover with ``whole``): every rank's slice is the whole round. The scatter brings every rank's
whole copy to every rank (``N (P-1)`` elements in per rank), each rank runs the whole tree itself from sums that
need no all-reduce, and the gather only writes the result where it belongs. Ranks end bitwise equal because each
runs the same kernels on the same rows, laid out alike in every rank's buffer. It moves more bytes than the two
shots above P = 2 (as many at P = 2) but takes no all-reduce and no second exchange: the default for small
buffers where measured faster (`adasum.transport.one_shot`).

**The combine rule is an op** (`CombineOp`): the schedule asks it for the weights from the Gram sums (or, in its
level form, combines each pair from the level's sums; the VHDD schedule, `adasum.collectives.vhdd`, asks the same
op's level form). Adasum's tree is `AdasumTree`, the default; AdaCons' consensus is another
(`adasum.reducers.adacons.Consensus`, through `combine_slices_`). An op whose weights couple
the tensors of a call (AdaCons' whole-model form) runs a call of several rounds in two sweeps: the Gram sums round
by round, then, with the call's weights, the weighted sums round by round (`combine_slices_`).

A mover may keep rounds in flight (`SliceMover.ahead`; the symmetric one keeps two, in two halves of its
buffer): the schedule then scatters round k + 1 before it runs round k's tree and gather, so the next round's
moves run beside this round's math. A layout that fits one round of the whole buffer runs in one.

The result equals the flat tree's (`adasum.reduce`) in exact arithmetic; numerically, the inner nodes are
never rounded to the dtype (the result is rounded once, where `adasum.reduce` rounds every level's). Each
element is computed by one rank and copied, so ranks end bitwise equal. Rounds are independent
Adasum problems because coefficients are per tensor: a round never cuts a tensor.

A single tensor larger than a round runs **in place** (`adasum_in_place_`, on the mover's
`in_place`): rank r's copies of the other slices go to their owners piece by piece, and the
owners' copies of slice r land in r's own buffer where those copies were, through a ring of
pieces of fixed size; the tree runs there (the last slice's few extra elements in small spare
rows: `Part`), and the result reaches every rank the same way. So no buffer is ever sized to a
tensor: the movers keep their rounds' rows and the ring, both within the memory budget
(`adasum.transport.slices.buffer_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Protocol, cast

import torch

from adasum.core import statistics
from adasum.core.gram import weights as gram_weights
from adasum.core.layout import Layout, Scattered
from adasum.core.operator import pair_coefficients
from adasum.core.tree import Tree, level_pairs
from adasum.kernels import combine_from_sums, combine_with, dot_and_norms, gram, tree_weights, weighted_sum
from adasum.transport.base import split

Piece = Callable[[int, int], None]
"""Work on positions [p0, p1) of this rank's slice (the schedule's callbacks to the mover)."""

Part = tuple[int, Sequence[torch.Tensor]]
"""Where every rank's copy of a run of this rank's slice lies: (the run's first position in the slice, one flat
tensor per rank, in rank order, all as long as the run). A mover's rows are one part, or (the in-place movers,
module doc) a part in the user's buffer and a short one in the mover's spare rows."""


class SliceMover(Protocol):
    """How the bytes of the slice-parallel schedule move (`adasum.transport.slices.C10dSlices`,
    `adasum.transport.symmetric.SymmetricSlices`). A mover may cut the slices into pieces and overlap the
    callbacks' math on one piece with the transfer of the next. `in_place`: the mover that runs a single tensor
    larger than this mover's rounds (`InPlaceMover`), or None (such a tensor makes a round of its own)."""

    name: str
    scattered: bool
    world: int
    rank: int
    timeout: timedelta | None  # how long a transfer may wait for a peer (None: the group's)
    in_place: InPlaceMover | None
    ahead: int  # rounds in flight: with 2, round k + 1 is scattered before round k's tree runs
    whole: bool  # one-shot (module doc): every rank's slice is the whole round

    def round_elements(self, element_size: int, ahead: int = 1) -> int | None:
        """The most elements one round should hold with `ahead` rounds in flight (None: no limit)."""

    def reserve(self, row: int, like, ahead: int = 1) -> None:
        """Room for rows of `row` elements like `like` for `ahead` rounds in flight: the largest round of a layout,
        before its first round."""

    def rows(self, buffer, bounds: Sequence[tuple[int, int]]) -> list[Part]:
        """Where every rank's copy of this rank's slice of the next round lands (scratch): parts covering the slice
        in order. Rounds are gathered in the order they were given rows."""

    def scatter(self, buffer, bounds: Sequence[tuple[int, int]], landed: Piece) -> Callable[[], None] | None:
        """Fill the latest `rows`; ``landed(p0, p1)`` runs once a piece of every row is complete (the pieces cover
        the slice, each inside one part). May return a join, which the schedule calls before the round's tree reads
        the rows (a mover with rounds ahead moves them beside the work that follows)."""

    def all_reduce_sums(self, sums: torch.Tensor) -> None:
        """SUM all-reduce of a small float64 array over the group."""

    def gather(self, buffer, bounds: Sequence[tuple[int, int]], finish: Callable[[int, int, list], None]) -> None:
        """``finish(p0, p1, outs)`` writes the result of a piece of this rank's slice into `outs` (this rank's
        slice of `buffer` there first, then wherever the mover takes it from or sends it to); then every rank's
        pieces reach `buffer` everywhere. `finish` reads every row of its positions (a mover may land peers'
        results in the rows only once every rank's `finish` is done)."""

    def discard(self, buffer, bounds: Sequence[tuple[int, int]]) -> None:
        """The oldest round given rows and not gathered is done with, and no gather follows: its rows were read (the
        sums of `landed`, joined), so the rounds after it may land in them (`combine_slices_`' first sweep)."""


class InPlaceMover(SliceMover, Protocol):
    """A mover for one tensor's flat buffer larger than the memory budget (`adasum_in_place_`): the slices are cut
    by `cut`, and every rank's copy of this rank's slice lands in the buffer itself, where this rank's copies of
    the other slices were (they have gone to their owners by then), through a ring of pieces of fixed size."""

    def cut(self, numel: int) -> list[tuple[int, int]] | None:
        """The slices of a buffer of `numel` elements (None: too small to run in place)."""


def rounds(sizes: Sequence[int], capacity: int | None) -> list[tuple[int, int, int, int]]:
    """Cut a layout into runs of whole tensors of at most `capacity` elements (a larger tensor alone):
    (first tensor, end tensor, first element, end element) of each.

    >>> rounds([4, 4, 10, 1], 8)
    [(0, 2, 0, 8), (2, 3, 8, 18), (3, 4, 18, 19)]
    """
    out: list[tuple[int, int, int, int]] = []
    first, start, total = 0, 0, 0
    for i, n in enumerate(sizes):
        if capacity is not None and total and total + n > capacity:
            out.append((first, i, start, start + total))
            first, start, total = i, start + total, 0
        total += n
    if total or not out:
        out.append((first, len(sizes), start, start + total))
    return out


Round = tuple[int, int, int, int, "list[tuple[int, int]] | None"]
"""(first tensor, end tensor, first element, end element, every rank's slice; None: one tensor run in place)."""


def runs_in_place(mover: InPlaceMover | None, capacity: int | None, lo: int, hi: int) -> bool:
    """Whether a round of `rounds` over elements [lo, hi) runs in place on `mover` (a transport's `in_place`):
    it is larger than `capacity`, so it holds one tensor with elements (zero-size ones ride along), and the
    mover can cut it."""
    return capacity is not None and hi - lo > capacity and mover is not None and mover.cut(hi - lo) is not None


def round_tensor(buffer: torch.Tensor | Scattered, first: int, end: int, lo: int, hi: int) -> torch.Tensor:
    """The flat elements of a round that holds one tensor with elements (`runs_in_place`): ``buffer[lo:hi]``, or
    that tensor of a `Scattered` list."""
    if isinstance(buffer, Scattered):
        return next(t for t in buffer.tensors[first:end] if t.numel()).view(-1)
    return buffer[lo:hi]


def slice_rounds(layout: Layout, mover: SliceMover, like, most: int | None = None) -> tuple[list[Round], int]:
    """The rounds `adasum_slices_` runs `layout` in on `mover` (`rounds` within the mover's capacity for `like`'s
    dtype), each with every rank's slice of it, and how many of them are in flight: the mover's `ahead` (at most
    `most`), unless the layout fits one round of the whole buffer (then 1: there is no next round to move beside
    it). A single tensor larger than the capacity runs in place (`adasum_in_place_`, no slices here) where the
    mover has an in-place mover for it. The mover's buffers are reserved for the largest slice first, so that a
    layout grows them once."""
    ahead = mover.ahead if most is None else min(most, mover.ahead)
    capacity = mover.round_elements(like.element_size(), ahead)
    if ahead > 1:
        whole = mover.round_elements(like.element_size(), 1)
        if whole is None or layout.numel <= whole:
            ahead, capacity = 1, whole
    cut: list[Round] = []
    for first, end, lo, hi in rounds(layout.sizes, capacity):
        if hi > lo:
            alone = runs_in_place(mover.in_place, capacity, lo, hi)
            cut.append((first, end, lo, hi, None if alone else cut_round(mover, lo, hi)))
    rows = [b - a for *_, bounds in cut if bounds is not None for a, b in bounds]
    if rows:
        mover.reserve(max(rows), like, ahead)
    return cut, ahead


def cut_round(mover: SliceMover, lo: int, hi: int) -> list[tuple[int, int]]:
    """Every rank's slice of a round over elements [lo, hi): P aligned slices, or the whole round for every rank
    where the mover is one-shot (module doc)."""
    return [(lo, hi)] * mover.world if mover.whole else split(lo, hi, mover.world)


def _columns(layout: Layout, lo: int, hi: int, first_tensor: int) -> tuple[slice, list[int]]:
    """The sums columns and the segment lengths of layout positions [lo, hi) (columns count from the round's
    first tensor)."""
    first, lengths = layout.overlap(lo, hi)
    return slice(first - first_tensor, first - first_tensor + len(lengths)), lengths


def _runs(parts: Sequence[Part], layout: Layout, where: tuple[int, int], p0: int, p1: int, first_tensor: int,
          outs: Sequence | None = None):
    """For each part that positions [p0, p1) of the slice at `where` overlap with elements: (every rank's row over
    the overlap, the sums columns and segment lengths there, `outs` over the overlap). `outs` may be address tables
    only where [p0, p1) lies in one part (then they are passed on whole)."""
    pieces = [(start, rows, max(p0, start), min(p1, start + rows[0].numel())) for start, rows in parts]
    pieces = [piece for piece in pieces if piece[3] > piece[2]]
    for start, rows, lo, hi in pieces:
        columns, lengths = _columns(layout, where[0] + lo, where[0] + hi, first_tensor)
        if lengths:
            targets = outs if outs is None or len(pieces) == 1 else [o[lo - p0 : hi - p0] for o in outs]
            yield [row[lo - start : hi - start] for row in rows], columns, lengths, targets


def _dots(parts, pairs, layout: Layout, where: tuple[int, int], p0: int, p1: int, sums, first_tensor: int) -> None:
    """Add the pairs' partial sums over positions [p0, p1) of the slice at `where` into `sums` ([pairs, 3, T])."""
    for rows, columns, lengths, _ in _runs(parts, layout, where, p0, p1, first_tensor):
        for p, (a, b, _, _) in enumerate(pairs):
            dot_and_norms(rows[a], rows[b], lengths, out=sums[p, :, columns])


def _combine(
    op, parts, pair, sums, layout: Layout, where, p0: int, p1: int, first_tensor: int, outs: Sequence | None
) -> None:
    """Positions [p0, p1) of one pair's combination by `op`'s level form (`CombineOp.pair`; its [3, T] `sums`
    complete) into `outs` (None: into the pair's side a). `outs` may be address tables only where [p0, p1) lies in
    one part."""
    a, b, workers_a, workers_b = pair
    for rows, columns, lengths, targets in _runs(parts, layout, where, p0, p1, first_tensor, outs):
        op.pair(rows[a], rows[b], sums[:, columns], workers_a, workers_b, lengths,
                *([rows[a]] if targets is None else targets))


def _gram(parts, layout: Layout, where: tuple[int, int], p0: int, p1: int, sums, first_tensor: int) -> None:
    """Add the Gram matrices' partial sums over positions [p0, p1) of the slice at `where` into `sums`
    ([P, P, T])."""
    for rows, columns, lengths, _ in _runs(parts, layout, where, p0, p1, first_tensor):
        gram(rows, lengths, out=sums[:, :, columns])


def _weighted(parts, weights, layout: Layout, where, p0: int, p1: int, first_tensor: int, outs: Sequence) -> None:
    """Positions [p0, p1) of the result, ``sum_j w_j x_j`` with the root's `weights` ([P, T]), into `outs`.
    `outs` may be address tables only where [p0, p1) lies in one part."""
    for rows, columns, lengths, targets in _runs(parts, layout, where, p0, p1, first_tensor, outs):
        weighted_sum(rows, weights[:, columns], lengths, *targets)


def by_gram(dtype: torch.dtype, tree: Tree) -> bool:
    """Whether Adasum's tree on a slice of `dtype` runs from the Gram matrices (`adasum.core.gram`: one pass of sums,
    one all-reduce, one pass) or level by level (a pass of sums, an all-reduce and a combination per level). The
    Gram form's error grows as ``eps64 k^2`` where a node nearly cancels (k: the ratio of its terms' magnitudes to
    its own), the level form's as ``eps k`` with the dtype's eps, since it rounds every node to the dtype: so
    the Gram form for every dtype narrower than float64, the level form for float64; and the level form for a
    tree of one level (two ranks), where both are the same formulas and the pair kernels measured faster."""
    return dtype != torch.float64 and tree.workers > 2


class CombineOp:
    """The combine rule a schedule runs: what it asks for coefficients. The schedules move the copies, add up the
    float64 sums over the group and write the combination per tensor; the op turns the sums into coefficients.

    * Gram form (the slice-parallel schedule): `weights` from the whole group's ``[P, P, T]`` float64 Gram sums
      ``G_ij = <x_i, x_j>`` of a round's tensors, the schedule writing ``sum_j w_j x_j``: one pass of sums, one
      all-reduce, `weights`, one pass.
    * Level form (`pairwise` ops: the VHDD schedule, and the slice-parallel one where `levels` says so; Adasum's
      tree for float64 and two ranks): level by level of the tree (`adasum.core.tree`: the fold of pairs
      ``(2i, 2i+1)`` when P is not a power of two, then the levels d = 1, 2, 4, ...), each pair ``a``, ``b`` of
      the level standing for `workers_a` and `workers_b` workers, its per-tensor ``<a,b>``, ``|a|^2``, ``|b|^2``
      summed over the group (``[3, T]`` float64, the same on every rank), then `pair` writes
      ``c_a a + c_b b`` per tensor over this rank's part of the pair. An op states its rule in
      `pair_coefficients`; the default `pair` applies those with one kernel (`adasum.kernels.combine_with`).
      `record` sees each level's sums (slice-parallel schedule only).

    What the VHDD schedule (`adasum.collectives.vhdd.run_schedule`) asks: `pair` once per piece of the slice a
    rank keeps at each level (and of the fold), with that level's complete sums over the piece's tensors and the
    level's worker counts (ints); every rank of a pair's block asks with the same sums and gets the same
    coefficients, so ranks end bitwise equal. `pair_coefficients` must run as device work (torch ops on the sums'
    device, no host synchronisation: a CUDA graph of the call replays it) and depend only on its arguments (the
    schedule cuts a call into rounds and pieces and asks per piece). A pairwise op without a Gram form of its own
    gets one: the tree's root weights from the Gram sums level after level with its `pair_coefficients`
    (`adasum.core.gram.weights`), so it runs on every schedule.

    `coupled`: a tensor's weights depend on other tensors' sums (AdaCons' whole-model form). The schedule then
    has every tensor's Gram sums of the call before it writes any result: a call of several rounds (or several
    buffers) runs in two sweeps (`combine_slices_`). Otherwise each round's weights come from its own tensors'.
    A coupled op has no level form.

    Adasum's tree is `AdasumTree` (the schedules' default); AdaCons' consensus is
    `adasum.reducers.adacons.Consensus`. A new rule is a subclass with `weights` (and `coupled` where it couples
    tensors), handed to `combine_slices_`, or with `pair_coefficients`, handed to either schedule
    (`adasum.collectives.vhdd.adasum_flat_`'s `op`)."""

    coupled: bool = False

    @property
    def pairwise(self) -> bool:
        """Whether the op has a level form (it overrides `pair_coefficients` or `pair`): the VHDD schedule runs it."""
        own = type(self)
        return own.pair_coefficients is not CombineOp.pair_coefficients or own.pair is not CombineOp.pair

    def levels(self, dtype: torch.dtype, tree: Tree) -> bool:
        """Whether a slice of `dtype` runs level by level (`pair`) rather than from the Gram sums (`weights`) on the
        slice-parallel schedule."""
        return False

    def weights(self, gram: torch.Tensor, first: int) -> torch.Tensor:
        """The [P, T] float64 weights of the P copies (last dimension contiguous) from the [P, P, T] float64 Gram
        sums of the call's tensors ``first .. first + T`` (columns count over the call's buffers in order), the same
        on every rank (the sums are). Called once per round in order (once per call where `coupled`); it may add
        to `gram` over a wider group first (AdaCons' shard group). A `pairwise` op's default: its tree's root
        weights (class doc)."""
        if type(self).pair_coefficients is CombineOp.pair_coefficients:
            raise NotImplementedError(f"{type(self).__name__} has no Gram form (weights) and no pair_coefficients; "
                                      "write one of them on the op")
        weights, _ = gram_weights(gram, Tree(gram.shape[0]), self.pair_coefficients)
        return weights.contiguous()

    def pair_coefficients(self, sums: torch.Tensor, workers_a: int, workers_b: int) -> torch.Tensor:
        """Level form: the float64 ``[2, T]`` coefficients (rows c_a, c_b) of a pair from its [3, T] float64 sums
        (rows ``<a,b>``, ``|a|^2``, ``|b|^2`` per tensor) and the workers each side stands for (class doc)."""
        raise NotImplementedError(f"{type(self).__name__} has no level form; write pair_coefficients on the op, "
                                  "or run it on a schedule that uses its Gram form")

    def pair(self, a, b, sums: torch.Tensor, workers_a: int, workers_b: int, lengths: Sequence[int], out,
             *more_outs) -> None:
        """Level form: ``out = c_a a + c_b b`` per segment from the pair's [3, T] level sums (`more_outs`, at most
        three, get the same values): `pair_coefficients`, applied by `adasum.kernels.combine_with`. An op whose
        rule has a fused kernel serves `pair` by it (`AdasumTree`)."""
        coefficients = self.pair_coefficients(sums, workers_a, workers_b)
        if coefficients.shape != (2, sums.shape[1]) or coefficients.dtype != torch.float64:
            raise ValueError(f"{type(self).__name__}.pair_coefficients gave {coefficients.dtype} "
                             f"{tuple(coefficients.shape)}, not float64 (2, {sums.shape[1]}); make it return "
                             "the pair's two coefficients per tensor in float64")
        combine_with(a, b, coefficients.contiguous(), lengths, out, *more_outs)

    def record(self, sums: torch.Tensor, pairs) -> None:
        """Level form: see a level's [pairs, 3, T] sums (`adasum.core.statistics`)."""


class AdasumTree(CombineOp):
    """Adasum's tree (SPEC 1.3) as the schedules' combine rule: the root's weights from the Gram sums
    (`adasum.core.gram.weights`, one kernel on GPUs), or level by level from the pairs' sums, as `by_gram` chooses
    on the slice-parallel schedule (always on VHDD). Its level form is served by the fused combine kernel
    (`adasum.kernels.combine_from_sums`: the coefficients, `adasum.core.operator.coefficients`, computed inside the
    kernel from the sums); `pair_coefficients` gives the same coefficients as a tensor
    (`adasum.core.operator.pair_coefficients`). `record`: the sums are the whole group's (not one tier's), so a
    statistics recording takes every level's."""

    def __init__(self, tree: Tree, record: bool = True) -> None:
        self.tree, self.recording = tree, record

    def levels(self, dtype: torch.dtype, tree: Tree) -> bool:
        """Level by level where the Gram form is not the more accurate or faster one (`by_gram`)."""
        return not by_gram(dtype, tree)

    def weights(self, gram: torch.Tensor, first: int) -> torch.Tensor:
        """The root's weights over the copies (`adasum.kernels.tree_weights`); every pair's sums recorded."""
        weights, pair_sums = tree_weights(gram, self.tree)
        if self.recording and statistics.active():
            at = 0
            for pairs in level_pairs(self.tree):
                self.record(pair_sums[at : at + len(pairs)], pairs)
                at += len(pairs)
        return weights

    def pair_coefficients(self, sums: torch.Tensor, workers_a: int, workers_b: int) -> torch.Tensor:
        """Adasum's (c_a, c_b), zero guard included (`adasum.core.operator.pair_coefficients`)."""
        return pair_coefficients(sums, workers_a, workers_b)

    def pair(self, a, b, sums, workers_a, workers_b, lengths, out, *more_outs) -> None:
        """One pair by the fused combine kernel, its coefficients `adasum.core.operator.coefficients`."""
        combine_from_sums(a, b, sums, workers_a, workers_b, lengths, out, *more_outs)

    def record(self, sums: torch.Tensor, pairs) -> None:
        """The level's sums, where they are the whole group's (`record`)."""
        if self.recording:
            _record(sums, pairs)


def _op(op: CombineOp | None, tree: Tree, record: bool = True) -> CombineOp:
    return AdasumTree(tree, record) if op is None else op


def first_sums(tree: Tree, width: int, dtype: torch.dtype, device, op: CombineOp | None = None) -> torch.Tensor:
    """Zeroed float64 sums for the first pass over a slice of `dtype` (`op`'s form; None: Adasum's tree):
    [P, P, T] Gram matrices, or [pairs, 3, T] for the first level's pairs."""
    if not _op(op, tree).levels(dtype, tree):
        return torch.zeros((tree.workers, tree.workers, width), dtype=torch.float64, device=device)
    return torch.zeros((len(level_pairs(tree)[0]), 3, width), dtype=torch.float64, device=device)


def add_first_sums(parts, layout: Layout, where: tuple[int, int], tree: Tree, p0: int, p1: int, sums,
                   first_tensor: int, op: CombineOp | None = None) -> None:
    """Add positions [p0, p1)'s share of the first pass's sums (`first_sums`) into `sums`."""
    if not _op(op, tree).levels(parts[0][1][0].dtype, tree):
        _gram(parts, layout, where, p0, p1, sums, first_tensor)
    else:
        _dots(parts, level_pairs(tree)[0], layout, where, p0, p1, sums, first_tensor)


def _record(sums: torch.Tensor, pairs) -> None:
    statistics.record_level(sums, [(workers_a, workers_b) for _, _, workers_a, workers_b in pairs])


def tree_on_slice_(
    parts: Sequence[Part],
    layout: Layout,
    where: tuple[int, int],
    tree: Tree,
    all_reduce_sums: Callable[[torch.Tensor], None],
    tensors: tuple[int, int],
    sums: torch.Tensor | None = None,
    record: bool = True,
    op: CombineOp | None = None,
    column: int = 0,
) -> Callable[[int, int, Sequence], None]:
    """Step 2 of the module doc on one rank's slice up to its last pass: the `parts` hold every rank's copy of
    positions `where` of `layout` (a level-by-level tree overwrites them); `tensors` is the round's (first, end)
    tensor range, the columns of the sums. `sums`: the first pass's sums (`first_sums`), already added up over the
    slice. `record`: the sums are the whole group's (not one tier's), so a statistics recording may take every
    level's (`adasum.core.statistics`). `op`: the combine rule (`CombineOp`; None: Adasum's tree), asked for the
    weights of the call's tensors from ``column + tensors[0]`` on. Returns ``finish(p0, p1, outs)``, which writes
    positions [p0, p1) of the result into `outs` (it reads every row there)."""
    op = _op(op, tree, record)
    width = tensors[1] - tensors[0]
    size = where[1] - where[0]
    dtype = parts[0][1][0].dtype
    if sums is None:
        sums = first_sums(tree, width, dtype, parts[0][1][0].device, op)
        add_first_sums(parts, layout, where, tree, 0, size, sums, tensors[0], op)
    if not op.levels(dtype, tree):
        all_reduce_sums(sums)
        weights = op.weights(sums, column + tensors[0])

        def finish(p0: int, p1: int, outs: Sequence) -> None:
            _weighted(parts, weights, layout, where, p0, p1, tensors[0], outs)

        return finish
    levels = level_pairs(tree)
    for depth, pairs in enumerate(levels):
        if depth:
            sums = torch.zeros((len(pairs), 3, width), dtype=torch.float64, device=sums.device)
            _dots(parts, pairs, layout, where, 0, size, sums, tensors[0])
        all_reduce_sums(sums)
        if statistics.active():
            op.record(sums, pairs)
        if depth < len(levels) - 1:
            for pair, pair_sums in zip(pairs, sums):
                _combine(op, parts, pair, pair_sums, layout, where, 0, size, tensors[0], None)
    last, last_sums = levels[-1][0], sums[0]

    def finish_level(p0: int, p1: int, outs: Sequence) -> None:
        _combine(op, parts, last, last_sums, layout, where, p0, p1, tensors[0], outs)

    return finish_level


def _complete(sums: torch.Tensor) -> None:
    """The sums of a one-shot round: this rank's are the whole round's, nothing to add."""


def _start(buffer, layout: Layout, mover: SliceMover, tensors: tuple[int, int], bounds, across, offset: int,
           op: CombineOp | None = None, column: int = 0):
    """One round of `adasum_slices_` (module doc) up to its scatter: `bounds` every rank's slice of `buffer`
    (positions of `layout`), `tensors` the round's tensor range; `offset` where `buffer` starts in the caller's
    layout (what `across` is told); `op` the combine rule (None: Adasum's tree), `column` the buffer's first tensor
    among the call's (what `op` is told). Returns the rest of the round (its tree and gather) to call later."""
    tree = Tree(mover.world)
    op = _op(op, tree, across is None)
    where = bounds[mover.rank]
    parts = mover.rows(buffer, bounds)
    sums = first_sums(tree, tensors[1] - tensors[0], parts[0][1][0].dtype, parts[0][1][0].device, op)

    def landed(p0: int, p1: int) -> None:
        add_first_sums(parts, layout, where, tree, p0, p1, sums, tensors[0], op)

    join = mover.scatter(buffer, bounds, landed)

    def rest() -> None:
        if join is not None:
            join()
        # two tiers (`across`): the mover's sums are one host's, the levels across hosts record theirs; one-shot:
        # every rank's sums are the whole round's already
        add_up = _complete if mover.whole else mover.all_reduce_sums
        finish = tree_on_slice_(parts, layout, where, tree, add_up, tensors, sums, across is None, op, column)
        if across is None:
            mover.gather(buffer, bounds, finish)
            return
        mine = cast(torch.Tensor, buffer)[where[0] : where[1]]  # the two-tier path runs on flat buffers
        finish(0, where[1] - where[0], [mine])
        with statistics.workers_per_peer(mover.world):  # a peer across hosts holds the subtree of this host's ranks
            across(mine, offset + where[0])

        def publish(p0: int, p1: int, outs: Sequence) -> None:
            for out in outs[1:]:  # the mover's own staging of the result (symmetric memory)
                out.copy_(mine[p0:p1])

        mover.gather(buffer, bounds, publish)

    return rest


def adasum_in_place_(
    flat: torch.Tensor, mover: InPlaceMover, across: Callable[[torch.Tensor, int], None] | None = None,
    offset: int = 0, op: CombineOp | None = None, column: int = 0, sizes: Sequence[int] | None = None,
) -> None:
    """Adasum of one tensor's flat buffer across the mover's group, in place, with no more memory than the mover's
    fixed ring (`InPlaceMover`): each rank's copies of the other ranks' slices go to their owners piece by piece,
    and the owners' copies of this rank's slice land where they were; the tree runs there, and the result reaches
    every rank the same way. `across`, `offset`: as in `adasum_slices_`, `offset` being where `flat` starts. `op`,
    `column`, `sizes`: another combine rule than Adasum's tree, the round's first tensor among the call's
    (`combine_slices_`), and the round's tensors (the one with elements, and zero-size ones beside it, whose columns
    the op's weights cover too: its state per tensor)."""
    bounds = mover.cut(flat.numel())
    if bounds is None:
        raise ValueError(f"a buffer of {flat.numel()} elements is too small to run in place over {mover.world} ranks")
    layout = Layout((flat.numel(),) if sizes is None else tuple(sizes))
    _start(flat, layout, mover, (0, len(layout.sizes)), bounds, across, offset, op, column)()


def adasum_slices_(
    buffer: torch.Tensor | Scattered,
    layout: Layout,
    mover: SliceMover,
    across: Callable[[torch.Tensor, int], None] | None = None,
    op: CombineOp | None = None,
    column: int = 0,
) -> None:
    """Adasum of `buffer` (a flat tensor, or a `Scattered` list where ``mover.scattered``) across the mover's
    group, in place, each tensor of `layout` with its own coefficients (module doc); a tensor larger than the
    mover's rounds runs in place (`adasum_in_place_`, on the mover's `in_place`).

    `across` (flat buffers only): ``across(slice, offset)`` runs on each rank's finished slice (at layout
    position `offset`) before the gather: the tree's levels above the mover's group (two tiers,
    `adasum.collectives.hierarchical.adasum_two_tier_flat_`). `op`, `column`: another combine rule whose rounds are
    independent (not `CombineOp.coupled`), and the buffer's first tensor among the call's (`combine_slices_`)."""
    if mover.world == 1:
        return
    # two tiers: the levels across hosts run between a round's tree and its gather, one round at a time
    cut, ahead = slice_rounds(layout, mover, buffer, None if across is None else 1)
    started: list[Callable[[], None]] = []  # rounds scattered whose trees and gathers have not run, oldest first
    for first, end, lo, hi, bounds in cut:
        if bounds is None:
            while started:
                started.pop(0)()
            adasum_in_place_(round_tensor(buffer, first, end, lo, hi), cast(InPlaceMover, mover.in_place), across, lo,
                             op, column + first, None if op is None else layout.sizes[first:end])
            continue
        started.append(_start(buffer, layout, mover, (first, end), bounds, across, 0, op, column))
        if len(started) >= ahead:  # the next round's scatter is issued: this one's tree and gather run beside it
            started.pop(0)()
    while started:
        started.pop(0)()


def combine_slices_(buffers: Sequence[tuple[torch.Tensor, Layout]], mover: SliceMover, op: CombineOp) -> None:
    """The combine rule `op` over flat buffers (one per dtype: the call's tensors are the first buffer's, then the
    second's, ...; the op's columns count them so) across the mover's group, in place, on the slice-parallel
    schedule's moves and passes, within the mover's memory budget.

    Rounds independent (``op.coupled`` False): each buffer as `adasum_slices_` runs it, the op's weights per round.
    Coupled: one buffer that fits one round runs in one (one scatter, one pass of Gram sums, one all-reduce, one
    pass, one gather: one all-reduce's bytes). Otherwise two sweeps over rounds of at most the mover's capacity,
    which may cut tensors (each round's sums are partial sums of its tensors; the weights are the call's):

    1. per round: scatter, the round's share of the Gram sums of every tensor it touches, the rows let go
       (`SliceMover.discard`); then one all-reduce of the call's ``[P, P, T]`` sums and the op's weights;
    2. per round: scatter again, one pass of ``sum_j w_j x_j`` into the slice, gather.

    Bytes per rank: ``3 N (P-1)/P`` (two all-reduces move ``4 N (P-1)/P``); no buffer sized to a tensor. Each
    element of the result is computed by one rank and copied: ranks end bitwise equal."""
    if mover.world == 1:
        return
    if not op.coupled:
        column = 0
        for buffer, layout in buffers:
            if layout.numel == 0:  # no round to run: the op still sees the (zero) sums of the empty tensors
                width = len(layout.sizes)
                op.weights(torch.zeros((mover.world, mover.world, width), dtype=torch.float64, device=buffer.device),
                           column)
            adasum_slices_(buffer, layout, mover, None, op, column)
            column += len(layout.sizes)
        return
    if len(buffers) == 1:
        buffer, layout = buffers[0]
        capacity = mover.round_elements(buffer.element_size(), 1)
        if layout.numel and (capacity is None or layout.numel <= capacity):  # one round of the whole layout
            ((_, _, _, _, bounds),), _ = slice_rounds(layout, mover, buffer, 1)
            _start(buffer, layout, mover, (0, len(layout.sizes)), bounds, None, 0, op)()
            return
    _two_sweeps(buffers, mover, op)


def chunk_rounds(numel: int, mover: SliceMover, like: torch.Tensor) -> tuple[list[list[tuple[int, int]]], int]:
    """Rounds of at most the mover's capacity over elements [0, numel) of a flat buffer like `like`, cutting tensors
    where they must (`combine_slices_`' two sweeps): every rank's slice of each round, and how many rounds are in
    flight (the mover's `ahead`, or 1 where the buffer fits one round of the whole buffer). The mover's buffers are
    reserved for the largest slice first."""
    ahead = mover.ahead
    capacity = mover.round_elements(like.element_size(), ahead)
    if ahead > 1:
        whole = mover.round_elements(like.element_size(), 1)
        if whole is None or numel <= whole:
            ahead, capacity = 1, whole
    step = numel if capacity is None else max(1, capacity)
    cut = [cut_round(mover, lo, min(lo + step, numel)) for lo in range(0, numel, step)]
    rows = [b - a for bounds in cut for a, b in bounds]
    if rows:
        mover.reserve(max(rows), like, ahead)
    return cut, ahead


def _pipelined(rounds: Sequence[Callable[[], Callable[[], None]]], ahead: int) -> None:
    """Start each round (its scatter) and run its rest once `ahead` rounds are in flight, oldest first."""
    started: list[Callable[[], None]] = []
    for start in rounds:
        started.append(start())
        if len(started) >= ahead:
            started.pop(0)()
    while started:
        started.pop(0)()


def _two_sweeps(buffers: Sequence[tuple[torch.Tensor, Layout]], mover: SliceMover, op: CombineOp) -> None:
    """`combine_slices_`' two sweeps of a coupled rule."""
    workers, rank = mover.world, mover.rank
    widths = [len(layout.sizes) for _, layout in buffers]
    columns = [sum(widths[:b]) for b in range(len(buffers))]
    sums = torch.zeros((workers, workers, sum(widths)), dtype=torch.float64, device=buffers[0][0].device)

    def sums_round(buffer, layout: Layout, bounds, view: torch.Tensor) -> Callable[[], None]:
        where = bounds[rank]
        parts = mover.rows(buffer, bounds)
        join = mover.scatter(buffer, bounds, lambda p0, p1: _gram(parts, layout, where, p0, p1, view, 0))

        def rest() -> None:
            if join is not None:
                join()
            mover.discard(buffer, bounds)

        return rest

    def weighted_round(buffer, layout: Layout, bounds, weights: torch.Tensor) -> Callable[[], None]:
        where = bounds[rank]
        parts = mover.rows(buffer, bounds)
        join = mover.scatter(buffer, bounds, lambda p0, p1: None)

        def finish(p0: int, p1: int, outs: Sequence) -> None:
            _weighted(parts, weights, layout, where, p0, p1, 0, outs)

        def rest() -> None:
            if join is not None:
                join()
            mover.gather(buffer, bounds, finish)

        return rest

    for (buffer, layout), column, width in zip(buffers, columns, widths):
        cut, ahead = chunk_rounds(layout.numel, mover, buffer)
        view = sums[:, :, column : column + width]
        _pipelined([partial(sums_round, buffer, layout, bounds, view) for bounds in cut], ahead)
    if not mover.whole:  # one-shot: every rank's sums are the whole call's already
        mover.all_reduce_sums(sums)
    weights = op.weights(sums, 0)
    for (buffer, layout), column, width in zip(buffers, columns, widths):
        cut, ahead = chunk_rounds(layout.numel, mover, buffer)
        part = weights[:, column : column + width]
        _pipelined([partial(weighted_round, buffer, layout, bounds, part) for bounds in cut], ahead)
