"""Tile tables: a flat slice cut into tiles of at most `TILE` elements, each inside one segment
(tensor). GPU kernels run one program per tile; tables are cached per layout and device, so
repeated calls neither rebuild them nor copy them to the device again (which would synchronise)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from adasum.core.keep import kept

TILE = 16384


@dataclass(frozen=True)
class Tiles:
    """The tile table of a layout on the device, for the kernels: each tile a run of at most `TILE` elements
    inside one segment."""
    starts: torch.Tensor  # int64 [n_tiles]: first element of each tile
    sizes: torch.Tensor  # int64 [n_tiles]: elements in each tile
    segments: torch.Tensor  # int64 [n_tiles]: the segment each tile lies in
    first: torch.Tensor  # int64 [T]: index of each segment's first tile
    count: torch.Tensor  # int64 [T]: tiles in each segment
    n_tiles: int
    longest: int  # the most tiles in one segment
    align: int = 0  # the gcd of every start and size (0 without tiles): kernels may load in vectors this wide


@functools.lru_cache(maxsize=1024)
def table(lengths: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The tile table on the host: (starts, sizes, segments, first, count) as tuples of ints."""
    starts: list[int] = []
    sizes: list[int] = []
    segments: list[int] = []
    first: list[int] = []
    count: list[int] = []
    offset = 0
    for seg, n in enumerate(lengths):
        first.append(len(starts))
        for lo in range(offset, offset + n, TILE):
            starts.append(lo)
            sizes.append(min(TILE, offset + n - lo))
            segments.append(seg)
        count.append(len(starts) - first[-1])
        offset += n
    return tuple(starts), tuple(sizes), tuple(segments), tuple(first), tuple(count)


def tiles(lengths: tuple[int, ...], device: torch.device) -> Tiles:
    """The tile table of segments of `lengths` elements laid end to end, on `device` (cached; a graph being
    captured keeps the one it reads, `adasum.core.keep`)."""
    return kept(_tiles(lengths, device))


@functools.lru_cache(maxsize=1024)
def _tiles(lengths: tuple[int, ...], device: torch.device) -> Tiles:
    starts, sizes, segments, first, count = table(lengths)

    def as_tensor(values: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return Tiles(
        as_tensor(starts), as_tensor(sizes), as_tensor(segments), as_tensor(first), as_tensor(count),
        len(starts), max(count, default=0), math.gcd(*starts, *sizes),
    )


def clear_cache() -> None:
    """Forget the device tile tables (`tiles`; the host ones, `table`, hold no device memory)."""
    _tiles.cache_clear()
