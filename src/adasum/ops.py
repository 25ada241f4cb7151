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

from adasum.tree import Tree

ZERO_NORM = math.sqrt(torch.finfo(torch.float64).tiny)
"""Squared norms below this count as zero: their coefficient is 1."""


def check_floating(dtype: torch.dtype) -> None:
    """Raise TypeError unless `dtype` is a real floating-point dtype."""
    if not dtype.is_floating_point:
        raise TypeError(f"Adasum needs floating-point tensors, got {dtype}")


@functools.lru_cache(maxsize=512)
def _device_lengths(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # a fresh host-to-device copy would synchronise the host on every call; layouts repeat
    return torch.tensor(lengths, dtype=torch.int64, device=device)


_CPU_CHUNK = 65536  # float64 pairs of this many elements stay in cache


def _dot_and_norms_batched(a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    products = torch.stack([a64 * b64, a64 * a64, b64 * b64], dim=1)  # [n, 3]
    seg = _device_lengths(tuple(lengths), a.device)
    return torch.segment_reduce(products, "sum", lengths=seg, axis=0, unsafe=True).t()


def dot_and_norms(a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Per-segment ``<a,b>``, ``|a|^2``, ``|b|^2`` of two flat tensors, in float64, as a [3, T] tensor.

    `lengths` splits the flat tensors into T consecutive segments (zero lengths allowed); their sum
    is ``a.numel()``. Everything is computed in float64. On the CPU, chunks of both inputs are cast
    into a cached 2 x chunk float64 block whose Gram matrix (one BLAS call) gives all three sums;
    on GPUs a few batched kernels serve all segments together, with no host synchronisation.
    """
    if a.device.type != "cpu":
        return _dot_and_norms_batched(a, b, lengths)
    gram = torch.zeros(len(lengths), 2, 2, dtype=torch.float64)
    pair = torch.empty(2, min(_CPU_CHUNK, max(lengths, default=0)), dtype=torch.float64)
    start = 0
    for i, n in enumerate(lengths):
        for lo in range(start, start + n, _CPU_CHUNK):
            m = min(_CPU_CHUNK, start + n - lo)
            block = pair[:, :m]
            block[0].copy_(a[lo : lo + m])
            block[1].copy_(b[lo : lo + m])
            gram[i].addmm_(block, block.t())
        start += n
    return torch.stack([gram[:, 0, 1], gram[:, 0, 0], gram[:, 1, 1]])


def coefficients(
    partials: torch.Tensor, weight_a: float, weight_b: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 coefficients (c_a, c_b) per segment from ``dot_and_norms`` output, zero guard included."""
    dot, norm_a, norm_b = partials[0], partials[1], partials[2]
    one = torch.ones_like(dot)
    coeff_a = torch.where(norm_a >= ZERO_NORM, 1 - weight_a * dot / norm_a.clamp_min(ZERO_NORM), one)
    coeff_b = torch.where(norm_b >= ZERO_NORM, 1 - weight_b * dot / norm_b.clamp_min(ZERO_NORM), one)
    return coeff_a, coeff_b


def _scale_add_batched(a, b, coeff_a, coeff_b, lengths: Sequence[int], out: torch.Tensor) -> None:
    seg = _device_lengths(tuple(lengths), a.device)
    n = a.numel()
    ca = torch.repeat_interleave(coeff_a, seg, output_size=n)
    cb = torch.repeat_interleave(coeff_b, seg, output_size=n)
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
    pair = torch.empty(2, min(_CPU_CHUNK, max(lengths, default=0)), dtype=torch.float64)
    mixed = torch.empty(1, pair.shape[1], dtype=torch.float64)
    start = 0
    for i, n in enumerate(lengths):
        for lo in range(start, start + n, _CPU_CHUNK):
            m = min(_CPU_CHUNK, start + n - lo)
            block = pair[:, :m]
            block[0].copy_(a[lo : lo + m])
            block[1].copy_(b[lo : lo + m])
            torch.mm(coeffs[i], block, out=mixed[:, :m])
            out[lo : lo + m].copy_(mixed[0, :m])
        start += n


def combine_weighted(a: torch.Tensor, b: torch.Tensor, workers_a: int, workers_b: int) -> torch.Tensor:
    """The operator for `a` standing for `workers_a` workers and `b` for `workers_b` (module doc)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"dtypes differ: {a.dtype} and {b.dtype}")
    check_floating(a.dtype)
    total = workers_a + workers_b
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    lengths = [flat_a.numel()]
    coeff_a, coeff_b = coefficients(dot_and_norms(flat_a, flat_b, lengths), workers_a / total, workers_b / total)
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    scale_add(flat_a, flat_b, coeff_a, coeff_b, lengths, out.view(-1))
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
    tree = Tree(len(tensors))
    values = []
    for group in range(tree.groups):
        follower = tree.follower(group)
        lead = tensors[tree.leader(group)]
        values.append(lead.clone() if follower is None else combine_weighted(lead, tensors[follower], 1, 1))
    for d in tree.levels():
        for base in range(0, tree.groups, 2 * d):
            values[base] = combine_weighted(
                values[base], values[base + d], tree.count(base, d), tree.count(base + d, d)
            )
    return values[0]
