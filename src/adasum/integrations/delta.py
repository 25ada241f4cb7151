"""The delta combiner: ``x := x0 + combine(x - x0)`` over buckets of parameters, the one implementation behind
`adasum.DistributedOptimizer`'s delta mode, `adasum.SlowMo` (and DiLoCo on top of it) and the Lightning delta
strategy (which wraps its optimizers in `adasum.DistributedOptimizer`).

>>> combiner = DeltaCombiner(adasum.get_reducer("mean"), group=None, bucket_cap_bytes=None)  # doctest: +SKIP
>>> combiner.save(params); local_steps(); combiner.combine(params)                           # doctest: +SKIP

What it holds, per list of parameters (the same list step after step):

* **anchor buckets**: the round's starting weights x0, one flat buffer per bucket (`buckets`), seen per
  parameter in its shape (`DeltaCombiner.anchor`);
* **delta slots**: `IN_FLIGHT` flat buffers per dtype and device, kept between rounds (the same addresses
  each round, so the reducer's captured CUDA graphs replay);
* **the side-stream pipeline** (GPUs), drawn as streams over time for buckets 0, 1, 2, ...::

    compute  | delta 0 | delta 1 | delta 2 | apply 0 | delta 3 | apply 1 | ...
    comm     |         | comb. 0 | comb. 1 | comb. 2 |         | comb. 3 | ...

  bucket k's deltas are written on the compute stream while the "comm" side stream combines bucket k - 1 and
  the compute stream applies bucket k - IN_FLIGHT + 1 (each ordered by events), so the elementwise passes overlap
  the combination, which waits on the link. On the CPU the buckets go one after the other.

Everything here is local except the reducer's call per bucket: the callers check across ranks (the layout once,
the per-step signature, the non-finite policy) before `combine`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist

from adasum import kernels
from adasum.checks.agreement import agree, describe
from adasum.core.layout import Scattered
from adasum.core.statistics import StepStatistics
from adasum.reducers import Reducer
from adasum.transport.communicator import communicator, side_stream
from adasum.transport.errors import failures_named

IN_FLIGHT = 3
"""Delta slots: buckets whose deltas are computed, combined or applied at once on a GPU (module doc)."""

_data_ptr = torch.Tensor.data_ptr

CombineFlat = Callable[[torch.Tensor, list[int], int], None]
"""Combines one bucket's flat buffer in place across ranks, given its tensors' sizes and the bucket's number
(`adasum.integrations.compression.CompressedCombine` is one)."""

ApplyFlat = Callable[[int, torch.Tensor], None]
"""Takes bucket `number`'s combined flat deltas instead of adding them to the parameters (an outer optimizer)."""


def buckets(tensors: list[torch.Tensor], cap_bytes: int | None) -> list[list[int]]:
    """Indices of `tensors` in buckets of one device and dtype, in order; a bucket closes once it
    holds `cap_bytes` (a larger tensor gets one of its own). ``cap_bytes=None``: one bucket per
    device and dtype. The one bucketing of the delta combiner, gradient mode and the broadcasts.

    >>> buckets([torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64)], 16)
    [[0], [1], [2]]
    """
    by_kind: dict[tuple[str, str], list[int]] = {}
    for i, t in enumerate(tensors):
        by_kind.setdefault((str(t.device), str(t.dtype)), []).append(i)
    out: list[list[int]] = []
    for kind in sorted(by_kind):
        current: list[int] = []
        size = 0
        for i in by_kind[kind]:
            current.append(i)
            size += tensors[i].numel() * tensors[i].element_size()
            if cap_bytes is not None and size >= cap_bytes:
                out.append(current)
                current, size = [], 0
        if current:
            out.append(current)
    return out


def versions(params: list[torch.Tensor]) -> tuple:
    """The parameters' storage and version counters: what `DeltaCombiner.current` compares."""
    return tuple((p.data_ptr(), p._version) for p in params)


class DeltaCombiner:
    """The anchor buckets, the delta slots and the pipeline of one list of parameters (module doc).

    Args:
        reducer: combines each bucket (`Reducer.all_reduce_flat`) unless `combine` is given another function.
        group: the process group of the reducer's calls.
        bucket_cap_bytes: the buckets' cap (`buckets`); None: one bucket per dtype and device (reducers with
            whole-model coefficients).
        statistics: where each bucket's call is recorded (`adasum.core.statistics.StepStatistics`).
    """

    def __init__(
        self,
        reducer: Reducer,
        group: dist.ProcessGroup | None,
        bucket_cap_bytes: int | None,
        statistics: StepStatistics | None = None,
    ) -> None:
        self.reducer = reducer
        self.group = group
        self.bucket_cap_bytes = bucket_cap_bytes
        self.statistics = statistics if statistics is not None else StepStatistics()
        self.anchor: list[torch.Tensor] | None = None  # the round's starting weights, views of `flats`
        self.flats: list[torch.Tensor] = []  # the anchor's storage, one flat buffer per bucket
        self._memory: tuple = ()  # the addresses of the parameters the anchor was made for (`fits`)
        self._mark: tuple | None = None  # the parameters as the last combination left them (`current`)
        self._slots: dict[tuple, torch.Tensor] = {}  # `IN_FLIGHT` delta buffers per dtype and device (`slot`), and
        # gradient mode's buffer per bucket (`gradient_slot`)
        self._plan: list = []  # the buckets' parameters (`plan`), for `_plan_key`
        self._plan_key: tuple | None = None

    # -- the anchor ------------------------------------------------------------------------------

    def fits(self, params: list[torch.Tensor]) -> bool:
        """Whether the anchor was made for these parameters as they lie: the same memory of each (a model converted
        after wrapping, ``model.double()`` or ``.to(device)``, keeps its parameter objects and gives each new memory
        of its new dtype and device; one C-level map, not a comparison of every shape, dtype and device a step)."""
        return self.anchor is not None and tuple(map(_data_ptr, params)) == self._memory

    def current(self, params: list[torch.Tensor]) -> bool:
        """Whether the anchor holds the parameters already: the last combination wrote both in one pass and no
        parameter changed since, by its version counter (every in-place torch op bumps it) and its storage."""
        return self._mark is not None and self._mark == versions(params)

    def forget(self) -> None:
        """The next `save` copies the parameters again (they were changed in a way torch does not count)."""
        self._mark = None

    def drop(self) -> None:
        """No anchor: the next `save` makes a new one (parameters added)."""
        self.anchor = None
        self._mark = None

    def new(self, params: list[torch.Tensor]) -> None:
        """Room for the starting weights: one flat buffer per bucket of `params` (`flats`), seen per parameter, in
        its shape, by `anchor` (views)."""
        self._mark = None
        anchor: list[torch.Tensor] = [torch.empty(0)] * len(params)
        self.flats = []
        for bucket in buckets(params, self.bucket_cap_bytes):
            sizes = [params[i].numel() for i in bucket]
            flat = torch.empty(sum(sizes), dtype=params[bucket[0]].dtype, device=params[bucket[0]].device)
            self.flats.append(flat)
            for i, view in zip(bucket, flat.split(sizes)):
                anchor[i] = view.view(params[i].shape)
        self.anchor = anchor
        self._memory = tuple(map(_data_ptr, params))

    def save(self, params: list[torch.Tensor]) -> None:
        """Take the parameters as the round's starting weights (a new anchor where they moved)."""
        if not self.fits(params):
            self.new(params)
        assert self.anchor is not None
        if params:
            torch._foreach_copy_(self.anchor, [p.detach() for p in params])
        self._mark = None

    def load(self, params: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
        """An anchor for `params` holding `saved` (a checkpoint's), converted to the parameters' devices and dtypes."""
        self.new(params)
        assert self.anchor is not None
        if params:
            torch._foreach_copy_(self.anchor, [a.to(p.device) for a, p in zip(saved, params)])

    def move(self, params: list[torch.Tensor], operation: str) -> None:
        """The anchor converted to the parameters' dtypes and devices, which changed in the middle of a round;
        ValueError when a parameter was added or changed shape (no starting weights for it)."""
        assert self.anchor is not None
        old = self.anchor
        if len(old) != len(params) or any(a.shape != p.shape for a, p in zip(old, params)):
            raise ValueError(
                f"{operation}: parameters were added or changed shape in the middle of a round of local steps; "
                "change them between rounds"
            )
        self.load(params, old)

    # -- the combination -----------------------------------------------------------------------

    def check(self, params: list[torch.Tensor], operation: str, names: list[str] | None = None) -> None:
        """Every rank's parameters have the same dtypes, shapes and device type now, or the same ValueError on
        every rank naming the first parameter that differs, before anything is combined: one 24-byte all-reduce
        on the checks' group (`adasum.checks.agreement.agree`; a gather only on a difference). Run by the
        wrappers before each combination, so that a model converted on one rank only (``model.double()``) is
        an error, not a combination of buffers of different sizes (which gloo answers by aborting the peer)."""
        if self.group is None and not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return
        labels = names if names is not None else [str(i) for i in range(len(params))]
        description = [(f"parameter {label}", *entry) for label, entry in zip(labels, describe(params))]
        with failures_named(operation, "the per-step parameter layout check", self.group):
            agree(description, None, self.group, "parameters (dtype, shape, device type)", operation)

    def plan(self, params: list[torch.Tensor]) -> list[tuple[list[torch.Tensor] | Scattered, list[int]]]:
        """Per bucket (as `new` cut them): its parameters, as a `Scattered` view when all are contiguous on a GPU
        (one kernel reads and writes them in place), and their sizes. Kept while the parameters keep their
        storage and shapes (checked every call)."""
        key = (tuple(map(_data_ptr, params)), tuple(p.shape for p in params))
        if self._plan_key != key:
            plan = []
            for bucket in buckets(params, self.bucket_cap_bytes):
                members = [params[i] for i in bucket]
                inplace = all(p.is_contiguous() for p in members) and members[0].device.type == "cuda"
                plan.append((Scattered(members) if inplace else members, [p.numel() for p in members]))
            self._plan, self._plan_key = plan, key
        return self._plan

    def slot(self, number: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The first `numel` elements of delta slot `number % IN_FLIGHT` for `like`'s dtype and device (grown as
        needed). Bucket k reuses the slot of bucket k - IN_FLIGHT only after that bucket was applied, which waited
        for its combination."""
        key = (number % IN_FLIGHT, like.device, like.dtype)
        buffer = self._slots.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._slots[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel]

    def gradient_slot(self, number: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The first `numel` elements of gradient bucket `number`'s own flat buffer for `like`'s dtype and device
        (gradient mode; grown as needed): kept between steps, so that a repeated step's bucket lies where it lay
        and its captured call replays (`combine_flat`)."""
        key = ("gradients", number, like.device, like.dtype)
        buffer = self._slots.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._slots[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel]

    def combine_flat(self, flat: torch.Tensor, sizes: list[int], label: str = "delta") -> None:
        """The reducer on one bucket's flat buffer through its plan (`adasum.reducers.Reducer.all_reduce_flat`'s,
        unchecked: the layouts were agreed; a repeat of a captured bucket replays its graph,
        `adasum.transport.communicator.Communicator.replay`), recorded as one call of the combination; the key
        names what a captured CUDA graph of the call depends on (its buffer and layout)."""
        layout = tuple(sizes)
        key = (label, flat.data_ptr(), flat.dtype, flat.numel(), layout)
        comm = communicator(self.group)
        entry = (label, id(self.reducer), layout)
        with self.statistics.call(key, flat.device):
            if not comm.replay(entry, (flat,)):  # a repeat of a captured bucket: its graph, nothing else
                operation = f"adasum.{type(self.reducer).__name__}.all_reduce_flat"
                comm.run(self.reducer._plan(entry, [flat], layout, self.group, "none", operation, "bucket segments",
                                            {}), [flat])

    def combine(
        self,
        params: list[torch.Tensor],
        *,
        deltas: bool = True,
        advance: bool = True,
        combine: CombineFlat | None = None,
        apply: ApplyFlat | None = None,
    ) -> None:
        """Set x to x0 plus the combined x - x0, bucket by bucket (with ``deltas=False``: x to the combined x,
        the models themselves, for reducers that average exactly); with `advance` the anchor takes the result too,
        from the same pass (the next round's start). The anchor and the combination agree on every rank, so the
        parameters come out bitwise identical. Returns with the compute stream ordered after every bucket.

        `combine` replaces the reducer's call on each bucket (compressed deltas); `apply` takes each bucket's
        combined deltas instead of adding them (the parameters are then left alone: an outer optimizer's
        pseudo-gradients)."""
        assert self.anchor is not None

        def combined(flat: torch.Tensor, sizes: list[int], number: int) -> None:
            if combine is None:
                self.combine_flat(flat, sizes)
                return
            key = ("delta", number, flat.data_ptr(), flat.dtype, flat.numel(), tuple(sizes))
            with self.statistics.call(key, flat.device):
                combine(flat, sizes, number)
        device = params[0].device if params else None
        comm = side_stream(device, "comm") if device is not None and device.type == "cuda" else None
        main = torch.cuda.current_stream(device) if comm is not None else None
        pending: deque = deque()
        tables = communicator(self.group).tiles  # the buckets' tile addresses, kept between rounds

        def finish(number: int, members, anchor: torch.Tensor, flat: torch.Tensor, done) -> None:
            if done is not None:
                assert main is not None  # there is a side stream
                main.wait_event(done)
            if apply is not None:
                apply(number, flat)
                return
            if deltas:  # one pass: x0 + combined, into the parameters (and into the anchor)
                kernels.add_into(members, anchor, flat, base_too=advance, tables=tables)
                return
            listed = members.tensors if isinstance(members, Scattered) else members
            sizes = [t.numel() for t in listed]
            for t, value in zip(listed, flat.split(sizes)):
                t.copy_(value.view(t.shape))
            if advance:
                anchor.copy_(flat)

        for number, (members, sizes) in enumerate(self.plan(params)):
            anchor = self.flats[number]  # the bucket's dtype and device, and its size
            flat = self.slot(number, anchor.numel(), anchor)
            if deltas:
                kernels.subtract_into(flat, members, anchor, tables)
            else:
                listed = members.tensors if isinstance(members, Scattered) else members
                torch.cat([t.reshape(-1) for t in listed], out=flat)
            if comm is None:
                combined(flat, sizes, number)
                finish(number, members, anchor, flat, None)
                continue
            comm.wait_stream(cast(torch.cuda.Stream, main))  # the compute stream, set with `comm`
            with torch.cuda.stream(comm):
                combined(flat, sizes, number)
                done = comm.record_event()
            pending.append((number, members, anchor, flat, done))
            if len(pending) >= IN_FLIGHT:
                finish(*pending.popleft())
        while pending:
            finish(*pending.popleft())
        if advance and apply is None:
            self._mark = versions(params)
        self.statistics.finish_step()
