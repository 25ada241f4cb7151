"""Flat buffers of many tensors: where each tensor lies, which tensors a slice touches, fusion
of tensor lists into one buffer per dtype."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Layout:
    """Tensors of `sizes` elements laid end to end in one flat buffer."""

    sizes: tuple[int, ...]

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each tensor starts in the flat buffer."""
        out, total = [], 0
        for n in self.sizes:
            out.append(total)
            total += n
        return tuple(out)

    @cached_property
    def ends(self) -> tuple[int, ...]:
        """Where each tensor ends (exclusive) in the flat buffer."""
        return tuple(start + n for start, n in zip(self.offsets, self.sizes))

    @property
    def numel(self) -> int:
        """Elements of all the tensors together."""
        return sum(self.sizes)

    def overlap(self, lo: int, hi: int) -> tuple[int, list[int]]:
        """Tensors that [lo, hi) touches: (index of the first, element count of each inside).

        The counts cover [lo, hi) exactly; an empty tensor between two touched ones counts 0.
        """
        if hi <= lo:
            return 0, []
        first = bisect.bisect_right(self.ends, lo)
        last = bisect.bisect_left(self.offsets, hi, lo=first)
        lengths = [
            max(0, min(end, hi) - max(start, lo))
            for start, end in zip(self.offsets[first:last], self.ends[first:last])
        ]
        return first, lengths


def group_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """Indices of `tensors` per dtype, dtypes in a fixed (name) order so every rank agrees."""
    out: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return dict(sorted(out.items(), key=lambda kv: str(kv[0])))


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One flat buffer holding `tensors` end to end: a view when one contiguous tensor allows it,
    else a copy (into `out` if given: a flat tensor of the right size and dtype)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    if out is None:
        return torch.cat([t.reshape(-1) for t in tensors])
    flat = out[: sum(t.numel() for t in tensors)]
    if out.device.type != "cuda":  # on the CPU one cat is faster (docs/benchmarks.md, settings)
        return torch.cat([t.reshape(-1) for t in tensors], out=flat)
    # on GPUs, batched copies into views of `out`: in a profile of the ResNet-50 layout (161 tensors) torch.cat(out=)
    # took about twice as long as this copy in the other direction (`unflatten_into`) for the same bytes
    copy_into(tensors, flat)
    return flat


def _pieces(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat`, end to end, shaped like `tensors`."""
    return [piece.view(t.shape) for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]))]


def copy_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy `tensors` end to end into the flat buffer `flat` (of their total size): batched copies into views."""
    torch._foreach_copy_(_pieces(flat, tensors), list(tensors))


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the flat buffer back into `tensors` (nothing to do if `flat` is a view of the only one)."""
    if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr() and tensors[0].is_contiguous():
        return
    torch._foreach_copy_(list(tensors), _pieces(flat, tensors))  # batched: a few launches for all tensors


class Scattered:
    """Contiguous tensors of one dtype and device seen end to end as one flat buffer, without copying
    them: what the symmetric-memory transport reads and writes in place of a fusion buffer (its
    kernels load and store through per-tile addresses; `adasum.kernels.triton`).

    Slices of it are copied to and from real flat tensors (`read_into`, `write_from`) and named to
    kernels by their tile addresses (`adasum.kernels.addresses`); `key` names the tensors (their
    addresses) for graph keys and address tables."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors or any(not t.is_contiguous() for t in tensors):
            raise ValueError("Scattered needs one or more contiguous tensors; pass .contiguous() ones")
        self.tensors = [t.view(-1) for t in tensors]
        self.layout = Layout(tuple(t.numel() for t in self.tensors))
        self.dtype = tensors[0].dtype
        self.device = tensors[0].device
        self.key = tuple(t.data_ptr() for t in self.tensors)

    def numel(self) -> int:
        """Elements of all the tensors together, as `torch.Tensor.numel`."""
        return self.layout.numel

    def element_size(self) -> int:
        """Bytes per element, as `torch.Tensor.element_size`."""
        return self.tensors[0].element_size()

    def new_zeros(self, *shape, **kwargs) -> torch.Tensor:
        """A new zero tensor of the tensors' dtype and device, as `torch.Tensor.new_zeros`."""
        return self.tensors[0].new_zeros(*shape, **kwargs)

    def pieces(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Views of the tensors' parts that positions [lo, hi) cover, in order."""
        first, lengths = self.layout.overlap(lo, hi)
        out = []
        for i, n in enumerate(lengths):
            if n:
                start = max(0, lo - self.layout.offsets[first + i])
                out.append(self.tensors[first + i][start : start + n])
        return out

    def _paired(self, flat: torch.Tensor, lo: int, hi: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the tensors' parts at [lo, hi), the matching views of `flat`)."""
        parts = self.pieces(lo, hi)
        return parts, list(flat[lo:hi].split([p.numel() for p in parts]))

    def read_into(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        """``flat[lo:hi] = self[lo:hi]`` (batched copies)."""
        parts, views = self._paired(flat, lo, hi)
        if parts:
            torch._foreach_copy_(views, parts)

    def write_from(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        """``self[lo:hi] = flat[lo:hi]`` (batched copies)."""
        parts, views = self._paired(flat, lo, hi)
        if parts:
            torch._foreach_copy_(parts, views)
