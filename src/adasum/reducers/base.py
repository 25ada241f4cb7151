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

from adasum.collectives.api import fused_per_dtype
from adasum.core.operator import check_floating


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
            check_floating(t.dtype)
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




_REDUCERS: dict[str, type[Reducer]] = {}


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
