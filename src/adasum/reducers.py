"""How to combine across workers, behind one interface that every placement uses.

A reducer answers one question: given the workers' copies of a list of tensors, what single
list do they agree on? Each reducer has two forms that compute the same thing:

* ``reduce(per_worker)``: single-process, over a list (one entry per worker) of lists of tensors;
  the simulator runs this one.
* ``all_reduce(tensors, group)``: in place across a torch.distributed process group;
  ``all_reduce_flat(buffer, sizes, group)`` is the same on one flat buffer holding tensors of
  `sizes` elements end to end (what a DDP bucket is).

What is combined (gradients, optimizer deltas, model deltas) and what happens afterwards (an
optimizer step, slow momentum) is the caller's business. Places that combine take a reducer
object or its name: ``"sum"``, ``"mean"``, ``"adasum"``, ``"adacons"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from adasum import hierarchical, ops
from adasum.collectives import adasum_flat_, fused_per_dtype
from adasum.layout import group_by_dtype


class Reducer:
    """Base class: subclasses implement `reduce` and `all_reduce_flat`."""

    name = "reducer"

    def reduce(self, per_worker: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        raise NotImplementedError

    def all_reduce_flat(
        self, buffer: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup | None = None
    ) -> None:
        raise NotImplementedError

    def all_reduce(self, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
        """In place across `group`; tensors are fused into one flat buffer per dtype."""
        tensors = list(tensors)
        for t in tensors:
            ops.check_floating(t.dtype)
        fused_per_dtype(tensors, lambda flat, sizes: self.all_reduce_flat(flat, sizes, group))

    def setup(self, group: dist.ProcessGroup | None = None) -> None:
        """Collective set-up for `group` (sub-groups, checks), before the first `all_reduce_flat`.

        Optional (the first call does it otherwise); owners of a group (the DDP hook state, the
        distributed optimizer) call it at construction so that errors surface there.
        """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _check_workers(per_worker: Sequence[Sequence[torch.Tensor]]) -> int:
    if len(per_worker) == 0:
        raise ValueError("reduce needs at least one worker")
    count = len(per_worker[0])
    for w, tensors in enumerate(per_worker):
        if len(tensors) != count:
            raise ValueError(f"worker 0 has {count} tensors, worker {w} has {len(tensors)}")
    return count


class Sum(Reducer):
    """The plain sum over workers."""

    name = "sum"

    def reduce(self, per_worker):
        count = _check_workers(per_worker)
        return [torch.stack([w[i] for w in per_worker]).sum(0) for i in range(count)]

    def all_reduce_flat(self, buffer, sizes, group=None):
        dist.all_reduce(buffer, group=group)


class Mean(Reducer):
    """The average over workers (Horovod's and DDP's default)."""

    name = "mean"

    def reduce(self, per_worker):
        count = _check_workers(per_worker)
        return [torch.stack([w[i] for w in per_worker]).sum(0) / len(per_worker) for i in range(count)]

    def all_reduce_flat(self, buffer, sizes, group=None):
        dist.all_reduce(buffer, group=group)
        buffer.div_(dist.get_world_size(group))


def _per_dtype_whole(whole: Reducer, per_worker, count: int) -> list[torch.Tensor]:
    """`whole` applied to each dtype group of tensors fused into one (whole-model coefficients)."""
    out: list[torch.Tensor] = [torch.empty(0)] * count
    for indices in group_by_dtype(list(per_worker[0])).values():
        flat = whole.reduce([[torch.cat([w[i].reshape(-1) for i in indices])] for w in per_worker])[0]
        for i, piece in zip(indices, flat.split([per_worker[0][i].numel() for i in indices])):
            out[i] = piece.view(per_worker[0][i].shape)
    return out


class Adasum(Reducer):
    """Adasum (see `adasum.ops`): per tensor by default; ``per_tensor=False`` uses one pair of
    coefficients for all tensors of one dtype together (the whole-model variant; per dtype
    because the collective runs on one flat buffer per dtype).

    ``hierarchical=True`` (multi-GPU nodes): mean within each node of `local_size` consecutive
    ranks (default LOCAL_WORLD_SIZE), Adasum across the node means (see `adasum.hierarchical`).
    """

    name = "adasum"

    def __init__(self, per_tensor: bool = True, hierarchical: bool = False, local_size: int | None = None) -> None:
        self.per_tensor = per_tensor
        self.hierarchical = hierarchical
        self.local_size = local_size
        self._hierarchies: dict[Any, Any] = {}  # per group, built on first use (collective)

    def reduce(self, per_worker):
        count = _check_workers(per_worker)
        if self.hierarchical:
            size = self.local_size or hierarchical.local_size_from_env() or 1
            if self.per_tensor:
                return [hierarchical.reduce_hierarchical([w[i] for w in per_worker], size) for i in range(count)]
            whole = Adasum(per_tensor=True, hierarchical=True, local_size=self.local_size)
            return _per_dtype_whole(whole, per_worker, count)
        # one batched tree per dtype over the workers' flat buffers, as the collective fuses them
        out: list[torch.Tensor] = [torch.empty(0)] * count
        for indices in group_by_dtype(list(per_worker[0])).values():
            first = per_worker[0]
            sizes = [first[i].numel() for i in indices]
            for t in (w[i] for w in per_worker for i in indices):
                ops.check_floating(t.dtype)
            stacked = torch.stack([torch.cat([w[i].reshape(-1) for i in indices]) for w in per_worker])
            flat = ops.reduce_stacked(stacked, sizes if self.per_tensor else [sum(sizes)])
            for i, piece in zip(indices, flat.split(sizes)):
                out[i] = piece.view(first[i].shape)
        return out

    def setup(self, group=None):
        if self.hierarchical:
            self._hierarchy(group)

    def _hierarchy(self, group):
        if group not in self._hierarchies:
            self._hierarchies[group] = hierarchical.build_hierarchy(group, self.local_size)
        return self._hierarchies[group]

    def all_reduce_flat(self, buffer, sizes, group=None):
        sizes = sizes if self.per_tensor else [buffer.numel()]
        if self.hierarchical:
            hierarchical.adasum_hierarchical_flat_(buffer, sizes, self._hierarchy(group))
        else:
            adasum_flat_(buffer, sizes, group)

    def __getstate__(self) -> dict[str, Any]:
        # process groups do not pickle; they are rebuilt on first use
        return {**self.__dict__, "_hierarchies": {}}

    def __repr__(self) -> str:
        extra = f", hierarchical=True, local_size={self.local_size}" if self.hierarchical else ""
        return f"Adasum(per_tensor={self.per_tensor}{extra})"


_REDUCERS: dict[str, type[Reducer]] = {"sum": Sum, "mean": Mean, "adasum": Adasum}


def register(name: str, cls: type[Reducer]) -> None:
    """Make `cls` available by `name` to every place that takes a reducer name."""
    _REDUCERS[name] = cls


def get_reducer(reducer: str | Reducer) -> Reducer:
    """A reducer object from a reducer or its name ("sum", "mean", "adasum", "adacons")."""
    if isinstance(reducer, Reducer):
        return reducer
    if isinstance(reducer, str) and reducer in _REDUCERS:
        return _REDUCERS[reducer]()
    raise ValueError(f"unknown reducer {reducer!r}; choose one of {sorted(_REDUCERS)} or pass a Reducer")
