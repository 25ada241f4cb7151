"""Adasum in one process: the operator on two tensors (`combine`) and over P workers' copies on
the collective's tree (`reduce`, `reduce_stacked`), through the same kernels as the collective."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from adasum.core import statistics
from adasum.core.operator import check_floating
from adasum.core.tree import Tree
from adasum.kernels import combine_from_sums, dot_and_norms


def combine_weighted(a: torch.Tensor, b: torch.Tensor, workers_a: int, workers_b: int) -> torch.Tensor:
    """The operator for `a` standing for `workers_a` workers and `b` for `workers_b` (module doc)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"adasum.combine takes two tensors, got {type(a).__name__} and {type(b).__name__}; for "
                        "lists of tensors per worker use adasum.Adasum().reduce([list_a, list_b])")
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}; pass two tensors of one shape")
    if a.dtype != b.dtype:
        raise TypeError(f"dtypes differ: {a.dtype} and {b.dtype}; cast them to one dtype first (b.to(a.dtype))")
    check_floating(a.dtype)
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    lengths = [flat_a.numel()]
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    sums = dot_and_norms(flat_a, flat_b, lengths)
    combine_from_sums(flat_a, flat_b, sums, workers_a, workers_b, lengths, out.view(-1))
    return out


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors of the same shape and floating dtype (equal worker counts).

    >>> a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    >>> adasum.combine(a, b)        # orthogonal: the sum
    tensor([1., 2.])
    """
    return combine_weighted(a, b, 1, 1)


def reduce(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adasum of P workers' copies of one tensor, in worker order, on the collective's tree.

    For a power of two this is Horovod's binary tree; for any P, parallel inputs give the mean and
    orthogonal inputs the sum (see `adasum.core.tree`). Each level's result is rounded to the
    dtype, as the collective's VHDD schedule does; ``adasum.all_reduce`` on P ranks gives the same result
    (the slice-parallel schedule above two ranks rounds once, from the Gram matrices: the same within the
    dtype's rounding of the levels, `adasum.core.gram`).

    >>> g = torch.tensor([1.0, 2.0])
    >>> adasum.reduce([g, g, g])                                      # parallel: the mean
    tensor([1., 2.])
    >>> adasum.reduce([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])])   # orthogonal: the sum
    tensor([1., 3.])
    """
    if len(tensors) == 0:
        raise ValueError("reduce needs at least one tensor; pass one tensor per worker")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"adasum.reduce takes one tensor per worker, got a {type(t).__name__} for worker {i}; for a list "
                "of tensors per worker use adasum.Adasum().reduce(per_worker) (each tensor combined on its own)"
            )
    first = tensors[0]
    check_floating(first.dtype)
    for t in tensors[1:]:
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"all tensors need one shape and dtype: {tuple(first.shape)} {first.dtype} "
                f"vs {tuple(t.shape)} {t.dtype}; pass one tensor per worker, all of one shape and dtype"
            )
    stacked = torch.stack([t.reshape(-1) for t in tensors])
    return reduce_stacked(stacked, [first.numel()]).view(first.shape)


def _record(sums: torch.Tensor, workers: list[tuple[int, int]]) -> None:
    """Record a level's ``[3, pairs * T]`` sums as the collectives do, ``[pairs, 3, T]`` (`adasum.core.statistics`)."""
    if statistics.active():
        statistics.record_level(sums.reshape(3, len(workers), -1).transpose(0, 1), workers)


def _bit_reverse(value: int, bits: int) -> int:
    return int(format(value, f"0{bits}b")[::-1], 2) if bits else 0


@functools.lru_cache(maxsize=256)
def _segment_counts(counts: tuple[int, ...], tensors: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64, device=device).repeat_interleave(tensors)


def clear_cache() -> None:
    """Forget the segment counts kept on devices (`adasum.kernels.clear_device_caches`)."""
    _segment_counts.cache_clear()


def reduce_stacked(stacked: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Adasum over the rows of `stacked` ([P, N]: P workers' flat buffers, each holding tensors of
    `sizes` elements end to end), per tensor, on the collective's tree. Returns the [N] result.

    All pairs of a level are combined at once (one reduction and one combine over the whole level),
    so P = 64 workers of a large model take 2 log2(P) batched kernels, not 63 per tensor. The
    groups are stored in bit-reversed order: the pairs of every level are then the two contiguous
    halves of the stored rows, and each level's results land in the order the next level needs.
    """
    workers, n = stacked.shape
    if sum(sizes) != n:
        raise ValueError(
            f"sizes add up to {sum(sizes)} elements, the rows have {n}; pass the sizes of the tensors each row holds, "
            "end to end"
        )
    tree = Tree(workers)
    sizes = tuple(int(x) for x in sizes)
    rows: list[torch.Tensor] = []
    if tree.folded:
        pairs = stacked[: 2 * tree.folded].view(tree.folded, 2, n)
        a, b = pairs[:, 0].contiguous().view(-1), pairs[:, 1].contiguous().view(-1)
        lengths = sizes * tree.folded
        sums = dot_and_norms(a, b, lengths)
        _record(sums, [(1, 1)] * tree.folded)
        combine_from_sums(a, b, sums, 1, 1, lengths, out=a)
        rows += list(a.view(tree.folded, n))
    rows += list(stacked[2 * tree.folded :])
    bits = tree.groups.bit_length() - 1
    order = [_bit_reverse(p, bits) for p in range(tree.groups)]
    values = torch.stack([rows[g] for g in order]) if tree.groups > 1 else rows[0].clone().unsqueeze(0)
    counts = [tree.count(g, 1) for g in order]
    groups = tree.groups
    while groups > 1:
        half = groups // 2
        a, b = values[:half].view(-1), values[half:groups].view(-1)
        lengths = sizes * half
        workers_a: int | torch.Tensor
        workers_b: int | torch.Tensor
        if counts[:half] == counts[half:groups] and len(set(counts[:half])) == 1:
            workers_a = workers_b = counts[0]
        else:
            workers_a = _segment_counts(tuple(counts[:half]), len(sizes), stacked.device)
            workers_b = _segment_counts(tuple(counts[half:groups]), len(sizes), stacked.device)
        sums = dot_and_norms(a, b, lengths)
        _record(sums, list(zip(counts[:half], counts[half:groups])))
        combine_from_sums(a, b, sums, workers_a, workers_b, lengths, out=a)
        counts = [x + y for x, y in zip(counts[:half], counts[half:groups])]
        groups = half
    return values[0]
