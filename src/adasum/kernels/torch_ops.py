"""Device kernels as a few batched torch ops (the path without Triton): products in float64
summed per tile, then tiles per segment; coefficients expanded per tile."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adasum.core.tiles import tiles


def dot_and_norms(a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Torch-only device path: products in float64, summed per tile, then tiles per segment.
    (segment_reduce runs one thread per segment: fine for tiles, hopeless for a whole tensor.)"""
    table = tiles(tuple(lengths), a.device)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    products = torch.stack([a64 * b64, a64 * a64, b64 * b64], dim=1)  # [n, 3]
    tile_sums = torch.segment_reduce(products, "sum", lengths=table.sizes, axis=0, unsafe=True)
    return torch.segment_reduce(tile_sums, "sum", lengths=table.count, axis=0, unsafe=True).t()



def scale_add(a, b, coeff_a, coeff_b, lengths: Sequence[int], out: torch.Tensor) -> None:
    """``out = coeff_a a + coeff_b b`` with one coefficient pair per segment."""
    table = tiles(tuple(lengths), a.device)
    n = a.numel()
    ca = torch.repeat_interleave(coeff_a[table.segments], table.sizes, output_size=n)
    cb = torch.repeat_interleave(coeff_b[table.segments], table.sizes, output_size=n)
    out.copy_(torch.addcmul(ca * a.to(torch.float64), cb, b.to(torch.float64)))


def gram(rows: Sequence[torch.Tensor], lengths: Sequence[int]) -> torch.Tensor:
    """Torch-only device path of the Gram matrices, ``[P, P, T]`` float64: one row's products with every row at
    a time, summed per tile, then tiles per segment."""
    table = tiles(tuple(lengths), rows[0].device)
    stacked = torch.stack([r.to(torch.float64) for r in rows], dim=1)  # [n, P]
    out = []
    for k in range(len(rows)):
        products = stacked * stacked[:, k : k + 1]  # [n, P]
        tile_sums = torch.segment_reduce(products, "sum", lengths=table.sizes, axis=0, unsafe=True)
        out.append(torch.segment_reduce(tile_sums, "sum", lengths=table.count, axis=0, unsafe=True).t())
    return torch.stack(out)


def weighted_sum(rows: Sequence[torch.Tensor], weights: torch.Tensor, lengths: Sequence[int], out) -> None:
    """``out = sum_j weights[j] rows[j]`` with one weight per row and segment (`weights` [P, T])."""
    table = tiles(tuple(lengths), rows[0].device)
    n = rows[0].numel()
    total = torch.zeros(n, dtype=torch.float64, device=rows[0].device)
    for row, w in zip(rows, weights):
        total.addcmul_(torch.repeat_interleave(w[table.segments], table.sizes, output_size=n), row.to(torch.float64))
    out.copy_(total)
