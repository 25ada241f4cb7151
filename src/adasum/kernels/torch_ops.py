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

