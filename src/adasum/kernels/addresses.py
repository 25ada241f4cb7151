"""Per-tile addresses of `adasum.core.layout.Scattered` slices: how the Triton kernels read and write a list
of tensors where it lies.

A slice [lo, hi) of a `Scattered` buffer is named to a kernel by the address of each tile's first element
(the tile table of its overlap lengths, `adasum.core.tiles.table`). Building one costs host work and a copy
to the device, so each process group's communicator keeps an `AddressTables` (`adasum.transport.communicator`):
a layout's first, eager call builds its tables and a CUDA graph capture of a later call finds them made.
`adasum.release()` drops them with the communicator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from adasum.core import tiles as tile_tables
from adasum.core.keep import kept
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
    values = [address for address, _, _ in _spans((buffer, lo, hi))]
    addresses = torch.tensor(values, dtype=torch.int64, device=buffer.device)
    return TileAddresses(addresses, buffer.dtype, all(v % 16 == 0 for v in values))


class _Recent:
    """Values built on first use, by key; the most recently built `MOST` are kept (a group's calls use few)."""

    MOST = 256

    def __init__(self) -> None:
        self._values: OrderedDict[Hashable, object] = OrderedDict()

    def _find(self, key: Hashable, build: Callable[[], object]) -> object:
        found = self._values.get(key)
        if found is None:
            found = self._values[key] = build()
            while len(self._values) > self.MOST:
                self._values.popitem(last=False)
        return kept(found)  # an evicted table lives on with the graphs that read it (`adasum.core.keep`)

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        """Forget every table."""
        self._values.clear()


class AddressTables(_Recent):
    """The `TileAddresses` a group's calls used, by tensors and slice (the most recent `MOST`)."""

    def get(self, buffer: Scattered, lo: int, hi: int) -> TileAddresses:
        """The `TileAddresses` of positions [lo, hi) of `buffer`, built on first use. The same tensors give
        the same addresses, so a captured CUDA graph that reads them replays correctly while they live."""
        key = (buffer.key, buffer.layout.sizes, buffer.dtype, buffer.device, lo, hi)
        return cast(TileAddresses, self._find(key, lambda: tile_addresses(buffer, lo, hi)))


Run = tuple["torch.Tensor | Scattered", int, int]
"""Positions [lo, hi) of a flat tensor (a peer's symmetric memory, say) or of a `Scattered` list."""


@dataclass(frozen=True)
class CopyTable:
    """Tiles to copy, each from one address to another (`adasum.kernels.triton.copy_tiles`): the tiles of several
    moves in one table, so that one kernel serves them all, dealt in turn (one tile of each move, then the next of
    each), so that the programs in flight at any time spread over every move's source and target."""

    sources: torch.Tensor  # int64 [n]: each tile's first source element's address
    targets: torch.Tensor  # int64 [n]: its first target element's address
    sizes: torch.Tensor  # int64 [n]: elements in each tile
    n: int
    aligned: bool  # every address a multiple of 16 bytes and every size of 16 bytes' worth of elements


def run_key(run: Run) -> tuple:
    """What names a run's memory for `CopyTables`: its tensors' addresses and layout, dtype and positions."""
    x, lo, hi = run
    if isinstance(x, Scattered):
        return (x.key, x.layout.sizes, x.dtype, lo, hi)
    return (x.data_ptr(), x.dtype, lo, hi)


def _spans(run: Run) -> list[tuple[int, int, int]]:
    """(address, position in the run, elements) of each tile of a run: a `Scattered` run's tiles lie inside one
    tensor each (`adasum.core.tiles.table`), a flat run's are cut every `TILE` elements."""
    x, lo, hi = run
    size = x.element_size()
    if isinstance(x, torch.Tensor):
        base = x.data_ptr() + lo * size
        step = tile_tables.TILE
        return [(base + p * size, p, min(step, hi - lo - p)) for p in range(0, hi - lo, step)]
    first, lengths = x.layout.overlap(lo, hi)
    starts, sizes, segments, _, _ = table(tuple(lengths))
    bases, seg_start = [], 0
    for i, n in enumerate(lengths):
        inside = max(0, lo - x.layout.offsets[first + i])
        bases.append((x.tensors[first + i].data_ptr() + inside * size, seg_start))
        seg_start += n
    return [(bases[seg][0] + (start - bases[seg][1]) * size, start, n)
            for start, n, seg in zip(starts, sizes, segments)]


def copy_table(moves: Sequence[tuple[Run, Run]], device: torch.device) -> CopyTable:
    """The `CopyTable` of `moves`, each (source run, target run) of equal length, at most one side of each a
    `Scattered` list (its tiles cut the move; the flat side follows)."""
    per_move = []
    width = 1  # elements in 16 bytes (vector accesses)
    for source, target in moves:
        if source[2] - source[1] != target[2] - target[1]:
            raise ValueError(f"a move copies runs of equal length, got {source[2] - source[1]} and "
                             f"{target[2] - target[1]} (internal error; please report)")
        cut_by_target = isinstance(target[0], Scattered)
        cut, other = (target, source) if cut_by_target else (source, target)
        if not isinstance(other[0], torch.Tensor):
            raise ValueError("a move has at most one Scattered side (internal error; please report)")
        size = source[0].element_size()
        width = max(1, 16 // size)
        base = other[0].data_ptr() + other[1] * size
        per_move.append([(base + at * size, address, n) if cut_by_target else (address, base + at * size, n)
                         for address, at, n in _spans(cut)])
    dealt = [tiles[turn] for turn in range(max((len(t) for t in per_move), default=0))
             for tiles in per_move if turn < len(tiles)]
    aligned = all(s % 16 == 0 and t % 16 == 0 and n % width == 0 for s, t, n in dealt)
    columns = torch.tensor(dealt or [(0, 0, 0)], dtype=torch.int64).t().contiguous().to(device)
    return CopyTable(columns[0], columns[1], columns[2], len(dealt), aligned)


class CopyTables(_Recent):
    """The `CopyTable`s a mover's calls used, by their moves' `run_key`s (the most recent `MOST`): a layout's
    first, eager call builds them and a CUDA graph capture finds them made."""

    def get(self, moves: Sequence[tuple[Run, Run]], device: torch.device) -> CopyTable:
        """The table of `moves` (`copy_table`), built on first use."""
        key = tuple((run_key(source), run_key(target)) for source, target in moves)
        return cast(CopyTable, self._find(key, lambda: copy_table(moves, device)))
