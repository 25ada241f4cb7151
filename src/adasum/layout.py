"""Flat buffers of many tensors: where each tensor lies, which tensors a slice touches, fusion
of tensor lists into one buffer per dtype, and the cross-rank check that layouts agree."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """Tensors of `sizes` elements laid end to end in one flat buffer."""

    sizes: tuple[int, ...]

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, total = [], 0
        for n in self.sizes:
            out.append(total)
            total += n
        return tuple(out)

    @cached_property
    def ends(self) -> tuple[int, ...]:
        return tuple(start + n for start, n in zip(self.offsets, self.sizes))

    @property
    def numel(self) -> int:
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
    for t, piece in zip(tensors, out.split([t.numel() for t in tensors])):
        piece.view(t.shape).copy_(t)
    return out


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the flat buffer back into `tensors` (nothing to do if `flat` is a view of the only one)."""
    if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr() and tensors[0].is_contiguous():
        return
    pieces = flat.split([t.numel() for t in tensors])
    for t, piece in zip(tensors, pieces):
        t.copy_(piece.view(t.shape))


def describe(tensors: Sequence[torch.Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    return [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]


def _signature(description: list[tuple[str, tuple[int, ...]]]) -> int:
    digest = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits, so its negation fits int64


def check_same_layout(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device, what: str = "tensors"
) -> None:
    """Raise ValueError on every rank unless all ranks pass the same count, shapes and dtypes.

    One all-reduce of two int64 values (max of the signature and of its negation); only on a
    mismatch are the descriptions gathered, to name the first difference.
    """
    description = describe(tensors)
    sig = _signature(description)
    probe = torch.tensor([sig, -sig], dtype=torch.int64, device=device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    high, neg_low = probe.tolist()
    if high == -neg_low:
        return
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, description, group=group)
    raise ValueError(first_mismatch(everyone, what))


def first_mismatch(descriptions: list[list[tuple[str, tuple[int, ...]]]], what: str) -> str:
    """A one-line account of where rank descriptions first differ from rank 0's."""
    ref = descriptions[0]
    for rank, desc in enumerate(descriptions[1:], start=1):
        if len(desc) != len(ref):
            return f"{what} differ across ranks: rank 0 passed {len(ref)}, rank {rank} passed {len(desc)}"
        for i, (mine, theirs) in enumerate(zip(ref, desc)):
            if mine != theirs:
                return (
                    f"{what} differ across ranks at index {i}: rank 0 has {mine[0]} {list(mine[1])}, "
                    f"rank {rank} has {theirs[0]} {list(theirs[1])}"
                )
    return f"{what} differ across ranks"
