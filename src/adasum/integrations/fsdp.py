"""Adasum (or any reducer) across the replicas of FSDP2 sharded training (HSDP), in one call.

>>> mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))  # doctest: +SKIP
>>> for block in model.blocks:  # doctest: +SKIP
...     fully_shard(block, mesh=mesh["shard"])
>>> fully_shard(model, mesh=mesh["shard"])  # doctest: +SKIP
>>> adasum.fsdp.enable(model, mesh)                  # Adasum across the replicas, per parameter  # doctest: +SKIP

Each `fully_shard` unit reduce-scatters its gradients over the shard group (FSDP averages them
there), then calls the all-reduce hook that `enable` installs ("custom HSDP", the route torchtitan
takes for its own replica groups). The hook gets one flat buffer per unit: each parameter's dim-0
shard, zero-padded to the same length on every shard rank, end to end. It combines that buffer
across the replicate dimension with the reducer, **per parameter over the whole parameter**, not
per shard:

* Adasum: the VHDD tree runs over the replicas holding the same shard (`Placement`), and the
  per-parameter partial ``<a,b>``, ``|a|^2``, ``|b|^2`` of each level are summed over the shard
  group as well as over the replicas merged so far, so every shard applies the coefficients of
  the whole parameter (the padding adds nothing). The result, per parameter, is
  ``adasum.reduce`` over the replicas' shard-mean gradients. With one shard per replica the
  buffer holds whole parameters and the tree runs on the replicate group itself, with the
  transport `adasum.all_reduce` would pick there (NVLink symmetric memory inside one host).
* AdaCons: the per-parameter (or whole-unit) ``<g_i, m>``, ``|g_i|^2``, ``|m|^2`` are summed over
  the shard group before the coefficients are computed; its momentum is kept per unit.
* Sum and Mean are element-wise and run on the shards directly; another `Reducer` is accepted
  only with one shard per replica (then each buffer holds whole parameters).

Before data moves, all ranks of the mesh check that they have the same layout (dtype and padded
shard size of every parameter) and raise the same ValueError otherwise: once per backward for all
units together, at its first reduction (a check per unit would make the host wait for the
reductions queued before it, and backward would stop overlapping them), or for every reduction of
a unit whose unused parameters are left out (the layout then depends on the batch). `enable` turns
on ``set_reduce_scatter_unused_params(True)`` so that a parameter unused by one replica's batch
still takes part (with a zero gradient, which Adasum leaves out).

Not supported, refused with a clear error: a 1-D mesh (plain FSDP: there are no replicas to combine
across; Adasum across the shard ranks themselves, each rank's micro-batch gradient a worker, is a
later step), native 2-D HSDP (``fully_shard(mesh=mesh)`` hard-codes its averaging all-reduce),
``set_requires_all_reduce(False)`` (use ``set_requires_gradient_sync(False)`` to accumulate),
hierarchical Adasum, and `adasum.DistributedOptimizer` / `adasum.SlowMo` on sharded parameters
(`check_not_sharded`).

FSDP's private state is read in one place, `unit_view`; a test fails when torch changes it.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from adasum.collectives.agreement import agree, describe
from adasum.collectives.vhdd import Placement, adasum_flat_
from adasum.kernels import dot_and_norms
from adasum.reducers import AdaCons, Adasum, Mean, Reducer, Sum, get_reducer
from adasum.reducers.adacons import scale_segments_

DIMS = ("replicate", "shard")


# --- FSDP's private state, read in one place ------------------------------------------------------


@dataclass(frozen=True)
class UnitView:
    """What the hook needs of one `fully_shard` unit, read from FSDP's private state.

    `segments` are the padded shard sizes (elements) of the unit's trainable parameters in the order
    of the hook's buffer; `names` their names; `dtype` the buffer's (the reduce dtype).
    `include_unused`: FSDP reduce-scatters zeros for parameters without a gradient (otherwise
    they are left out of the buffer). `all_reduce`: FSDP's ``set_requires_all_reduce`` flag.
    `post_divides`: FSDP divides the buffer after the hook (fp16 reduce dtype or forced sum
    reductions).
    """

    segments: tuple[int, ...]
    names: tuple[str, ...]
    dtype: torch.dtype | None
    include_unused: bool
    all_reduce: bool
    post_divides: bool


_MISSING = (
    "adasum.fsdp reads FSDP2's private state ({what}), which this torch ({version}) does not have; "
    "adasum.fsdp supports the layout of torch 2.11 to 2.13. Please report it with your torch version."
)


def _param_group(module: nn.Module) -> Any:
    """The single FSDPParamGroup of a `fully_shard` unit (torch >= 2.11: a list of one)."""
    state = module._get_fsdp_state()  # type: ignore[operator]  # FSDPModule's: the stubs don't join it with Module
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before per-parameter meshes: one optional group
        if not hasattr(state, "_fsdp_param_group"):
            raise RuntimeError(_MISSING.format(what="FSDPState._fsdp_param_groups", version=torch.__version__))
        groups = [g for g in (state._fsdp_param_group,) if g is not None]
    if len(groups) > 1:
        raise ValueError("adasum.fsdp supports one parameter group per fully_shard unit (no per-parameter meshes)")
    return groups[0] if groups else None


def unit_view(module: nn.Module) -> UnitView | None:
    """Read one unit's layout and flags from FSDP2's private state; None for a unit without parameters.

    The one function of adasum that touches FSDP's internals (``FSDPParamGroup.fsdp_params``,
    ``FSDPParam.padded_sharded_param_size`` / ``sharded_param`` / ``_param_fqn``, the group's
    ``reduce_scatter_unused_params``, ``all_reduce_grads``, ``mp_policy``,
    ``force_sum_reduction_for_comms``); raises RuntimeError naming what is missing.
    """
    group = _param_group(module)
    if group is None:
        return None
    try:
        params = [p for p in group.fsdp_params if p.sharded_param.requires_grad]
        segments = tuple(int(p.padded_sharded_param_size.numel()) for p in params)
        names = tuple(str(getattr(p, "_param_fqn", None) or f"parameter {i}") for i, p in enumerate(params))
        policy = group.mp_policy
        reduce_dtype = policy.reduce_dtype or policy.param_dtype or (params[0].sharded_param.dtype if params else None)
        force_sum = bool(getattr(group, "force_sum_reduction_for_comms", False))
        include_unused = bool(getattr(group, "reduce_scatter_unused_params", False))
        all_reduce = bool(group.all_reduce_grads)
    except AttributeError as e:
        raise RuntimeError(_MISSING.format(what=e, version=torch.__version__)) from e
    # FSDP divides after the hook only where it cannot divide inside the reduction (fp16, forced sums)
    post_divides = force_sum or (reduce_dtype is not None and reduce_dtype not in (torch.float32, torch.bfloat16))
    return UnitView(segments, names, reduce_dtype, include_unused, all_reduce, post_divides)


# --- the groups of the mesh ----------------------------------------------------------------------


@dataclass(frozen=True)
class MeshGroups:
    """The process groups of a ("replicate", "shard") mesh as this rank sees them.

    `group` holds every rank of the mesh (None: the default group); `peers` are the `group` ranks
    of the replicas holding this rank's shard, in replica order (the Adasum tree's workers).
    """

    group: dist.ProcessGroup | None
    replicate: dist.ProcessGroup
    shard: dist.ProcessGroup
    peers: tuple[int, ...]
    replicas: int
    shards: int


def mesh_groups(mesh: Any) -> MeshGroups:
    """Check that `mesh` is a 2-D ("replicate", "shard") DeviceMesh and build its groups (collective)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh.ndim == 1:
        raise ValueError(
            "adasum.fsdp.enable needs a 2-D DeviceMesh with dims ('replicate', 'shard') and the model sharded with "
            "fully_shard(..., mesh=mesh['shard']): Adasum combines the replicas. On a 1-D mesh (plain FSDP) every "
            "rank is a shard and there are no replicas; Adasum across the shard ranks themselves (each rank's "
            "micro-batch gradient a worker) is not supported yet (a later step). Build, e.g., "
            "init_device_mesh(device, (replicas, shards), mesh_dim_names=('replicate', 'shard'))"
        )
    if mesh.ndim != 2 or set(names) != set(DIMS):
        raise ValueError(f"adasum.fsdp.enable needs a 2-D DeviceMesh with dims {DIMS}, got dims {names}")
    ranks = mesh.mesh.permute(names.index("replicate"), names.index("shard"))  # [replicas, shards] global ranks
    replicas, shards = ranks.shape
    everyone = sorted(int(r) for r in ranks.reshape(-1).tolist())
    group = None if everyone == list(range(dist.get_world_size())) else dist.new_group(everyone)
    mine = mesh.get_local_rank("shard")

    def group_rank(global_rank: int) -> int:
        return global_rank if group is None else dist.get_group_rank(group, global_rank)

    peers = tuple(group_rank(int(ranks[r, mine])) for r in range(replicas))
    return MeshGroups(group, mesh.get_group("replicate"), mesh.get_group("shard"), peers, int(replicas), int(shards))


# --- per-parameter reductions over shards --------------------------------------------------------


def adacons_shards_(
    reducer: AdaCons, buffer: torch.Tensor, sizes: Sequence[int], groups: MeshGroups, key: str
) -> None:
    """AdaCons across the replicas of a flat buffer of shards, coefficients of the whole parameters.

    As `AdaCons.all_reduce_flat` over the replicate group, except that each replica's partial
    ``<g_i, m>``, ``|g_i|^2``, ``|m|^2`` per segment are first summed over its shard group.
    """
    replicas = groups.replicas
    mean = buffer.clone()
    dist.all_reduce(mean, group=groups.replicate)
    mean.div_(replicas)
    partials = dot_and_norms(buffer, mean, sizes)  # [3, T] float64: <g, m>, |g|^2, |m|^2 over my shards
    del mean
    if groups.shards > 1:
        dist.all_reduce(partials, group=groups.shard)
    if not reducer.per_tensor:
        partials = partials.sum(1, keepdim=True)
    gathered = [torch.empty_like(partials) for _ in range(replicas)]
    dist.all_gather(gathered, partials, group=groups.replicate)
    stacked = torch.stack(gathered)  # [N, 3, T], the same on every rank of the mesh
    weights = reducer._weights(key, stacked[:, 0].T, stacked[:, 1].T, stacked[0, 2])
    mine = weights[:, dist.get_rank(groups.replicate)]
    scale_segments_(buffer, mine, sizes)
    dist.all_reduce(buffer, group=groups.replicate)


def reduce_shards_(reducer: Reducer, buffer: torch.Tensor, sizes: Sequence[int], groups: MeshGroups, key: str) -> None:
    """Combine a flat buffer of parameter shards across the replicas with `reducer`, per parameter."""
    if isinstance(reducer, Adasum):
        segments = list(sizes) if reducer.per_tensor else [buffer.numel()]
        if groups.shards == 1:  # whole parameters: the replicate group's own tree, its fastest transport
            adasum_flat_(buffer, segments, groups.replicate)
        else:
            adasum_flat_(buffer, segments, groups.group, Placement(groups.peers, 0))
    elif isinstance(reducer, AdaCons):
        adacons_shards_(reducer, buffer, sizes, groups, key)
    else:  # element-wise, or whole parameters (one shard per replica): checked by `enable`
        # the layout was agreed on across the mesh (`FSDPState`): no second check (a host round trip per unit)
        reducer.all_reduce_flat(buffer, sizes, groups.replicate, check_layout=False)


def check_reducer(reducer: Reducer, shards: int) -> None:
    """Raise ValueError for a reducer that cannot combine parameter shards per parameter."""
    if isinstance(reducer, Adasum) and reducer.hierarchical:
        raise ValueError(
            "hierarchical Adasum does not apply to adasum.fsdp: the shard dimension already plays the node's part "
            "(shard means are combined across replicas); pass reducer='adasum'"
        )
    if not isinstance(reducer, (Adasum, AdaCons, Sum, Mean)) and shards > 1:
        raise ValueError(
            f"{reducer!r} would see parameter shards, not whole parameters: adasum.fsdp runs Adasum, AdaCons, Sum "
            "and Mean per parameter over shards; other reducers need one shard per replica"
        )


# --- the hook ------------------------------------------------------------------------------------


class FSDPState:
    """The reducer and groups behind the hooks of one model; a `Stateful` for distributed checkpoints.

    ``state_dict()`` holds the reducer's state (AdaCons' momentum) and the number of reductions, so
    it can go into ``torch.distributed.checkpoint.save`` next to the model and the optimizer.
    """

    def __init__(self, reducer: Reducer, groups: MeshGroups, units: Sequence[tuple[str, nn.Module]] = ()) -> None:
        self.reducer = reducer
        self.groups = groups
        self.units = list(units)
        self.reductions = 0
        self._checked = False  # the model's layout agreed on for the current backward

    def new_step(self, *_: Any) -> None:
        """Forget the agreed layout (a forward pre-hook of the model): the next backward checks again."""
        self._checked = False

    def _check_model(self) -> None:
        """One check across the mesh of every unit's layout and flags (one host synchronisation per backward,
        at its first reduction: a check per unit would stall the stream of reductions behind it)."""
        layout = []
        for _, unit in self.units:
            view = unit_view(unit)
            if view is None or not view.segments:
                continue
            layout += [torch.empty(n, dtype=view.dtype, device="meta") for n in view.segments]
            flags = (int(view.include_unused), int(view.all_reduce))  # any difference shows in the check
            layout.append(torch.empty(flags, dtype=torch.int8, device="meta"))
        # a description (meta tensors: dtypes and sizes), not data: agreed on without the input checks
        group = self.groups.group
        agree(describe(layout), None, group, "the FSDP units' gradients", "adasum.fsdp")
        self._checked = True

    def reduce_unit(self, unit: nn.Module, key: str, buffer: torch.Tensor) -> None:
        """The all-reduce hook of one unit: check the layout across the mesh, then combine."""
        view = unit_view(unit)
        if view is None:
            return
        if not view.all_reduce:
            raise ValueError(
                f"adasum.fsdp: set_requires_all_reduce(False) on unit {key!r} is not supported (FSDP would add the "
                "next step's combined gradient to this step's uncombined one); accumulate with "
                "set_requires_gradient_sync(False) instead"
            )
        if view.post_divides and isinstance(self.reducer, AdaCons) and self.reducer.scale == "unit":
            raise ValueError(
                "AdaCons(scale='unit') with FSDP dividing after the hook (fp16 reduce dtype or forced sum "
                "reductions) would come out divided by the shard count; use a float32 or bfloat16 reduce dtype"
            )
        sizes = list(view.segments)
        fits = sum(sizes) == buffer.numel() and buffer.dtype == view.dtype
        if view.include_unused:
            # the layout follows from the parameters alone: checked once per backward, for every unit
            if not self._checked:
                self._check_model()
            if not fits:
                raise RuntimeError(f"adasum.fsdp: unit {key!r}'s buffer is not the layout FSDP's state describes")
        else:  # the layout depends on which parameters got gradients: check this very buffer
            layout = [torch.empty(n, dtype=buffer.dtype, device="meta") for n in sizes] if fits else []
            layout.append(torch.empty(buffer.numel(), dtype=buffer.dtype, device="meta"))
            group = self.groups.group
            agree(describe(layout), None, group, f"unit {key!r}'s gradients", "adasum.fsdp")
            if not fits:  # the same on every rank (the layouts agree)
                raise ValueError(
                    f"adasum.fsdp: unit {key!r} reduced {buffer.numel()} gradient elements, its trainable parameters "
                    f"have {sum(sizes)}: some parameter got no gradient in this backward. Call "
                    "model.set_reduce_scatter_unused_params(True) (adasum.fsdp.enable does) so that every replica "
                    "reduces the same layout"
                )
        reduce_shards_(self.reducer, buffer, sizes, self.groups, key)
        self.reductions += 1

    def state_dict(self) -> dict[str, Any]:
        """The reducer's state, serialised (its keys are only known after the first step) and the count."""
        blob = io.BytesIO()
        torch.save(self.reducer.state_dict(), blob)
        blob.seek(0)
        return {"reducer": blob, "reductions": torch.tensor(self.reductions, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved."""
        blob = state["reducer"]
        blob.seek(0)
        self.reducer.load_state_dict(torch.load(blob, weights_only=True))
        self.reductions = int(state["reductions"])

    def __repr__(self) -> str:
        return f"FSDPState(reducer={self.reducer!r}, replicas={self.groups.replicas}, shards={self.groups.shards})"


def _units(model: nn.Module) -> list[tuple[str, Any]]:  # (name, a module that is an FSDPModule)
    from torch.distributed.fsdp import FSDPModule

    return [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _check_sharding(model: nn.Module, mesh: Any, groups: MeshGroups) -> None:
    """Every parameter sharded by `fully_shard` on mesh['shard'] (public DTensor attributes only)."""
    from torch.distributed.tensor import DTensor

    shard_ranks = sorted(int(r) for r in mesh["shard"].mesh.reshape(-1).tolist())
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise ValueError(
                f"parameter {name!r} is not sharded by fully_shard: its gradient would not be combined across the "
                "replicas. Apply fully_shard(..., mesh=mesh['shard']) to a module holding it (e.g. the root)"
            )
        if p.device_mesh.ndim != 1:
            raise ValueError(
                f"parameter {name!r} is on a {p.device_mesh.ndim}-D mesh: native HSDP (fully_shard(mesh=mesh)) "
                "averages across replicas in a hard-coded all-reduce that a hook cannot replace. Shard with "
                "fully_shard(..., mesh=mesh['shard']) and let adasum.fsdp combine the replicas"
            )
        if sorted(int(r) for r in p.device_mesh.mesh.reshape(-1).tolist()) != shard_ranks:
            raise ValueError(f"parameter {name!r} is sharded on another mesh than mesh['shard']")


def enable(
    model: nn.Module,
    mesh: Any,
    reducer: str | Reducer = "adasum",
    *,
    include_unused: bool = True,
) -> FSDPState:
    """Combine the gradients of an FSDP2 model across the "replicate" dim of `mesh` with `reducer`.

    `model` must have been sharded with ``fully_shard(..., mesh=mesh["shard"])`` on every unit
    (module doc). Installs one all-reduce hook per unit; collective (call it on every rank).
    ``include_unused`` sets FSDP's ``set_reduce_scatter_unused_params`` on every unit. Returns the
    `FSDPState`; checkpoint it with the model and optimizer to keep AdaCons' momentum.

    >>> state = adasum.fsdp.enable(model, mesh)                      # Adasum  # doctest: +SKIP
    >>> state = adasum.fsdp.enable(model, mesh, adasum.AdaCons(momentum=0.9))  # doctest: +SKIP
    """
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_all_reduce_hook"):
        raise RuntimeError(
            f"adasum.fsdp needs FSDPModule.set_all_reduce_hook, which torch {torch.__version__} does not have "
            "(torch >= 2.7)"
        )
    groups = mesh_groups(mesh)
    reducer = get_reducer(reducer)
    check_reducer(reducer, groups.shards)
    units = _units(model)
    if not units:
        raise ValueError(
            "adasum.fsdp.enable: the model has no fully_shard unit; call fully_shard(..., mesh=mesh['shard'])"
        )
    _check_sharding(model, mesh, groups)
    if include_unused and not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        warnings.warn(
            f"adasum.fsdp: torch {torch.__version__} has no FSDPModule.set_reduce_scatter_unused_params, so FSDP "
            "leaves parameters without a gradient out of the reduced buffer and each unit's layout can change from "
            "batch to batch: the ranks agree on it at every unit's reduction (a host round trip per unit) instead "
            "of once per backward. torch 2.13 has the setter and checks once per backward.",
            stacklevel=2,
        )
    state = FSDPState(reducer, groups, units)
    model.register_forward_pre_hook(state.new_step)
    for name, unit in units:
        unit_view(unit)  # fails now, not in backward, if torch's state is not what we read
        if include_unused and hasattr(unit, "set_reduce_scatter_unused_params"):
            unit.set_reduce_scatter_unused_params(True)

        def hook(buffer: torch.Tensor, unit: nn.Module = unit, key: str = name) -> None:
            state.reduce_unit(unit, key, buffer)

        unit.set_all_reduce_hook(hook)
    return state
