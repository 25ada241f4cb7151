"""Per-tile addresses of `adasum.core.layout.Scattered` slices: how the Triton kernels read and write a list
of tensors where it lies.

A slice [lo, hi) of a `Scattered` buffer is named to a kernel by the address of each tile's first element
(the tile table of its overlap lengths, `adasum.core.tiles.table`). Building one costs host work and a copy
to the device, so each process group's communicator keeps an `AddressTables` (`adasum.transport.groups`):
a layout's first, eager call builds its tables and a CUDA graph capture of a later call finds them made.
`adasum.release()` drops them with the communicator.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from adasum.core.layout import Scattered
from adasum.core.tiles import table


@dataclass(frozen=True)
class TileAddresses:
    """A slice of a `Scattered` buffer as kernels take it: the address of each tile's first element."""

    table: torch.Tensor  # int64 [n_tiles], on the device
    dtype: torch.dtype
    aligned: bool = False  # every address a multiple of 16 bytes (vector loads and stores)


def tile_addresses(buffer: Scattered, lo: int, hi: int) -> TileAddresses:
    """The `TileAddresses` of positions [lo, hi) of `buffer`, built afresh (`AddressTables` keeps them)."""
    first, lengths = buffer.layout.overlap(lo, hi)
    starts, _, segments, _, _ = table(tuple(lengths))
    size = buffer.element_size()
    bases = []
    seg_start = 0
    for i, n in enumerate(lengths):  # address of each segment's first element, its start in the slice
        inside = max(0, lo - buffer.layout.offsets[first + i])
        bases.append((buffer.tensors[first + i].data_ptr() + inside * size, seg_start))
        seg_start += n
    values = []
    for start, seg in zip(starts, segments):
        base, begins = bases[seg]
        values.append(base + (start - begins) * size)
    addresses = torch.tensor(values, dtype=torch.int64, device=buffer.device)
    return TileAddresses(addresses, buffer.dtype, all(v % 16 == 0 for v in values))


class AddressTables:
    """The `TileAddresses` a group's calls used, by tensors and slice (the most recent `MOST`)."""

    MOST = 256

    def __init__(self) -> None:
        self._tables: OrderedDict[tuple, TileAddresses] = OrderedDict()

    def get(self, buffer: Scattered, lo: int, hi: int) -> TileAddresses:
        """The `TileAddresses` of positions [lo, hi) of `buffer`, built on first use. The same tensors give
        the same addresses, so a captured CUDA graph that reads them replays correctly while they live."""
        key = (buffer.key, buffer.layout.sizes, buffer.dtype, buffer.device, lo, hi)
        found = self._tables.get(key)
        if found is None:
            found = self._tables[key] = tile_addresses(buffer, lo, hi)
            while len(self._tables) > self.MOST:
                self._tables.popitem(last=False)
        return found

    def __len__(self) -> int:
        return len(self._tables)

    def clear(self) -> None:
        """Forget every table."""
        self._tables.clear()
