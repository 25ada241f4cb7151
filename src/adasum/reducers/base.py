"""How to combine across workers, behind one interface that every placement uses.

A reducer answers one question: given the workers' copies of a list of tensors, what single
list do they agree on? Each reducer has two forms that compute the same thing:

* ``reduce(per_worker)``: single-process, over a list (one entry per worker) of lists of tensors;
  the simulator runs this one.
* ``all_reduce(tensors, group)``: in place across a torch.distributed process group;
  ``all_reduce_flat(buffer, sizes, group)`` is the same on one flat buffer holding tensors of
  `sizes` elements end to end (what a DDP bucket is).

Both distributed forms first check, with one small all-reduce, that every rank passed the same
layout (count, shapes or sizes, dtypes, device type) and that no rank's input has a local problem
(sparse, non-floating, wrong device, a tensor that requires grad, overlapping views): the same
ValueError or TypeError on every rank, before any data moves (`adasum.checks.agreement`).
``check_layout=False`` skips it, for callers that verified a fixed layout once (the optimizer
wrappers at construction, the DDP hook, whose buckets DDP keeps identical). A failure of the
communication itself (a dead or stalled peer) raises `adasum.CollectiveError` on every reducer.
Besides ``check_layout`` a reducer takes the keyword options its ``call_options`` names (AdaCons:
``key``; the others none); any other keyword raises TypeError before anything is checked or moved.

Traits, on the class: ``per_tensor`` (each tensor combined on its own, so a list may be split
into buckets, or buckets joined; whole-model reducers need every tensor of a dtype in one call),
``exact_average`` (the result is the plain mean, so a model can be averaged directly instead of
its delta), ``capturable`` (on NCCL a call enqueues its work without waiting on the host, so a
CUDA graph can capture it: the DDP hook replays the graph of a repeated batch of buckets),
``elementwise`` (each element of the result depends on that element of the inputs only) and
``homogeneous`` (inputs scaled by k > 0 give the result scaled by k).
A subclass implements `reduce` and `_all_reduce_flat` (and `_all_reduce` to combine across
dtypes, as AdaCons does; `_all_reduce_shards` for the sharded form); the public methods add the checks and run the
call through its plan (`adasum.transport.communicator.Communicator.plan` and ``run``; `_op` says what the plan
executes: the reducer's own forms, or the collectives' own Adasum schedules).

Sharded form: ``all_reduce_shards(buffer, sizes, groups)`` combines, across the replicas of a
`ShardGroups` grid, a flat buffer that holds this rank's shard of each tensor, with the
coefficients of the whole tensors (FSDP2 across replicas, `adasum.fsdp`). ``check_shards(shards)``
says beforehand whether a reducer can: element-wise reducers run on the shards as they are; a
reducer with coefficients overrides `check_shards` and `_all_reduce_shards` (Adasum, AdaCons); any reducer
combines whole tensors
(one shard per replica).

What is combined (gradients, optimizer deltas, model deltas) and what happens afterwards (an
optimizer step, slow momentum) is the caller's business. Places that combine take a reducer
object or its name: ``"sum"``, ``"mean"``, ``"adasum"``, ``"adacons"``.
"""


from __future__ import annotations

import difflib
import operator
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from adasum.checks.agreement import tensor_list
from adasum.checks.plan import Check
from adasum.collectives.api import batch_segments, fused_per_dtype, on_flat
from adasum.transport.communicator import communicator
from adasum.transport.groups import check_group
from adasum.transport.topology import ShardGroups as ShardGroups  # its public path, `adasum.reducers.ShardGroups`
from adasum.transport.topology import Topology

_INT = frozenset({int})


def _identity(reducer: Reducer) -> Hashable:
    """What names `reducer` in a call's entry (`adasum.transport.communicator.Communicator.replay`): the object, or
    its id where its class is not hashable (a dataclass with ``eq=True``)."""
    return reducer if type(reducer).__hash__ is not None else id(reducer)


class Reducer:
    """Base class: subclasses implement `reduce` and `_all_reduce_flat` (module doc)."""

    name = "reducer"
    per_tensor: bool = True
    """Each tensor is combined on its own (a list may be split into buckets without changing the result)."""
    exact_average: bool = False
    """The result is the exact mean of the ranks' copies (a model may be averaged directly)."""
    elementwise: bool = False
    """Each element of the result depends on that element of the inputs only (a shard combines on its own)."""
    call_options: frozenset[str] = frozenset()
    """The keyword options `all_reduce` and `all_reduce_flat` pass on to `_all_reduce` and `_all_reduce_flat`
    (AdaCons: ``key``); any other keyword raises TypeError."""

    @property
    def homogeneous(self) -> bool:
        """Inputs scaled by k > 0 give the result scaled by k (a caller may divide before or after combining)."""
        return True

    @property
    def capturable(self) -> bool:
        """On NCCL a call never waits on the host, so a CUDA graph can capture it (`adasum.collectives.graphs`)."""
        return False

    def reduce(self, per_worker: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """The combination of `per_worker` (one list of tensors per worker) in one process."""
        raise NotImplementedError

    # -- distributed: the public forms check, the protected ones combine

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        *,
        check_layout: bool = True,
        **options: Any,
    ) -> None:
        """In place across `group`; tensors are fused into one flat buffer per dtype.

        With `check_layout` (default) every call first checks that every rank passed the same
        count, shapes, dtypes and device type to the same reducer with the same options, and that
        no rank's input has a local problem (`adasum.checks.plan`); the same ValueError/TypeError
        on every rank names the first difference or problem. Local problems are looked for even with
        ``check_layout=False`` (then raised on this rank only). A dead peer raises
        `adasum.CollectiveError`. `options` are the reducer's `call_options` (AdaCons: ``key``); any
        other keyword raises TypeError (for a non-finite check, `adasum.check_finite` first).
        A capturable reducer's repeated call on GPU tensors replays a captured CUDA graph of the whole call, as
        `adasum.all_reduce` does (`adasum.transport.communicator.Communicator.replay`).
        """
        operation = f"adasum.{type(self).__name__}.all_reduce"
        self._check_options(options, operation)
        entry = (operation, _identity(self), repr(sorted(options.items())) if options else "")
        if (group is None or isinstance(group, dist.ProcessGroup)) and dist.is_initialized():
            if communicator(group).replay(entry, tensors, check_layout):
                return
        tensors = tensor_list(tensors, operation)
        check_group(group, operation)
        plan = self._plan(entry, tensors, None, group, "call" if check_layout else "none", operation, "tensors",
                          options)
        if tensors:
            communicator(group).run(plan, tensors)

    def all_reduce_flat(
        self,
        buffer: torch.Tensor,
        sizes: Sequence[int],
        group: dist.ProcessGroup | None = None,
        *,
        check_layout: bool = True,
        **options: Any,
    ) -> None:
        """In place on one flat buffer holding tensors of `sizes` elements end to end (a DDP bucket);
        checked as `all_reduce` (the sizes, each at least 0 and adding up to the buffer's number of
        elements, the dtype and the device type must agree).

        The segments are the buffer's elements in order (row-major): a buffer of another shape or one
        that is not contiguous (``x.t()``) is combined as ``buffer.reshape(-1)``, through a contiguous
        copy written back where it is not contiguous."""
        operation = f"adasum.{type(self).__name__}.all_reduce_flat"
        self._check_options(options, operation)
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"{operation}: buffer must be a torch.Tensor, got {type(buffer).__name__}; pass one flat "
                            "tensor")
        layout = tuple(sizes) if type(sizes) in (list, tuple) else None
        entry = (operation, _identity(self), repr(sorted(options.items())) if options else "", layout)
        if layout is not None and set(map(type, layout)) <= _INT and dist.is_initialized() and (
            group is None or isinstance(group, dist.ProcessGroup)
        ):
            if communicator(group).replay(entry, buffer, check_layout):
                return
        check_group(group, operation)
        what = "bucket segments"
        plan = self._plan(entry, [buffer], sizes, group, "call" if check_layout else "none", operation, what, options)
        communicator(group).run(plan, [buffer])

    def _check_options(self, options: dict[str, Any], operation: str) -> None:
        """TypeError, on this rank before anything moves, for a keyword option the reducer does not take."""
        unknown = sorted(set(options) - self.call_options)
        if unknown:
            takes = " and ".join(["check_layout", *sorted(self.call_options)])
            if not self.call_options:
                takes = "check_layout only"
            raise TypeError(
                f"{operation}: unexpected keyword argument {unknown[0]!r}; {type(self).__name__} takes {takes}: "
                "remove it"
            )

    def _plan(
        self,
        entry: Hashable,
        tensors: list[torch.Tensor],
        sizes: Sequence[Any] | None,
        group: dist.ProcessGroup | None,
        check: Check,
        operation: str,
        what: str,
        options: dict[str, Any],
        topology: Topology | None = None,
    ) -> Any:
        """The call's plan (`adasum.transport.communicator.Communicator.plan`): the reducer, its options and the
        layout agree across ranks on every call (`check` "call"), local problems are raised; the reducer's
        combination (`_op`) is what it executes. `tensors` is a list, or ``[buffer]`` (or several buffers: a DDP
        batch) with `sizes`."""
        config = (operation, repr(self), repr(sorted(options.items())))
        return communicator(group).plan(
            entry, tensors, self._op(group, sizes, options, topology), topology, config=config, operation=operation,
            what=what, sizes=sizes, check=check, capturable=self.capturable, moves=sizes is None,
        )

    def _op(
        self, group: dist.ProcessGroup | None, sizes: Sequence[Any] | None, options: dict[str, Any],
        topology: Topology | None = None,
    ) -> Any:
        """What a call's plan runs (`adasum.collectives.api.plan_call`'s `op`): the reducer's own forms on the call's
        checked tensors (`_all_reduce` on a list or a batch's segments, `_all_reduce_flat` on one buffer); a reducer
        whose combination the collectives plan themselves returns an `adasum.collectives.api.AdasumOp` (the plan
        then chooses its movers)."""
        if sizes is None:
            return lambda tensors: self._all_reduce(list(tensors), group, **options)

        def flat(buffers: Sequence[torch.Tensor]) -> None:
            ints = list(map(operator.index, sizes))  # integers: checked with the layout
            if len(buffers) > 1:  # several buffers (a DDP batch): their segments as one list
                self._all_reduce(batch_segments(buffers, ints), group, **options)
                return
            on_flat(buffers[0], lambda vector: self._all_reduce_flat(vector, ints, group, **options))

        return flat

    def _all_reduce(self, tensors: list[torch.Tensor], group: dist.ProcessGroup | None, **options: Any) -> None:
        """Combine checked `tensors` in place (default: one flat buffer per dtype, `_all_reduce_flat`)."""
        fused_per_dtype(tensors, lambda flat, sizes: self._all_reduce_flat(flat, sizes, group, **options), group=group)

    def _all_reduce_flat(
        self, buffer: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None, **options: Any
    ) -> None:
        """Combine a checked flat buffer in place across `group`."""
        raise NotImplementedError(f"{type(self).__name__} implements no distributed form; write _all_reduce_flat, or "
                                  "use it through reduce() only")

    def check_shards(self, shards: int) -> None:
        """Raise ValueError unless `all_reduce_shards` combines tensors split over `shards` ranks per tensor."""
        if shards > 1 and not self.elementwise:
            raise ValueError(
                f"{self!r} would see tensor shards, not whole tensors: it combines shards only with one shard "
                "per replica; use Adasum, AdaCons, Sum or Mean, which combine shards per tensor"
            )

    def all_reduce_shards(
        self, buffer: torch.Tensor, sizes: Sequence[int], groups: Topology, *, key: str | None = None
    ) -> None:
        """In place across the replicas of `groups`: `buffer` holds this rank's shard of each tensor of
        `sizes` (shard sizes, end to end; zero padding adds nothing), combined per whole tensor.

        Nothing is checked across ranks: the caller agreed on the layout across the grid and called `check_shards`
        (local problems of the buffer are raised on this rank). `key` names the state of a reducer that keeps one
        (AdaCons' momentum). The combination is `_all_reduce_shards`, run through the grid group's plan (a
        capturable reducer's repeat replays its graph: `adasum.transport.communicator.Communicator.replay`)."""
        operation = f"adasum.{type(self).__name__}.all_reduce_shards"
        shards = tuple(int(n) for n in sizes)
        entry = (operation, _identity(self), groups, key, shards)
        comm = communicator(groups.group)
        if comm.replay(entry, buffer):
            return
        plan = comm.plan(
            entry, [buffer], self._shards_op(shards, groups, key), groups,
            config=(operation, repr(self), f"key={key}"), operation=operation, what="shards", check="none",
            capturable=self.capturable,
        )
        comm.run(plan, [buffer])

    def _shards_op(self, sizes: tuple[int, ...], groups: Topology, key: str | None) -> Any:
        """What `all_reduce_shards`' plan runs (`adasum.collectives.api.plan_call`'s `op`): `_all_reduce_shards` on
        the call's buffer; a reducer whose sharded form the collectives plan themselves returns an
        `adasum.collectives.api.AdasumOp` (its movers then the plan's)."""
        return lambda buffers: self._all_reduce_shards(buffers[0], sizes, groups, key=key)

    def _all_reduce_shards(
        self, buffer: torch.Tensor, sizes: Sequence[int], groups: Topology, *, key: str | None = None
    ) -> None:
        """`all_reduce_shards`' combination. The default serves element-wise reducers and one shard per replica:
        `_all_reduce_flat` over the replicate group."""
        self._all_reduce_flat(buffer, [int(n) for n in sizes], groups.replicate)

    def setup(self, group: dist.ProcessGroup | None = None) -> None:
        """Collective set-up for `group` (sub-groups, checks), before the first `all_reduce_flat`.

        Optional (the first call does it otherwise); owners of a group (the DDP hook state, the
        distributed optimizer) call it at construction so that errors surface there.
        """

    def state_dict(self) -> dict[str, Any]:
        """Cross-call state to checkpoint (none here)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved: ValueError for a state whose keys are not those this reducer saves
        (another reducer's, a misspelt key; `check_state_keys`)."""
        check_state_keys(self, state, self.state_dict().keys())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_workers(per_worker: Sequence[Sequence[torch.Tensor]], operation: str = "adasum.Reducer.reduce") -> int:
    """The number of tensors per worker of a single-process `reduce` input. As the distributed forms refuse it
    across ranks, `operation` (the reduce that calls) raises ValueError unless there is at least one worker,
    every worker has the same number of tensors and each tensor has one shape, dtype and device on every
    worker; TypeError for an entry that is not a tensor or a tensor that is not floating-point.

    >>> check_workers([[torch.zeros(3), torch.zeros(1)], [torch.ones(3), torch.ones(1)]])   # 2 workers, 2 tensors
    2
    >>> check_workers([[torch.zeros(3)], [torch.ones(3, dtype=torch.float64)]],
    ...               "adasum.Sum.reduce")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: adasum.Sum.reduce: tensor 0: worker 0 has torch.float32 [3], worker 1 has torch.float64 [3]; give ...
    """
    if len(per_worker) == 0:
        raise ValueError("reduce needs at least one worker; pass one list of tensors per worker")
    count = len(per_worker[0])
    for w, tensors in enumerate(per_worker):
        if len(tensors) != count:
            raise ValueError(f"worker 0 has {count} tensors, worker {w} has {len(tensors)}; give every worker the "
                             "same tensors")
    for i in range(count):
        for w, tensors in enumerate(per_worker):
            if not isinstance(tensors[i], torch.Tensor):
                raise TypeError(
                    f"{operation}: worker {w}'s tensor {i} is a {type(tensors[i]).__name__}, not a torch.Tensor; pass "
                    "tensors"
                )
        first = per_worker[0][i]
        if not first.is_floating_point():
            raise TypeError(
                f"{operation}: tensor {i} has dtype {first.dtype}; only floating-point tensors can be combined: pass "
                "float tensors"
            )
        for w, tensors in enumerate(per_worker):
            t = tensors[i]
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                where = (lambda x: f" on {x.device}") if t.device != first.device else (lambda x: "")
                raise ValueError(
                    f"{operation}: tensor {i}: worker 0 has {first.dtype} {list(first.shape)}{where(first)}, "
                    f"worker {w} has {t.dtype} {list(t.shape)}{where(t)}; give every worker the same layout"
                )
    return count


def is_float8(dtype: torch.dtype) -> bool:
    """Whether `dtype` is one of torch's 8-bit floats (``float8_e4m3fn``, ``float8_e5m2``, ...), which neither gloo
    nor NCCL sums and torch's reductions do not take."""
    return dtype.is_floating_point and dtype.itemsize == 1


@contextmanager
def widened(buffer: torch.Tensor) -> Iterator[torch.Tensor]:
    """`buffer` to combine in place inside the block: itself, or for an 8-bit float a float32 copy, written back
    (rounded once) when the block ends without an error."""
    if not is_float8(buffer.dtype):
        yield buffer
        return
    work = buffer.float()
    yield work
    buffer.copy_(work)


def check_state_keys(reducer: Reducer, state: Any, keys: Iterable[str]) -> None:
    """Raise unless `state` is a mapping with exactly the `keys` that `reducer` saves (TypeError for anything but
    a mapping, ValueError naming the unexpected and the missing keys: another reducer's state, a misspelt key).

    >>> check_state_keys(Reducer(), {"momentum": 0.9}, [])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: adasum.Reducer.load_state_dict: the state is not this reducer's: unexpected keys ['momentum'] ...
    """
    operation = f"adasum.{type(reducer).__name__}.load_state_dict"
    if not isinstance(state, Mapping):
        raise TypeError(f"{operation}: state must be a dict (what state_dict returned), got {type(state).__name__}; "
                        "pass what state_dict() returned")
    expected = sorted(keys)
    unexpected = sorted(set(state) - set(expected), key=str)
    missing = [k for k in expected if k not in state]
    if not unexpected and not missing:
        return
    name = type(reducer).__name__
    wrong = "; ".join(
        [f"unexpected keys {unexpected}"] * bool(unexpected) + [f"missing keys {missing}"] * bool(missing)
    )
    saves = f"saves {expected}" if expected else "saves no keys"
    raise ValueError(
        f"{operation}: the state is not this reducer's: {wrong} ({name} {saves}); load it into the reducer that saved "
        "it"
    )


_REDUCERS: dict[str, type[Reducer]] = {}
"""The reducer classes by name (`register`): process-wide, never released (a name outlives every process group)."""


def reducer_names() -> dict[str, type[Reducer]]:
    """The reducer classes by name (`register` adds to it)."""
    return _REDUCERS


def register(name: str, cls: type[Reducer]) -> None:
    """Make `cls` available by `name` to every place that takes a reducer name (`reducer_names`)."""
    _REDUCERS[name] = cls


def get_reducer(reducer: str | Reducer) -> Reducer:
    """A reducer object from a reducer or its name ("sum", "mean", "adasum", "adacons")."""
    if isinstance(reducer, Reducer):
        return reducer
    names = reducer_names()
    if isinstance(reducer, str) and reducer in names:
        return names[reducer]()
    hint = ""
    if isinstance(reducer, str):
        close = difflib.get_close_matches(reducer.lower(), list(names), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown reducer {reducer!r}{hint}; choose one of {sorted(names)} or pass a Reducer")
