"""Slice-parallel Adasum: the tree of `adasum.core.tree` with the traffic of a two-shot all-reduce
(SPEC 1.4b), for any number of ranks.

Per round (a run of whole tensors of the layout, at most what the mover's buffers hold):

1. The round is cut into P aligned slices; rank r owns slice r. The mover brings every rank's
   copy of slice r to rank r (`SliceMover.scatter`: a reduce-scatter without the reduction,
   ``N (P-1)/P`` elements in per rank).
2. Rank r runs the whole tree on its slice, level by level: the fold of pairs ``(2i, 2i+1)``
   first when P is not a power of two, then the power-of-two levels. For every pair of a level
   it adds its slice's share of the per-tensor ``<a,b>``, ``|a|^2``, ``|b|^2`` (float64) into one
   ``[pairs, 3, T]`` array, one small SUM all-reduce over the group gives every rank the
   whole-tensor sums, and every rank combines its slice with the same coefficients.
3. The mover hands slice r's result to every rank (`SliceMover.gather`).

The result equals the flat tree's (`adasum.reduce`) up to float64 rounding of the sums; each
element is computed by one rank and copied, so ranks end bitwise equal. Rounds are independent
Adasum problems because coefficients are per tensor: a round never cuts a tensor, so a tensor
larger than the mover's round capacity makes a round of its own (and the mover's buffers grow to it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from adasum.core.layout import Layout, Scattered
from adasum.core.tree import Tree
from adasum.kernels import combine_from_sums, dot_and_norms
from adasum.transport.base import split


class SliceMover(Protocol):
    """How the bytes of the slice-parallel schedule move (`adasum.transport.slices`,
    `adasum.transport.symmetric.SymmetricSlices`)."""

    name: str
    scattered: bool
    world: int
    rank: int

    def round_elements(self, element_size: int) -> int | None:
        """The most elements one round should hold (None: no limit)."""

    def scatter(self, buffer, layout: Layout, bounds: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Every rank's copy of this rank's slice, as `world` flat tensors in rank order (writable scratch)."""

    def outs(self, buffer, bounds: Sequence[tuple[int, int]]) -> list:
        """Where this rank's finished slice is written: its slice of `buffer` first, then any staging."""

    def all_reduce_sums(self, sums: torch.Tensor) -> None:
        """SUM all-reduce of a small float64 array over the group."""

    def gather(self, buffer, layout: Layout, bounds: Sequence[tuple[int, int]]) -> None:
        """Every other rank's finished slice into `buffer`."""


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


def level_pairs(tree: Tree) -> list[list[tuple[int, int, int, int]]]:
    """The tree's levels as (rank of side a, rank of side b, workers of a, workers of b) per pair: the fold
    (when P is not a power of two), then d = 1, 2, 4, ...; each pair's result replaces side a's vector.

    >>> level_pairs(Tree(3))
    [[(0, 1, 1, 1)], [(0, 2, 2, 1)]]
    """
    levels = []
    if tree.folded:
        levels.append([(2 * i, 2 * i + 1, 1, 1) for i in range(tree.folded)])
    for d in tree.levels():
        levels.append([
            (tree.leader(base), tree.leader(base + d), tree.count(base, d), tree.count(base + d, d))
            for base in range(0, tree.groups, 2 * d)
        ])
    return levels


def tree_on_slice_(
    rows: Sequence[torch.Tensor],
    layout: Layout,
    bounds: tuple[int, int],
    tree: Tree,
    all_reduce_sums: Callable[[torch.Tensor], None],
    outs: Sequence,
    tensors: tuple[int, int],
) -> None:
    """Step 2 of the module doc on one rank's slice: `rows[j]` holds rank j's copy of positions `bounds` of
    `layout` (overwritten); the result goes to ``outs[0]`` (and the same values to ``outs[1:]``).
    `tensors` is the round's (first, end) tensor range: the columns of the sums arrays."""
    first, lengths = layout.overlap(*bounds)
    column = first - tensors[0]
    width = tensors[1] - tensors[0]
    levels = level_pairs(tree)
    like = rows[0]
    for depth, pairs in enumerate(levels):
        sums = torch.zeros((len(pairs), 3, width), dtype=torch.float64, device=like.device)
        if lengths:
            for p, (a, b, _, _) in enumerate(pairs):
                dot_and_norms(rows[a], rows[b], lengths, out=sums[p, :, column : column + len(lengths)])
        all_reduce_sums(sums)
        if not lengths:
            continue
        last = depth == len(levels) - 1
        for p, (a, b, workers_a, workers_b) in enumerate(pairs):
            targets = list(outs) if last else [rows[a]]
            pair_sums = sums[p, :, column : column + len(lengths)]
            combine_from_sums(rows[a], rows[b], pair_sums, workers_a, workers_b, lengths, *targets)


def adasum_slices_(buffer: torch.Tensor | Scattered, layout: Layout, mover: SliceMover) -> None:
    """Adasum of `buffer` (a flat tensor, or a `Scattered` list where ``mover.scattered``) across the mover's
    group, in place, each tensor of `layout` with its own coefficients (module doc)."""
    world = mover.world
    if world == 1:
        return
    tree = Tree(world)
    capacity = mover.round_elements(buffer.element_size())
    for first, end, lo, hi in rounds(layout.sizes, capacity):
        if hi == lo:
            continue
        bounds = split(lo, hi, world)
        rows = mover.scatter(buffer, layout, bounds)
        outs = mover.outs(buffer, bounds)
        tree_on_slice_(rows, layout, bounds[mover.rank], tree, mover.all_reduce_sums, outs, (first, end))
        mover.gather(buffer, layout, bounds)
