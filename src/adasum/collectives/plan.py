"""One road for every call: a plan per (group, layout, configuration), built once and reused.

Every entry point that combines across ranks (`adasum.all_reduce`, `all_reduce_async`, each
reducer's `all_reduce` and `all_reduce_flat`, the DDP hook) asks `prepare` for its plan before any
data moves. A plan lives in the group's `Communicator` and records what was decided for that
layout once: its description and fingerprint, the checks done (agreed across ranks; the tensors
whose memory was found disjoint), the transport and the fusion. `prepare` then does the per-call
part, the same on every entry point:

* local problems (`adasum.collectives.agreement.local_problem`); the memory-overlap search runs
  once per set of addresses, not per call;
* the cross-rank check, by `check`: ``"call"`` compares the plan's fingerprint across ranks on
  every call, ``"once"`` on the plan's first call only, ``"none"`` never (the caller agreed
  the layout otherwise).

How a call's fingerprint is compared (``check="call"``):

* gloo (CPU tensors): one all-reduce (MAX) of the fingerprint, its negation and a problem flag on
  the checks' own group, before any data moves. Ranks whose layouts or configurations differ, or
  whose calls come in a different order, get the same ValueError on every rank naming the first
  difference and the ranks; nothing was changed.
* NCCL: the plan's first call is checked as on gloo (a host round trip on the CPU control group,
  no device synchronisation). Later calls post the fingerprint on the control group without
  waiting (`_post_fingerprint`) and compare it at the group's next call, before that call's data
  moves. A divergent call is named there on every rank; its own data collectives were already
  enqueued: its result is undefined, and if the divergent layouts differ in size its NCCL kernels
  may never finish, so after the error the process group must be destroyed (on NCCL,
  ``destroy_process_group`` aborts the communicator) and training restarted (docs/faults.md).
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from adasum.collectives.agreement import (
    Problem,
    agree,
    describe,
    describe_flat,
    local_problem,
    raise_difference,
    signature,
)
from adasum.settings import current
from adasum.transport.groups import Communicator, communicator, failures_named, group_device

Check = Literal["call", "once", "none"]


@dataclass
class Plan:
    """What one (group, layout, configuration) needs, decided on its first call (module doc)."""

    config: tuple
    description: list
    fingerprint: int
    agreed: bool = False  # every rank has passed this layout and configuration (checked across ranks)
    disjoint: set = field(default_factory=set)  # addresses and strides found free of shared memory
    transport: Any = None  # the transport chosen for it, where the entry point picks one
    uses: int = 0
    key: Hashable = None  # what names it in its communicator (and its CUDA graphs, `Communicator.run`)
    fusion: tuple[str, ...] | None = None  # per dtype, at its first call: "in place", "view" or "fused" (`api.fusion`)


_dtype, _shape, _layout = operator.attrgetter("dtype"), operator.attrgetter("shape"), operator.attrgetter("layout")
_data_ptr, _stride = torch.Tensor.data_ptr, torch.Tensor.stride


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
    plan = comm.plans.get(key)
    if plan is None:
        description = describe_flat(tensors[0], sizes) if sizes is not None else describe(tensors)
        plan = comm.plans[key] = Plan(config, description, signature([config, *description]), key=key)
        comm.plans_built += 1
    plan.uses += 1
    return plan


def _problem(plan: Plan, tensors: Sequence[torch.Tensor], sizes: Sequence[int] | None, device: torch.device,
             group: dist.ProcessGroup | None, in_place: bool, floating: bool) -> Problem | None:
    where = _addresses(tensors) if in_place else None
    problem = local_problem(tensors, device, in_place=in_place, floating=floating, group=group,
                            disjoint=where in plan.disjoint)
    if problem is None and where is not None:
        plan.disjoint.add(where)
    numel = sum(b.numel() for b in tensors)
    if problem is None and sizes is not None and sum(sizes) != numel:
        problem = Problem("ValueError", f"sizes add up to {sum(sizes)} elements, the buffer has {numel}")
    return problem


def prepare(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    config: tuple,
    operation: str,
    what: str = "tensors",
    sizes: Sequence[int] | None = None,
    check: Check = "call",
    in_place: bool = True,
    floating: bool = True,
) -> Plan:
    """The plan of this call (module doc), after its checks: raises the same error on every rank of `group`
    where ranks differ (with `check`), else this rank's local problem on this rank. `tensors` is the list, or
    ``[buffer]`` with the `sizes` of its segments; `config` names everything besides the layout that must be
    equal on every rank (the operation, the reducer and its options, the transport, the policies). With
    `sizes`, `tensors` may be several buffers of one dtype whose segments are `sizes` end to end."""
    comm = communicator(group)
    world = dist.get_world_size(group)
    plan = plan_for(comm, tensors, sizes, config)
    device = group_device(group)
    in_place = in_place and world > 1  # a world of one writes nothing
    problem = _problem(plan, tensors, sizes, device, group, in_place, floating)
    if world == 1 or check == "none" or (check == "once" and plan.agreed):
        if problem is not None:
            raise problem.exception(operation, dist.get_rank(group))
        return plan
    with failures_named(operation, "the layout check", group):
        settle(comm, group)
        deferred = current().deferred_checks
        if plan.agreed and problem is None and (device.type == "cuda" if deferred is None else deferred):
            _post_fingerprint(comm, plan, group, what, operation)
        else:
            agree(plan.description, problem, group, what, operation, plan.config)
            plan.agreed = True
    return plan


def recheck(plan: Plan, group: dist.ProcessGroup | None, operation: str, what: str = "tensors") -> None:
    """The cross-rank part of ``check="call"`` for a repeat of an agreed plan on NCCL (a replayed graph, whose
    plan look-up is skipped): compare the earlier fingerprints, post this one."""
    comm = communicator(group)
    with failures_named(operation, "the layout check", group):
        settle(comm, group)
        _post_fingerprint(comm, plan, group, what, operation)


@dataclass
class _Posted:
    work: Any
    probe: torch.Tensor
    plan: Plan
    what: str
    operation: str


def _post_fingerprint(comm: Communicator, plan: Plan, group: dist.ProcessGroup | None, what: str,
                      operation: str) -> None:
    """Start the all-reduce (MAX) of [fingerprint, -fingerprint] on the control group; `settle` compares it."""
    # three values, as `agree`'s probe: a peer that checks a new layout synchronously pairs with this one
    probe = torch.tensor([plan.fingerprint, -plan.fingerprint, 0], dtype=torch.int64)
    work = dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=comm.control_group(), async_op=True)
    comm.pending.append(_Posted(work, probe, plan, what, operation))


def settle(comm: Communicator, group: dist.ProcessGroup | None) -> None:
    """Compare the fingerprints posted by earlier calls (every rank posted its own before its data, so the
    waits end at once); on a difference, gather what each rank passed and raise the same ValueError on
    every rank, naming the first difference (module doc: the state afterwards)."""
    while comm.pending:
        posted = comm.pending.pop(0)
        posted.work.wait()
        high, neg_low, _ = posted.probe.tolist()
        if high == -neg_low:
            continue
        comm.pending.clear()
        raise_difference(comm.control_group(), posted.plan.config, posted.plan.description, None, posted.what,
                         posted.operation, " (an earlier call; its result is undefined: destroy the process group)")
