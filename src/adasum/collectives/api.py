"""The user-facing collective: `all_reduce` and `all_reduce_async` of lists of tensors, fused into
one flat buffer per dtype and combined with the VHDD schedule (`adasum.collectives.vhdd`)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from adasum.collectives import graphs
from adasum.collectives.agreement import verify_layout
from adasum.collectives.nonfinite import check_finite, check_policy
from adasum.collectives.vhdd import _workspace, adasum_flat_, transport_for
from adasum.core.layout import Scattered, flatten, group_by_dtype, unflatten_into
from adasum.core.operator import check_floating
from adasum.transport.base import Transport
from adasum.transport.groups import failures_named, group_device


def all_reduce(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    check_layout: bool = True,
    nonfinite: str = "propagate",
    transport: str | None = None,
) -> None:
    """Replace each tensor, on every rank, by the Adasum of the ranks' copies; in place.

    Each tensor gets its own coefficients ("per layer"). Any world size; gloo and NCCL; all ranks
    end with bitwise-identical tensors, equal to ``adasum.reduce`` of the ranks' copies up to
    float64 rounding of the coefficients. Tensors are fused into one flat buffer per dtype.

    With `check_layout` (the default) one 16-byte all-reduce first checks that every rank passed
    the same number of tensors with the same shapes and dtypes; a mismatch raises ValueError on
    every rank, naming the first difference. The verdict is kept per group and layout: a layout
    checked once is not checked again (no host synchronisation on repeated calls). Non-floating
    dtypes raise TypeError. World size 1 leaves the tensors unchanged.

    `transport` names how bytes move: "p2p" (c10d point-to-point), "collectives" (NCCL, the gather
    as one all-gather), "symmetric" (NVLink symmetric memory); None picks the fastest the group
    supports (`adasum.transport.select`). On GPUs, repeated calls on the same tensors replay a
    captured CUDA graph of the whole call (`adasum.collectives.graphs`).

    Non-finite inputs: ``nonfinite="propagate"`` (the default) lets them through; a tensor with a
    NaN or Inf on any rank comes out non-finite, identically on every rank. ``"raise"`` first
    checks with one small all-reduce and raises `adasum.NonFiniteError` on every rank, naming the
    first such tensor (its index in `tensors`) and the lowest rank that has it; nothing is changed.

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
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if nonfinite == "propagate" and _replayed(group, transport, tensors):
        return
    check_policy(nonfinite, ("propagate", "raise"))
    if not dist.is_initialized():
        raise RuntimeError("adasum.all_reduce needs torch.distributed to be initialised")
    if dist.get_world_size(group) == 1:
        for t in tensors:
            check_floating(t.dtype)
        if nonfinite == "raise":
            check_finite(tensors, group, operation="adasum.all_reduce")
        return
    device = group_device(group)
    if check_layout:  # once per group and layout (`verify_layout` keeps the verdicts)
        with failures_named("adasum.all_reduce", "the layout check", group):
            verify_layout(tensors, group, device, operation="adasum.all_reduce")
    for t in tensors:
        check_floating(t.dtype)
        if t.device != tensors[0].device:
            raise ValueError(f"all tensors must be on one device, got {tensors[0].device} and {t.device}")
    if tensors and tensors[0].device.type != device.type:
        raise ValueError(f"the {dist.get_backend(group)} backend needs {device.type} tensors, got {tensors[0].device}")
    if nonfinite == "raise":
        check_finite(tensors, group, operation="adasum.all_reduce")
    chosen = list_transport(group, transport)

    def run() -> None:
        adasum_list_(tensors, group, chosen)

    key = (id(group), chosen.name, graphs.tensor_key(tensors))
    graphs.run(key, run, device)
    if graphs.captured(key):
        _last[(id(group), transport)] = (tensors, tuple(map(_data_ptr, tensors)), tuple(map(_shape, tensors)), key)


def list_transport(group: dist.ProcessGroup | None, name: str | None = None) -> Transport:
    """The transport a list is combined on: `name`, or the fastest the group supports (every rank a leader of
    the tree where the group is a power of two; the slice-parallel schedule serves any size)."""
    world = dist.get_world_size(group)
    return transport_for(group, name, world & (world - 1) == 0)


def adasum_list_(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, transport: Transport) -> None:
    """Per-tensor Adasum of checked `tensors` in place: one flat buffer per dtype (`fused_per_dtype`; a list the
    transport reads in place is not copied) through the VHDD schedule on `transport`."""
    fused_per_dtype(tensors, lambda flat, sizes: adasum_flat_(flat, sizes, group, transport=transport), transport)


# The last captured call per (group, transport keyword): a repeat with the very same tensor objects,
# addresses and shapes replays its graph without re-validating (the checks passed for this key at capture).
_last: dict = {}


_data_ptr = torch.Tensor.data_ptr
_shape = operator.attrgetter("shape")


def _replayed(group, transport, tensors) -> bool:
    # host time is what the GPU waits for between calls: C-level maps, not a Python loop (66 against 92 us for
    # 161 tensors on the 2-core VM; the replay check was most of the 96 us per call profiled on an H100 host)
    entry = _last.get((id(group), transport))
    if entry is None:
        return False
    previous, pointers, shapes, key = entry
    if len(previous) != len(tensors) or not all(map(operator.is_, previous, tensors)):
        return False
    if tuple(map(_data_ptr, tensors)) != pointers or tuple(map(_shape, tensors)) != shapes:
        return False
    return graphs.replay(key)


def fused_per_dtype(
    tensors: Sequence[torch.Tensor],
    combine: Callable[..., None],
    transport: Transport | None = None,
    *,
    together: bool = False,
) -> None:
    """Fuse `tensors` into one flat buffer per dtype (reused between calls on the CPU; the
    transport's own buffer where it has one), run ``combine(flat, sizes)`` on each in place, and copy
    the results back into `tensors`. A transport that reads lists in place (``transport.scattered``:
    symmetric memory) gets contiguous tensors as one `Scattered` buffer instead: no copies.

    ``together=True`` calls ``combine(flats, sizes, indices)`` once with every dtype's buffer (in
    `group_by_dtype` order), its tensors' sizes and their indices in `tensors`: for coefficients
    computed across dtypes (AdaCons' whole-model form)."""
    groups = list(group_by_dtype(tensors).values())
    if together:
        per_dtype = [[tensors[i] for i in indices] for indices in groups]
        flats = [flatten(m, _workspace.get("fusion", sum(t.numel() for t in m), m[0])) for m in per_dtype]
        combine(flats, [[t.numel() for t in m] for m in per_dtype], groups)
        for flat, m in zip(flats, per_dtype):
            unflatten_into(flat, m)
        return
    for indices in groups:
        members = [tensors[i] for i in indices]
        numel = sum(t.numel() for t in members)
        in_place = transport is not None and transport.scattered and len(members) > 1
        if in_place and all(t.is_contiguous() for t in members):
            # the transport reads and writes the tensors where they are: no fusion and no copy back
            combine(Scattered(members), [t.numel() for t in members])
            continue
        if len(members) == 1 and members[0].is_contiguous():
            flat = members[0].view(-1)  # no fusion: no workspace either (a captured graph would keep it)
        else:
            fusion = transport.fusion_buffer(numel, members[0]) if transport is not None else None
            flat = flatten(members, fusion if fusion is not None else _workspace.get("fusion", numel, members[0]))
        combine(flat, [t.numel() for t in members])
        unflatten_into(flat, members)


def all_reduce_async(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    check_layout: bool = True,
    nonfinite: str = "propagate",
    transport: str | None = None,
) -> torch.futures.Future:
    """`all_reduce`, returning a Future of the list of tensors.

    On NCCL the work is enqueued on the current CUDA stream and the host does not wait for it
    (except for the layout check's one small read on a layout's first call, which
    ``check_layout=False`` removes, and the non-finite check's, which ``nonfinite="raise"`` adds);
    consumers on the same stream see the result. On gloo the exchanges complete before it returns.
    """
    tensor_list = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    all_reduce(tensor_list, group, check_layout=check_layout, nonfinite=nonfinite, transport=transport)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor_list)
    return future
