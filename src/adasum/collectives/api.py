"""The user-facing collective, `all_reduce` and `all_reduce_async` of lists of tensors, and the planner of every
entry point (`plan_call`, `adasum.transport.communicator.Communicator.plan`): a call's plan, decided once per
layout and configuration, holds the checks' verdict, one `Schedule` per dtype (the mover its bytes allow, the
schedule that mover serves, the fusion into one flat buffer) and the graph key; `Communicator.run` executes it."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from adasum.checks.agreement import tensor_list
from adasum.checks.nonfinite import check_finite
from adasum.checks.plan import Check, Plan, prepare, recheck
from adasum.collectives.hierarchical import adasum_hierarchical_flat_
from adasum.collectives.vhdd import adasum_flat_, transport_for
from adasum.core.layout import Scattered, flatten, group_by_dtype, unflatten_into
from adasum.options import Nonfinite, TransportName, check_flag, check_option, not_initialised
from adasum.transport.alone import warn_one_rank
from adasum.transport.base import Transport
from adasum.transport.communicator import Communicator, communicator, register_planner
from adasum.transport.groups import check_group, group_device
from adasum.transport.registry import serves, transport_names
from adasum.transport.topology import Hierarchy, Topology


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
    if check_layout is not True and check_layout is not False:
        check_flag(operation, "check_layout", check_layout)
    entry = ("adasum.all_reduce", transport)
    # a repeat of a recent captured call: the very tensors it checked (so no type check of the list either)
    if nonfinite == "propagate" and (group is None or isinstance(group, dist.ProcessGroup)) and dist.is_initialized():
        if communicator(group).replay(entry, tensors, check_layout):
            return
    tensors = tensor_list(tensors, operation)
    check_group(group, operation)
    if not dist.is_initialized():
        raise not_initialised(operation)
    comm = communicator(group)
    check_option(f"{operation}: nonfinite", nonfinite, Nonfinite, ("propagate", "raise"))
    check_transport(transport, operation)
    # the transport asked for is compared across ranks before it is chosen: the choice can be collective (the
    # symmetric transport's first support query), and a rank that asked for another would not join it
    asked = transport.name if isinstance(transport, Transport) else transport
    config = ("adasum.all_reduce", f"transport={asked}", f"nonfinite={nonfinite}")
    check: Check = "call" if check_layout else "none"
    if nonfinite == "raise":  # the layout agreed first, then the values, before the schedule is chosen
        prepare(tensors, group, config=config, operation=operation, check=check)
        check_finite(tensors, group, operation=operation)
        check = "none"
    plan = comm.plan(entry, tensors, ADASUM, config=config, operation=operation, check=check, transport=transport,
                     moves=True, checked_as="adasum.all_reduce")
    if dist.get_world_size(group) == 1:
        warn_one_rank(group, operation)
    comm.run(plan, tensors)


@dataclass(frozen=True)
class AdasumOp:
    """The op `plan_call` plans itself: Adasum on the schedules of this layer (VHDD, slice-parallel, one-shot, in
    place), on the mover the plan picks per dtype (`Schedule`). The default, `ADASUM`, is per tensor over the whole
    group. `whole`: one pair of coefficients per dtype (the whole-model variant: each dtype's tensors one segment).
    `tiers`: a hierarchy (`adasum.transport.topology.Hierarchy`, `adasum.collectives.hierarchical.build_hierarchy`):
    Adasum over the node means, or the flat tree in two tiers where it is exact. `shards`: a shard grid
    (`adasum.transport.topology.ShardGroups`) whose replicas combine this rank's shard of each tensor (`segments`,
    the shard sizes end to end) with the whole tensors' coefficients: one shard per replica on the replicate group's
    own tree, more over the grid's peers at offset 0 (`Reducer.all_reduce_shards`)."""

    whole: bool = False
    tiers: Topology | None = None
    shards: Topology | None = None
    segments: tuple[int, ...] | None = None


ADASUM = AdasumOp()
"""Adasum per tensor over the whole group (`AdasumOp`)."""

Fusion = Literal["in place", "view", "fused"]
Kind = Literal["vhdd", "in place", "slices", "one-shot", "node means", "two tiers"]


@dataclass(frozen=True)
class Schedule:
    """How one dtype's tensors of a call are combined, decided once per layout and configuration (`plan_call`):
    `indices` (the call's tensors of this dtype), the `sizes` of the segments its coefficients are per (the tensors',
    or one for the whole-model variant), the `mover` (the transport the group, the placement and the bytes allow:
    `adasum.collectives.vhdd.transport_for`, `adasum.transport.select`), the schedule it serves (`kind`: "vhdd", the
    VHDD levels; "in place", the same with a tensor larger than a round on the mover's in-place mover; "slices", the
    slice-parallel schedule; "one-shot", every rank takes every copy whole, `adasum.collectives.slices`; "node means"
    and "two tiers", a hierarchy's, `adasum.collectives.hierarchical`, whose tree across nodes runs on `mover` and
    whose two tiers' node schedule on `inner`) and the `fusion` (`_fusion`; with `workspace`, a fused buffer is the
    group's workspace, never the mover's: the whole-model variant's and a hierarchy's). Every schedule runs on these
    movers: none is chosen again below the plan."""

    indices: tuple[int, ...]
    sizes: tuple[int, ...]
    mover: Transport
    kind: Kind
    fusion: Fusion
    inner: Transport | None = None
    workspace: bool = False


@dataclass(eq=False)
class Execution:
    """A call's plan (`plan_call`; the `adasum.transport.communicator.Runnable` that `Communicator.run`
    executes): the checks' `verdict` (`adasum.checks.plan.Plan`), the `schedules` (one per dtype where the op is
    an `AdasumOp`, else none: the op is the caller's own), what ``execute(tensors)`` runs (`work`), and the fields the
    communicator reads (`entry`, `key`, `device`, `capturable`, `moves`, `exact`, `check`)."""

    verdict: Plan
    entry: Hashable
    key: Hashable
    device: torch.device
    capturable: bool
    moves: bool
    exact: bool
    check: Callable[[Callable[[], None]], None] | None
    schedules: tuple[Schedule, ...]
    work: Callable[[Sequence[torch.Tensor]], None]

    def execute(self, tensors: Sequence[torch.Tensor]) -> None:
        """Combine `tensors` (the call's, of this plan's layout) as planned."""
        self.work(tensors)


RUNS = 8
"""Executions a verdict keeps (the oldest goes first): one per entry point, reducer object and placement that calls
on its layout and configuration (a reducer made anew every call plans anew; memory stays flat)."""


def plan_call(
    comm: Communicator,
    entry: Hashable,
    tensors: Sequence[torch.Tensor],
    op: str | Callable[[Sequence[torch.Tensor]], None],
    topology: Topology | None = None,
    *,
    config: tuple,
    operation: str,
    what: str = "tensors",
    sizes: Sequence[Any] | None = None,
    check: Check = "call",
    transport: str | Transport | None = None,
    capturable: bool = True,
    moves: bool = False,
    checked_as: str | None = None,
) -> Execution:
    """`Communicator.plan`: the checks' verdict on this call (`adasum.checks.plan.prepare`, by `check`, with
    `config`, `operation`, `what` and `sizes` as it takes them: raises on every rank where ranks differ), then the
    execution decided once for its layout, configuration, `entry` and `topology` (kept with the verdict, `RUNS`).

    `tensors` is the call's list, or ``[buffer]`` with `sizes`, or several buffers of one dtype whose segments are
    `sizes` end to end (a DDP batch: combined as one list of its segments). `op` is an `AdasumOp` (`ADASUM`, or a
    reducer's whole-model, hierarchical or sharded form: planned here, per dtype the mover that the group, the
    placement and the bytes allow, `transport` if named, the schedule that mover serves and the fusion, `Schedule`)
    or ``op(tensors)``, a reducer's own combination of the call's tensors, run as it is.
    `capturable`: the op never waits on the host (CUDA graphs may hold it); `moves`: the caller re-makes the list's
    tensors (`adasum.transport.communicator.MOVED_CALLS`); `checked_as`: the operation a replay's cross-rank check
    names (default `operation`). The graph key is the verdict's key with the entry and the topology."""
    group = comm.group
    verdict = prepare(tensors, group, config=config, operation=operation, what=what, sizes=sizes, check=check)
    several = sizes is not None and len(tensors) > 1
    native = isinstance(op, AdasumOp)
    local: Hashable = (entry, topology, tuple(map(_numel, tensors)) if several else None,
                       tuple(map(_contiguous, tensors)) if native and sizes is None else None)
    runs = verdict.runs
    found = runs.get(local)
    if found is not None:
        return found
    schedules: tuple[Schedule, ...] = ()
    if not native:
        work = cast(Callable[[Sequence[torch.Tensor]], None], op)
    else:
        ints = None if sizes is None else tuple(map(operator.index, sizes))
        schedules, work = _planned(comm, tensors, ints, topology, cast(AdasumOp, op), transport, operation)
        capturable = capturable and bool(schedules)  # one rank, or no tensors: nothing to capture
        # what the plan records (`adasum.checks.plan.Plan`): the mover that runs (its first dtype's) and the fusion
        verdict.transport = schedules[0].mover if schedules else None
        verdict.fusion = tuple(s.fusion for s in schedules)
    recheck_as = checked_as or operation
    found = runs[local] = Execution(
        verdict, entry, (verdict.key, entry, topology), group_device(group), capturable, moves and sizes is None,
        sizes is not None, functools.partial(recheck, verdict, group, recheck_as, what=what), schedules, work,
    )
    while len(runs) > RUNS:
        del runs[next(iter(runs))]
    return found


register_planner(plan_call)


def _nothing(tensors: Sequence[torch.Tensor]) -> None:
    """A group of one rank: nothing to combine."""


def _planned(
    comm: Communicator, tensors: Sequence[torch.Tensor], sizes: tuple[int, ...] | None, topology: Topology | None,
    op: AdasumOp, transport: str | Transport | None, operation: str,
) -> tuple[tuple[Schedule, ...], Callable[[Sequence[torch.Tensor]], None]]:
    """`op`'s schedules for `plan_call` and the work that runs them."""
    group = comm.group
    if op.shards is not None:  # one shard per replica: the replicate group's tree; more: the grid's, at offset 0
        grid = op.shards
        group, topology = (grid.replicate, None) if grid.shards == 1 else (grid.group, grid.at(0))
        sizes = op.segments
    peers = dist.get_world_size(group) if topology is None else len(topology.peers)
    if peers == 1:
        return (), _nothing
    if sizes is None:
        schedules = _list_schedules(group, tensors, transport, operation, op)
        return schedules, functools.partial(_run_list, comm, op.tiers, schedules)
    if len(tensors) == 1:
        schedule = _one_schedule(group, (0,), (tensors[0].numel(),) if op.whole else sizes, tensors[0], topology,
                                 transport, operation, op, "view")
        return (schedule,), functools.partial(_run_flat, group, topology, op.tiers, schedule)
    cuts = _cuts(tensors, sizes)
    schedules = _list_schedules(group, _segments(tensors, cuts), transport, operation, op)
    return schedules, functools.partial(_run_batch, comm, op.tiers, cuts, schedules)


def _mover(group: dist.ProcessGroup | None, name: str | Transport | None, nbytes: int, topology: Topology | None,
           operation: str) -> Transport:
    """The mover of `nbytes` bytes of one dtype: `name` (or that very transport), else the fastest that the group
    (every rank a leader of the tree where it is a power of two; `topology`'s placement, if given) and the bytes
    allow (`adasum.collectives.vhdd.transport_for`)."""
    if isinstance(name, Transport):
        return name
    peers = dist.get_world_size(group) if topology is None else len(topology.peers)
    try:
        return transport_for(group, name, topology is None and peers & (peers - 1) == 0, topology is not None,
                             nbytes)
    except ValueError as error:  # a transport the group cannot run: every rank asked for it (checked before)
        raise ValueError(f"{operation}: {error}") from None


def _kind(mover: Transport, sizes: Sequence[int], element_size: int) -> Kind:
    """The schedule `mover` serves for tensors of `sizes` (its row of the movers' table,
    `adasum.transport.registry.serves`)."""
    if serves(mover) == "slices":
        return "one-shot" if mover.name == "one-shot" else "slices"
    capacity = mover.round_elements(element_size)
    large = capacity is not None and mover.in_place is not None and any(n > capacity for n in sizes)
    return "in place" if large else "vhdd"


def _one_schedule(group: dist.ProcessGroup | None, indices: tuple[int, ...], sizes: tuple[int, ...],
                  like: torch.Tensor, topology: Topology | None, name: str | Transport | None, operation: str,
                  op: AdasumOp, fusion: Fusion) -> Schedule:
    """The `Schedule` of one dtype's segments of `sizes` (elements like `like`'s) under `op`: on a hierarchy, its
    tree across nodes on the placed mover of `op.tiers`' group (a tier of one rank per node: the group's own, for
    the whole buffer's bytes) and, in two tiers, the node group's slice-parallel mover; else the mover of the group
    (over `topology`'s placement) for the bytes."""
    size = like.element_size()
    nbytes = sum(sizes) * size
    tiers = op.tiers
    if tiers is None:
        mover = _mover(group, name, nbytes, topology, operation)
        # a placement runs the VHDD levels on its slice as they are (no rounds: `adasum_flat_`)
        return Schedule(indices, sizes, mover, "vhdd" if topology is not None else _kind(mover, sizes, size), fusion)
    if tiers.local_size == 1:  # one rank per node: the flat tree of the group
        mover = _mover(tiers.group, None, nbytes, None, operation)
        return Schedule(indices, sizes, mover, _kind(mover, sizes, size), fusion)
    outer = _mover(tiers.group, None, nbytes, tiers.at(0), operation)  # a placement's: the bytes do not choose
    if not tiers.exact:
        return Schedule(indices, sizes, outer, "node means", fusion)
    inner = transport_for(tiers.local_group, "slices", whole_group=True)
    return Schedule(indices, sizes, outer, "two tiers", fusion, inner)


def _list_schedules(group: dist.ProcessGroup | None, tensors: Sequence[torch.Tensor],
                    name: str | Transport | None, operation: str, op: AdasumOp = ADASUM) -> tuple[Schedule, ...]:
    """One `Schedule` per dtype of `tensors` (in `group_by_dtype` order). The whole-model variant and a hierarchy
    fuse into the group's workspace (no mover reads their lists in place)."""
    out = []
    for indices in group_by_dtype(tensors).values():
        members = [tensors[i] for i in indices]
        sizes = tuple(t.numel() for t in members)
        segments = (sum(sizes),) if op.whole else sizes
        schedule = _one_schedule(group, tuple(indices), segments, members[0], None, name, operation, op, "fused")
        own = op.whole or op.tiers is not None
        out.append(replace(schedule, fusion=_fusion(members, None if own else schedule.mover), workspace=own))
    return tuple(out)


def _run_list(comm: Communicator, tiers: Topology | None, schedules: Sequence[Schedule],
              tensors: Sequence[torch.Tensor]) -> None:
    """Each dtype's tensors as its `Schedule` says: fused (into the mover's own buffer where it has one, else the
    group's workspace), viewed or handed over in place, combined on its movers, and copied back."""
    for schedule in schedules:
        members = [tensors[i] for i in schedule.indices]
        flat: torch.Tensor | Scattered
        if schedule.fusion == "in place":  # the mover reads and writes the tensors where they are
            adasum_flat_(Scattered(members), schedule.sizes, comm.group, transport=schedule.mover)
            continue
        if schedule.fusion == "view":
            flat = members[0].view(-1)  # no fusion: no workspace either (a captured graph would keep it)
        else:
            numel = sum(schedule.sizes)
            buffer = None if schedule.workspace else schedule.mover.fusion_buffer(numel, members[0])
            flat = flatten(members, buffer if buffer is not None else comm.workspace.get("fusion", numel, members[0]))
        _combine(flat, comm.group, None, tiers, schedule)
        unflatten_into(flat, members)


def _combine(flat: torch.Tensor, group: dist.ProcessGroup | None, topology: Topology | None,
             tiers: Topology | None, schedule: Schedule) -> None:
    """One flat buffer of one dtype on its `Schedule`'s movers: the hierarchy's schedule where `tiers` is given,
    else the tree over the group (over `topology`'s placement, if given)."""
    if tiers is None:
        adasum_flat_(flat, schedule.sizes, group, topology, transport=schedule.mover)
    else:
        adasum_hierarchical_flat_(flat, schedule.sizes, cast(Hierarchy, tiers), mover=schedule.mover,
                                  inner=schedule.inner)


def _run_flat(group: dist.ProcessGroup | None, topology: Topology | None, tiers: Topology | None,
              schedule: Schedule, tensors: Sequence[torch.Tensor]) -> None:
    """One flat buffer on its `Schedule`'s movers (over `topology`'s placement, if given; a hierarchy's schedule
    where `tiers` is given)."""
    on_flat(tensors[0], lambda flat: _combine(flat, group, topology, tiers, schedule))


def _cuts(buffers: Sequence[torch.Tensor], sizes: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Each buffer's share of `sizes` (segments end to end over the buffers)."""
    out, start = [], 0
    for buffer in buffers:
        end, filled = start, 0
        while filled < buffer.numel() and end < len(sizes):
            filled += sizes[end]
            end += 1
        out.append(tuple(sizes[start:end]))
        start = end
    if start < len(sizes):  # empty segments at the end
        out[-1] = (*out[-1], *sizes[start:])
    return tuple(out)


def _segments(buffers: Sequence[torch.Tensor], cuts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The segments of `buffers` (flat), as `cuts` cut them."""
    return [view for buffer, cut in zip(buffers, cuts) for view in buffer.view(-1).split(list(cut))]


def batch_segments(buffers: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
    """The segments of several flat buffers whose segments are `sizes` end to end (a DDP batch), as views."""
    return _segments(buffers, _cuts(buffers, sizes))


def _run_batch(comm: Communicator, tiers: Topology | None, cuts: Sequence[Sequence[int]],
               schedules: Sequence[Schedule], buffers: Sequence[torch.Tensor]) -> None:
    """Several buffers, their segments combined as one list (per-tensor coefficients: the same either way)."""
    _run_list(comm, tiers, schedules, _segments(buffers, cuts))


def on_flat(buffer: torch.Tensor, combine: Callable[[torch.Tensor], None]) -> None:
    """``combine(flat)`` on `buffer`'s elements in order (row-major) as one contiguous vector: a view of it, or of
    a contiguous copy written back where it is not contiguous."""
    if buffer.is_contiguous():
        combine(buffer if buffer.dim() == 1 else buffer.view(-1))
        return
    flat = buffer.contiguous().view(-1)
    combine(flat)
    buffer.copy_(flat.view(buffer.shape))


def check_transport(transport: object, operation: str) -> None:
    """Raise unless `transport` is a name a caller may give (a row of the movers' table,
    `adasum.transport.registry.transport_names`: the built-ins of `adasum.options.TransportName` and any registered
    since), a `Transport` or None: before the one-rank shortcut, so that a typo raises at every world size
    (TypeError for another type).

    >>> check_transport("p2pp", "adasum.all_reduce")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: adasum.all_reduce: transport must be one of ['p2p', 'collectives', ...] or None, got 'p2pp'; pass ...
    """
    if transport is None or isinstance(transport, Transport):
        return
    names = list(transport_names())
    if not isinstance(transport, str):
        raise TypeError(
            f"{operation}: transport must be one of {names}, a Transport or None, got {transport!r}; pass one of "
            "them, or None to let adasum choose"
        )
    if transport not in names:
        raise ValueError(
            f"{operation}: transport must be one of {names} or None, got {transport!r}; pass one of them, or None "
            "to let adasum choose"
        )


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
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, transport: Transport | None = None,
    name: str | Transport | None = None,
) -> None:
    """Per-tensor Adasum of checked `tensors` in place, as `ADASUM`'s plan runs it (`Schedule`: per dtype the mover
    of `name`, or of `transport`, or the default for its bytes, its fusion), planned for this call alone."""
    if dist.get_world_size(group) == 1:
        return
    chosen = name if name is not None else transport
    _run_list(communicator(group), None, _list_schedules(group, tensors, chosen, "adasum.all_reduce"), tensors)


_numel, _contiguous = torch.Tensor.numel, torch.Tensor.is_contiguous


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
