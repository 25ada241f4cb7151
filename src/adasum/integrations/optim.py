"""A distributed optimizer wrapper: combine optimizer deltas (or gradients) across ranks with any
reducer.

>>> opt = adasum.DistributedOptimizer(torch.optim.Adam(model.parameters()), reducer="adasum")  # doctest: +SKIP
>>> loss.backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP

On one process (a group of one rank; under torchrun every rank makes the same calls), delta mode with two
local steps per round, from zero weights:

>>> import torch.distributed as dist
>>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
>>> model = torch.nn.Linear(2, 1)
>>> _ = [torch.nn.init.zeros_(p) for p in model.parameters()]
>>> opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=2)
>>> for _ in range(2):
...     model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()
>>> model.weight.data, opt.statistics()             # two local steps of 0.1, one combination
(tensor([[-0.2000, -0.2000]]), {'step': 1, 'skipped_steps': 0})
>>> dist.destroy_process_group()

Delta mode (the default, Horovod's ``DistributedOptimizer(op=Adasum)`` for Adam and LAMB): ``step()``
keeps the starting weights x0, runs the wrapped optimizer locally, combines the weight changes
``x - x0`` across ranks and sets every rank's weights to ``x0 + combined``. Optimizer state
(momentum, Adam moments) stays local. Because the local step happens inside ``step()``,
``clip_grad_norm_`` and ``torch.amp.GradScaler`` work the usual way. With ``local_steps=tau`` the
ranks take tau local steps between combinations (local SGD with the reducer of model deltas).

Gradient mode: ``step()`` combines the gradients, then runs the wrapped optimizer (for plain SGD,
the slides' usage). The ranks agree on which parameters have a gradient (one small all-reduce on
the host per step): a parameter whose ``.grad`` is None on every rank keeps None, so the wrapped
optimizer leaves it alone (no weight decay, no momentum), as plain PyTorch and DDP do; one with a
gradient on some ranks only is combined with zeros from the others. ``step(closure)`` combines the
gradients of every closure evaluation (the closure is wrapped), and the wrapped optimizer sees the
loss averaged over the ranks, so optimizers that evaluate the closure several times (LBFGS) take
the same decisions on every rank.

GradScaler: ``scaler.step(opt)`` hands this optimizer ``grad_scale`` and ``found_inf`` (the
``_step_supports_amp_scaling`` contract) instead of deciding alone; ``step()`` all-reduces the
inf flag, so when any rank sees inf/NaN every rank skips the step together. Pass
``grad_scaler=scaler`` and the agreed flag also reaches the scaler, so every rank's loss scale
backs off together (otherwise parameters still agree, loss scales may not).

Memory: delta mode keeps one extra copy of the parameters (the starting weights, one flat buffer per
bucket) and `adasum.integrations.delta.IN_FLIGHT` (3) flat delta buffers of at most `bucket_cap_mb`
each, kept between steps (reducers with whole-model coefficients, such as AdaCons or
``Adasum(per_tensor=False)``, need one bucket per dtype, so the delta buffers hold the whole model).
Gradient mode keeps no copy; while it combines, a transient flat buffer of at most `bucket_cap_mb`
exists.

Speed (delta mode on GPUs): each bucket's deltas and its update are one Triton pass over the
parameters where they lie (per-tensor ops for non-contiguous ones, such as channels-last weights),
and the buckets are pipelined: the combination of one bucket runs on a side stream while the next
bucket's deltas and the previous bucket's update run on the compute stream. After the first step
(which builds the buckets' tile tables) ``step()`` does not synchronise the host, unless
``nonfinite`` or GradScaler ask for a flag; work enqueued after it on the compute stream sees the
final parameters.

Statistics: ``opt.statistics()`` returns the last combination's Adasum coefficient range and
orthogonality (or AdaCons' consensus weights) and the skipped steps, the same on every rank, kept
from what the combination computes anyway: no collective, no host synchronisation until read.
"""

from __future__ import annotations

import gc
import hashlib
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist

from adasum.checks.agreement import Problem, agree, check_not_sharded, check_same_layout, describe, local_problem
from adasum.checks.nonfinite import apply_nonfinite_policy, check_policy, nonfinite_message
from adasum.core.layout import flatten, unflatten_into
from adasum.core.statistics import StepStatistics
from adasum.integrations.compression import CompressedCombine, communication_dtype
from adasum.integrations.delta import IN_FLIGHT as IN_FLIGHT  # noqa: F401  (the delta slots, named here as before)
from adasum.integrations.delta import DeltaCombiner, buckets
from adasum.options import (
    Mode,
    Nonfinite,
    check_count,
    check_flag,
    check_number,
    check_option,
    not_initialised,
    reducer_of_op,
)
from adasum.reducers import Reducer, get_reducer
from adasum.transport.alone import warn_one_rank
from adasum.transport.communicator import control_group
from adasum.transport.errors import failures_named
from adasum.transport.groups import group_device

__all__ = ["DistributedOptimizer", "buckets", "check_same_parameters", "checksum", "nonfinite_message"]

_numel = torch.Tensor.numel


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the tensor's bits (plain and position-weighted), exact in any order of
    summation, masked to 62 bits so that their negation fits: equal tensors give equal checksums
    on any device and thread count.

    >>> checksum(torch.ones(3)).tolist()
    [3196059648, 6392119296]
    """
    flat = tensor.detach().reshape(-1).contiguous()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(as_int).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return torch.stack([bits.sum(), (bits * weights).sum()]) & (2**62 - 1)


def check_same_parameters(
    params: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    names: list[str] | None = None,
    *,
    operation: str = "adasum",
) -> None:
    """Raise ValueError on every rank of `group` unless every rank holds parameters of the same
    shapes, dtypes, device type and values (bits): one 24-byte all-reduce for the layout (and local
    problems: sparse or non-floating parameters, a device the backend does not serve), one small
    all-reduce of exact checksums for the values. The message names the first differing parameter.

    >>> check_same_parameters(list(model.parameters()), names=list(dict(model.named_parameters())))  # doctest: +SKIP

    On one process (a group of one rank), where only the local problems can fail:

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> model = torch.nn.Linear(2, 1)
    >>> check_same_parameters(list(model.parameters()), names=list(dict(model.named_parameters())))
    >>> check_same_parameters([model.weight, torch.zeros(2, dtype=torch.int64)])
    Traceback (most recent call last):
    TypeError: adasum: on rank 0, tensor 1 has dtype torch.int64; only floating-point tensors can be combined
    >>> dist.destroy_process_group()
    """
    device = group_device(group)
    with failures_named(operation, "the parameter layout check", group):
        check_same_layout(params, group, device, what="parameters", in_place=False, operation=operation)
    if not params:
        return
    sums = torch.stack([checksum(p) for p in params]).cpu()
    probe = torch.cat([sums, -sums])
    with failures_named(operation, "the parameter value check", group):
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=control_group(group))
    high, neg_low = probe.chunk(2)
    differs = (high != -neg_low).any(dim=1).tolist()
    if any(differs):
        index = differs.index(True)
        label = repr(names[index]) if names is not None else str(index)
        raise ValueError(
            f"{operation}: parameter {label} (shape {list(params[index].shape)}) differs across ranks; "
            "start every rank from the same weights (same seed, or broadcast rank 0's parameters; DDP does this)"
        )


def names_by_parameter(named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> dict[int, str] | None:
    """``{id(parameter): name}`` from ``model.named_parameters()`` (Horovod's ``named_parameters=``), or
    None. A name given twice, or something other than (name, tensor) pairs, raises ValueError."""
    if named_parameters is None:
        return None
    out: dict[int, str] = {}
    seen: set[str] = set()
    for item in named_parameters:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(
                "named_parameters must be (name, parameter) pairs, such as model.named_parameters(); "
                f"got {type(item).__name__}"
            )
        name, param = item
        if name in seen:
            raise ValueError(
                f"named_parameters names {name!r} twice; pass each name once, as model.named_parameters() gives them"
            )
        seen.add(name)
        out.setdefault(id(param), name)
    return out


def ddp_problem(params: list[torch.Tensor], group: dist.ProcessGroup | None) -> Problem | None:
    """A `Problem` when `params` belong to a DistributedDataParallel model whose process group shares
    two or more ranks with `group` and which combines gradients itself: DDP averages the gradients in
    backward, so combining them (or the steps they make) again over those ranks gives DDP's average.
    Not a problem: a DDP over other ranks (say inside each host, with `group` across hosts), or one
    given a comm hook of the user's own (not torch's nor adasum's), which decides what DDP combines.
    Found by looking through the live objects (DDP leaves no mark on the parameters); called at
    construction and on the first step."""
    from torch.nn.parallel import DistributedDataParallel

    wanted = {id(p) for p in params}
    mine = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    for obj in gc.get_objects():
        if not issubclass(type(obj), DistributedDataParallel):  # type(), not isinstance: no proxy's __class__
            continue
        if not any(id(p) in wanted for p in obj.module.parameters()):
            continue
        theirs = set(dist.get_process_group_ranks(obj.process_group))
        if len(mine & theirs) > 1 and _combines(obj):
            return Problem(
                "ValueError",
                "the parameters belong to a DistributedDataParallel model over the same ranks: DDP has "
                "already averaged the gradients in backward, so combining them again would give DDP's "
                "average, not the reducer's. Either drop the DDP wrapper (DistributedOptimizer combines "
                "across ranks itself), or keep DDP with a plain optimizer and register the hook: "
                "ddp_model.register_comm_hook(adasum.ddp.AdasumState(), adasum.ddp.adasum_hook)",
            )
    return None


def _combines(ddp: torch.nn.Module) -> bool:
    """Whether a DDP model combines gradients across its ranks: with no comm hook (its own averaging, or a
    built-in hook) or a hook from torch's ``ddp_comm_hooks`` or adasum's, yes; with one of the user's own, it is
    theirs to decide."""
    hooks = getattr(ddp, "_comm_hooks", [])  # DDP's record of register_comm_hook
    known = ("torch.distributed.algorithms.ddp_comm_hooks", "adasum.")
    return not hooks or any(getattr(hook, "__module__", "").startswith(known) for hook, _ in hooks)


def optimizer_param_names(optimizer: torch.optim.Optimizer) -> list[str] | None:
    """The parameter names the optimizer was given (``torch.optim.SGD(model.named_parameters())``),
    in param-group order, or None when any group has none."""
    names: list[str] = []
    for group in optimizer.param_groups:
        group_names = group.get("param_names")
        if not group_names:
            return None
        names.extend(group_names)
    return names


def check_wrappable(optimizer: object, operation: str) -> None:
    """Raise a TypeError unless `optimizer` is a torch optimizer of whole (not sharded) parameters that does not
    combine across ranks itself (a `DistributedOptimizer` or `adasum.SlowMo`: a second wrapper would combine every
    step twice). Every rank that passes the same arguments raises the same, before any collective."""
    if getattr(type(optimizer), "combines_across_ranks", False):
        raise TypeError(
            f"{operation}: the optimizer is an adasum.{type(optimizer).__name__} already, which combines across "
            "ranks itself: wrapping it again would combine every step twice. Wrap the torch optimizer once "
            "(its .optimizer)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{operation} wraps a torch.optim.Optimizer, got {type(optimizer).__name__}; pass a torch optimizer, "
            "such as torch.optim.SGD(model.parameters(), lr=0.1)"
        )
    check_not_sharded((p for g in optimizer.param_groups for p in g["params"]), operation)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap `optimizer` so that ``step()`` combines across ranks with `reducer` (module doc).

    Args:
        optimizer: any torch.optim optimizer (SGD, Adam, AdamW, LAMB, ...), on every rank with
            the same parameters in the same order and with the same values. Not an adasum wrapper
            (`DistributedOptimizer`, `adasum.SlowMo`: TypeError, it would combine twice).
        reducer: a `Reducer` or its name: "adasum" (default), "mean", "sum", "adacons", ...
        mode: "delta" (combine the weight changes of a local step) or "gradient".
        group: the process group (default: the world).
        backward_passes_per_step: ``step()`` and ``zero_grad()`` calls that make one real step (an
            integer >= 1); gradients accumulate (sum) in between, as in plain PyTorch (scale the
            loss by 1/k for their mean).
        local_steps: delta mode: local optimizer steps between combinations (an integer >= 1).
        grad_scaler: the ``torch.amp.GradScaler`` in use (or a subclass, such as FSDP's
            ``ShardedGradScaler``), so that its found-inf flag agrees on every rank; None: no scaler.
        bucket_cap_mb: the largest transient buffer of a combination (per-tensor reducers), in
            MiB: a finite number > 0 (a tensor larger than the cap gets a bucket of its own).
        check (True or False): at construction and in `add_param_group`, check that every rank has the same
            parameter shapes, dtypes, device type and (by a checksum) values; ValueError on every
            rank names the first difference. Each combination then sends a 24-byte signature of
            the dtypes and shapes (gradient mode: in its presence check; delta mode: before the
            step that ends a round), so that a model converted on one rank only is a ValueError on
            every rank (docs/faults.md); gradient mode checks the gradients' full layout once per
            set of gradients: sparse gradients raise TypeError on every rank.
        nonfinite: what a NaN or Inf in any rank's local gradients does, decided identically on
            every rank before anything is combined or stepped: "propagate" (default, as DDP does)
            checks nothing, and a non-finite gradient makes the parameters non-finite identically
            on every rank; "raise" raises `adasum.NonFiniteError` on every rank naming the parameter
            (its name when the optimizer was given ``model.named_parameters()``) and the rank;
            "skip" skips the step on every rank (parameters, optimizer state and the round of
            local steps untouched) and counts it in ``skipped_steps``
            (`adasum.checks.nonfinite.apply_nonfinite_policy`). "raise" and "skip" cost one
            8-byte all-reduce and a host synchronisation per step, which stops the host from
            queueing work ahead (docs/benchmarks.md), hence not the default.
        named_parameters: ``model.named_parameters()`` (as Horovod takes it): the names that error
            messages give the parameters. Every parameter of the optimizer must be named.
        compression: delta mode: the dtype the weight changes cross the network in (Horovod's
            ``compression=hvd.Compression.fp16``): None (default: their own dtype), ``torch.bfloat16``,
            ``torch.float16``, ``torch.float8_e4m3fn`` (one scale per tensor, agreed across ranks) or a
            name ("bf16", "fp16", "fp8", "none"; Horovod's ``Compression.fp16`` and ``.none`` are taken
            too). The compressed deltas travel as chunks, combined in float32 on the chunk's owner and
            all-gathered compressed again, the same on every rank (`adasum.integrations.compression`: about
            2 n values of the dtype per rank whatever P). Gradient mode refuses it (ValueError).
        sparse_as_dense (True or False): turn sparse gradients (``nn.Embedding(sparse=True)``) into dense ones
            before anything else in ``step()`` (Horovod's option). Without it gradient mode refuses
            sparse gradients; delta mode steps them locally as they are.
        op: Horovod's spelling of `reducer` (``op=hvd.Adasum``, ``hvd.Average``, ``hvd.Sum``, or the strings
            "Adasum", "Average", "Sum"): the reducer "adasum", "mean" or "sum" (`adasum.options.reducer_of_op`).
            It picks the reducer only: Horovod's ``op=Average`` averages gradients, which is
            ``reducer="mean", mode="gradient"`` here.

    Parameters of a DistributedDataParallel model over the same ranks are refused (ValueError on
    every rank, at construction and on the first step): DDP has averaged their gradients already.

    ``param_groups``, ``state``, ``defaults``, ``zero_grad()`` pass through to the wrapped
    optimizer (LR schedulers work on it). A model converted after wrapping (``model.double()``,
    ``model.to(device)``, also in the middle of a round of local steps) is followed: delta mode keeps
    the round's starting weights in the parameters' dtypes and devices. Hooks registered on the wrapper
    (``register_step_pre_hook``, ``register_step_post_hook``, the ``state_dict`` and
    ``load_state_dict`` hooks) run around its own ``step()`` (every call, accumulation passes
    included), ``state_dict()`` and ``load_state_dict()``. ``state_dict()`` holds the wrapped
    optimizer's state, which in delta mode is local to each rank: every rank saves its own.

    On one process (a group of one rank; under torchrun every rank makes the same calls):

    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mode="gradient")
    >>> model(torch.randn(8, 4)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    >>> dist.destroy_process_group()
    """

    # GradScaler.step passes grad_scale and found_inf instead of skipping this step on its own
    _step_supports_amp_scaling = True
    combines_across_ranks = True  # another wrapper refuses to wrap it (`check_wrappable`)
    found_inf: torch.Tensor  # set by GradScaler.step for one call (no value here: hasattr tells)
    grad_scale: torch.Tensor | None

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        reducer: str | Reducer = "adasum",
        mode: Mode = "delta",
        group: dist.ProcessGroup | None = None,
        backward_passes_per_step: int = 1,
        local_steps: int = 1,
        grad_scaler: torch.amp.GradScaler | None = None,
        bucket_cap_mb: float = 25.0,
        check: bool = True,
        nonfinite: Nonfinite = "propagate",
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        sparse_as_dense: bool = False,
        op: object = None,
        compression: Any = None,
    ) -> None:
        operation = "adasum.DistributedOptimizer"
        reducer = cast("str | Reducer", reducer_of_op(operation, op, reducer))
        check_policy(nonfinite)
        check_wrappable(optimizer, operation)
        check_option("mode", mode, Mode)
        check_count(operation, "backward_passes_per_step", backward_passes_per_step)
        check_count(operation, "local_steps", local_steps)
        if mode == "gradient" and local_steps != 1:
            raise ValueError(f"{operation}: local_steps > 1 needs mode='delta'; pass mode='delta' or local_steps=1")
        wire = communication_dtype(compression, operation, "compression")
        if mode == "gradient" and wire is not None:
            raise ValueError(
                f"{operation}: compression= sends delta mode's weight changes in {wire}; gradient mode combines the "
                "gradients in their own dtype: use mode='delta', or DDP with the Adasum hook inside torch's "
                "fp16_compress_wrapper / bf16_compress_wrapper"
            )
        check_number(operation, "bucket_cap_mb", bucket_cap_mb, "a finite number > 0 (MiB)", lambda v: 0 < v < math.inf)
        check_flag(operation, "check", check)
        check_flag(operation, "sparse_as_dense", sparse_as_dense)
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(
                f"{operation}: grad_scaler must be a torch.amp.GradScaler (the scaler whose step() drives this "
                f"optimizer) or None, got {type(grad_scaler).__name__}; pass that scaler or leave grad_scaler= out"
            )
        if not dist.is_initialized():
            raise not_initialised(operation)
        self.optimizer = optimizer
        self._names_by_id = names_by_parameter(named_parameters)
        if self._names_by_id is not None:
            unnamed = [i for i, p in enumerate(self._params()) if id(p) not in self._names_by_id]
            if unnamed:
                raise ValueError(
                    f"named_parameters names no parameter {unnamed[0]} of the optimizer ({len(unnamed)} unnamed); "
                    "pass the named_parameters() of the model the optimizer trains"
                )
        self.sparse_as_dense = sparse_as_dense
        self.compression = wire
        self.reducer = get_reducer(reducer)
        self.mode = mode
        self.group = group
        self.backward_passes_per_step = backward_passes_per_step
        self.local_steps = local_steps
        self.grad_scaler = grad_scaler
        self.nonfinite = nonfinite
        self.skipped_steps = 0  # steps skipped on every rank under nonfinite="skip"
        self.check = check
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20) if self.reducer.per_tensor else None
        self._checked_present: tuple[int, ...] | None = None  # gradient mode: the gradients whose layout was checked
        self._ddp_checked = False  # the first step looks for a DDP wrapper again (one made after construction)
        self._device = group_device(group)
        self._passes = 0  # backward passes accumulated since the last real step
        self._round_step = 0  # local steps taken since the last combination
        self._statistics = StepStatistics()  # the last combination's records (`statistics`)
        # delta mode: the round's starting weights, the delta slots and the pipeline (`adasum.integrations.delta`)
        self._deltas = DeltaCombiner(self.reducer, group, self.bucket_cap_bytes, self._statistics)
        self._compressed = (
            CompressedCombine(self.reducer, wire, group, operation="adasum.DistributedOptimizer.step")
            if wire is not None
            else None
        )
        # what torch.optim.Optimizer's own methods expect to find
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._refuse_ddp(self._settings())  # and the settings, the same on every rank
        if check:
            self._check_parameters()
        self.reducer.setup(group)
        warn_one_rank(group, operation)

    # -- pass-through -------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's add_param_group, collective: every rank must add the same
        parameters (shapes, dtypes, values), checked as at construction (with ``check=True``); on
        a difference every rank raises ValueError naming it and the group is not added."""
        if self._round_step:
            raise RuntimeError(
                "add_param_group in the middle of a round of local steps; call it at a round's boundary (after the "
                "step() that ends the round, every local_steps steps)"
            )
        self.optimizer.add_param_group(param_group)
        if self.check:
            added = self.optimizer.param_groups[-1]
            names = self._names(list(added["params"])) or added.get("param_names") or None
            try:
                check_same_parameters(
                    list(added["params"]), self.group, names, operation="adasum.DistributedOptimizer.add_param_group"
                )
            except BaseException:
                self.optimizer.param_groups.pop()
                raise
        self._deltas.drop()
        self._checked_present = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad, except while gradients accumulate."""
        if self._passes == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, reducer={self.reducer!r}, mode={self.mode!r})"

    # -- the step -----------------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @torch.optim.Optimizer.profile_hook_step  # the step hooks registered on the wrapper, as torch runs them
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step: local step and combination of the deltas (delta mode) or combination of the
        gradients and step (gradient mode); nothing but counting on accumulation passes. Skipped
        on every rank together when GradScaler found inf/NaN on any rank. With a `closure`, gradient
        mode combines the gradients of each of its evaluations (module doc)."""
        if closure is not None:
            self._check_closure_options()
        scaled = hasattr(self, "found_inf")  # set by GradScaler.step for this call only
        if scaled and self.backward_passes_per_step > 1:
            raise ValueError(
                "with GradScaler, accumulate by calling scaler.step(opt) once every k backward passes "
                "(backward_passes_per_step=1): the scaler updates its scale at every call"
            )
        self._passes += 1
        if self._passes < self.backward_passes_per_step:
            return None
        self._passes = 0
        if scaled and self._agree_on_inf(self.found_inf):
            return None
        params = self._params()
        scale = getattr(self, "grad_scale", None)
        if scaled and scale is not None:
            self._unscale(params, scale)
        if self.sparse_as_dense:
            _densify(params)
        if self.nonfinite != "propagate" and self._nonfinite_gradients(params):
            return None
        if not self._ddp_checked:  # a DDP wrapper made after construction; before anything changes
            self._refuse_ddp()
            self._ddp_checked = True
        if self.mode == "gradient":
            if closure is None:
                self._combine_gradients(params)
                return self.optimizer.step()
            with torch.enable_grad():
                return self.optimizer.step(self._combining(closure))
        if self._round_step + 1 >= self.local_steps:  # this step combines: the layouts first, before it changes
            self._deltas.check(params, "adasum.DistributedOptimizer.step", self._names())
        if self._round_step == 0 and not self._deltas.current(params):
            self._deltas.save(params)
        with torch.enable_grad():
            loss = self.optimizer.step(self._densifying(closure)) if closure is not None else self.optimizer.step()
        self._round_step += 1
        if self._round_step >= self.local_steps:
            if self.local_steps > 1 and not self._deltas.fits(params):  # converted in the round (model.double())
                self._deltas.move(params, "adasum.DistributedOptimizer.step")
            self._deltas.combine(params, combine=self._compressed)
            self._round_step = 0
        return loss

    def _check_closure_options(self) -> None:
        """Refuse a closure where the wrapper cannot honour it (the same options on every rank give the
        same error on every rank): gradients accumulated over calls, or a non-finite policy, which
        looks at the gradients before the closure has made them."""
        if self.backward_passes_per_step > 1:
            raise ValueError(
                "step(closure) with backward_passes_per_step > 1: accumulate inside the closure "
                "(k backward passes, then return the loss) and use backward_passes_per_step=1"
            )
        if self.nonfinite != "propagate":
            raise ValueError(
                f"step(closure) with nonfinite={self.nonfinite!r}: the policy checks the gradients before the "
                "step, and a closure makes them inside it; call backward yourself and then step()"
            )

    def _combining(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Gradient mode: `closure`, then the combination of the gradients it made; the loss it returns
        averaged over the ranks (the wrapped optimizer may decide on it: LBFGS's line search)."""

        def combined() -> Any:
            with torch.enable_grad():
                loss = closure()
            with torch.no_grad():
                params = self._params()
                if self.sparse_as_dense:
                    _densify(params)
                self._combine_gradients(params)
                return self._mean_loss(loss)

        return combined

    def _densifying(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Delta mode: `closure`, then its sparse gradients made dense under ``sparse_as_dense``."""
        if not self.sparse_as_dense:
            return closure

        def densified() -> Any:
            loss = closure()
            _densify(self._params())
            return loss

        return densified

    def _mean_loss(self, loss: Any) -> Any:
        """The closure's `loss` averaged over the ranks, summed in rank order (bitwise the same on every rank),
        as a tensor like `loss` (or a float); None when every rank's closure returned None. A loss on some ranks
        only raises ValueError on every rank."""
        world = dist.get_world_size(self.group)
        value = float("nan") if loss is None else float(loss)
        mine = torch.tensor([value, float(loss is not None)], dtype=torch.float64)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        with failures_named("adasum.DistributedOptimizer.step", "the closure's loss all-gather", self.group):
            dist.all_gather(everyone, mine, group=control_group(self.group))
        given = [bool(t[1]) for t in everyone]
        if not any(given):
            return None
        if not all(given):
            raise ValueError(
                f"adasum.DistributedOptimizer.step: the closure returned a loss on ranks "
                f"{[r for r, g in enumerate(given) if g]} and None on the others; make the closure return the loss "
                "on every rank"
            )
        total = 0.0
        for t in everyone:
            total += float(t[0])
        mean = total / world
        if isinstance(loss, torch.Tensor):
            return torch.tensor(mean, dtype=loss.dtype, device=loss.device)
        return mean

    def statistics(self) -> dict[str, float | int | list[float]]:
        """The last combination's statistics, identical on every rank (no collective; reading waits for the device):

        * ``step``: combinations so far (real steps in gradient mode, rounds of `local_steps` in delta mode; each
          closure evaluation in gradient mode); the values below are of the last one.
        * ``skipped_steps``: steps skipped on every rank under ``nonfinite="skip"`` (`skipped_steps`).
        * Adasum: ``coefficient_min``, ``coefficient_max`` (the range of the per-tensor coefficients
          ``1 - w <a,b> / |a|^2`` applied at every level of the tree: 1 summed, 1/2 averaged), ``orthogonality``
          (``sum |g_i|^2 / |sum g_i|^2`` of the tree's pairs of single workers: 1 orthogonal, 1/2 equal) and
          ``cosine_abs_mean`` (the mean ``|cos|`` between the two sides of every pair and tensor).
        * AdaCons: ``consensus_weight_min``, ``consensus_weight_max``, ``consensus_weights`` (per worker).

        In delta mode the combined vectors are the weight changes, in gradient mode the gradients.
        `adasum.core.statistics` defines each value; a key is absent where the reducer computes no such thing
        (Sum, Mean) or nothing was combined yet.

        >>> opt.step(); opt.statistics()  # doctest: +SKIP
        {'step': 1, 'skipped_steps': 0, 'coefficient_min': 0.51, 'coefficient_max': 0.97, 'orthogonality': 0.62, ...}

        On one process (a group of one rank: nothing is combined, so only the counts), a step with a NaN
        gradient skipped under ``nonfinite="skip"``:

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mode="gradient", nonfinite="skip")
        >>> for x in (torch.ones(1, 2), torch.full((1, 2), float("nan"))):
        ...     model(x).sum().backward(); opt.step(); opt.zero_grad()
        >>> opt.statistics()
        {'step': 1, 'skipped_steps': 1}
        >>> dist.destroy_process_group()
        """
        return {"step": self._statistics.steps, "skipped_steps": self.skipped_steps, **self._statistics.summary()}

    def last_combined(self) -> list[torch.Tensor] | None:
        """The parameters as of the last combination (the round's starting weights, in the order of
        ``param_groups``) while a round of local steps is under way; None when the parameters are
        the combined ones (gradient mode, or between rounds). For evaluating the model the ranks
        agree on.

        >>> agreed = opt.last_combined() or [p for g in opt.param_groups for p in g["params"]]  # doctest: +SKIP

        On one process (a group of one rank), two local steps per round, from zero weights:

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> _ = [torch.nn.init.zeros_(p) for p in model.parameters()]
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=2)
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()
        >>> opt.last_combined(), model.bias.data      # mid-round: the round's starting weights
        ([tensor([[0., 0.]]), tensor([0.])], tensor([-0.1000]))
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()
        >>> opt.last_combined() is None                # the round is combined
        True
        >>> dist.destroy_process_group()
        """
        return list(self._anchor) if self._round_step and self._anchor is not None else None

    def _nonfinite_gradients(self, params: list[torch.Tensor]) -> bool:
        """Whether to skip this step: the local gradients, checked across ranks before any state
        changes (delta mode: before the local step, so the wrapped optimizer's state is untouched)."""
        grads = [p.grad if p.grad is not None else p.new_empty(0) for p in params]
        skip = apply_nonfinite_policy(
            self.nonfinite,
            grads,
            self.group,
            self._names(),
            operation="adasum.DistributedOptimizer.step",
            what="the gradient of parameter",
        )
        self.skipped_steps += int(skip)
        return skip

    def _agree_on_inf(self, found_inf: torch.Tensor) -> bool:
        """Whether any rank found inf/NaN; the agreed flag also goes to `grad_scaler`."""
        flag = found_inf.detach().reshape(1).to(device=self._device, dtype=torch.float32, copy=True)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if self.grad_scaler is not None:
            # GradScaler.update reads these per-device flags; it keeps them in a private table
            states = getattr(self.grad_scaler, "_per_optimizer_states", {})
            for local in states.get(id(self), {}).get("found_inf_per_device", {}).values():
                local.copy_(flag.reshape(()).to(local.device))
        return bool(flag.item())

    @staticmethod
    def _unscale(params: list[torch.Tensor], scale: torch.Tensor) -> None:
        inv = scale.double().reciprocal().float()  # as GradScaler computes it
        grads = [p.grad for p in params if p.grad is not None]
        for device in {g.device for g in grads}:
            torch._foreach_mul_([g for g in grads if g.device == device], inv.to(device))

    @property
    def _anchor(self) -> list[torch.Tensor] | None:
        """Delta mode: the round's starting weights (`adasum.integrations.delta.DeltaCombiner.anchor`)."""
        return self._deltas.anchor

    def resync_anchor(self) -> None:
        """Take the parameters as they are as the next round's starting weights (delta mode), after changing them
        in a way torch does not count (through ``p.data``, or a kernel of one's own). In-place torch ops on the
        parameters need no call: `step` sees them."""
        self._deltas.forget()

    def _combine_gradients(self, params: list[torch.Tensor]) -> None:
        """Combine the gradients of the parameters that have one on any rank (`_present_gradients`); the others
        keep ``.grad = None`` everywhere, so the wrapped optimizer leaves them alone."""
        present = self._present_gradients(params)
        grads: list[torch.Tensor] = []
        for i in present:
            grad = params[i].grad
            if grad is None:  # a gradient on other ranks only: this rank contributes zeros
                grad = params[i].grad = torch.zeros_like(params[i])
            grads.append(grad)
        operation = "adasum.DistributedOptimizer.step"
        if self._checked_present != present:  # once per set of gradients (agreed): checked on every rank
            self._check_gradients(grads, present, operation)
            self._checked_present = present
        elif any(g.is_sparse for g in grads):
            raise TypeError(f"{operation}: {_sparse_message(self._label(present[0]))}")
        for number, bucket in enumerate(buckets(grads, self.bucket_cap_bytes)):
            members = [grads[i] for i in bucket]
            one = len(members) == 1 and members[0].is_contiguous()  # a view of it: no copy, no buffer
            flat = flatten(members, None if one else self._deltas.gradient_slot(number, sum(map(_numel, members)),
                                                                             members[0]))
            self._deltas.combine_flat(flat, [g.numel() for g in members], "gradient")
            unflatten_into(flat, members)
        self._statistics.finish_step()

    def _present_gradients(self, params: list[torch.Tensor]) -> tuple[int, ...]:
        """Indices of the parameters with a gradient on at least one rank, the same on every rank; ValueError on
        every rank when a gradient's dtype or shape differs across ranks (a model converted on one rank only).

        Shaped like every check of the control group (`adasum.checks.agreement.agree`), so that it can pair
        only with checks: one all-reduce (MAX) of three int64 (a signature of this rank's presence, dtype and
        shape of every gradient, its negation, a flag); when the signatures differ, a gather of the descriptions
        gives the union of the indices, or the difference. A rank at another check (say `add_param_group` on one
        rank only) gets a ValueError on both sides instead of a mixed result."""
        description = [
            ("gradient of parameter", i, p.grad is not None, *(describe([p.grad if p.grad is not None else p])[0]))
            for i, p in enumerate(params)
        ]
        mine = tuple(i for i, p in enumerate(params) if p.grad is not None)
        if dist.get_world_size(self.group) == 1:
            return mine
        digest = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
        signature = int.from_bytes(digest, "little") >> 2  # 62 bits: its negation fits int64
        probe = torch.tensor([signature, -signature, 0], dtype=torch.int64)
        operation = "adasum.DistributedOptimizer.step"
        control = control_group(self.group)
        with failures_named(operation, "the gradient presence check", self.group):
            dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=control)
            high, neg_low, _ = probe.tolist()
            if high == -neg_low:
                return mine
            everyone: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, (description, None), group=control)
        for rank, (theirs, _) in enumerate(everyone):
            if len(theirs) != len(params) or any(
                not (isinstance(e, tuple) and e[:1] == ("gradient of parameter",)) for e in theirs
            ):
                raise ValueError(
                    f"{operation}: rank {rank} was at another check than step()'s gradient presence check "
                    "(a collective such as add_param_group called on some ranks only); call step() on every rank"
                )
        for i in range(len(params)):
            layouts = [theirs[i][3:] for theirs, _ in everyone]
            if any(layout != layouts[0] for layout in layouts):
                rank = next(r for r, layout in enumerate(layouts) if layout != layouts[0])
                dtype, shape, device = layouts[0]
                other_dtype, other_shape, other_device = layouts[rank]
                raise ValueError(
                    f"{operation}: the gradient of parameter {self._label(i)} is {dtype} of shape {list(shape)} on "
                    f"{device} on rank 0 but {other_dtype} of shape {list(other_shape)} on {other_device} on rank "
                    f"{rank}; convert the model the same way on every rank (call model.double() or model.to() on "
                    "all)"
                )
        return tuple(i for i in range(len(params)) if any(theirs[i][2] for theirs, _ in everyone))

    def _check_gradients(self, grads: list[torch.Tensor], present: tuple[int, ...], operation: str) -> None:
        """Same layout on every rank and no local problem (sparse, misplaced), or the same error on every rank."""
        sparse = [i for i, g in zip(present, grads) if g.is_sparse]
        problem = (
            Problem("TypeError", _sparse_message(self._label(sparse[0])))
            if sparse
            else local_problem(grads, self._device, in_place=False, group=self.group)
        )
        with failures_named(operation, "the gradient layout check", self.group):
            agree(describe(grads), problem, self.group, "gradients", operation)

    def _label(self, index: int) -> str:
        """Parameter `index` as messages name it: its name when known."""
        names = self._names()
        return f"{index} ({names[index]!r})" if names is not None else str(index)

    def _names(self, params: list[torch.Tensor] | None = None) -> list[str] | None:
        """The names of `params` (default: every parameter, in order): from ``named_parameters=``, else the
        optimizer's own (built from ``model.named_parameters()``); None when any is unnamed."""
        if params is None and self._names_by_id is None:
            return optimizer_param_names(self.optimizer)
        if self._names_by_id is None:
            return None
        names = [self._names_by_id.get(id(p)) for p in (params if params is not None else self._params())]
        return None if any(n is None for n in names) else names  # type: ignore[return-value]

    def _refuse_ddp(self, settings: list[tuple] | None = None) -> None:
        """ValueError on every rank when a rank's parameters belong to a DDP model over our ranks (`ddp_problem`),
        or when ranks give different `settings` (which decide the collectives each step runs)."""
        operation = "adasum.DistributedOptimizer"
        with failures_named(operation, "the settings check", self.group):
            agree(settings or [], ddp_problem(self._params(), self.group), self.group, "settings", operation)

    def _settings(self) -> list[tuple]:
        """What every rank must set alike: ``(name, value)`` pairs."""
        return [
            ("reducer", repr(self.reducer)),
            ("mode", self.mode),
            ("local_steps", self.local_steps),
            ("backward_passes_per_step", self.backward_passes_per_step),
            ("nonfinite", self.nonfinite),
            ("bucket_cap_bytes", self.bucket_cap_bytes),
            ("sparse_as_dense", self.sparse_as_dense),
            ("grad_scaler", self.grad_scaler is not None),
            ("compression", str(self.compression)),
        ]

    # -- checks and checkpoints ---------------------------------------------------------------

    def _check_parameters(self) -> None:
        """Same shapes, dtypes and values on every rank (`check_same_parameters`)."""
        check_same_parameters(self._params(), self.group, self._names(), operation="adasum.DistributedOptimizer")

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, the mode, the accumulation counters, the round's length and, in the
        middle of a round of local steps, the round's starting weights; the wrapper's state_dict hooks run
        around it, as torch's optimizers run theirs."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        anchor = [a.clone() for a in self._anchor] if (self._round_step and self._anchor is not None) else None
        state = {
            "optimizer": self.optimizer.state_dict(),
            "mode": self.mode,
            "passes": self._passes,
            "round_step": self._round_step,
            "local_steps": self.local_steps,
            "backward_passes_per_step": self.backward_passes_per_step,
            "anchor": anchor,
            "reducer": self.reducer.state_dict(),
            "skipped_steps": self.skipped_steps,
            "world_size": dist.get_world_size(self.group),
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state = post_hook(self, state) or state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned. A state saved in the middle of a round of local steps (or
        of accumulated passes) loads only into a wrapper with the same ``local_steps``
        (``backward_passes_per_step``), and a reducer state only into the reducer that saved it (the reducer's
        ``load_state_dict`` decides: another reducer's state, other AdaCons settings), and a delta-mode state
        not into gradient mode (`_check_mode`: its optimizer state is per rank): otherwise ValueError, and
        nothing is changed. Checked on each rank against its own state (every rank loads the state it
        saved, with the same counters)."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        self._check_counters(state_dict)
        self._check_mode(state_dict.get("mode"))
        saved_world, world = state_dict.get("world_size"), dist.get_world_size(self.group)
        if saved_world is not None and int(saved_world) != world:  # an elastic restart (docs/faults.md)
            self._load_resized(state_dict, int(saved_world), world)
            for post_hook in self._optimizer_load_state_dict_post_hooks.values():
                post_hook(self)
            return
        previous = self.reducer.state_dict()
        self.reducer.load_state_dict(state_dict["reducer"])  # refuses another reducer's state: first
        try:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        except BaseException:
            self.reducer.load_state_dict(previous)
            raise
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._passes = int(state_dict["passes"])
        self._round_step = int(state_dict["round_step"])
        self._deltas.forget()
        if state_dict["anchor"] is not None:
            self._deltas.load(self._params(), state_dict["anchor"])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_resized(self, state_dict: dict[str, Any], saved_world: int, world: int) -> None:
        """A state saved on `saved_world` ranks loaded on `world` (docs/faults.md, elastic restarts): the wrapped
        optimizer's state loads as saved (gradient mode: the same on every rank; delta mode: the saved rank's on
        every rank); a round of local steps in flight is discarded (the parameters go back to its start weights,
        the round begins again); the reducer's cross-call state (AdaCons' per-worker momentum) starts afresh.
        Passes accumulated toward a step cannot be resized (their gradients are not in the state): ValueError.
        The rules taken are named in one warning, the same on every rank."""
        operation = "adasum.DistributedOptimizer.load_state_dict"
        if int(state_dict["passes"]):
            raise ValueError(
                f"{operation}: the state was saved after {state_dict['passes']} of {self.backward_passes_per_step} "
                f"backward passes on {saved_world} ranks; a resized job ({world} ranks) cannot take the gradients "
                "accumulated toward that step: load a state saved at a step boundary"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._passes = 0
        self._deltas.forget()
        notes = ["the wrapped optimizer's state is the saved rank's on every rank" if self.mode == "delta"
                 else "the wrapped optimizer's state loads as saved"]
        if int(state_dict["round_step"]) and state_dict["anchor"] is not None:
            with torch.no_grad():
                for p, a in zip(self._params(), state_dict["anchor"]):
                    p.copy_(a.to(device=p.device, dtype=p.dtype))
            notes.append(
                f"the round in flight ({state_dict['round_step']} of {self.local_steps} local steps) restarts from "
                "its start weights"
            )
        self._round_step = 0
        if state_dict.get("reducer"):
            notes.append(f"{type(self.reducer).__name__}'s state (one entry per rank) starts afresh")
        warnings.warn(
            f"{operation}: the state was saved on {saved_world} ranks and loads on {world}: " + "; ".join(notes),
            stacklevel=3,
        )

    def _check_mode(self, saved: object) -> None:
        """A state loads into the mode it was saved in, or from gradient mode into delta mode (gradient mode's
        optimizer state is the same on every rank; delta mode lets it drift per rank from there). A delta-mode
        state into gradient mode is refused: its optimizer state (momenta, Adam moments) is each rank's own, and
        gradient mode, which assumes it equal, would step the ranks apart. A state without a mode (saved before
        it was recorded) loads as it is."""
        if saved is None or saved == self.mode or (saved == "gradient" and self.mode == "delta"):
            return
        raise ValueError(
            f"adasum.DistributedOptimizer.load_state_dict: the state was saved in mode={saved!r}, whose optimizer "
            f"state is each rank's own, but this wrapper has mode={self.mode!r}, which needs it equal on every rank; "
            "build the wrapper with mode='delta', or load the state into the wrapped optimizer on every rank and "
            "then make it equal (adasum.broadcast_optimizer_state(opt.optimizer, root_rank=0)) before wrapping"
        )

    def _check_counters(self, state_dict: dict[str, Any]) -> None:
        """A saved round (or accumulation) in progress must have the length this wrapper counts to: a round
        saved at local step 3 and resumed with ``local_steps=2`` would otherwise end at a step no rank reaches."""
        for counter, length, name in (
            ("round_step", "local_steps", "local step"),
            ("passes", "backward_passes_per_step", "backward pass"),
        ):
            done, mine = int(state_dict[counter]), getattr(self, length)
            saved = state_dict.get(length)  # absent from states saved before it was recorded
            if done and (done >= mine or (saved is not None and int(saved) != mine)):
                was = f" of {saved}" if saved is not None else ""
                raise ValueError(
                    f"adasum.DistributedOptimizer.load_state_dict: the state was saved after {name} {done}{was}, "
                    f"but this wrapper has {length}={mine}; build the wrapper with the {length} the state was "
                    "saved with, or resume from a state saved between rounds"
                )


def _sparse_message(label: str) -> str:
    return (
        f"the gradient of parameter {label} is sparse; gradient mode combines dense gradients: pass "
        "sparse_as_dense=True (or use mode='delta', which steps sparse gradients locally)"
    )


def _densify(params: list[torch.Tensor]) -> None:
    """Sparse gradients made dense, in place of the old ones (``sparse_as_dense``)."""
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            p.grad = p.grad.to_dense()
