"""Adasum (or any reducer) across the replicas of FSDP2 sharded training (HSDP), in one call.

>>> mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))  # doctest: +SKIP
>>> for block in model.blocks:  # doctest: +SKIP
...     fully_shard(block, mesh=mesh["shard"])
>>> fully_shard(model, mesh=mesh["shard"])  # doctest: +SKIP
>>> adasum.fsdp.enable(model, mesh)                  # Adasum across the replicas, per parameter  # doctest: +SKIP

On one process: a gloo group of one rank, a CPU mesh of one replica of one shard (under torchrun every rank
makes the same calls on a mesh of several):

>>> import torch.distributed as dist
>>> from torch.distributed.device_mesh import init_device_mesh
>>> from torch.distributed.fsdp import fully_shard
>>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
>>> mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
>>> for block in model:
...     _ = fully_shard(block, mesh=mesh["shard"])
>>> _ = fully_shard(model, mesh=mesh["shard"])
>>> state = adasum.fsdp.enable(model, mesh)
>>> state, state.agreements                         # the layouts checked once, at enable
(FSDPState(reducer=Adasum(per_tensor=True), replicas=1, shards=1), 1)
>>> model(torch.ones(3, 2)).sum().backward()
>>> state.reductions, model[1].bias.grad.full_tensor()   # one reduction per unit with parameters
(2, tensor([3.]))
>>> dist.destroy_process_group()

Each `fully_shard` unit reduce-scatters its gradients over the shard group (FSDP averages them
there), then calls the all-reduce hook that `enable` installs ("custom HSDP", the route torchtitan
takes for its own replica groups). The hook gets one flat buffer per unit: each parameter's dim-0
shard, zero-padded to the same length on every shard rank, end to end. It combines that buffer
across the replicate dimension with the reducer's sharded form (`Reducer.all_reduce_shards`),
**per parameter over the whole parameter**, not per shard:

* Adasum: the VHDD tree runs over the replicas holding the same shard (`adasum.transport.topology.Topology`), and the
  per-parameter partial ``<a,b>``, ``|a|^2``, ``|b|^2`` of each level are summed over the shard
  group as well as over the replicas merged so far, so every shard applies the coefficients of
  the whole parameter (the padding adds nothing). The result, per parameter, is
  ``adasum.reduce`` over the replicas' shard-mean gradients. With one shard per replica the
  buffer holds whole parameters and the tree runs on the replicate group itself, with the
  transport `adasum.all_reduce` would pick there (NVLink symmetric memory inside one host).
* AdaCons: the per-parameter (or whole-unit) ``<g_i, m>``, ``|g_i|^2``, ``|m|^2`` are summed over
  the shard group before the coefficients are computed; its momentum is kept per unit.
* Sum and Mean are element-wise and run on the shards directly; another `Reducer` is accepted
  only with one shard per replica (`Reducer.check_shards`).

The layout a unit reduces does not depend on the batch: every trainable parameter is in the
buffer, a parameter without a gradient as zeros (which Adasum's zero guard leaves out exactly),
and it gets the combined gradient on every rank. `enable` turns on FSDP's
``set_reduce_scatter_unused_params(True)``, or on a torch without that setter gives such a
parameter a zero gradient just before FSDP collects the unit's gradients (`fill_unused_grads`).

Before data moves, all ranks of the mesh have the same layouts (dtype and padded shard size of
every trainable parameter, and FSDP's flags), or raise the same ValueError naming the first
difference. `enable` checks it (one blocking agreement). Then each forward posts a probe, the
signature of the layouts all-reduced on the checks' own gloo group without waiting
(`adasum.checks.agreement.agree_async`); the backward's first reduction reads its result, long
arrived: the same layouts everywhere need no round trip, a difference makes every rank run the
blocking check, which raises. No host round trip is left in the reduction path. With
``include_unused=False`` FSDP leaves parameters without a gradient out, the layout depends on the
batch, and every reduction of a unit checks its buffer (a host round trip per unit).

Not supported, refused with a clear error: a 1-D mesh (plain FSDP: there are no replicas to combine
across; Adasum across the shard ranks themselves, each rank's micro-batch gradient a worker, is a
later step), native 2-D HSDP (``fully_shard(mesh=mesh)`` hard-codes its averaging all-reduce),
``set_requires_all_reduce(False)`` (use ``set_requires_gradient_sync(False)`` to accumulate),
a second `enable` on a model with a unit enabled already (ValueError, before any collective),
`enable` on a part of the FSDP model (a module inside FSDP's root, e.g. one block: the units outside it would
reduce over the shard group only; FSDP knows its root from the first forward on, so the first reduction raises
ValueError naming those units, the same on every rank), hierarchical Adasum, and `adasum.DistributedOptimizer` /
`adasum.SlowMo` on sharded parameters (`check_not_sharded`).

FSDP's private state is read in one section, `unit_view`, `tree_units` and, on torches without the setter,
`fill_unused_grads`; each raises a RuntimeError naming what is missing, at `enable`.
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

from adasum.checks.agreement import Agreement, agree, agree_async
from adasum.options import check_flag, user_stacklevel
from adasum.reducers import Reducer, get_reducer
from adasum.settings import current
from adasum.transport.communicator import side_stream
from adasum.transport.topology import ShardGroups, Topology, group_rank

DIMS = ("replicate", "shard")


# --- FSDP's private state, read in one section ----------------------------------------------------


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
        raise ValueError(
            "adasum.fsdp supports one parameter group per fully_shard unit (no per-parameter meshes); apply "
            "fully_shard(..., mesh=mesh['shard']) with one mesh for all of a unit's parameters"
        )
    return groups[0] if groups else None


def _used_on_current_stream(buffer: torch.Tensor) -> None:
    """Tell the caching allocator that the hook's stream uses `buffer`. FSDP allocates it on its reduce-scatter
    stream and, where the reduce dtype differs from the parameters', frees it right after the hook: without
    this, the next unit's reduce-scatter (on that stream) may take its memory while the hook's kernels still
    read and write it (NCCL's own collectives record their stream; the kernels adasum launches do not)."""
    if buffer.is_cuda and not torch.cuda.is_current_stream_capturing():
        buffer.record_stream(torch.cuda.current_stream(buffer.device))


def unit_view(module: nn.Module) -> UnitView | None:
    """Read one unit's layout and flags from FSDP2's private state; None for a unit without parameters.

    One of the three functions of adasum that touch FSDP's internals (with `tree_units` and `fill_unused_grads`);
    it reads ``FSDPParamGroup.fsdp_params``, ``FSDPParam.padded_sharded_param_size`` / ``sharded_param`` /
    ``_param_fqn``, the group's ``reduce_scatter_unused_params``, ``all_reduce_grads``, ``mp_policy``,
    ``force_sum_reduction_for_comms``; raises RuntimeError naming what is missing.
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


def tree_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name in FSDP's root, module) of every `fully_shard` unit with trainable parameters in the FSDP tree that the
    unit `module` belongs to; known once FSDP's lazy init ran (the root's first forward), [] before.

    Reads ``FSDPState._state_ctx.all_states`` (the root's first) and each state's ``_modules``; raises RuntimeError
    naming what is missing.
    """
    state = module._get_fsdp_state()  # type: ignore[operator]  # FSDPModule's: the stubs don't join it with Module
    try:
        states = list(state._state_ctx.all_states)
        modules = [m for s in states for m in s._modules]
    except AttributeError as e:
        raise RuntimeError(_MISSING.format(what=e, version=torch.__version__)) from e
    if not modules:
        return []
    names = {id(m): name or "<root>" for name, m in modules[0].named_modules()}
    out = []
    for m in modules:
        view = unit_view(m)
        if view is not None and view.segments:
            out.append((names.get(id(m), type(m).__name__), m))
    return out


def fill_unused_grads(module: nn.Module) -> None:
    """For torches without ``FSDPModule.set_reduce_scatter_unused_params``: what the setter does.

    Wraps the unit's ``FSDPParamGroup.post_backward`` so that, when the unit reduces, every trainable
    parameter without a gradient (nor an accumulated one) first gets a zero gradient; FSDP then
    reduce-scatters it with the others and gives it the combined gradient. The unit's buffer holds
    every trainable parameter whatever the batch used (``FSDPParam.unsharded_param``,
    ``unsharded_accumulated_grad``, the group's ``reduce_grads``).
    """
    group = _param_group(module)
    if group is None:
        return
    for owner, name in [(group, "post_backward"), (group, "reduce_grads"), (group, "fsdp_params")] + [
        (p, "unsharded_accumulated_grad") for p in getattr(group, "fsdp_params", ())
    ]:
        if not hasattr(owner, name):
            raise RuntimeError(_MISSING.format(what=f"{type(owner).__name__}.{name}", version=torch.__version__))
    collect = group.post_backward

    def post_backward(*args: Any) -> Any:
        if group.reduce_grads:
            for fsdp_param in group.fsdp_params:
                if not hasattr(fsdp_param, "_unsharded_param") or fsdp_param.unsharded_accumulated_grad is not None:
                    continue
                param = fsdp_param.unsharded_param
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
        return collect(*args)

    group.post_backward = post_backward


# --- the groups of the mesh ----------------------------------------------------------------------


def mesh_groups(mesh: Any) -> Topology:
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
        raise ValueError(
            f"adasum.fsdp.enable needs a 2-D DeviceMesh with dims {DIMS}, got dims {names}; build it with "
            "init_device_mesh(device, (replicas, shards), mesh_dim_names=('replicate', 'shard'))"
        )
    ranks = mesh.mesh.permute(names.index("replicate"), names.index("shard"))  # [replicas, shards] global ranks
    replicas, shards = ranks.shape
    everyone = sorted(int(r) for r in ranks.reshape(-1).tolist())
    group = None if everyone == list(range(dist.get_world_size())) else dist.new_group(everyone)
    mine = mesh.get_local_rank("shard")
    peers = tuple(group_rank(group, int(ranks[r, mine])) for r in range(replicas))
    return ShardGroups(group, mesh.get_group("replicate"), mesh.get_group("shard"), peers, int(replicas), int(shards))


# --- the layouts the ranks agree on ---------------------------------------------------------------


def unit_layout(view: UnitView, include_unused: bool) -> tuple:
    """What the ranks must share for one unit's reduction: the buffer's dtype, the padded shard size of
    every trainable parameter, and the flags. Names are left out (FSDP sets them at the first forward)."""
    return (str(view.dtype).removeprefix("torch."), view.segments, include_unused, view.all_reduce, view.post_divides)


def layout_entries(layouts: dict[str, tuple]) -> list[tuple]:
    """The units' layouts as entries for `agree`, one per parameter and one of flags per unit, so that
    an error names the unit and the parameter's index."""
    entries: list[tuple] = []
    for key, (dtype, segments, include_unused, all_reduce, post_divides) in layouts.items():
        entries += [(key, f"parameter {i}", dtype, n) for i, n in enumerate(segments)]
        flags = (f"include_unused={include_unused}", f"all_reduce={all_reduce}", f"post_divides={post_divides}")
        entries.append((key, *flags))
    return entries


WHAT = "the FSDP units' gradient layouts"
"""What the layout checks name (with the schedule-shaping settings, `adasum.settings.Settings.shaping`)."""


# --- the hook ------------------------------------------------------------------------------------


class FSDPState:
    """The reducer and groups behind the hooks of one model; a `Stateful` for distributed checkpoints.

    ``state_dict()`` holds the reducer's state (AdaCons' momentum) and the number of reductions, so
    it can go into ``torch.distributed.checkpoint.save`` next to the model and the optimizer.
    `agreements` counts the blocking layout checks across the mesh (module doc: one at `enable`,
    then one only where a probe finds ranks that differ, and one per reduction of a unit whose
    unused parameters are left out).
    """

    def __init__(
        self,
        reducer: Reducer,
        groups: Topology,
        units: Sequence[tuple[str, nn.Module]] = (),
        fills_unused: bool = False,
    ) -> None:
        self.reducer = reducer
        self.groups = groups
        self.units = list(units)
        self.fills_unused = fills_unused  # `fill_unused_grads` stands in for FSDP's setter
        self.reductions = 0
        self.agreements = 0
        self._agreed: dict[str, tuple] = {}  # each unit's layout, the same on every rank
        self._probe: tuple[dict[str, tuple], Agreement] | None = None  # the forward's layouts, being compared
        self._tree_checked = False  # every unit of FSDP's tree has this state's hooks (`_check_tree`)

    def _layouts(self) -> dict[str, tuple]:
        """This rank's layout of every unit with trainable parameters (host only: FSDP's state)."""
        out = {}
        for key, unit in self.units:
            view = unit_view(unit)
            if view is not None:
                out[key] = unit_layout(view, view.include_unused or self.fills_unused)
        return out

    def agree_layouts(self) -> None:
        """The blocking check: every rank of the mesh has the same units' layouts, or the same
        ValueError on every rank names the first difference (collective)."""
        layouts = self._layouts()
        self.agreements += 1
        agree(layout_entries(layouts), None, self.groups.group, WHAT, "adasum.fsdp", current().shaping)
        self._agreed = layouts

    def new_step(self, *_: Any) -> None:
        """The model's forward pre-hook: post this step's probe of the layouts (no wait)."""
        if torch.is_grad_enabled() and dist.get_world_size(self.groups.group) > 1:
            layouts = self._layouts()  # compared as `agree_layouts` compares them, without waiting
            self._probe = (layouts, agree_async(layout_entries(layouts), None, self.groups.group, current().shaping))

    def _check_probe(self) -> None:
        """At a backward's first reduction: the forward's probe found the same layouts on every rank
        (taken as agreed, no round trip), or every rank runs the blocking check, which names the difference."""
        probe, self._probe = self._probe, None
        if probe is None:
            return
        layouts, posted = probe
        if posted.same():
            self._agreed = layouts
        else:
            self.agree_layouts()

    def _check_tree(self, unit: nn.Module) -> None:
        """At the first reduction (FSDP knows its root from the first forward on): every unit with trainable
        parameters in the FSDP tree of `unit` was enabled, or ValueError (the same on every rank: the same model)."""
        if self._tree_checked:
            return
        outside = [name for name, m in tree_units(unit) if not hasattr(m, ENABLED)]
        if outside:
            raise ValueError(
                f"adasum.fsdp: the fully_shard units {outside} of the FSDP model are outside the module given to "
                "adasum.fsdp.enable, so their gradients would not be combined across the replicas; call "
                "adasum.fsdp.enable on the module that FSDP takes as root (the outermost fully_shard module, whose "
                "forward runs first)"
            )
        self._tree_checked = True

    def reduce_unit(self, unit: nn.Module, key: str, buffer: torch.Tensor) -> None:
        """The all-reduce hook of one unit: the whole FSDP tree enabled (checked once), the layout agreed across
        the mesh, then combine."""
        self._check_tree(unit)
        view = unit_view(unit)
        if view is None:
            return
        sizes = list(view.segments)
        fits = sum(sizes) == buffer.numel() and buffer.dtype == view.dtype
        include_unused = view.include_unused or self.fills_unused
        if include_unused:  # the layout follows from the parameters alone
            self._check_probe()
            if self._agreed.get(key) != unit_layout(view, include_unused) or not fits:
                raise RuntimeError(
                    f"adasum.fsdp: unit {key!r}'s gradient layout changed between the forward and its reduction, "
                    "or its buffer is not the layout FSDP's state describes; leave the unit's parameters as they are "
                    "between its forward and backward (if they were, please report it with your torch version)"
                )
        else:
            self._agree_buffer(key, buffer, sizes, fits)
        self._refuse_flags(view, key)
        _used_on_current_stream(buffer)
        self.reducer.all_reduce_shards(buffer, sizes, self.groups, key=key)
        self.reductions += 1

    def _agree_buffer(self, key: str, buffer: torch.Tensor, sizes: list[int], fits: bool) -> None:
        """Unused parameters left out: the layout depends on the batch, so this very buffer is checked."""
        layout = [(key, f"parameter {i}", str(buffer.dtype), n) for i, n in enumerate(sizes)] if fits else []
        layout.append((key, "elements", str(buffer.dtype), buffer.numel()))
        self.agreements += 1
        agree(layout, None, self.groups.group, f"unit {key!r}'s gradients", "adasum.fsdp")
        if not fits:  # the same on every rank (the layouts agree)
            raise ValueError(
                f"adasum.fsdp: unit {key!r} reduced {buffer.numel()} gradient elements, its trainable parameters "
                f"have {sum(sizes)}: some parameter got no gradient in this backward. Call "
                "model.set_reduce_scatter_unused_params(True) (adasum.fsdp.enable does) so that every replica "
                "reduces the same layout"
            )

    def _refuse_flags(self, view: UnitView, key: str) -> None:
        """FSDP settings the hook cannot serve (agreed on across the mesh: the same error everywhere)."""
        if not view.all_reduce:
            raise ValueError(
                f"adasum.fsdp: set_requires_all_reduce(False) on unit {key!r} is not supported (FSDP would add the "
                "next step's combined gradient to this step's uncombined one); to accumulate, call "
                "set_requires_gradient_sync(False) instead"
            )
        if view.post_divides and not self.reducer.homogeneous:
            raise ValueError(
                f"{self.reducer!r} with FSDP dividing after the hook (fp16 reduce dtype or forced sum reductions) "
                "would come out divided by the shard count (its result does not scale with its inputs); use a "
                "float32 or bfloat16 reduce dtype"
            )

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


ENABLED = "_adasum_fsdp_enabled"
"""The attribute `enable` marks each `fully_shard` unit it installed hooks on with (its name there): a second
`enable` is refused."""


def _units(model: nn.Module) -> list[tuple[str, Any]]:  # (name, a module that is an FSDPModule)
    from torch.distributed.fsdp import FSDPModule

    return [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _check_sharding(model: nn.Module, mesh: Any, groups: Topology) -> None:
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
                "averages across replicas in a hard-coded all-reduce that a hook cannot replace. Apply "
                "fully_shard(..., mesh=mesh['shard']) instead and let adasum.fsdp combine the replicas"
            )
        if sorted(int(r) for r in p.device_mesh.mesh.reshape(-1).tolist()) != shard_ranks:
            raise ValueError(
                f"parameter {name!r} is sharded on another mesh than mesh['shard']; apply "
                "fully_shard(..., mesh=mesh['shard']) with the mesh given to adasum.fsdp.enable"
            )


def enable(
    model: nn.Module,
    mesh: Any,
    reducer: str | Reducer = "adasum",
    *,
    include_unused: bool = True,
) -> FSDPState:
    """Combine the gradients of an FSDP2 model across the "replicate" dim of `mesh` with `reducer`.

    `model` must have been sharded with ``fully_shard(..., mesh=mesh["shard"])`` on every unit
    (module doc), and be FSDP's root (the outermost `fully_shard` module): a unit of FSDP's tree outside `model`
    makes the first reduction raise ValueError. Installs one all-reduce hook per unit; collective (call it on
    every rank). Once per model: a model with a unit enabled already raises ValueError (before any collective).
    ``include_unused`` (True or False, else TypeError) sets FSDP's ``set_reduce_scatter_unused_params`` on
    every unit. Returns the
    `FSDPState`; checkpoint it with the model and optimizer to keep AdaCons' momentum.

    >>> state = adasum.fsdp.enable(model, mesh)                      # Adasum  # doctest: +SKIP
    >>> state = adasum.fsdp.enable(model, mesh, adasum.AdaCons(momentum=0.9))  # doctest: +SKIP

    On one process (a gloo group of one rank, a CPU mesh of one replica of one shard); a second enable and a
    1-D mesh are refused:

    >>> import torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.fsdp import fully_shard
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    >>> model = fully_shard(torch.nn.Linear(2, 1), mesh=mesh["shard"])
    >>> adasum.fsdp.enable(model, mesh, adasum.AdaCons(momentum=0.9))
    FSDPState(reducer=AdaCons(momentum=0.9, per_tensor=False, scale='mean_norm'), replicas=1, shards=1)
    >>> adasum.fsdp.enable(model, mesh, "mean")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: adasum.fsdp.enable: unit '<root>' of the model is enabled already ...
    >>> adasum.fsdp.enable(fully_shard(torch.nn.Linear(2, 1), mesh=mesh["shard"]), init_device_mesh("cpu", (1,)))
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: adasum.fsdp.enable needs a 2-D DeviceMesh with dims ('replicate', 'shard') and the model sharded ...
    >>> dist.destroy_process_group()
    """
    from torch.distributed.fsdp import FSDPModule

    check_flag("adasum.fsdp.enable", "include_unused", include_unused)
    if not hasattr(FSDPModule, "set_all_reduce_hook"):
        raise RuntimeError(
            f"adasum.fsdp needs FSDPModule.set_all_reduce_hook, which torch {torch.__version__} does not have "
            "(torch >= 2.7); install a newer torch (pip install 'torch>=2.7')"
        )
    units = _units(model)
    enabled = [name for name, unit in units if hasattr(unit, ENABLED)]
    if enabled:  # before any collective: every rank that calls alike raises alike
        raise ValueError(
            f"adasum.fsdp.enable: unit {enabled[0]!r} of the model is enabled already (an earlier "
            "adasum.fsdp.enable installed its hooks); a second enable would leave the first one's forward hook "
            "posting probes and its FSDPState unused. Call enable once per model and keep the FSDPState it returns "
            "(for another reducer, shard a new model)"
        )
    groups = mesh_groups(mesh)
    if groups.replicas == 1:  # the mesh is the same on every rank: every rank warns
        warnings.warn(
            f"adasum.fsdp.enable: the mesh's 'replicate' dim has size 1, so there is one replica and nothing to "
            f"combine: training runs as plain FSDP over {groups.shards} shard(s); build the mesh with 2 or more "
            "replicas, init_device_mesh(device, (replicas, shards), mesh_dim_names=('replicate', 'shard'))",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    reducer = get_reducer(reducer)
    reducer.check_shards(groups.shards)
    if not units:
        raise ValueError(
            "adasum.fsdp.enable: the model has no fully_shard unit; call fully_shard(..., mesh=mesh['shard'])"
        )
    _check_sharding(model, mesh, groups)
    setter = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
    state = FSDPState(reducer, groups, units, fills_unused=include_unused and not setter)
    # the reductions' own stream (FSDP's all-reduce stream otherwise; docs/integrations.md: streams and graphs)
    options = {}
    if getattr(mesh, "device_type", "cpu") == "cuda":
        options["stream"] = side_stream(torch.device("cuda", torch.cuda.current_device()), "fsdp")
    for name, unit in units:
        unit_view(unit)  # fails now, not in backward, if torch's state is not what we read
        tree_units(unit)
        if include_unused and setter:
            unit.set_reduce_scatter_unused_params(True)
        elif include_unused:
            fill_unused_grads(unit)

        def hook(buffer: torch.Tensor, unit: nn.Module = unit, key: str = name) -> None:
            state.reduce_unit(unit, key, buffer)

        unit.set_all_reduce_hook(hook, **options)
    state.agree_layouts()
    model.register_forward_pre_hook(state.new_step)
    for name, unit in units:
        setattr(unit, ENABLED, name)
    return state
