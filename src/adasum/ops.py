r"""Adasum's pairwise operator, the tree reduction over P workers, and the per-tensor math on flat
buffers that the collective applies slice by slice. No communication happens here.

For two vectors ``a`` and ``b`` standing for ``n_a`` and ``n_b`` workers,
``w_a = n_a / (n_a + n_b)`` and ``w_b = n_b / (n_a + n_b)``::

    adasum(a, b) = (1 - w_a <a,b> / |a|^2) a + (1 - w_b <a,b> / |b|^2) b

With equal counts this is the paper's ``(1 - <a,b>/2|a|^2) a + (1 - <a,b>/2|b|^2) b``: orthogonal
inputs are summed, parallel inputs averaged (worker-weighted), and in between the parallel part
is averaged and the orthogonal part summed.

Numerics: the three reductions are computed in float64 whatever the dtype (products included:
float32 squares underflow and overflow at the ends of float32's range); the coefficients are float64; the combination is
computed in float64 and written back in the tensor's dtype. Zero guard, no epsilon: a side whose
squared norm is below ``sqrt(float64 tiny)`` (about 1.5e-154) gets coefficient 1, so
``adasum(0, b) = b`` and ``adasum(0, 0) = 0``. For float64 inputs this means vectors of norm
below about 1.2e-77 count as zero, and squared norms above float64's range overflow; for
float32, bfloat16 and float16 inputs the whole representable range is safe.
Non-finite inputs propagate: a tensor with a NaN or Inf in either input comes out non-finite.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from adasum import triton_kernels
from adasum.tiles import tiles
from adasum.tree import Tree

ZERO_NORM = math.sqrt(torch.finfo(torch.float64).tiny)
"""Squared norms below this count as zero: their coefficient is 1."""


def check_floating(dtype: torch.dtype) -> None:
    """Raise TypeError unless `dtype` is a real floating-point dtype."""
    if not dtype.is_floating_point:
        raise TypeError(f"Adasum needs floating-point tensors, got {dtype}")


_CPU_CHUNK = 65536  # float64 pairs of this many elements stay in cache


def _dot_and_norms_batched(a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Torch-only device path: products in float64, summed per tile, then tiles per segment.
    (segment_reduce runs one thread per segment: fine for tiles, hopeless for a whole tensor.)"""
    table = tiles(tuple(lengths), a.device)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    products = torch.stack([a64 * b64, a64 * a64, b64 * b64], dim=1)  # [n, 3]
    tile_sums = torch.segment_reduce(products, "sum", lengths=table.sizes, axis=0, unsafe=True)
    return torch.segment_reduce(tile_sums, "sum", lengths=table.count, axis=0, unsafe=True).t()


def dot_and_norms(
    a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-segment ``<a,b>``, ``|a|^2``, ``|b|^2`` of two flat tensors, in float64, as a [3, T] tensor.

    `lengths` splits the flat tensors into T consecutive segments (zero lengths allowed); their sum
    is ``a.numel()``. Everything is computed in float64. On the CPU, chunks of both inputs are cast
    into a cached 2 x chunk float64 block whose Gram matrix (one BLAS call) gives all three sums;
    on GPUs Triton kernels (or, without Triton, a few batched torch kernels) serve all segments
    together, with no host synchronisation. With `out` ([3, T] float64), the sums are added into it.
    """
    if triton_kernels.available(a.device):
        return triton_kernels.dot_and_norms(a, b, lengths, out)
    sums = _dot_and_norms_batched(a, b, lengths) if a.device.type != "cpu" else _dot_and_norms_blocked(a, b, lengths)
    if out is None:
        return sums
    return out.add_(sums)


def _float64_blocks(a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int]):
    """Yield (segment, start, block) over the CPU inputs: `block` is a reused float64 [2, m] array
    holding a[start:start+m] and b[start:start+m], at most `_CPU_CHUNK` wide (it stays in cache)."""
    pair = torch.empty(2, min(_CPU_CHUNK, max(lengths, default=0)), dtype=torch.float64)
    start = 0
    for i, n in enumerate(lengths):
        for lo in range(start, start + n, _CPU_CHUNK):
            m = min(_CPU_CHUNK, start + n - lo)
            block = pair[:, :m]
            block[0].copy_(a[lo : lo + m])
            block[1].copy_(b[lo : lo + m])
            yield i, lo, block
        start += n


def _dot_and_norms_blocked(a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    gram = torch.zeros(len(lengths), 2, 2, dtype=torch.float64)
    for i, _, block in _float64_blocks(a, b, lengths):
        gram[i].addmm_(block, block.t())  # [[|a|^2, <a,b>], [<a,b>, |b|^2]] of the block
    return torch.stack([gram[:, 0, 1], gram[:, 0, 0], gram[:, 1, 1]])


def coefficients(
    partials: torch.Tensor, weight_a: float | torch.Tensor, weight_b: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 coefficients (c_a, c_b) per segment from ``dot_and_norms`` output, zero guard included."""
    dot, norm_a, norm_b = partials[0], partials[1], partials[2]
    one = torch.ones_like(dot)
    coeff_a = torch.where(norm_a >= ZERO_NORM, 1 - weight_a * dot / norm_a.clamp_min(ZERO_NORM), one)
    coeff_b = torch.where(norm_b >= ZERO_NORM, 1 - weight_b * dot / norm_b.clamp_min(ZERO_NORM), one)
    return coeff_a, coeff_b


def _scale_add_batched(a, b, coeff_a, coeff_b, lengths: Sequence[int], out: torch.Tensor) -> None:
    table = tiles(tuple(lengths), a.device)
    n = a.numel()
    ca = torch.repeat_interleave(coeff_a[table.segments], table.sizes, output_size=n)
    cb = torch.repeat_interleave(coeff_b[table.segments], table.sizes, output_size=n)
    out.copy_(torch.addcmul(ca * a.to(torch.float64), cb, b.to(torch.float64)))


def scale_add(
    a: torch.Tensor,
    b: torch.Tensor,
    coeff_a: torch.Tensor,
    coeff_b: torch.Tensor,
    lengths: Sequence[int],
    out: torch.Tensor,
) -> None:
    """``out = coeff_a * a + coeff_b * b`` segment by segment, computed in float64 and written in
    out's dtype. `out` may alias `a` or `b`."""
    if a.device.type != "cpu":
        _scale_add_batched(a, b, coeff_a, coeff_b, lengths, out)
        return
    coeffs = torch.stack([coeff_a, coeff_b], dim=1).unsqueeze(1)  # [T, 1, 2]
    mixed = torch.empty(1, min(_CPU_CHUNK, max(lengths, default=0)), dtype=torch.float64)
    for i, lo, block in _float64_blocks(a, b, lengths):
        m = block.shape[1]
        torch.mm(coeffs[i], block, out=mixed[:, :m])
        out[lo : lo + m].copy_(mixed[0, :m])


def combine_from_sums(
    a: torch.Tensor,
    b: torch.Tensor,
    sums: torch.Tensor,
    workers_a: int | torch.Tensor,
    workers_b: int | torch.Tensor,
    lengths: Sequence[int],
    out: torch.Tensor,
) -> None:
    """``out = c_a a + c_b b`` per segment, `a` standing for `workers_a` workers and `b` for
    `workers_b` (ints, or int64 tensors with one count per segment), with (c_a, c_b) =
    ``coefficients(sums, w_a, w_b)``. One fused kernel on GPUs with Triton; `out` may alias `a`
    or `b`."""
    if triton_kernels.available(a.device):
        triton_kernels.combine(a, b, sums, workers_a, workers_b, lengths, out)
        return
    if isinstance(workers_a, torch.Tensor):
        total = (workers_a + workers_b).to(torch.float64)
        coeff_a, coeff_b = coefficients(sums, workers_a / total, workers_b / total)
    else:
        total = workers_a + workers_b
        coeff_a, coeff_b = coefficients(sums, workers_a / total, workers_b / total)
    scale_add(a, b, coeff_a, coeff_b, lengths, out)


def combine_weighted(a: torch.Tensor, b: torch.Tensor, workers_a: int, workers_b: int) -> torch.Tensor:
    """The operator for `a` standing for `workers_a` workers and `b` for `workers_b` (module doc)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"dtypes differ: {a.dtype} and {b.dtype}")
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
    orthogonal inputs the sum (see `adasum.tree`). Each level's result is rounded to the dtype,
    as the collective does.

    >>> adasum.reduce([g0, g1, g2])     # what adasum.all_reduce gives on 3 ranks
    """
    if len(tensors) == 0:
        raise ValueError("reduce needs at least one tensor")
    first = tensors[0]
    check_floating(first.dtype)
    for t in tensors[1:]:
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"all tensors need one shape and dtype: {tuple(first.shape)} {first.dtype} "
                f"vs {tuple(t.shape)} {t.dtype}"
            )
    stacked = torch.stack([t.reshape(-1) for t in tensors])
    return reduce_stacked(stacked, [first.numel()]).view(first.shape)


def _bit_reverse(value: int, bits: int) -> int:
    return int(format(value, f"0{bits}b")[::-1], 2) if bits else 0


@functools.lru_cache(maxsize=256)
def _segment_counts(counts: tuple[int, ...], tensors: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64, device=device).repeat_interleave(tensors)


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
        raise ValueError(f"sizes add up to {sum(sizes)} elements, the rows have {n}")
    tree = Tree(workers)
    sizes = tuple(int(x) for x in sizes)
    rows: list[torch.Tensor] = []
    if tree.folded:
        pairs = stacked[: 2 * tree.folded].view(tree.folded, 2, n)
        a, b = pairs[:, 0].contiguous().view(-1), pairs[:, 1].contiguous().view(-1)
        lengths = sizes * tree.folded
        combine_from_sums(a, b, dot_and_norms(a, b, lengths), 1, 1, lengths, out=a)
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
        if counts[:half] == counts[half:groups] and len(set(counts[:half])) == 1:
            workers_a = workers_b = counts[0]
        else:
            workers_a = _segment_counts(tuple(counts[:half]), len(sizes), stacked.device)
            workers_b = _segment_counts(tuple(counts[half:groups]), len(sizes), stacked.device)
        combine_from_sums(a, b, dot_and_norms(a, b, lengths), workers_a, workers_b, lengths, out=a)
        counts = [x + y for x, y in zip(counts[:half], counts[half:groups])]
        groups = half
    return values[0]
