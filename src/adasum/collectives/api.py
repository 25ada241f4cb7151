"""The user-facing collective: `all_reduce` and `all_reduce_async` of lists of tensors, fused into
one flat buffer per dtype and combined with the VHDD schedule (`adasum.collectives.vhdd`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from adasum.collectives.agreement import check_same_layout
from adasum.collectives.nonfinite import check_finite, check_policy
from adasum.collectives.vhdd import _workspace, adasum_flat_
from adasum.core.layout import flatten, group_by_dtype, unflatten_into
from adasum.core.operator import check_floating
from adasum.transport.groups import failures_named, group_device


def all_reduce(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    check_layout: bool = True,
    nonfinite: str = "propagate",
) -> None:
    """Replace each tensor, on every rank, by the Adasum of the ranks' copies; in place.

    Each tensor gets its own coefficients ("per layer"). Any world size; gloo and NCCL; all ranks
    end with bitwise-identical tensors, equal to ``adasum.reduce`` of the ranks' copies up to
    float64 rounding of the coefficients. Tensors are fused into one flat buffer per dtype.

    With `check_layout` (the default) one 16-byte all-reduce first checks that every rank passed
    the same number of tensors with the same shapes and dtypes; a mismatch raises ValueError on
    every rank, naming the first difference. Non-floating dtypes raise TypeError. World size 1
    leaves the tensors unchanged.

    Non-finite inputs: ``nonfinite="propagate"`` (the default) lets them through; a tensor with a
    NaN or Inf on any rank comes out non-finite, identically on every rank. ``"raise"`` first
    checks with one small all-reduce and raises `adasum.NonFiniteError` on every rank, naming the
    first such tensor (its index in `tensors`) and the lowest rank that has it; nothing is changed.

    A dead or stalled peer raises `adasum.CollectiveError` naming the step within the group's
    timeout (gloo; on NCCL the watchdog enforces it).

    >>> grads = [p.grad for p in model.parameters()]
    >>> adasum.all_reduce(grads)
    >>> adasum.all_reduce(grads, nonfinite="raise")
    """
    check_policy(nonfinite, ("propagate", "raise"))
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not dist.is_initialized():
        raise RuntimeError("adasum.all_reduce needs torch.distributed to be initialised")
    if dist.get_world_size(group) == 1:
        for t in tensors:
            check_floating(t.dtype)
        if nonfinite == "raise":
            check_finite(tensors, group, operation="adasum.all_reduce")
        return
    device = group_device(group)
    if check_layout:
        with failures_named("adasum.all_reduce", "the layout check", group):
            check_same_layout(tensors, group, device)
    for t in tensors:
        check_floating(t.dtype)
        if t.device != tensors[0].device:
            raise ValueError(f"all tensors must be on one device, got {tensors[0].device} and {t.device}")
    if tensors and tensors[0].device.type != device.type:
        raise ValueError(f"the {dist.get_backend(group)} backend needs {device.type} tensors, got {tensors[0].device}")
    if nonfinite == "raise":
        check_finite(tensors, group, operation="adasum.all_reduce")
    fused_per_dtype(tensors, lambda flat, sizes: adasum_flat_(flat, sizes, group))


def fused_per_dtype(
    tensors: Sequence[torch.Tensor], combine: Callable[..., None], *, together: bool = False
) -> None:
    """Fuse `tensors` into one flat buffer per dtype (reused between calls on the CPU), run
    ``combine(flat, sizes)`` on each in place, and copy the results back into `tensors`.

    ``together=True`` calls ``combine(flats, sizes, indices)`` once with every dtype's buffer (in
    `group_by_dtype` order), its tensors' sizes and their indices in `tensors`: for coefficients
    computed across dtypes (AdaCons' whole-model form)."""
    groups = list(group_by_dtype(tensors).values())
    if together:
        members = [[tensors[i] for i in indices] for indices in groups]
        flats = [flatten(m, _workspace.get("fusion", sum(t.numel() for t in m), m[0])) for m in members]
        combine(flats, [[t.numel() for t in m] for m in members], groups)
        for flat, m in zip(flats, members):
            unflatten_into(flat, m)
        return
    for indices in groups:
        members = [tensors[i] for i in indices]
        flat = flatten(members, _workspace.get("fusion", sum(t.numel() for t in members), members[0]))
        combine(flat, [t.numel() for t in members])
        unflatten_into(flat, members)


def all_reduce_async(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    check_layout: bool = True,
    nonfinite: str = "propagate",
) -> torch.futures.Future:
    """`all_reduce`, returning a Future of the list of tensors.

    On NCCL the work is enqueued on the current CUDA stream and the host does not wait for it
    (except for the layout check's one small read, which ``check_layout=False`` removes, and the
    non-finite check's, which ``nonfinite="raise"`` adds); consumers on the same stream see the
    result. On gloo the exchanges complete before it returns.
    """
    tensor_list = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    all_reduce(tensor_list, group, check_layout=check_layout, nonfinite=nonfinite)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor_list)
    return future
