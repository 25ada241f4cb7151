"""Cross-rank agreement: before data moves, every rank checks that all ranks passed the same
layout (count, shapes, dtypes, device type) and that no rank has a local problem with its input
(a non-floating or sparse tensor, tensors on a device the backend does not serve, a leaf that
requires grad or an inference tensor given to an in-place collective, views that overlap in memory), with one small
all-reduce. Either raises the same error on every rank, naming the first difference (first) or
the lowest rank with a problem and what it is; so no rank enters an exchange that its peers will not join.

>>> check_same_layout(tensors, group, device, "tensors", operation="adasum.Mean.all_reduce")  # doctest: +SKIP

On one process (a group of one rank; under torchrun every rank makes the same call): views that share
memory are refused before any data moves.

>>> import torch.distributed as dist
>>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
>>> x, cpu = torch.zeros(4), torch.device("cpu")
>>> check_same_layout([x[:2], x[2:]], None, cpu)                 # disjoint views: agreed
>>> check_same_layout([x[:3], x[1:]], None, cpu, operation="adasum.Mean.all_reduce")  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: adasum.Mean.all_reduce: on rank 0, tensors 0 and 1 share memory (overlapping views of one storage); ...
>>> dist.destroy_process_group()

The entry points reach these checks through their plan (`adasum.checks.plan.prepare`).
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from adasum.transport.communicator import control_group
from adasum.transport.groups import accepts

Entry = tuple[str, tuple[int, ...], str]
"""One tensor as the check sees it: dtype name, shape, device type."""


def describe(tensors: Sequence[torch.Tensor]) -> list[Entry]:
    """``[(dtype, shape, device type), ...]``, e.g. ``[("float32", (3, 4), "cpu")]``."""
    return [(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.device.type) for t in tensors]


def describe_flat(buffer: torch.Tensor, sizes: Sequence) -> list[Entry]:
    """The segments of a flat buffer as `describe` entries: ``[(dtype, (n,), device type), ...]`` (a size that is
    not an integer as it was given, so that a rank's float shows in the difference)."""
    dtype = str(buffer.dtype).removeprefix("torch.")
    return [(dtype, (n,), buffer.device.type) for n in sizes]


def message_sizes(description: Sequence[Entry]) -> list[Entry]:
    """What the sizes of a call's messages depend on besides its configuration: each tensor's dtype, number of
    elements and device type (a combination reads each tensor as one vector of its elements: the shapes do not
    change what travels). A size that is not an integer stays as it was given.

    >>> message_sizes([("float32", (4, 2), "cpu"), ("float16", (3,), "cpu")])
    [('float32', (8,), 'cpu'), ('float16', (3,), 'cpu')]
    """
    return [(dtype, (math.prod(shape),) if all(isinstance(n, int) for n in shape) else shape, device)
            for dtype, shape, device in description]


def signature(description: Sequence) -> int:
    """A 62-bit fingerprint of `description` (its repr), so that its negation fits an int64."""
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
        """The exception to raise: `operation`, when given the rank, and the message. The rank comes first
        (``"op: on rank 1, tensor 0 is sparse; pass ..."``): at the end it would read as part of the advice."""
        where = f"on rank {rank}, " if rank is not None else ""
        kind = TypeError if self.error == "TypeError" else ValueError
        return kind(f"{operation}: {where}{self.message}")


# the per-tensor reads of the checks, as C-level callables for `map` (plan and api read tensors the same way)
_layout, _dtype, _device = operator.attrgetter("layout"), operator.attrgetter("dtype"), operator.attrgetter("device")
_shape, _requires_grad = operator.attrgetter("shape"), operator.attrgetter("requires_grad")
_data_ptr, _stride, _is_inference = torch.Tensor.data_ptr, torch.Tensor.stride, torch.Tensor.is_inference


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) in bytes of the storage that `t` can touch (its elements lie within)."""
    if t.numel() == 0:
        return (0, 0)
    size = t.element_size()
    last = int(sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
    start = int(t.storage_offset()) * size
    return start, start + (last + 1) * size


def _elements(t: torch.Tensor) -> torch.Tensor:
    """The storage element offsets `t` covers (only called for tensors whose spans overlap): built dimension by
    dimension, linear in its number of elements (not in its span: a column of a wide matrix spans the matrix)."""
    return _pattern(tuple(t.shape), tuple(t.stride())) + int(t.storage_offset())


def _pattern(shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """The element offsets, from the first, of a view of `shape` and `stride`."""
    offsets = torch.zeros(1, dtype=torch.int64)
    for n, s in zip(shape, stride):
        offsets = (offsets.unsqueeze(1) + torch.arange(n, dtype=torch.int64) * s).reshape(-1)
    return offsets


def _units(
    tensors: Sequence[torch.Tensor], members: list[int], unit: int, lo: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every unit (`_first_shared`) that `members` of `tensors` cover, from `lo`, and the index of the tensor that
    covers each: views of one shape and stride (the columns of a matrix) at once, as their offsets plus one
    pattern."""
    alike: dict[tuple, list[int]] = {}
    for i in members:
        t = tensors[i]
        alike.setdefault((tuple(t.shape), tuple(t.stride()), t.element_size()), []).append(i)
    parts, owners = [], []
    for (shape, stride, size), indices in alike.items():
        starts = torch.tensor([int(tensors[i].storage_offset()) for i in indices], dtype=torch.int64)
        units = (starts.unsqueeze(1) + _pattern(shape, stride)) * size // unit - lo
        if unit != size:
            units = units.unsqueeze(2) + torch.arange(size)
        parts.append(units.reshape(len(indices), -1))
        owners.append(torch.tensor(indices, dtype=torch.int64).unsqueeze(1).expand_as(parts[-1]))
    return torch.cat([p.reshape(-1) for p in parts]), torch.cat([o.reshape(-1) for o in owners])


def _clusters(spans: list[tuple[tuple[int, int], int]]) -> list[list[tuple[tuple[int, int], int]]]:
    """Spans sorted by start, grouped into runs whose byte ranges chain into one another."""
    runs: list[list[tuple[tuple[int, int], int]]] = []
    end = -1
    for span in spans:
        if span[0][0] < end:
            runs[-1].append(span)
        else:
            runs.append([span])
        end = max(end, span[0][1])
    return [run for run in runs if len(run) > 1]


def _first_shared(tensors: Sequence[torch.Tensor], run: list[tuple[tuple[int, int], int]]) -> tuple[int, int] | None:
    """The first pair of `run`'s tensors that share a byte: each unit of the run's range (an element where every
    tensor of the run has one element size and its elements start at multiples of it, else a byte) is marked with
    the tensor that covers it, in one pass over their elements (linear in their elements plus the range)."""
    sizes = {tensors[i].element_size() for _, i in run}
    unit = sizes.pop() if len(sizes) == 1 else 1
    lo = min(start for (start, _), _ in run) // unit
    hi = -(-max(end for (_, end), _ in run) // unit)
    units, owners = _units(tensors, [i for _, i in run], unit, lo)
    counts = torch.bincount(units, minlength=hi - lo)
    shared = counts[units] > 1
    if not bool(shared.any()):
        return None  # no unit covered twice (the usual case, at once)
    # which pair: tensor by tensor, over those that cover a unit some other one covers (the others change nothing)
    owner = torch.full((hi - lo,), -1, dtype=torch.int64)
    found: list[tuple[int, int]] = []
    for i in torch.unique(owners[shared]).tolist():
        t = tensors[i]
        size = t.element_size()
        starts = _elements(t) * size // unit - lo  # the storage offset is in elements of t's own size
        covered = starts if unit == size else (starts.unsqueeze(1) + torch.arange(size)).reshape(-1)
        taken = owner[covered]
        if bool((taken >= 0).any()):
            found.append((int(taken[taken >= 0].min()), i))
            continue
        owner[covered] = i
    return min(found) if found else None


def overlapping(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The first pair (i, j), i < j, of tensors that share a memory location, or None.

    Spans are compared first (by storage, sorted by start); only runs of tensors whose spans chain
    into one another have their elements marked, once each (`_first_shared`), so interleaved views
    such as ``x[::2]`` and ``x[1::2]``, or the columns of a matrix, pass in time linear in their elements and
    span (the sort: n log n in the number of tensors).

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
        for run in _clusters(sorted((_span(tensors[i]), i) for i in members)):
            pair = _first_shared(tensors, run)
            if pair is not None:
                found.append(pair)
    return min(found) if found else None


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of `t` are one memory location (an ``expand``ed view: stride 0 over a dim of size > 1)."""
    if t.layout != torch.strided:
        return False
    stride = t.stride()
    return 0 in stride and any(s == 0 and n > 1 for n, s in zip(t.shape, stride))


def local_problem(
    tensors: Sequence[torch.Tensor],
    backend_device: torch.device | None,
    *,
    in_place: bool = True,
    floating: bool = True,
    group: dist.ProcessGroup | None = None,
    disjoint: bool = False,
) -> Problem | None:
    """The first problem with this rank's `tensors`, or None; checks nothing across ranks.

    In order: a sparse (non-strided) tensor (TypeError); a non-floating dtype when `floating`
    (TypeError); tensors on several devices, or on a device type other than `backend_device`'s
    (ValueError; with `group`, any type the group's backends take, `adasum.transport.groups.accepts`);
    when `in_place` and autograd is recording, a tensor that requires grad: a leaf, a view of one, the output
    of a recorded operation (ValueError: an in-place write into it would fail, or be recorded, after data
    moved); when `in_place` outside ``torch.inference_mode()``, an inference tensor (ValueError: torch
    refuses in-place writes into it there); when `in_place`, two tensors sharing a
    memory location, or one tensor whose elements share one (an ``expand``ed view), ValueError: the
    results would depend on the order of the writes. ``disjoint=True``: the caller found these very
    tensors (addresses, shapes, strides) free of both before; those memory checks are skipped.
    """
    # C-level maps over the tensors (this runs on every call); the index is looked for only on a problem
    layouts = list(map(_layout, tensors))
    if any(layout != torch.strided for layout in set(layouts)):
        i = next(i for i, layout in enumerate(layouts) if layout != torch.strided)
        return Problem(
            "TypeError",
            f"tensor {i} is {str(layouts[i]).removeprefix('torch.')}; only dense (strided) tensors can be "
            "combined (sparse gradients: make them dense, e.g. nn.Embedding(sparse=False))",
        )
    if floating:
        dtypes = list(map(_dtype, tensors))
        if not all(d.is_floating_point for d in set(dtypes)):
            i = next(i for i, d in enumerate(dtypes) if not d.is_floating_point)
            message = f"tensor {i} has dtype {dtypes[i]}; only floating-point tensors can be combined"
            return Problem("TypeError", message)
    if tensors:
        devices = list(map(_device, tensors))
        first = devices[0]
        if len(set(devices)) > 1:
            other = next(d for d in devices if d != first)
            return Problem("ValueError", f"all tensors must be on one device, got {first} and {other}")
        if backend_device is not None and first.type != backend_device.type and not accepts(group, first):
            return Problem(
                "ValueError", f"the process group's backend needs {backend_device.type} tensors, got {first}"
            )
    if in_place:
        if torch.is_grad_enabled() and any(map(_requires_grad, tensors)):
            i, t = next((i, t) for i, t in enumerate(tensors) if t.requires_grad)
            what = ("a leaf that requires grad" if t.is_leaf else
                    "a view of a tensor that requires grad" if t._is_view() else
                    "the output of an operation autograd records (it requires grad)")
            return Problem(
                "ValueError",
                f"tensor {i} is {what}, which an in-place collective cannot write; "
                f"pass {'p' if t.is_leaf else 't'}.detach() (or call under torch.no_grad())",
            )
        if not torch.is_inference_mode_enabled() and any(map(_is_inference, tensors)):
            i = next(i for i, t in enumerate(tensors) if t.is_inference())
            return Problem(
                "ValueError",
                f"tensor {i} is an inference tensor (made under torch.inference_mode()), which an in-place "
                "collective cannot write outside inference mode; pass t.clone() (made outside it)",
            )
        for i, t in enumerate(() if disjoint else tensors):
            if _self_overlapping(t):
                return Problem(
                    "ValueError",
                    f"tensor {i} has elements that share memory (an expanded view, stride 0); "
                    "an in-place collective cannot write it: pass t.contiguous()",
                )
        pair = None if disjoint else overlapping(tensors)
        if pair is not None:
            return Problem(
                "ValueError",
                f"tensors {pair[0]} and {pair[1]} share memory (overlapping views of one storage); "
                "pass each memory location once",
            )
    return None


def tensor_list(tensors: object, operation: str) -> list[torch.Tensor]:
    """`tensors` as a list: a tensor, or any sequence or iterable of tensors; TypeError for anything else
    (a dict: pass its values).

    >>> len(tensor_list(torch.zeros(3), "op")), len(tensor_list((torch.zeros(1), torch.zeros(2)), "op"))
    (1, 2)
    """
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, Mapping):
        raise TypeError(f"{operation}: takes a tensor or a list of tensors, got a {type(tensors).__name__}; "
                        "pass list(d.values())")
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise TypeError(f"{operation}: takes a tensor or a list of tensors, got {type(tensors).__name__}; pass one of "
                        "those")
    listed = list(tensors)
    for i, t in enumerate(listed):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{operation}: element {i} is a {type(t).__name__}, not a torch.Tensor; pass tensors only")
    return listed


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


def difference(configs: Sequence, descriptions: Sequence[Sequence[tuple]], what: str) -> str:
    """One line naming the first difference across ranks: of the configurations first, else of the layouts."""
    for rank, config in enumerate(configs[1:], start=1):
        if config != configs[0]:
            return (f"the configuration differs across ranks: rank 0 has {_entry(configs[0])}, "
                    f"rank {rank} has {_entry(config)}")
    return first_mismatch(descriptions, what)


def agree(
    description: Sequence[tuple],
    problem: Problem | None,
    group: dist.ProcessGroup | None,
    what: str = "tensors",
    operation: str = "adasum",
    config: tuple = (),
) -> None:
    """The collective part: raise the same error on every rank of `group` unless every rank has the
    same `config` (the call's options) and `description` (any list of hashable-by-repr tuples) and no
    rank has a `problem`.

    One all-reduce (MAX) of three int64 values, on the checks' own gloo group (`control_group`: a
    check never pairs with a data collective of a rank that went on): the signature, its negation
    and a problem flag (`agree_async`, waited for at once).
    Only on a mismatch or a problem are the descriptions and problems gathered
    (``all_gather_object``), to name the first difference from rank 0's (`difference`, ValueError)
    or else the lowest rank with a problem (its error, TypeError or ValueError).
    """
    if dist.get_world_size(group) == 1:
        if problem is not None:
            raise problem.exception(operation, dist.get_rank(group))
        return
    agree_async(description, problem, group, config).check(what, operation)


class Agreement:
    """A comparison of every rank's fingerprint under way (`agree_async`): `same` waits for it and says whether
    every rank posted the same one with no problem (the same answer on every rank); `check` raises the same error
    on every rank where not (`agree`'s)."""

    def __init__(self, description: Sequence[tuple], problem: Problem | None, group: dist.ProcessGroup | None,
                 config: tuple) -> None:
        self.description, self.problem, self.config = description, problem, config
        self.control = control_group(group)  # the checks' own gloo group (`control_group`)
        sig = signature([config, *description])
        self._values = torch.tensor([sig, -sig, 0 if problem is None else 1], dtype=torch.int64)
        self._work = dist.all_reduce(self._values, op=dist.ReduceOp.MAX, group=self.control, async_op=True)
        self._same: bool | None = None

    def same(self) -> bool:
        """Whether every rank posted the same configuration and description and none a problem (waits once)."""
        if self._same is None:
            self._work.wait()
            high, neg_low, any_problem = self._values.tolist()
            self._same = high == -neg_low and not any_problem
        return self._same

    def check(self, what: str = "tensors", operation: str = "adasum") -> None:
        """Return where `same`, else gather every rank's parts and raise the same error on every rank
        (`raise_difference`: collective, so every rank of the group calls it)."""
        if not self.same():
            raise_difference(self.control, self.config, self.description, self.problem, what, operation)


def agree_async(
    description: Sequence[tuple],
    problem: Problem | None,
    group: dist.ProcessGroup | None,
    config: tuple = (),
) -> Agreement:
    """`agree`'s all-reduce posted without waiting: the one agreement helper's asynchronous form (the FSDP
    integration posts its units' layouts at the forward and waits at the backward's first reduction). Every rank
    of `group` posts the same number of agreements in the same order."""
    return Agreement(description, problem, group, config)


def raise_difference(
    control: dist.ProcessGroup | None,
    config: tuple,
    description: Sequence[tuple],
    problem: Problem | None,
    what: str,
    operation: str,
    note: str = "",
) -> None:
    """After fingerprints differed: gather every rank's configuration, description and problem on `control` and
    raise the same error on every rank (`named_difference`)."""
    everyone: list = [None] * dist.get_world_size(control)
    dist.all_gather_object(everyone, (config, list(description), problem, operation, note), group=control)
    raise named_difference(everyone, what)


def named_difference(everyone: Sequence[tuple], what: str) -> Exception:
    """The error of every rank's ``(config, description, problem, operation, note)``, as rank 0 names it (so that
    every rank raises the very same one): the first difference (ValueError, `difference`, then the note), or else
    the lowest rank's problem."""
    configs = [c for c, _, _, _, _ in everyone]
    descriptions = [d for _, d, _, _, _ in everyone]
    operation, note = everyone[0][3], everyone[0][4]
    if any(c != configs[0] for c in configs) or any(d != descriptions[0] for d in descriptions):
        return ValueError(f"{operation}: {difference(configs, descriptions, what)}{note}")
    for rank, (_, _, theirs, _, _) in enumerate(everyone):
        if theirs is not None:
            return theirs.exception(operation, rank)
    return ValueError(f"{operation}: {what} differ across ranks{note}")  # a fingerprint collision cannot get here


def check_same_layout(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    device: torch.device,
    what: str = "tensors",
    *,
    in_place: bool = True,
    floating: bool = True,
    operation: str = "adasum",
    config: tuple = (),
) -> None:
    """Raise on every rank unless all ranks pass the same count, shapes, dtypes and device type (and
    `config`, the call's options) and no rank has a `local_problem` (checked with `in_place` and
    `floating`); one small all-reduce (`agree`). `device` is the group's device
    (`adasum.transport.groups.group_device`).

    >>> check_same_layout(grads, None, torch.device("cpu"))  # doctest: +SKIP

    On one process (a group of one rank), a local problem raises at once, naming the rank:

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> check_same_layout([torch.zeros(3), torch.ones(2, 2)], None, torch.device("cpu"))   # passes
    >>> check_same_layout([torch.zeros(3), torch.arange(2)], None, torch.device("cpu"), operation="adasum.all_reduce")
    Traceback (most recent call last):
    TypeError: adasum.all_reduce: on rank 0, tensor 1 has dtype torch.int64; only floating-point tensors can be combined
    >>> dist.destroy_process_group()
    """
    tensors = list(tensors)
    problem = local_problem(tensors, device, in_place=in_place, floating=floating, group=group)
    agree(describe(tensors), problem, group, what, operation, config)


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
