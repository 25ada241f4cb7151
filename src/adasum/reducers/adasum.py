"""Adasum as a reducer: per tensor or whole-model, flat or hierarchical."""

from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.distributed as dist

from adasum.collectives import hierarchical
from adasum.collectives.api import ADASUM, AdasumOp, adasum_list_
from adasum.collectives.vhdd import adasum_flat_
from adasum.core.layout import group_by_dtype
from adasum.core.operator import check_floating
from adasum.kernels.reduce import reduce_stacked
from adasum.reducers.base import Reducer, check_workers
from adasum.transport.topology import Topology


def _per_dtype_whole(whole: Reducer, per_worker, count: int) -> list[torch.Tensor]:
    """`whole` applied to each dtype group of tensors fused into one (whole-model coefficients)."""
    out: list[torch.Tensor] = [torch.empty(0)] * count
    for indices in group_by_dtype(list(per_worker[0])).values():
        flat = whole.reduce([[torch.cat([w[i].reshape(-1) for i in indices])] for w in per_worker])[0]
        for i, piece in zip(indices, flat.split([per_worker[0][i].numel() for i in indices])):
            out[i] = piece.view(per_worker[0][i].shape)
    return out


class Adasum(Reducer):
    """Adasum (see `adasum.core.operator`): per tensor by default; ``per_tensor=False`` uses one pair of
    coefficients for all tensors of one dtype together (the whole-model variant; per dtype
    because the collective runs on one flat buffer per dtype).

    ``hierarchical=True`` (multi-GPU nodes): mean within each node of `local_size` consecutive
    ranks (default LOCAL_WORLD_SIZE), Adasum across the node means (see `adasum.hierarchical`).
    ``hierarchical="exact"``: the flat tree over every rank, computed in two tiers (slice-parallel inside
    each node, VHDD across nodes); needs powers of two for `local_size` and the number of nodes.
    `local_size` is a positive int, and only with `hierarchical` (ValueError otherwise).
    """

    name = "adasum"
    exact_average = False

    def __init__(
        self, per_tensor: bool = True, hierarchical: bool | str = False, local_size: int | None = None
    ) -> None:
        if not isinstance(per_tensor, bool):
            raise TypeError(f"per_tensor must be True or False, got {per_tensor!r}; pass a bool")
        if hierarchical not in (False, True, "exact"):
            raise ValueError(f"hierarchical must be False, True or 'exact', got {hierarchical!r}; pass one of them")
        if local_size is not None:
            if isinstance(local_size, bool) or not isinstance(local_size, numbers.Integral):
                raise TypeError(f"local_size must be a positive int or None, got {local_size!r}; pass ranks per node, "
                                "or None")
            if local_size < 1:
                raise ValueError(f"local_size must be a positive int or None, got {local_size!r}; pass ranks per "
                                 "node, or None")
            if not hierarchical:
                raise ValueError(f"local_size needs hierarchical=True or 'exact', got local_size={local_size!r} "
                                 f"with hierarchical={hierarchical!r}; pass hierarchical=True too, or drop local_size")
            local_size = int(local_size)
        self.per_tensor = per_tensor
        self.hierarchical = hierarchical
        self.local_size = local_size
        self._hierarchies: dict[Any, Any] = {}  # per group, built on first use (collective)

    def reduce(self, per_worker):
        """Adasum of the workers' copies, tensor by tensor (or whole-model), in one process."""
        count = check_workers(per_worker, f"adasum.{type(self).__name__}.reduce")
        if self.hierarchical is True:
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
                check_floating(t.dtype)
            stacked = torch.stack([torch.cat([w[i].reshape(-1) for i in indices]) for w in per_worker])
            flat = reduce_stacked(stacked, sizes if self.per_tensor else [sum(sizes)])
            for i, piece in zip(indices, flat.split(sizes)):
                out[i] = piece.view(first[i].shape)
        return out

    @property
    def capturable(self) -> bool:
        """The flat VHDD collective runs captured (`adasum.transport.graphs`); the hierarchical one is not
        captured (never tried)."""
        return not self.hierarchical

    def setup(self, group=None):
        """Build the hierarchical groups (collective) when ``hierarchical=True``."""
        if self.hierarchical:
            self._hierarchy(group)

    def _hierarchy(self, group):
        # kept with the process group it was built on: the default group re-made (destroy_process_group, then
        # init_process_group, its ranks perhaps renumbered) builds a new one (the old one's sub-groups are gone)
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        found = self._hierarchies.get(group)
        if found is None or found[0] is not pg:
            exact = self.hierarchical == "exact"
            found = self._hierarchies[group] = (pg, hierarchical.build_hierarchy(group, self.local_size, exact=exact))
        return found[1]

    def _op(self, group, sizes, options, topology=None):
        """The collectives' own Adasum (`adasum.collectives.api.AdasumOp`), planned as `adasum.all_reduce` plans it:
        per dtype the movers the group, the placement and the bytes allow (a transport that reads lists in place
        takes contiguous tensors where they lie: no fusion copy), for the per-tensor or whole-model form, flat or on
        the hierarchy (`setup`). No keyword options (`Reducer.call_options`): the transport and the non-finite policy
        are `adasum.all_reduce`'s."""
        if not self.hierarchical and self.per_tensor:
            return ADASUM
        return AdasumOp(whole=not self.per_tensor, tiers=self._hierarchy(group) if self.hierarchical else None)

    def _shards_op(self, sizes, groups, key):
        """The sharded form as the collectives plan it (`adasum.collectives.api.AdasumOp` with the grid): the
        movers of `_all_reduce_shards`' trees are the plan's."""
        return AdasumOp(whole=not self.per_tensor, shards=groups, segments=tuple(sizes))

    def _all_reduce(self, tensors, group=None):
        """Per tensor and flat: as `_op`'s plan runs it, planned for this call alone (`adasum_list_`)."""
        if self.hierarchical or not self.per_tensor:
            super()._all_reduce(tensors, group)
            return
        adasum_list_(tensors, group)

    def _all_reduce_flat(self, buffer, sizes, group=None):
        sizes = sizes if self.per_tensor else [buffer.numel()]
        if self.hierarchical:
            hierarchical.adasum_hierarchical_flat_(buffer, sizes, self._hierarchy(group))
        else:
            adasum_flat_(buffer, sizes, group)

    def check_shards(self, shards: int) -> None:
        """Raise ValueError for hierarchical Adasum, which does not combine shards (flat Adasum does, per tensor)."""
        if self.hierarchical:
            raise ValueError(
                "hierarchical Adasum does not combine tensor shards: the shard groups already play the nodes' part "
                "(shard means are combined across replicas); use Adasum() without hierarchical"
            )

    def _all_reduce_shards(self, buffer, sizes, groups: Topology, *, key=None):
        """The VHDD tree over the replicas holding this rank's shard (`groups.peers`); each level's per-tensor
        partial ``<a,b>``, ``|a|^2``, ``|b|^2`` are summed over the shard group too, so every shard applies
        the coefficients of the whole tensor. One shard per replica: the replicate group's own tree, on
        the transport `adasum.all_reduce` picks there."""
        segments = [int(n) for n in sizes] if self.per_tensor else [buffer.numel()]
        if groups.shards == 1:
            adasum_flat_(buffer, segments, groups.replicate)
        else:
            adasum_flat_(buffer, segments, groups.group, groups.at(0))

    def __getstate__(self) -> dict[str, Any]:
        # process groups do not pickle; they are rebuilt on first use
        return {**self.__dict__, "_hierarchies": {}}

    def __repr__(self) -> str:
        extra = f", hierarchical={self.hierarchical!r}, local_size={self.local_size}" if self.hierarchical else ""
        return f"Adasum(per_tensor={self.per_tensor}{extra})"
