"""One road for every call: a plan per (group, layout, configuration), built once and reused.

Every entry point that combines across ranks (`adasum.all_reduce`, `all_reduce_async`, each
reducer's `all_reduce`, `all_reduce_flat` and `all_reduce_shards`, the DDP hook's batch, the delta
combiner's bucket) asks `prepare` for its plan before any data moves (through
`adasum.transport.communicator.Communicator.plan`, unless a repeat replays). A plan lives in the group's
`Communicator` and records what was decided for that layout once: its description and fingerprint, the checks
done (agreed across ranks; the tensors whose memory was found disjoint), and the executions planned on it
(`adasum.collectives.api.plan_call`: the schedule, the mover per dtype, the fusion; a list's transport and fusion
recorded here). `prepare` then does the per-call part, the same on every entry point:

* local problems (`adasum.checks.agreement.local_problem`; with `sizes`, a size that is not an integer, a
  negative size or sizes that do not add up to the buffer's elements); the memory-overlap search runs once per
  set of addresses, not per call (a plan remembers its last `DISJOINT` sets, a group its last `MAX_PLANS` plans:
  gradients re-made at new addresses every call, or a new layout every call, keep memory flat);
* the cross-rank check, by `check`: ``"call"`` compares the plan's fingerprint across ranks on
  every call, ``"once"`` on the plan's first call only, ``"none"`` never (the caller agreed
  the layout otherwise).

How a call's fingerprint is compared (``check="call"``):

* gloo (CPU tensors): one all-reduce (MAX) of the fingerprint, its negation and a problem flag on
  the checks' own group, before any data moves. Ranks whose layouts or configurations differ, or
  whose calls come in a different order, get the same ValueError on every rank naming the first
  difference and the ranks; nothing was changed.
* NCCL (``deferred_checks``, on by default where the group's device is a GPU): every checked call
  hands its plan to the group's guard (`adasum.checks.guard`), a thread that compares the i-th
  checked call of every rank with its peers' on a gloo group of its own. A plan's first call, and a
  call with a local problem, wait for the verdict (nothing moves before it; an error leaves the
  group usable). Later calls do not wait: the call appends its plan (a few microseconds) and its
  data goes on. A divergent one is named by the thread within 0.1 s on every rank; the
  error is kept and raised on every rank by the same later call, the `adasum.checks.guard.LAG`-th
  after the divergent one, and every call after it (ValueError, ending ``(a call already under way on
  some rank: its result is undefined; destroy the process group)``), so that no rank enqueues a
  collective its peers never match; where the device does not drain, the group's NCCL communicator is
  aborted, which ends kernels that wait for data no peer sends: by the call that raises the error, or by
  the guard where the rank made no call for `adasum.checks.guard.ABORT_AFTER_S` (it is blocked on the
  device behind such a kernel).
  A divergence no call raised yet, and ranks that made different numbers of checked calls, are raised on
  every rank by the group's next ``torch.distributed.barrier``, `adasum.release` or ``destroy_process_group``
  (a line on stderr at exit: the guard's fences, `adasum.checks.guard`).
  Afterwards the process group must be destroyed and training restarted (docs/faults.md).
  Where the group's backend has no communicator abort (gloo, with ``deferred_checks=True``), every call also
  waits for the guard's comparison of its message sizes (`adasum.checks.guard.Guard.sizes_first`): data of
  other sizes is never sent (gloo would kill the process); such a difference raises at the call on every rank.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from adasum.checks.agreement import (
    Problem,
    _data_ptr,
    _dtype,
    _layout,
    _shape,
    _stride,
    agree,
    describe,
    describe_flat,
    local_problem,
    signature,
)
from adasum.checks.guard import guard_of
from adasum.settings import current
from adasum.transport.caches import MOST
from adasum.transport.communicator import Communicator, communicator
from adasum.transport.errors import failures_named
from adasum.transport.groups import group_device

Check = Literal["call", "once", "none"]

MAX_PLANS = MOST
"""Plans a group keeps: 512, the bound of every per-layout cache (`adasum.transport.caches`); the least recently
used goes first (its layout's next call builds it again and compares it as a first call)."""
DISJOINT = 8
"""Sets of addresses a plan remembers as free of shared memory (the oldest goes first): gradients re-made at new
addresses every call are searched every call, as they were before any was remembered, and kept within this."""


@dataclass
class Plan:
    """What one (group, layout, configuration) needs, decided on its first call (module doc)."""

    config: tuple
    description: list
    fingerprint: int
    agreed: bool = False  # every rank has passed this layout and configuration (checked across ranks)
    disjoint: dict = field(default_factory=dict)  # addresses and strides found free of shared memory (`DISJOINT`)
    transport: Any = None  # a list's mover (its first dtype's), as its execution chose it (`api.plan_call`)
    uses: int = 0
    key: Hashable = None  # what names it in its communicator (and its CUDA graphs, `Communicator.run`)
    fusion: tuple[str, ...] | None = None  # per dtype: "in place", "view" or "fused", as its execution fuses
    runs: dict = field(default_factory=dict)  # its executions by entry point and placement (`api.plan_call`)
    sizes: int | None = None  # the fingerprint of its message sizes, where the guard compares them first (guard.py)


def _layout_key(tensors: Sequence[torch.Tensor], sizes: Sequence[int] | None) -> tuple:
    # C-level maps: this runs on every call (tensors on several devices are a local problem, found every call)
    device = tensors[0].device.type if tensors else None
    if sizes is not None:
        return (tensors[0].dtype, device, sum(b.numel() for b in tensors), tuple(sizes))
    return (device, tuple(map(_dtype, tensors)), tuple(map(_shape, tensors)))


def _addresses(tensors: Sequence[torch.Tensor]) -> tuple | None:
    """What the memory-overlap verdict depends on besides the layout: addresses and strides (None: not dense)."""
    if any(layout != torch.strided for layout in map(_layout, tensors)) or (tensors and tensors[0].is_meta):
        return None
    return (tuple(map(_data_ptr, tensors)), tuple(map(_stride, tensors)))


def plan_for(comm: Communicator, tensors: Sequence[torch.Tensor], sizes: Sequence[int] | None, config: tuple) -> Plan:
    """The plan of this layout and configuration on `comm`'s group, built on its first call."""
    key: Hashable = (config, sizes is not None, _layout_key(tensors, sizes))
    plans = comm.plans
    plan = plans.get(key)
    if plan is None:
        description = describe_flat(tensors[0], sizes) if sizes is not None else describe(tensors)
        plan = plans[key] = Plan(config, description, signature([config, *description]), key=key)
        comm.plans_built += 1
        while len(plans) > MAX_PLANS:
            del plans[next(iter(plans))]
    elif plan.uses % 64 == 0:  # now and then: a plan in use stays (a C-level move, not on every call)
        plans[key] = plans.pop(key)
    plan.uses += 1
    return plan


def _integers(sizes: Sequence[Any]) -> tuple[tuple[Any, ...], Problem | None]:
    """`sizes` as ints (`operator.index`: Python, NumPy and 0-d torch integers; a float is not one), and the problem
    of the first that is not an integer; those stay as they are, so that the layout's description shows them."""
    try:
        return tuple(map(operator.index, sizes)), None
    except TypeError:
        pass
    given: list[Any] = []
    problem = None
    for i, n in enumerate(sizes):
        try:
            given.append(operator.index(n))
        except TypeError:
            given.append(n if isinstance(n, (int, float)) else repr(n))
            if problem is None:
                problem = Problem("TypeError", f"sizes must be integers, got {n!r} at index {i}")
    return tuple(given), problem


def _problem(plan: Plan, tensors: Sequence[torch.Tensor], sizes: Sequence[int] | None, device: torch.device,
             group: dist.ProcessGroup | None, in_place: bool, floating: bool,
             not_integer: Problem | None = None) -> Problem | None:
    where = _addresses(tensors) if in_place else None
    problem = local_problem(tensors, device, in_place=in_place, floating=floating, group=group,
                            disjoint=where in plan.disjoint)
    if problem is None and where is not None and where not in plan.disjoint:
        plan.disjoint[where] = None
        if len(plan.disjoint) > DISJOINT:
            del plan.disjoint[next(iter(plan.disjoint))]
    if problem is None and not_integer is not None:
        return not_integer
    if problem is None and sizes is not None:
        if sizes and min(sizes) < 0:
            i = next(i for i, n in enumerate(sizes) if n < 0)
            return Problem("ValueError", f"sizes must be >= 0, got {sizes[i]} at index {i}")
        numel = sum(b.numel() for b in tensors)
        if sum(sizes) != numel:
            problem = Problem("ValueError", f"sizes add up to {sum(sizes)} elements, the buffer has {numel}")
    return problem


def prepare(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    config: tuple,
    operation: str,
    what: str = "tensors",
    sizes: Sequence[Any] | None = None,
    check: Check = "call",
    in_place: bool = True,
    floating: bool = True,
) -> Plan:
    """The plan of this call (module doc), after its checks: raises the same error on every rank of `group`
    where ranks differ (with `check`), else this rank's local problem on this rank. `tensors` is the list, or
    ``[buffer]`` with the `sizes` of its segments; `config` names everything besides the layout that must be
    equal on every rank (the operation, the reducer and its options, the transport, the policies); the settings
    that shape the schedule and differ from their defaults join it (`adasum.settings.Settings.shaping`). With
    `sizes`, `tensors` may be several buffers of one dtype whose segments are `sizes` end to end."""
    comm = communicator(group)
    world = dist.get_world_size(group)
    not_integer = None
    if sizes is not None:
        sizes, not_integer = _integers(sizes)
    plan = plan_for(comm, tensors, sizes, config + current().shaping)
    device = group_device(group)
    in_place = in_place and world > 1  # a world of one writes nothing
    problem = _problem(plan, tensors, sizes, device, group, in_place, floating, not_integer)
    if world == 1 or check == "none" or (check == "once" and plan.agreed):
        if problem is not None:
            raise problem.exception(operation, dist.get_rank(group))
        return plan
    if not _deferred(device):
        with failures_named(operation, "the layout check", group):
            agree(plan.description, problem, group, what, operation, plan.config)
    elif plan.agreed and problem is None:
        guard_of(comm, group).post(plan, what, operation)  # compared off the call's path
        return plan
    else:
        guard_of(comm, group).check(plan, problem, what, operation)
    plan.agreed = True
    return plan


def _deferred(device: torch.device) -> bool:
    deferred = current().deferred_checks
    return device.type == "cuda" if deferred is None else deferred


def recheck(plan: Plan, group: dist.ProcessGroup | None, operation: str, launch: Callable[[], object],
            what: str = "tensors") -> None:
    """The cross-rank part of ``check="call"`` for a repeat of an agreed plan on a GPU (a replayed graph, whose
    plan look-up is skipped), around `launch` (the replay): where checks are deferred, a kept error is raised and
    the guard waited for before the launch (`adasum.checks.guard.Guard.reserve`), and the fingerprint posted
    after it, off the host time the device waits for; else it is compared at once, before the launch."""
    if _deferred(_CUDA):
        guard = guard_of(communicator(group), group)
        guard.reserve()
        launch()
        guard.post(plan, what, operation, reserved=True)
        return
    with failures_named(operation, "the layout check", group):
        agree(plan.description, None, group, what, operation, plan.config)
    launch()


_CUDA = torch.device("cuda")
