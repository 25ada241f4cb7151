r"""The orthogonality diagnostic of the Adasum slides, for P workers' copies of a list of tensors::

    O = sum_i |g_i|^2 / |sum_i g_i|^2

O is 1 when the workers' vectors are mutually orthogonal and 1/P when they are all equal. Early in
training gradients are nearly parallel (O near 1/P, Adasum averages); later they turn more
orthogonal (O grows, Adasum moves toward summing). It is computed per tensor and for the whole
model (the model value pools the numerators and denominators of all tensors). Norms are
accumulated in float64. Where every worker's tensor is zero the value is NaN (0/0); where the
workers cancel exactly it is +inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from adasum.checks.agreement import agree, local_problem, tensor_list
from adasum.transport.errors import failures_named
from adasum.transport.groups import check_group, group_device


@dataclass(frozen=True)
class Orthogonality:
    """O per tensor (float64 tensor of shape [T]) and for the whole model (a float)."""

    per_tensor: torch.Tensor
    model: float


def from_norms(sum_of_squares: torch.Tensor, square_of_sum: torch.Tensor) -> Orthogonality:
    """O from per-tensor ``sum_i |g_i|^2`` and ``|sum_i g_i|^2`` (two [T] tensors, one value per tensor
    each; ValueError otherwise).

    >>> from_norms(torch.tensor([2.0]), torch.tensor([2.0])).model   # two orthogonal unit vectors
    1.0
    """
    if sum_of_squares.shape != square_of_sum.shape or sum_of_squares.dim() != 1:
        raise ValueError(
            "sum_of_squares and square_of_sum need one value per tensor each, "
            f"got {_count(sum_of_squares)} and {_count(square_of_sum)}; pass two 1-D tensors of the same length"
        )
    num = sum_of_squares.to(torch.float64)
    den = square_of_sum.to(torch.float64)
    per_tensor = num / den
    model = (num.sum() / den.sum()).item() if num.numel() else float("nan")
    return Orthogonality(per_tensor, model)


def _count(values: torch.Tensor) -> str:
    return str(values.numel()) if values.dim() == 1 else f"shape {list(values.shape)}"


def orthogonality_stacked(stacked: Sequence[torch.Tensor]) -> Orthogonality:
    """O over workers for tensors stacked with the worker index first (each of shape [P, ...], one P
    for all; ValueError otherwise).

    This is the simulator's layout: one batched computation for all workers.

    >>> g = torch.stack([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])])
    >>> orthogonality_stacked([g]).model
    1.0
    """
    if len(stacked) == 0:
        return from_norms(torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64))
    for i, t in enumerate(stacked):
        if t.dim() == 0:
            raise ValueError(
                f"every tensor needs the worker index first: tensor {i} is a scalar; pass torch.stack of the "
                "workers' copies (shape [workers, ...])"
            )
        if t.shape[0] != stacked[0].shape[0]:
            raise ValueError(
                f"every tensor needs the same number of workers first: tensor 0 has {stacked[0].shape[0]}, "
                f"tensor {i} has {t.shape[0]}; pass every tensor stacked over the same workers"
            )
    device = stacked[0].device
    # accumulate in float64 whatever the gradient dtype, as Adasum's own reductions do
    sum_sq = torch.stack([t.reshape(t.shape[0], -1).to(torch.float64).square().sum() for t in stacked])
    sq_sum = torch.stack([t.to(torch.float64).sum(0).square().sum() for t in stacked])
    return from_norms(sum_sq.to(device), sq_sum.to(device))


def orthogonality(per_worker: Sequence[Sequence[torch.Tensor]]) -> Orthogonality:
    """O for P workers' copies of a list of tensors, given as one list of tensors per worker
    (the layout of `Reducer.reduce`). Every worker needs the same number of tensors with the same shapes
    (ValueError otherwise; a worker given as one tensor rather than a list, or an element that is not a
    tensor, TypeError).

    >>> w0, w1 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])   # orthogonal weights
    >>> b = torch.tensor([2.0])                                         # equal biases
    >>> orthogonality([[w0, b], [w1, b]]).per_tensor                    # one value per tensor
    tensor([1.0000, 0.5000], dtype=torch.float64)
    """
    if len(per_worker) == 0:
        raise ValueError("orthogonality needs at least one worker; pass one list of tensors per worker")
    for k, w in enumerate(per_worker):
        if isinstance(w, torch.Tensor):
            raise TypeError(
                f"orthogonality takes one list of tensors per worker, got a tensor for worker {k} "
                "(one tensor per worker: pass [[g] for g in tensors])"
            )
    count = len(per_worker[0])
    if any(len(w) != count for w in per_worker):
        raise ValueError(
            "every worker needs the same number of tensors; give every worker's list the same tensors, in one order"
        )
    for i in range(count):
        for k, w in enumerate(per_worker):
            if not isinstance(w[i], torch.Tensor):
                raise TypeError(
                    f"orthogonality takes tensors: worker {k}'s tensor {i} is a {type(w[i]).__name__}; "
                    "pass torch tensors (torch.as_tensor(x))"
                )
            if w[i].shape != per_worker[0][i].shape:
                raise ValueError(
                    f"every worker needs the same shapes: tensor {i} has shape {list(per_worker[0][i].shape)} on "
                    f"worker 0, {list(w[i].shape)} on worker {k}; pass tensors of one shape at each index"
                )
    return orthogonality_stacked([torch.stack([w[i] for w in per_worker]) for i in range(count)])


def all_reduce_orthogonality(
    tensors: torch.Tensor | Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> Orthogonality:
    """O across the ranks of `group`, each rank holding its own copy of `tensors` (unchanged).

    `tensors` is a tensor or a list of tensors (any dtype; each is all-reduced as a float64 copy). Every rank
    must pass the same number of tensors with the same shapes, dense, on a device type the group takes: first
    one small all-reduce checks this, and raises on every rank before data moves (ValueError naming the first
    difference and the ranks, TypeError for a sparse tensor; anything but a tensor or a list of tensors, or a
    `group` that is not a process group, TypeError). Then it costs one all-reduce of a copy of the tensors
    (float64) plus one of T float64 values; call it every few steps, not every step, in production runs.

    >>> o = all_reduce_orthogonality([p.grad for p in model.parameters()])  # doctest: +SKIP

    On one process (a group of one rank), each tensor is orthogonal to nothing:

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> all_reduce_orthogonality([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])])
    Orthogonality(per_tensor=tensor([1., 1.], dtype=torch.float64), model=1.0)
    >>> dist.destroy_process_group()
    """
    operation = "adasum.all_reduce_orthogonality"
    tensors = tensor_list(tensors, operation)
    check_group(group, operation)
    problem = local_problem(tensors, group_device(group), in_place=False, floating=False, group=group)
    moved = [("float64", tuple(t.shape), t.device.type) for t in tensors]  # the copies that are all-reduced
    with failures_named(operation, "the layout check", group):
        agree(moved, problem, group, "tensors", operation)
    if not tensors:
        return orthogonality_stacked([])
    device = tensors[0].device
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    sum_sq = torch.stack([t.to(torch.float64).square().sum() for t in tensors]).to(device)
    dist.all_reduce(flat, group=group)
    dist.all_reduce(sum_sq, group=group)
    sq_sum = torch.stack([part.square().sum() for part in flat.split([t.numel() for t in tensors])])
    return from_norms(sum_sq, sq_sum)
