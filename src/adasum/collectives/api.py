"""The user-facing collective: `all_reduce` and `all_reduce_async` of lists of tensors, fused into
one flat buffer per dtype and combined with the VHDD schedule (`adasum.collectives.vhdd`)."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from adasum.checks.agreement import (
    _data_ptr,
    _dtype,
    _requires_grad,
    _shape,
    _stride,
    tensor_list,
)
from adasum.checks.nonfinite import check_finite, check_policy
from adasum.checks.plan import Plan, prepare, recheck
from adasum.collectives.vhdd import adasum_flat_, transport_for
from adasum.core.layout import Scattered, flatten, group_by_dtype, unflatten_into
from adasum.options import Nonfinite, TransportName, check_flag, not_initialised
from adasum.transport.alone import warn_one_rank
from adasum.transport.base import Transport
from adasum.transport.communicator import Communicator, communicator
from adasum.transport.graphs import MAX_GRAPHS, tensor_key
from adasum.transport.groups import check_group, group_device
from adasum.transport.registry import transport_names


def all_reduce(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    check_layout: bool = True,
    nonfinite: Nonfinite = "propagate",
    transport: TransportName | Transport | None = None,
) -> None:
    """Replace each tensor, on every rank, by the Adasum of the ranks' copies; in place.

    Each tensor gets its own coefficients ("per layer"). Any world size; gloo and NCCL; all ranks
    end with bitwise-identical tensors, equal to ``adasum.reduce`` of the ranks' copies up to
    float64 rounding of the coefficients. Tensors are fused into one flat buffer per dtype.

    With `check_layout` (the default) every call first checks that every rank passed the same
    number of tensors with the same shapes and dtypes, and the same `nonfinite` and `transport`
    (`adasum.checks.plan`: on gloo one 24-byte all-reduce before data moves; on NCCL the
    layout's first call so, later calls by a fingerprint compared at the group's next call, with no
    host synchronisation); a difference raises ValueError on every rank, naming the first
    difference and the ranks. Non-floating dtypes raise TypeError, anything but a tensor or a list
    of tensors (a dict), a `group` that is not a process group or a `check_layout` that is not True or
    False TypeError. World size 1 leaves the tensors unchanged (and warns once per group,
    `adasum.transport.alone`).

    `transport` names how bytes move: "p2p" (c10d point-to-point), "collectives" (NCCL, the gather
    as one all-gather), "symmetric" (NVLink symmetric memory), "slices" (the slice-parallel schedule, any number
    of ranks), "one-shot" (every rank takes every copy whole and runs the tree itself); None picks the fastest the
    group supports for each dtype's bytes (`adasum.transport.select`); a `adasum.transport.base.Transport` object
    is used as it is (a wrapping transport injects faults in tests); another name raises ValueError, at any world
    size (`check_transport`), and so does a name the group cannot run ("symmetric" on gloo), on every rank after
    the cross-rank check. Every rank must ask for the same transport (a `Transport` object counts as its name; None
    is not the name the default picks): ranks that ask differently get that difference, before any choice is made.
    On GPUs, repeated calls on
    the same tensors replay a captured CUDA graph of the whole call (`adasum.transport.graphs`): the same tensor
    objects at the same addresses with the same numbers of elements (each tensor is combined as one vector of its
    elements, so a view changed in place over the same memory, ``t_()`` or ``squeeze_()``, replays too), and new
    tensors at the same addresses with the same dtypes, shapes and strides (gradients re-made after
    ``zero_grad(set_to_none=True)`` where the caching allocator places them where the last ones were: adasum holds
    the tensors weakly). The group remembers as many recent captured lists as it keeps graphs (`RECENT`), so a
    step that combines several lists (one per block, say) replays each. Tensors at new addresses every call
    (gradients re-made by ``zero_grad()`` that the allocator places elsewhere) run eagerly every call, and a group
    warns once when that goes on (`adasum.transport.communicator.MOVED_CALLS`); ``zero_grad(set_to_none=False)`` keeps
    gradients where they lie.

    Non-finite inputs: ``nonfinite="propagate"`` (the default) lets them through; a tensor with a
    NaN or Inf on any rank comes out NaN in every element (in a group of two or more), identically on
    every rank. ``"raise"`` first checks with one small all-reduce and raises `adasum.NonFiniteError` on
    every rank, naming the first such tensor (its index in `tensors`) and the lowest rank that has it;
    nothing is changed.

    A dead or stalled peer raises `adasum.CollectiveError` naming the step within the group's
    timeout (gloo; on NCCL the watchdog enforces it).

    >>> grads = [p.grad for p in model.parameters()]  # doctest: +SKIP
    >>> adasum.all_reduce(grads)  # doctest: +SKIP
    >>> adasum.all_reduce(grads, nonfinite="raise")  # doctest: +SKIP

    On one process (a group of one rank; under torchrun every rank makes the same calls):

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> grads = [torch.tensor([3.0, 4.0]), torch.ones(2, 2)]
    >>> adasum.all_reduce(grads, nonfinite="raise")
    >>> grads[0]                                                   # one rank: nothing to combine
    tensor([3., 4.])
    >>> dist.destroy_process_group()
    """
    _all_reduce(tensors, group, check_layout, nonfinite, transport, "adasum.all_reduce")


def _all_reduce(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    check_layout: bool,
    nonfinite: Nonfinite,
    transport: TransportName | Transport | None,
    operation: str,
) -> None:
    """`all_reduce` (and `all_reduce_async`): its errors name `operation`, the entry point called; the cross-rank
    check compares "adasum.all_reduce" (either entry point, the same collective)."""
    check_flag(operation, "check_layout", check_layout)
    # a repeat of a recent captured call: the very tensors it checked (so no type check of the list either)
    if nonfinite == "propagate" and (group is None or isinstance(group, dist.ProcessGroup)) and dist.is_initialized():
        if _replayed(communicator(group), group, transport, tensors, check_layout):
            return
    tensors = tensor_list(tensors, operation)
    check_group(group, operation)
    if not dist.is_initialized():
        raise not_initialised(operation)
    comm = communicator(group)
    check_policy(nonfinite, ("propagate", "raise"), operation)
    check_transport(transport, operation)
    # the transport asked for is compared across ranks before it is chosen: the choice can be collective (the
    # symmetric transport's first support query), and a rank that asked for another would not join it
    asked = transport.name if isinstance(transport, Transport) else transport
    config = ("adasum.all_reduce", f"transport={asked}", f"nonfinite={nonfinite}")
    plan = prepare(tensors, group, config=config, operation=operation, check="call" if check_layout else "none")
    if nonfinite == "raise":
        check_finite(tensors, group, operation=operation)
    if dist.get_world_size(group) == 1:
        warn_one_rank(group, operation)
        return
    try:
        chosen = list_transport(group, transport)
    except ValueError as error:  # a transport the group cannot run: every rank asked for it (checked above)
        raise ValueError(f"{operation}: {error}") from None

    if plan.transport is None:
        plan.transport = chosen
        plan.fusion = fusion(tensors, chosen)

    def run() -> None:
        adasum_list_(tensors, group, chosen, transport)

    key = comm.run(plan.key, tensor_key(tensors), run, group_device(group), first=tensors[0] if tensors else None)
    handle = comm.graphs.handle(key)
    if handle is not None:
        remember(comm, _Last.of(tensors, transport, handle, plan))


def check_transport(transport: object, operation: str) -> None:
    """Raise unless `transport` is a name a caller may give (a row of the movers' table,
    `adasum.transport.registry.transport_names`: the built-ins of `adasum.options.TransportName` and any registered
    since), a `Transport` or None: before the one-rank shortcut, so that a typo raises at every world size
    (TypeError for another type).

    >>> check_transport("p2pp", "adasum.all_reduce")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: adasum.all_reduce: transport must be one of ['p2p', 'collectives', ...] or None, got 'p2pp'
    """
    if transport is None or isinstance(transport, Transport):
        return
    names = list(transport_names())
    if not isinstance(transport, str):
        raise TypeError(f"{operation}: transport must be one of {names}, a Transport or None, got {transport!r}")
    if transport not in names:
        raise ValueError(f"{operation}: transport must be one of {names} or None, got {transport!r}")


def list_transport(
    group: dist.ProcessGroup | None, name: str | Transport | None = None, nbytes: int | None = None
) -> Transport:
    """The transport a list is combined on: `name` (or that very transport), or the fastest the group supports
    (every rank a leader of the tree where the group is a power of two; the slice-parallel schedule serves any
    size; `nbytes`, one dtype's bytes, if given: one-shot where they are few, `adasum.transport.one_shot`)."""
    if isinstance(name, Transport):
        return name
    world = dist.get_world_size(group)
    return transport_for(group, name, world & (world - 1) == 0, nbytes=nbytes)


def adasum_list_(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, transport: Transport,
    name: str | Transport | None = None,
) -> None:
    """Per-tensor Adasum of checked `tensors` in place: one flat buffer per dtype (`fused_per_dtype`, fused as
    `transport`, the list's, takes them; a list it reads in place is not copied) through the schedule of `name` (a
    name or a transport; None: the default for each dtype's bytes, `adasum.transport.select`, whose one-shot mover
    takes the same fusion as the default for the whole list)."""
    fused_per_dtype(
        tensors, lambda flat, sizes: adasum_flat_(flat, sizes, group, transport=name), transport, group=group
    )


_numel = torch.Tensor.numel

RECENT = MAX_GRAPHS
"""Captured list calls a group remembers for the replay's fast path (`_replayed`), as many as the graphs it keeps: a
step that combines several lists (one per block or parameter group, say) replays each without the plan look-up,
whose host time grows with the number of tensors (docs/benchmarks.md, settings)."""


@dataclass(frozen=True)
class _Last:
    """One of the group's recent captured list calls: a repeat on tensors at the same addresses with the same sizes
    (and the same transport keyword) replays its graph without the plan look-up (its checks passed at capture). The
    tensors are held weakly: a caller that drops them (``zero_grad(set_to_none=True)``) frees their memory, and the
    caching allocator may place the next ones there."""

    transport: str | Transport | None
    tensors: tuple  # weak references
    pointers: tuple
    sizes: tuple  # numbers of elements
    shapes: tuple
    dtypes: tuple
    strides: tuple
    graph: tuple  # its graph's `adasum.transport.graphs.Graphs.handle`
    plan: Plan

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], transport, graph: tuple, plan: Plan) -> _Last:
        """The record of a captured call on `tensors` (checked, at least one) with the `transport` keyword."""
        return cls(
            transport, tuple(map(weakref.ref, tensors)), tuple(map(_data_ptr, tensors)), tuple(map(_numel, tensors)),
            tuple(map(_shape, tensors)), tuple(map(_dtype, tensors)), tuple(map(_stride, tensors)),
            graph, plan,
        )

    @property
    def key(self) -> tuple[int, int]:
        """What finds it among the group's recent calls: its number of tensors and the first one's address (a
        repeat's own key: ``(len(tensors), tensors[0].data_ptr())``)."""
        return len(self.pointers), self.pointers[0]


_alive = weakref.ref.__call__


def remember(comm: Communicator, last: _Last) -> None:
    """Keep `last` among `comm`'s recent list calls (`RECENT`), by its `_Last.key`."""
    comm.recent[last.key] = last
    comm.recent.move_to_end(last.key)
    while len(comm.recent) > RECENT:
        comm.recent.popitem(last=False)


def _placed_like(tensors: Sequence[torch.Tensor], last: _Last) -> bool:
    """Whether other tensor objects at the addresses of the call `last`'s (new gradients that the caching allocator
    placed where the last ones were) are what its graph was captured on: the same dtypes, shapes and strides, so
    the same memory, which that call found disjoint and its checks passed on (the dtypes floating, the layouts
    strided; equal addresses put them on its device: CUDA addresses are unified), and, where autograd records,
    none that requires grad (the checked path's own refusal of a leaf an in-place write would fail on)."""
    if tuple(map(_dtype, tensors)) != last.dtypes or tuple(map(_shape, tensors)) != last.shapes:
        return False
    if tuple(map(_stride, tensors)) != last.strides:
        return False
    return not (torch.is_grad_enabled() and any(map(_requires_grad, tensors)))


def _replayed(comm: Communicator, group, transport, tensors, check_layout: bool) -> bool:
    # host time is what the GPU waits for between calls: C-level maps, not a Python loop, and numbers of elements
    # rather than shapes for a recent call's own tensors (a shape is a new torch.Size per tensor; docs/benchmarks.md,
    # where the time goes); the addresses first for other objects, which most often differ (`_placed_like` after
    # them); the fingerprint still goes out (`adasum.checks.plan`). `tensors` is the caller's argument,
    # unchecked: a tensor, or a list or tuple of a recent call's (checked) tensors or of others placed like them.
    # The graph reads and writes each tensor as the elements from its address on, so that call's tensors replay it
    # wherever their addresses and sizes are the same
    if not comm.recent:
        return False
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    elif type(tensors) not in (list, tuple) or not tensors or not isinstance(tensors[0], torch.Tensor):
        return False
    last = comm.recent.get((len(tensors), _data_ptr(tensors[0])))  # a recent call's `_Last.key`
    if last is None or last.transport != transport:
        return False
    same = all(map(operator.is_, map(_alive, last.tensors), tensors))
    try:
        if tuple(map(_data_ptr, tensors)) != last.pointers:
            return False
        if not ((tuple(map(_numel, tensors)) == last.sizes) if same else _placed_like(tensors, last)):
            return False
    except (TypeError, RuntimeError):  # not a tensor, or one without storage or strides (sparse): the checked path
        return False
    graphs = comm.graphs
    if not graphs.replayable(last.graph):  # before the check: the checked path that follows checks the call itself
        return False
    if check_layout:
        recheck(last.plan, group, "adasum.all_reduce", lambda: graphs.launch(last.graph))
    else:
        graphs.launch(last.graph)
    return True


def fused_per_dtype(
    tensors: Sequence[torch.Tensor],
    combine: Callable[..., None],
    transport: Transport | None = None,
    *,
    together: bool = False,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Fuse `tensors` into one flat buffer per dtype (reused between calls on the CPU; the
    transport's own buffer where it has one), run ``combine(flat, sizes)`` on each in place, and copy
    the results back into `tensors`. A transport that reads lists in place (``transport.scattered``:
    symmetric memory) gets contiguous tensors as one `Scattered` buffer instead: no copies.

    ``together=True`` calls ``combine(flats, sizes, indices)`` once with every dtype's buffer (in
    `group_by_dtype` order), its tensors' sizes and their indices in `tensors`: for coefficients
    computed across dtypes (AdaCons' whole-model form). The CPU fusion buffers are `group`'s (its
    `Communicator`'s workspace)."""
    workspace = communicator(group).workspace
    groups = list(group_by_dtype(tensors).values())
    if together:
        per_dtype = [[tensors[i] for i in indices] for indices in groups]
        flats = [flatten(m, workspace.get("fusion", sum(t.numel() for t in m), m[0])) for m in per_dtype]
        combine(flats, [[t.numel() for t in m] for m in per_dtype], groups)
        for flat, m in zip(flats, per_dtype):
            unflatten_into(flat, m)
        return
    for indices in groups:
        members = [tensors[i] for i in indices]
        numel = sum(t.numel() for t in members)
        how = _fusion(members, transport)
        if how == "in place":
            # the transport reads and writes the tensors where they are: no fusion and no copy back
            combine(Scattered(members), [t.numel() for t in members])
            continue
        if how == "view":
            flat = members[0].view(-1)  # no fusion: no workspace either (a captured graph would keep it)
        else:
            buffer = transport.fusion_buffer(numel, members[0]) if transport is not None else None
            flat = flatten(members, buffer if buffer is not None else workspace.get("fusion", numel, members[0]))
        combine(flat, [t.numel() for t in members])
        unflatten_into(flat, members)


Fusion = Literal["in place", "view", "fused"]


def _fusion(members: Sequence[torch.Tensor], transport: Transport | None) -> Fusion:
    """How `fused_per_dtype` hands one dtype's tensors to the combination: "in place" (a `Scattered` list, for a
    transport that reads lists where they lie), "view" (one contiguous tensor, flattened without a copy) or
    "fused" (copied into a flat buffer: the transport's own where it has one, else the group's workspace)."""
    if transport is not None and transport.scattered and len(members) > 1 and all(t.is_contiguous() for t in members):
        return "in place"
    if len(members) == 1 and members[0].is_contiguous():
        return "view"
    return "fused"


def fusion(tensors: Sequence[torch.Tensor], transport: Transport | None) -> tuple[Fusion, ...]:
    """`fused_per_dtype`'s fusion of `tensors` on `transport`, per dtype (in `group_by_dtype` order)."""
    return tuple(_fusion([tensors[i] for i in indices], transport) for indices in group_by_dtype(tensors).values())


def all_reduce_async(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    check_layout: bool = True,
    nonfinite: Nonfinite = "propagate",
    transport: TransportName | Transport | None = None,
) -> torch.futures.Future:
    """`all_reduce`, returning a Future of the list of tensors.

    On NCCL the work is enqueued on the current CUDA stream and the host does not wait for it
    (the layout check waits on the CPU control group on a layout's first call only, which
    ``check_layout=False`` removes; the non-finite check reads the device, which
    ``nonfinite="raise"`` adds);
    consumers on the same stream see the result. On gloo the exchanges complete before it returns.
    Its errors are `all_reduce`'s, raised by the call (not by the Future) and naming
    ``adasum.all_reduce_async``; ranks may mix the two entry points.
    """
    listed = tensor_list(tensors, "adasum.all_reduce_async")
    _all_reduce(listed, group, check_layout, nonfinite, transport, "adasum.all_reduce_async")
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(listed)
    return future
