"""CPU kernels: chunks of the inputs cast into a cached float64 block; one BLAS call per block
gives the sums (a Gram matrix) or the combination."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_CPU_CHUNK = 65536  # float64 pairs of this many elements stay in cache


def _float64_blocks(rows: Sequence[torch.Tensor], lengths: Sequence[int]):
    """Yield (segment, start, block) over the CPU inputs: `block` is a reused float64 [len(rows), m] array
    holding each row's [start:start+m], at most `_CPU_CHUNK` wide (it stays in cache)."""
    stacked = torch.empty(len(rows), min(_CPU_CHUNK, max(lengths, default=0)), dtype=torch.float64)
    start = 0
    for i, n in enumerate(lengths):
        for lo in range(start, start + n, _CPU_CHUNK):
            m = min(_CPU_CHUNK, start + n - lo)
            block = stacked[:, :m]
            for k, row in enumerate(rows):
                block[k].copy_(row[lo : lo + m])
            yield i, lo, block
        start += n


def dot_and_norms(a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """The three float64 sums ``<a,b>``, ``|a|^2``, ``|b|^2`` of each segment, ``[3, T]``."""
    gram = torch.zeros(len(lengths), 2, 2, dtype=torch.float64)
    for i, _, block in _float64_blocks((a, b), lengths):
        gram[i].addmm_(block, block.t())  # [[|a|^2, <a,b>], [<a,b>, |b|^2]] of the block
    return torch.stack([gram[:, 0, 1], gram[:, 0, 0], gram[:, 1, 1]])


def scale_add(a, b, coeff_a, coeff_b, lengths: Sequence[int], out: torch.Tensor) -> None:
    """``out = coeff_a * a + coeff_b * b`` per segment, in float64 blocks, written in out's dtype."""
    coeffs = torch.stack([coeff_a, coeff_b], dim=1).unsqueeze(1)  # [T, 1, 2]
    mixed = torch.empty(1, min(_CPU_CHUNK, max(lengths, default=0)), dtype=torch.float64)
    for i, lo, block in _float64_blocks((a, b), lengths):
        m = block.shape[1]
        torch.mm(coeffs[i], block, out=mixed[:, :m])
        out[lo : lo + m].copy_(mixed[0, :m])


def gram(rows: Sequence[torch.Tensor], lengths: Sequence[int]) -> torch.Tensor:
    """Per segment the Gram matrix of the rows (``<row_i, row_j>``), ``[P, P, T]`` float64."""
    out = torch.zeros(len(lengths), len(rows), len(rows), dtype=torch.float64)
    for i, _, block in _float64_blocks(rows, lengths):
        out[i].addmm_(block, block.t())
    return out.permute(1, 2, 0).contiguous()


def weighted_sum(rows: Sequence[torch.Tensor], weights: torch.Tensor, lengths: Sequence[int], out) -> None:
    """``out = sum_j weights[j] rows[j]`` per segment (`weights` [P, T] float64), in float64 blocks, written in
    out's dtype; `out` may be one of the rows."""
    per_segment = weights.t().unsqueeze(1)  # [T, 1, P]
    mixed = torch.empty(1, min(_CPU_CHUNK, max(lengths, default=0)), dtype=torch.float64)
    for i, lo, block in _float64_blocks(rows, lengths):
        m = block.shape[1]
        torch.mm(per_segment[i], block, out=mixed[:, :m])
        out[lo : lo + m].copy_(mixed[0, :m])
