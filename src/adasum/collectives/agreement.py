"""Cross-rank agreement: before data moves, every rank checks that all ranks passed the same
layout (count, shapes, dtypes), with one small all-reduce; a mismatch raises the same ValueError
on every rank naming the first difference."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist


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
