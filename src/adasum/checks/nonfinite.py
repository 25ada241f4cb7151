"""Non-finite values across ranks: find on every rank whether any rank has a NaN or Inf, in which
tensor and on which rank, with one small all-reduce, so that every rank takes the same decision.

Policies, chosen by an argument wherever tensors are combined:

* ``"propagate"``: do nothing; Adasum lets a NaN or Inf through, identically on every rank (a
  tensor non-finite on any rank comes out non-finite on all).
* ``"raise"``: raise `NonFiniteError` on every rank, naming the first tensor (lowest index) that is
  non-finite on some rank and the lowest rank where it is.
* ``"skip"`` (training steps only): skip the step on every rank and count it.

Every caller applies a policy through one helper: `apply_nonfinite_policy` (find across ranks,
then decide) or, where the finding is done another way (simulated workers),
`decide_nonfinite`; both raise the one-line `NonFiniteError` of `nonfinite_message` under
``"raise"`` and return True ("skip this step, count it") under ``"skip"``.

How: each rank takes every tensor's largest magnitude (``torch._foreach_norm`` with ``ord=inf``,
a few batched kernels: NaN if the tensor holds a NaN, Inf if an Inf, else finite), encodes the
first non-finite tensor as ``(index * world + rank) * 2 + (1 if Inf else 0)`` (int64 max when
none), and one all-reduce with MIN over the group gives every rank the lowest index and, for it,
the lowest rank. The host reads one number at the end; nothing syncs per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from adasum.checks.agreement import tensor_list
from adasum.options import Nonfinite, check_option, choices
from adasum.transport.errors import failures_named
from adasum.transport.groups import check_group, group_device

POLICIES = choices(Nonfinite)
"""What to do about a NaN or Inf (`adasum.options.Nonfinite`)."""

_NONE = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class NonFinite:
    """Where a non-finite value was found: tensor `index` (its `name` if given) on group `rank`."""

    index: int
    rank: int
    kind: str  # "NaN" (the tensor holds a NaN) or "Inf" (an Inf and no NaN)
    name: str | None = None

    def describe(self) -> str:
        """E.g. ``tensor 3 ('fc.weight') has NaN on rank 1``."""
        label = f"tensor {self.index}" + (f" ({self.name!r})" if self.name is not None else "")
        return f"{label} has {self.kind} on rank {self.rank}"


class NonFiniteError(FloatingPointError):
    """Raised on every rank when a rank holds a NaN or Inf under the ``"raise"`` policy."""

    def __init__(self, message: str, found: NonFinite) -> None:
        super().__init__(message)
        self.found = found


def check_policy(policy: str, allowed: Sequence[str] = POLICIES, operation: str | None = None) -> None:
    """Raise ValueError unless `policy` is one of `allowed` (by default all of `POLICIES`); the message begins
    with `operation` where given."""
    check_option("nonfinite" if operation is None else f"{operation}: nonfinite", policy, Nonfinite, allowed)


def _max_magnitudes(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Float64 vector on `device`: each tensor's largest |value| (NaN if it has a NaN); 0 if empty
    or integral."""
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    batches: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() > 0 and (t.is_floating_point() or t.is_complex()):
            batches.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), indices in batches.items():
        members = [tensors[i].detach() for i in indices]
        if dtype.is_complex:
            members = [torch.view_as_real(t) for t in members]
        elif dtype.itemsize == 1:  # 8-bit floats: torch's norms do not take them (a NaN stays NaN, an Inf Inf)
            members = [t.float() for t in members]
        for i, n in zip(indices, torch._foreach_norm(members, float("inf"), dtype=torch.float64)):
            norms[i] = n if n.device == device else n.to(device)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([zero if n is None else n for n in norms])


def _local_code(tensors: Sequence[torch.Tensor], rank: int, world: int, device: torch.device) -> torch.Tensor:
    """One int64 on `device`: ``(first non-finite index * world + rank) * 2 + is_inf``, or int64 max."""
    count = len(tensors)
    if count == 0:
        return torch.full((1,), _NONE, dtype=torch.int64, device=device)
    home = tensors[0].device
    magnitudes = _max_magnitudes(tensors, home)
    positions = torch.arange(count, device=home)
    first = torch.where(torch.isfinite(magnitudes), count, positions).min()
    is_inf = torch.isinf(magnitudes[first.clamp_max(count - 1)]).long()
    code = torch.where(first < count, (first * world + rank) * 2 + is_inf, _NONE)
    return code.reshape(1).to(device)


def _checkable(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` with each sparse one replaced by its stored values (what can be NaN or Inf)."""
    return [t.coalesce().values() if t.is_sparse else t for t in tensors]


def find_nonfinite(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    names: Sequence[str] | None = None,
) -> NonFinite | None:
    """On every rank of `group`: where any rank holds a NaN or Inf, or None if no rank does.

    Returns the lowest tensor index that is non-finite on some rank and, for it, the lowest such
    (group) rank; every rank gets the same answer from one all-reduce of one int64. Every rank
    must pass the same number of tensors. Without torch.distributed initialised (and no group), it
    looks at the local tensors only (as rank 0). `tensors` is a tensor or a list of tensors (TypeError
    otherwise: a dict, pass its values; and for a `group` that is not a process group); sparse tensors
    are checked by their stored values, integer and bool tensors are finite.

    >>> grads = [torch.ones(3), torch.tensor([1.0, float("nan")])]
    >>> adasum.find_nonfinite(grads, names=["fc.weight", "fc.bias"])   # no process group: rank 0
    NonFinite(index=1, rank=0, kind='NaN', name='fc.bias')
    >>> adasum.find_nonfinite([torch.ones(3)]) is None
    True
    """
    tensors = _checkable(tensor_list(tensors, "adasum.find_nonfinite"))
    check_group(group, "adasum.find_nonfinite")
    if isinstance(names, str):  # a string would be read as one name a character
        raise TypeError(f"adasum.find_nonfinite: names must be a list of names, one per tensor, got {names!r}; pass "
                        "[name, ...]")
    if names is not None and len(names) != len(tensors):
        raise ValueError(f"adasum.find_nonfinite: got {len(names)} names for {len(tensors)} tensors; pass one name "
                         "per tensor")
    if group is None and not dist.is_initialized():
        rank, world, device = 0, 1, tensors[0].device if tensors else torch.device("cpu")
    else:
        rank, world, device = dist.get_rank(group), dist.get_world_size(group), group_device(group)
    code = _local_code(tensors, rank, world, device)
    if world > 1:
        with failures_named("adasum.find_nonfinite", "the non-finite check all-reduce", group):
            dist.all_reduce(code, op=dist.ReduceOp.MIN, group=group)
    value = int(code.item())
    if value == _NONE:
        return None
    where, is_inf = divmod(value, 2)
    index, bad_rank = divmod(where, world)
    return NonFinite(index, bad_rank, "Inf" if is_inf else "NaN", None if names is None else names[index])


def nonfinite_message(
    operation: str, what: str, found: NonFinite, policy: str = "raise", where: str = "rank"
) -> str:
    """One line: ``op: the gradient of parameter 3 ('fc.weight') has NaN on rank 1 (...)``.

    `what` names the tensors (``"tensor"``, ``"the gradient of parameter"``); `where` is what
    ``found.rank`` counts (``"rank"``, or ``"worker"`` for simulated workers).
    """
    label = f"{what} {found.index}" + (f" ({found.name!r})" if found.name is not None else "")
    return (
        f"{operation}: {label} has {found.kind} on {where} {found.rank} (the first such tensor, lowest such "
        f"{where}); nothing was changed on any {where} (nonfinite={policy!r})"
    )


def decide_nonfinite(
    policy: str, found: NonFinite | None, *, operation: str, what: str = "tensor", where: str = "rank"
) -> bool:
    """Act on a finding under `policy`: True means skip the step (``"skip"`` and a non-finite value
    found; the caller counts it); ``"raise"`` raises `NonFiniteError` (`nonfinite_message`); False
    otherwise. The finding must be the same on every rank (`find_nonfinite` gives that).

    >>> found = find_nonfinite([torch.tensor([1.0, float("inf")])])
    >>> decide_nonfinite("skip", found, operation="my_step")      # skip the step and count it
    True
    >>> decide_nonfinite("skip", None, operation="my_step")
    False
    """
    check_policy(policy)
    if found is None or policy == "propagate":
        return False
    if policy == "raise":
        raise NonFiniteError(nonfinite_message(operation, what, found, policy, where), found)
    return True


def apply_nonfinite_policy(
    policy: str,
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    names: Sequence[str] | None = None,
    *,
    operation: str,
    what: str = "tensor",
) -> bool:
    """The one non-finite policy of a training step, the same decision on every rank of `group`:
    ``"propagate"`` looks at nothing and returns False; otherwise `find_nonfinite` (one 8-byte
    all-reduce) and `decide_nonfinite`: ``"raise"`` raises `NonFiniteError` on every rank naming
    the first such tensor (its name from `names`) and the lowest rank; ``"skip"`` returns True on
    every rank (skip the step and count it). Sparse tensors are checked by their stored values.

    >>> grads = [torch.ones(3), torch.tensor([float("nan")])]
    >>> apply_nonfinite_policy("skip", grads, operation="MyOptimizer.step")   # skip this step
    True
    >>> apply_nonfinite_policy("propagate", grads, operation="MyOptimizer.step")
    False
    """
    check_policy(policy)
    if policy == "propagate":
        return False
    return decide_nonfinite(policy, find_nonfinite(tensors, group, names), operation=operation, what=what)


def check_finite(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    names: Sequence[str] | None = None,
    *,
    operation: str = "adasum.check_finite",
) -> None:
    """Raise `NonFiniteError` on every rank of `group` if any rank holds a NaN or Inf.

    The one-line message names the operation, the first such tensor (index, and name if given) and
    the lowest rank that has it; ``error.found`` holds the `NonFinite`. See `find_nonfinite` (what it
    takes: a tensor or a list of tensors and a process group or None, TypeError otherwise; sparse tensors
    by their stored values).

    >>> grads = [torch.ones(3), torch.tensor([0.0, float("nan")])]
    >>> adasum.check_finite(grads, names=["fc.weight", "fc.bias"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    adasum.checks.nonfinite.NonFiniteError: adasum.check_finite: tensor 1 ('fc.bias') has NaN on rank 0 (...)...
    """
    tensors = tensor_list(tensors, operation)
    check_group(group, operation)
    decide_nonfinite("raise", find_nonfinite(tensors, group, names), operation=operation)
