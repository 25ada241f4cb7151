"""Cross-rank agreement: before data moves, every rank checks that all ranks passed the same
layout (count, shapes, dtypes, device type) and that no rank has a local problem with its input
(a non-floating or sparse tensor, tensors on a device the backend does not serve, a leaf that
requires grad given to an in-place collective, views that overlap in memory), with one small
all-reduce. Either raises the same error on every rank, naming the first difference (first) or
the lowest rank with a problem and what it is; so no rank enters an exchange that its peers will not join.

>>> verify_layout(tensors, group, group_device(group), "tensors", operation="adasum.Mean.all_reduce")  # doctest: +SKIP
>>> verify_layout([4096, 64], group, device, "bucket segments", buffer=flat)     # a flat buffer  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from adasum.transport.groups import accepts, control_group

Entry = tuple[str, tuple[int, ...], str]
"""One tensor as the check sees it: dtype name, shape, device type."""


def describe(tensors: Sequence[torch.Tensor]) -> list[Entry]:
    """``[(dtype, shape, device type), ...]``, e.g. ``[("float32", (3, 4), "cpu")]``."""
    return [(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.device.type) for t in tensors]


def describe_flat(buffer: torch.Tensor, sizes: Sequence[int]) -> list[Entry]:
    """The segments of a flat buffer as `describe` entries: ``[(dtype, (n,), device type), ...]``."""
    dtype = str(buffer.dtype).removeprefix("torch.")
    return [(dtype, (int(n),), buffer.device.type) for n in sizes]


def _signature(description: Sequence[tuple]) -> int:
    digest = hashlib.blake2b(repr(list(description)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits, so its negation fits int64


# --- local problems: found on one rank before any communication, raised on every rank


@dataclass(frozen=True)
class Problem:
    """A problem with one rank's input: the error to raise (``"TypeError"`` or ``"ValueError"``) and
    a message without the operation or the rank."""

    error: str
    message: str

    def exception(self, operation: str, rank: int | None = None) -> Exception:
        """The exception to raise: `operation`, the message and, when given, the rank."""
        where = f" on rank {rank}" if rank is not None else ""
        kind = TypeError if self.error == "TypeError" else ValueError
        return kind(f"{operation}: {self.message}{where}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) in bytes of the storage that `t` can touch (its elements lie within)."""
    if t.numel() == 0:
        return (0, 0)
    size = t.element_size()
    last = int(sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
    start = int(t.storage_offset()) * size
    return start, start + (last + 1) * size


def _elements(t: torch.Tensor) -> torch.Tensor:
    """The storage element offsets `t` covers (only called for tensors whose spans overlap)."""
    base = torch.arange(int(t.storage_offset()) + int(sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) + 1)
    return torch.as_strided(base, t.shape, t.stride(), t.storage_offset()).reshape(-1)


def overlapping(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The first pair (i, j), i < j, of tensors that share a memory location, or None.

    Spans are compared first (by storage, sorted by start); only tensors whose spans overlap have
    their elements compared, so interleaved views such as ``x[::2]`` and ``x[1::2]`` pass.

    >>> x = torch.zeros(10)
    >>> overlapping([x[:6], x[4:]]), overlapping([x[::2], x[1::2]])
    ((0, 1), None)
    """
    by_storage: dict[tuple[str, int], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() and t.layout == torch.strided and t.device.type != "meta":
            by_storage.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(i)
    found: list[tuple[int, int]] = []
    for members in by_storage.values():
        if len(members) < 2:
            continue
        spans = sorted((_span(tensors[i]), i) for i in members)
        for a in range(len(spans)):
            (start_a, end_a), i = spans[a]
            for b in range(a + 1, len(spans)):
                (start_b, _), j = spans[b]
                if start_b >= end_a:
                    break
                x, y = tensors[i], tensors[j]
                if x.element_size() != y.element_size() or bool(
                    torch.isin(_elements(x) * x.element_size(), _elements(y) * y.element_size()).any()
                ):
                    found.append((min(i, j), max(i, j)))
    return min(found) if found else None


def local_problem(
    tensors: Sequence[torch.Tensor],
    backend_device: torch.device | None,
    *,
    in_place: bool = True,
    floating: bool = True,
    group: dist.ProcessGroup | None = None,
) -> Problem | None:
    """The first problem with this rank's `tensors`, or None; checks nothing across ranks.

    In order: a sparse (non-strided) tensor (TypeError); a non-floating dtype when `floating`
    (TypeError); tensors on several devices, or on a device type other than `backend_device`'s
    (ValueError; with `group`, any type the group's backends take, `adasum.transport.groups.accepts`);
    when `in_place` and autograd is recording, a leaf that requires grad (ValueError:
    an in-place write into it would fail after data moved); when `in_place`, two tensors sharing a
    memory location (ValueError: the results would depend on the order of the writes).
    """
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            return Problem(
                "TypeError",
                f"tensor {i} is {str(t.layout).removeprefix('torch.')}; only dense (strided) tensors can be "
                "combined (sparse gradients: make them dense, e.g. nn.Embedding(sparse=False))",
            )
    if floating:
        for i, t in enumerate(tensors):
            if not t.dtype.is_floating_point:
                return Problem(
                    "TypeError", f"tensor {i} has dtype {t.dtype}; only floating-point tensors can be combined"
                )
    if tensors:
        first = tensors[0].device
        for t in tensors:
            if t.device != first:
                return Problem("ValueError", f"all tensors must be on one device, got {first} and {t.device}")
        if backend_device is not None and first.type != backend_device.type and not accepts(group, first):
            return Problem(
                "ValueError", f"the process group's backend needs {backend_device.type} tensors, got {first}"
            )
    if in_place:
        if torch.is_grad_enabled():
            for i, t in enumerate(tensors):
                if t.requires_grad and t.is_leaf:
                    return Problem(
                        "ValueError",
                        f"tensor {i} is a leaf that requires grad, which an in-place collective cannot write; "
                        "pass p.detach() (or call under torch.no_grad())",
                    )
        pair = overlapping(tensors)
        if pair is not None:
            return Problem(
                "ValueError",
                f"tensors {pair[0]} and {pair[1]} share memory (overlapping views of one storage); "
                "pass each memory location once",
            )
    return None


# --- the cross-rank check


def first_mismatch(descriptions: Sequence[Sequence[tuple]], what: str) -> str:
    """A one-line account of where rank descriptions first differ from rank 0's."""
    ref = descriptions[0]
    for rank, desc in enumerate(descriptions[1:], start=1):
        if len(desc) != len(ref):
            return f"{what} differ across ranks: rank 0 passed {len(ref)}, rank {rank} passed {len(desc)}"
        for i, (mine, theirs) in enumerate(zip(ref, desc)):
            if mine != theirs:
                return (
                    f"{what} differ across ranks at index {i}: rank 0 has {_entry(mine)}, "
                    f"rank {rank} has {_entry(theirs)}"
                )
    return f"{what} differ across ranks"


def _entry(entry: tuple) -> str:
    """``float32 [3, 4] on cpu`` for a `describe` entry; other tuples as their parts joined."""
    if len(entry) == 3 and isinstance(entry[1], tuple):
        dtype, shape, device = entry
        return f"{dtype} {list(shape)} on {device}"
    return " ".join(str(list(p)) if isinstance(p, tuple) else str(p) for p in entry)


def agree(
    description: Sequence[tuple],
    problem: Problem | None,
    group: dist.ProcessGroup | None,
    what: str = "tensors",
    operation: str = "adasum",
) -> None:
    """The collective part: raise the same error on every rank of `group` unless every rank has the
    same `description` (any list of hashable-by-repr tuples) and no rank has a `problem`.

    One all-reduce (MAX) of three int64 values, on the checks' own gloo group (`control_group`: a
    check never pairs with a data collective of a rank that went on): the signature, its negation
    and a problem flag.
    Only on a mismatch or a problem are the descriptions and problems gathered
    (``all_gather_object``), to name the first difference from rank 0's description (ValueError)
    or else the lowest rank with a problem (its error, TypeError or ValueError).
    """
    if dist.get_world_size(group) == 1:
        if problem is not None:
            raise problem.exception(operation, dist.get_rank(group))
        return
    sig = _signature(description)
    control = control_group(group)  # the checks' own gloo group (`adasum.transport.groups.control_group`)
    probe = torch.tensor([sig, -sig, 0 if problem is None else 1], dtype=torch.int64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=control)
    high, neg_low, any_problem = probe.tolist()
    if high == -neg_low and not any_problem:
        return
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (list(description), problem), group=control)
    descriptions = [d for d, _ in everyone]
    if any(d != descriptions[0] for d in descriptions):
        raise ValueError(f"{operation}: {first_mismatch(descriptions, what)}")
    for rank, (_, theirs) in enumerate(everyone):
        if theirs is not None:
            raise theirs.exception(operation, rank)
    raise ValueError(f"{operation}: {what} differ across ranks")  # a signature collision cannot get here


def check_same_layout(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    device: torch.device,
    what: str = "tensors",
    *,
    in_place: bool = True,
    floating: bool = True,
    operation: str = "adasum",
) -> None:
    """Raise on every rank unless all ranks pass the same count, shapes, dtypes and device type and
    no rank has a `local_problem` (checked with `in_place` and `floating`); one small all-reduce
    (`agree`). `device` is the group's device (`adasum.transport.groups.group_device`).

    >>> check_same_layout(grads, None, torch.device("cpu"))  # doctest: +SKIP
    """
    tensors = list(tensors)
    problem = local_problem(tensors, device, in_place=in_place, floating=floating, group=group)
    agree(describe(tensors), problem, group, what, operation)


# --- verdicts cached per group and layout

_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _resolved(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def verify_layout(
    tensors_or_sizes: Sequence[torch.Tensor] | Sequence[int],
    group: dist.ProcessGroup | None,
    device: torch.device,
    what: str = "tensors",
    *,
    buffer: torch.Tensor | None = None,
    in_place: bool = True,
    floating: bool = True,
    cache: bool = True,
    operation: str = "adasum",
) -> None:
    """`check_same_layout`, remembering each verdict per (group, layout): once every rank of
    `group` has agreed on a layout, later calls with that layout skip the all-reduce (no host
    synchronisation), so a fixed layout is checked once, on its first call.

    `tensors_or_sizes` is a list of tensors, or the element counts of the segments of the flat
    `buffer` (a DDP bucket). Local problems (`local_problem`) are looked for on every call; on a
    layout already agreed on, one is raised on this rank only (its peers were not asked), and a
    peer that then waits on it fails within the group's timeout.

    What the cache cannot see: after ranks agreed on two layouts A and B, a rank that passes A
    while another passes B (both remembered) is not caught. Use ``cache=False`` (check every
    call) where layouts vary from call to call; the reducers do for direct calls.

    >>> verify_layout(grads, None, torch.device("cpu"), "gradients")   # all-reduce on first call only  # doctest: +SKIP
    """
    if buffer is not None:
        sizes = [int(n) for n in tensors_or_sizes]
        tensors = [buffer]
        description = describe_flat(buffer, sizes)
        problem = local_problem(tensors, device, in_place=in_place, floating=floating, group=group)
        if problem is None and sum(sizes) != buffer.numel():
            problem = Problem("ValueError", f"sizes add up to {sum(sizes)} elements, the buffer has {buffer.numel()}")
    else:
        tensors = list(tensors_or_sizes)  # type: ignore[arg-type]
        description = describe(tensors)
        problem = local_problem(tensors, device, in_place=in_place, floating=floating, group=group)
    if not cache:
        agree(description, problem, group, what, operation)
        return
    sig = _signature(description)
    known = _verdicts.setdefault(_resolved(group), set())
    if sig in known:
        if problem is not None:
            raise problem.exception(operation, dist.get_rank(group))
        return
    agree(description, problem, group, what, operation)
    known.add(sig)


def check_not_sharded(params: Iterable[torch.Tensor], where: str) -> None:
    """Raise TypeError if a parameter is a DTensor (FSDP2 or tensor parallel): `where` works on whole
    local tensors and would combine shards with per-shard coefficients."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in params):
        raise TypeError(
            f"{where} does not support sharded (DTensor) parameters such as FSDP2's: it would combine each "
            "shard with its own coefficients. For FSDP2 use adasum.fsdp.enable(model, mesh) (gradients "
            "combined across the replicas, per parameter)"
        )
