"""Start every rank from one rank's model and optimizer state (Horovod's ``broadcast_parameters`` and
``broadcast_optimizer_state``), so that `adasum.DistributedOptimizer`'s construction check passes.

>>> adasum.broadcast_parameters(model.state_dict(), root=0)  # doctest: +SKIP
>>> adasum.broadcast_optimizer_state(optimizer, root=0)  # doctest: +SKIP

On one process (a group of one rank; under torchrun every rank makes the same calls), before wrapping the
optimizer (its construction checks that every rank holds the same weights):

>>> import torch.distributed as dist
>>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
>>> model = torch.nn.Linear(2, 1)
>>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
>>> adasum.broadcast_parameters(model.state_dict(), root=0)
>>> adasum.broadcast_optimizer_state(optimizer, root=0)
>>> opt = adasum.DistributedOptimizer(optimizer)
>>> model(torch.ones(1, 2)).sum().backward(); opt.step()
>>> opt.statistics()
{'step': 1, 'skipped_steps': 0}
>>> dist.destroy_process_group()

Both are collective: every rank of the group calls them with the same layout and root (checked first, one
small all-reduce: a difference, or a root that is not a rank of the group, raises the same ValueError on every
rank before data moves). Tensors
travel fused, one broadcast per device and dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from adasum.checks.agreement import check_same_layout
from adasum.core.layout import flatten, unflatten_into
from adasum.integrations.delta import buckets
from adasum.transport.communicator import control_group
from adasum.transport.errors import failures_named
from adasum.transport.groups import group_device

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]

Params = Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def broadcast_parameters(
    params: Params,
    root: int = 0,
    group: dist.ProcessGroup | None = None,
    *,
    root_rank: int | None = None,
    src: int | None = None,
    group_src: int | None = None,
) -> None:
    """Copy rank `root`'s values into every rank's tensors, in place.

    Args:
        params: ``model.state_dict()`` (buffers included: BatchNorm statistics, integer counters),
            ``model.parameters()`` or ``model.named_parameters()``; a dict is taken in sorted key
            order, as Horovod does. Tied weights (one tensor under two names) travel once.
        root: the rank, in `group`, whose values every rank takes.
        group: the process group (default: the world).
        root_rank: Horovod's name of `root`.
        src: torch's spelling: the root's global rank (``dist.broadcast(src=)``), translated to its rank in
            `group`.
        group_src: torch's spelling of `root` (the root's rank in `group`).

    Name the root one way only (ValueError otherwise, naming the keywords).

    >>> adasum.broadcast_parameters(model.state_dict(), root=0)  # doctest: +SKIP

    On one process (a group of one rank), rank 0's values are its own; a tied weight travels once, integer
    buffers travel too:

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> weight = torch.tensor([1.0, 2.0])
    >>> params = {"embed.weight": weight, "head.weight": weight, "steps": torch.tensor(7)}
    >>> adasum.broadcast_parameters(params, root=0)
    >>> params["head.weight"], params["steps"]
    (tensor([1., 2.]), tensor(7))
    >>> dist.destroy_process_group()
    """
    operation = "adasum.broadcast_parameters"
    keyword = _root_keyword(operation, root, root_rank, src, group_src)
    tensors = _unique(_tensors(params))
    with torch.no_grad():
        with failures_named(operation, "the layout check", group):
            check_same_layout(
                tensors, group, group_device(group), "tensors", in_place=False, floating=False, operation=operation,
                config=(f"{keyword[0]}={keyword[1]!r}",),
            )
        root = _check_root(keyword, group, operation)
        _broadcast_tensors(tensors, root, group, operation)


def broadcast_optimizer_state(
    optimizer: Any,
    root: int = 0,
    group: dist.ProcessGroup | None = None,
    *,
    root_rank: int | None = None,
    src: int | None = None,
    group_src: int | None = None,
) -> None:
    """Give every rank rank `root`'s optimizer state (``state_dict()``, then ``load_state_dict()``):
    learning rates, momentum buffers, Adam moments and step counters, also where other ranks have no
    state yet (never stepped). Works on a torch optimizer, an `adasum.DistributedOptimizer` or anything
    with ``param_groups`` (whose parameters are checked), ``state_dict()`` and ``load_state_dict()``.

    The state's structure goes as one pickled object from `root`, its tensors as fused broadcasts;
    first every rank checks that all hold parameters of the same shapes and dtypes (ValueError on every
    rank otherwise), so the state fits everywhere. The root is named as in `broadcast_parameters`: ``root``
    (its rank in `group`), Horovod's ``root_rank``, torch's ``src`` (global) or ``group_src``.

    >>> adasum.broadcast_optimizer_state(optimizer, root=0)  # doctest: +SKIP

    On one process (a group of one rank), after a step of SGD with momentum:

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> model = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> model(torch.ones(1, 2)).sum().backward(); optimizer.step()
    >>> adasum.broadcast_optimizer_state(optimizer, root=0)
    >>> optimizer.state[model.bias]["momentum_buffer"], optimizer.param_groups[0]["momentum"]
    (tensor([1.]), 0.9)
    >>> dist.destroy_process_group()
    """
    operation = "adasum.broadcast_optimizer_state"
    keyword = _root_keyword(operation, root, root_rank, src, group_src)
    if not all(hasattr(optimizer, a) for a in ("param_groups", "state_dict", "load_state_dict")):
        raise TypeError(f"{operation} takes an optimizer (param_groups, state_dict() and load_state_dict()), "
                        f"got {type(optimizer).__name__}; pass the torch optimizer itself")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    with failures_named(operation, "the parameter layout check", group):
        check_same_layout(
            params, group, group_device(group), "parameters", in_place=False, operation=operation,
            config=(f"{keyword[0]}={keyword[1]!r}",),
        )
    root = _check_root(keyword, group, operation)
    is_root = dist.get_rank(group) == root
    tensors: list[torch.Tensor] = []
    skeleton = _hollow(optimizer.state_dict(), tensors) if is_root else None
    box = [skeleton]
    with failures_named(operation, "the state structure broadcast", group):
        dist.broadcast_object_list(box, group_src=root, group=control_group(group))
    skeleton = box[0]
    assert skeleton is not None  # the root's, broadcast to every rank
    if not is_root:
        tensors = [torch.empty(shape, dtype=dtype, device=_device(kind, group)) for shape, dtype, kind in skeleton[1]]
    with torch.no_grad():
        _broadcast_tensors(tensors, root, group, operation)
    if not is_root:
        optimizer.load_state_dict(_fill(skeleton[0], tensors))


# -- the state's structure without its tensors


class _Slot:
    """Where tensor `index` of the broadcast goes back into the state."""

    def __init__(self, index: int) -> None:
        self.index = index


def _hollow(state: Any, tensors: list[torch.Tensor]) -> tuple[Any, list[tuple]]:
    """(the state with each tensor replaced by a `_Slot`, [(shape, dtype, device type), ...]); the tensors are
    appended to `tensors`."""
    specs: list[tuple] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach())
            specs.append((tuple(value.shape), value.dtype, value.device.type))
            return _Slot(len(tensors) - 1)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    return walk(state), specs


def _fill(state: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(state, _Slot):
        return tensors[state.index]
    if isinstance(state, dict):
        return {k: _fill(v, tensors) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_fill(v, tensors) for v in state)
    return state


def _device(kind: str, group: dist.ProcessGroup | None) -> torch.device:
    """A device of type `kind` on this rank (the root's tensor's device type: Adam keeps ``step`` on the CPU)."""
    home = group_device(group)
    if kind == home.type:
        return home
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


# -- moving tensors


def _tensors(params: Params) -> list[torch.Tensor]:
    """The tensors of `params` (a dict in sorted key order); TypeError for anything else, before any collective."""
    operation = "adasum.broadcast_parameters"
    if isinstance(params, torch.nn.Module):
        raise TypeError(f"{operation} takes model.state_dict(), model.parameters() or model.named_parameters(), "
                        f"not the {type(params).__name__} itself; pass one of those")
    if isinstance(params, Mapping):
        out = [params[k] for k in sorted(params)]
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        out = [item[1] if isinstance(item, tuple) and len(item) == 2 else item for item in params]
    else:
        raise TypeError(f"{operation} takes a dict or an iterable of tensors or (name, tensor) pairs, "
                        f"got {type(params).__name__}")
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{operation}: item {i} is a {type(t).__name__}, not a tensor or a (name, tensor) pair")
    return out


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each memory location once (a state dict lists tied weights under each name), in order."""
    seen: set[tuple] = set()
    out = []
    for t in tensors:
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.device)
        if t.numel() == 0 or key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _root_keyword(
    operation: str, root: int, root_rank: int | None, src: int | None, group_src: int | None
) -> tuple[str, Any]:
    """The keyword that names the root and its value, as given (``("src", 3)``); ValueError where more than one
    names it."""
    given = {k: v for k, v in (("root_rank", root_rank), ("src", src), ("group_src", group_src)) if v is not None}
    if len(given) > 1 or (given and root != 0):
        named = ", ".join(f"{k}={v!r}" for k, v in ({"root": root, **given} if root != 0 else given).items())
        raise ValueError(f"{operation}: name the root once (root=, Horovod's root_rank=, torch's src= or group_src=), "
                         f"got {named}")
    return next(iter(given.items())) if given else ("root", root)


def _check_root(keyword: tuple[str, Any], group: dist.ProcessGroup | None, operation: str) -> int:
    """The root's rank in `group` from its keyword (`_root_keyword`); ValueError for one that is not a rank of
    `group` (after the ranks agreed on the keyword: the same error on every rank)."""
    name, value = keyword
    spelled = f"{name}={value!r}"
    world = dist.get_world_size(group)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{operation}: {spelled} is not a rank of the group (0 to {world - 1}); pass {name}= an integer from 0 "
            f"to {world - 1}"
        )
    if name == "src":
        members = dist.get_process_group_ranks(group) if group is not None else range(world)
        if value not in members:
            raise ValueError(f"{operation}: src={value} (a global rank) is not in the group, whose ranks are "
                             f"{list(members)}; pass src= one of them, or group_src= or root= the rank in the group")
        return dist.get_group_rank(group, value) if group is not None else value
    if not 0 <= value < world:
        raise ValueError(
            f"{operation}: {spelled} is not a rank of the group (0 to {world - 1}); pass {name}= an integer from 0 "
            f"to {world - 1}"
        )
    return value


def _broadcast_tensors(tensors: list[torch.Tensor], root: int, group: dist.ProcessGroup | None, operation: str) -> None:
    """Rank `root`'s `tensors` into every rank's, in place: one broadcast per bucket of one device and dtype,
    through the group's device."""
    home = group_device(group)
    for number, bucket in enumerate(buckets(tensors, 64 * 2**20)):
        members = [tensors[i] for i in bucket]
        flat = flatten(members).to(home)
        with failures_named(operation, f"the broadcast of bucket {number}", group):
            dist.broadcast(flat, group_src=root, group=group)
        unflatten_into(flat.to(members[0].device), members)
