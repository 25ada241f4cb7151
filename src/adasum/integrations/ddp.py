"""Adasum as a DistributedDataParallel communication hook.

>>> state = adasum.ddp.AdasumState()                 # Adasum over the default group
>>> ddp_model.register_comm_hook(state, adasum.ddp.adasum_hook)  # doctest: +SKIP

DDP hands the hook one bucket at a time: a flat buffer holding several parameters' gradients end
to end (``bucket.gradients()`` are views of ``bucket.buffer()`` at their offsets). The hook gives
every parameter its own Adasum coefficients and returns a Future of the buffer.

**Batches of buckets.** With a per-tensor reducer (Adasum, the default; Sum; Mean) the hook
combines buckets in batches of at least ``batch_mb`` MB (`AdasumState`, default
`BATCH_MB`): a bucket joins the open batch and its Future completes when the batch is
combined, which happens once the batch reaches ``batch_mb``, or at the iteration's last bucket
(DDP waits for the Futures only after that one). Every parameter keeps its own coefficients, so
batching changes how many collectives run (the BERT-Large-sized stack of `benchmarks/bench_e2e.py`:
5 instead of 37 per step), not what they compute. The autograd thread runs the hook, so on a step
bound by that thread's issuing of work every collective's host time lengthens the step: larger
batches mean fewer collectives (docs/benchmarks.md measures batch sizes; beyond about 128 MB the
gain is within a host's noise, and the symmetric-memory buffers grow with the largest batch).
A batch of several buckets is combined as one list of
their segments: in place where the transport reads lists in place (symmetric memory), else fused
into one buffer (one copy each way). ``batch_mb=0`` combines bucket by bucket.

On NCCL all the work is enqueued on a side stream that waits for the gradients by an event, so
the backward pass keeps computing while a batch is combined; the Futures complete on that
stream, and the host never waits for the GPU (a repeated batch replays a captured CUDA graph); on
gloo, whose point-to-point operations have no futures, the work completes before the hook
returns (a correct synchronous fallback). What the hook learns about a bucket (its segments) is
kept while DDP keeps the bucket's buffer, so a repeated bucket costs the host a dictionary look-up.

It composes with what DDP offers: bucket rebuilding after the first iteration, ``no_sync()``,
``join()`` (ranks that have finished contribute zero buckets: ``adasum(0, b) = b``, never NaN),
``static_graph=True``, ``gradient_as_bucket_view=True``, and torch's
``fp16_compress_wrapper`` / ``bf16_compress_wrapper``. Gradients are not divided by the world
size before the hook (DDP leaves that to hooks): Adasum needs no division.

**Statistics.** ``state.statistics()`` returns the last iteration's Adasum coefficient range and
orthogonality (or AdaCons' consensus weights) as a dict of numbers, the same on every rank: the
collectives compute them anyway (`adasum.core.statistics`), so the hook keeps references to them
and adds no collective and no host synchronisation; reading them waits for the device once.

The batch limit decides which collectives run, so it must be the same on every rank: `AdasumState`
checks it across the group at construction (one small all-reduce; the first bucket does it for a state
made before the process group or unpickled) and raises the same ValueError on every rank where it
differs. ``batch_mb`` is fixed at construction.

One `AdasumState` serves one DDP model: the open batch belongs to the backward pass in progress.
If a backward pass stops before its last bucket (an error raised in the hook), the next pass's
first bucket drops the unfinished batch and fails its Futures.

This module deliberately has no ``from __future__ import annotations``: DDP compares the hook's
annotations with ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects.
"""

import contextlib
import math
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from adasum.checks.agreement import agree
from adasum.checks.nonfinite import NonFiniteError, apply_nonfinite_policy, check_policy
from adasum.checks.plan import prepare
from adasum.core.statistics import StepStatistics
from adasum.options import Nonfinite, check_number
from adasum.reducers import Adasum, Reducer, get_reducer
from adasum.transport.alone import warn_one_rank
from adasum.transport.communicator import communicator, side_stream
from adasum.transport.errors import failures_named

HOOK_POLICIES = ("propagate", "raise")
BATCH_MB = 256.0
"""`AdasumState`'s default ``batch_mb``: buckets are combined together until a batch holds this many MB."""


class AdasumState:
    """What `adasum_hook` needs: the process group, the reducer and the iteration count.

    `reducer` is any `adasum.reducers.Reducer` or its name ("adasum", the default, "mean", "sum", ...);
    ``hierarchical=True`` (with `local_size`, default LOCAL_WORLD_SIZE) selects Adasum over node
    means (`adasum.hierarchical`); ``hierarchical="exact"`` the flat tree over every rank in two tiers.
    When torch.distributed is initialised, construction runs the
    reducer's collective set-up (on every rank), so that placement errors surface here.
    The state pickles without its process group (the default group is used after unpickling).
    ``group`` is the process group (default: the world; ``process_group=``, the keyword of torch's
    ``PowerSGDState``, is the same). The hook skips the
    reducer's per-call layout check: DDP verifies the parameters across ranks at construction and
    keeps the buckets identical on every rank.

    ``batch_mb`` (default `BATCH_MB`; 0: bucket by bucket; a finite number >= 0, else TypeError or
    ValueError): with a per-tensor reducer, buckets are combined in batches of at least this many MB (module
    doc); the symmetric-memory transport's staging buffers grow with the largest batch, within the memory
    budget (``memory_mb``). Reducers that combine several
    tensors with shared coefficients (``per_tensor=False``: AdaCons' default, whole-model Adasum)
    always go bucket by bucket.

    ``nonfinite``: "propagate" (default: a NaN/Inf gradient comes out non-finite on every rank,
    bitwise identical, as with DDP's own averaging) or "raise": every bucket's gradients are
    checked across ranks first (one 8-byte all-reduce per bucket; on NCCL a host sync per bucket)
    and backward raises on every rank, naming the parameter (its name when `named_parameters` is
    given) and the rank. A hook cannot skip a step (the optimizer step comes after backward and
    DDP expects every bucket to complete): to skip, use "raise" and catch, or check the
    gradients before ``optimizer.step()`` with `adasum.find_nonfinite`. After the error the DDP
    reducer is mid-iteration: rebuild the DDP model (or restart) before training on.

    >>> state = AdasumState(hierarchical=True)         # e.g. 8 GPUs per node under torchrun
    >>> ddp_model.register_comm_hook(state, adasum_hook)  # doctest: +SKIP
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        reducer: str | Reducer = "adasum",
        *,
        hierarchical: bool | str = False,
        local_size: int | None = None,
        nonfinite: Nonfinite = "propagate",
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        batch_mb: float = BATCH_MB,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if process_group is not None:
            if group is not None:
                raise ValueError("adasum.ddp.AdasumState: pass group= or torch's process_group=, not both")
            group = process_group
        if nonfinite == "skip":
            raise ValueError(
                "nonfinite='skip' is not available in a DDP hook (it cannot skip the optimizer step); "
                "use 'raise' and catch adasum.NonFiniteError, or check the gradients before optimizer.step()"
            )
        check_policy(nonfinite, HOOK_POLICIES)
        check_number("adasum.ddp.AdasumState", "batch_mb", batch_mb, "a finite number >= 0 (MB)",
                     lambda v: 0 <= v < math.inf)
        if hierarchical:
            if isinstance(reducer, Reducer) or reducer != "adasum":
                raise ValueError(
                    f"hierarchical={hierarchical!r} goes with reducer='adasum', got {reducer!r}; "
                    f"pass Adasum(hierarchical={hierarchical!r}, local_size=...) as the reducer instead"
                )
            reducer = Adasum(hierarchical=hierarchical, local_size=local_size)
        elif local_size is not None:
            raise ValueError("local_size needs hierarchical=True; pass hierarchical=True too, or drop local_size")
        self.group = group
        self.reducer = get_reducer(reducer)
        self.iteration = 0
        self.skipped_steps = 0  # backward passes stopped by NonFiniteError (nonfinite="raise")
        self.nonfinite = nonfinite
        self.names = {id(p): n for n, p in named_parameters} if named_parameters is not None else {}
        self._batch_mb = float(batch_mb)
        self._reset_caches()
        if dist.is_initialized():
            self.reducer.setup(group)
            _check_batch_limit(self, "adasum.ddp.AdasumState")

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group (``group``; this name, torch's states' own, is kept for code that reads or sets it)."""
        return self.group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    @property
    def batch_mb(self) -> float:
        """The batch limit in MB, fixed at construction: every rank must batch alike, and that is checked then."""
        return self._batch_mb

    @property
    def batch_bytes(self) -> int:
        """A batch is combined once it holds this many bytes (0 with a whole-model reducer: bucket by bucket)."""
        return int(self._batch_mb * 2**20) if self.reducer.per_tensor else 0

    def _reset_caches(self) -> None:
        self._batch_checked = False  # every rank of the group was found to have the same batch limit
        self._plans: dict[int, _BucketPlan] = {}  # per bucket index, while DDP keeps that buffer
        self._agreed: set[tuple] = set()  # batch keys checked across ranks
        # the model's parameters by id, learnt from its first backward pass
        self._parameters: weakref.WeakValueDictionary | None = None
        self._learning: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._open: list[tuple[torch.Tensor, _BucketPlan, torch.futures.Future]] = []  # the open batch
        self._open_bytes = 0
        self._statistics = StepStatistics()  # the last iteration's records (device tensors: not pickled)

    def statistics(self) -> dict[str, float | int | list[float]]:
        """The last iteration's statistics, identical on every rank (no collective; reading waits for the device):

        * ``step``: iterations combined so far (`iteration`); the values below are of the last one.
        * ``skipped_steps``: backward passes stopped by `adasum.NonFiniteError` under ``nonfinite="raise"``
          (the steps a training loop that catches it skips).
        * Adasum: ``coefficient_min``, ``coefficient_max`` (the range of the per-tensor coefficients
          ``1 - w <a,b> / |a|^2`` applied at every level of the tree: 1 summed, 1/2 averaged), ``orthogonality``
          (``sum |g_i|^2 / |sum g_i|^2`` of the tree's pairs of single workers: 1 orthogonal, 1/2 equal) and
          ``cosine_abs_mean`` (the mean ``|cos|`` between the two sides of every pair and tensor).
        * AdaCons: ``consensus_weight_min``, ``consensus_weight_max``, ``consensus_weights`` (per worker).

        `adasum.core.statistics` defines each value; a key is absent where the reducer computes no such thing
        (Sum, Mean) or nothing was combined yet. With batches of buckets, the values cover every batch.

        >>> ddp_model(inputs).sum().backward(); state.statistics()  # doctest: +SKIP
        {'step': 1, 'skipped_steps': 0, 'coefficient_min': 0.51, 'coefficient_max': 0.97, 'orthogonality': 0.62, ...}

        On one process (a group of one rank: nothing is combined, so only the counts), two backward passes:

        >>> import torch.distributed as dist
        >>> from torch.nn.parallel import DistributedDataParallel
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp_model, state = DistributedDataParallel(torch.nn.Linear(3, 2)), AdasumState()
        >>> ddp_model.register_comm_hook(state, adasum_hook)
        >>> for _ in range(2):
        ...     ddp_model(torch.ones(4, 3)).sum().backward()
        >>> state.statistics()
        {'step': 2, 'skipped_steps': 0}
        >>> dist.destroy_process_group()
        """
        return {"step": self.iteration, "skipped_steps": self.skipped_steps, **self._statistics.summary()}

    def __getstate__(self) -> dict[str, Any]:
        skip = (
            "group", "_batch_checked", "_plans", "_agreed", "_parameters", "_learning", "_open", "_open_bytes",
            "_statistics",
        )
        state = {k: v for k, v in self.__dict__.items() if k not in skip}
        # the world the reducer's cross-call state was made on (`_follow_world` resets it on another)
        state["_saved_world"] = dist.get_world_size(self.group) if dist.is_initialized() else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.group = None
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._reset_caches()

    def __repr__(self) -> str:
        return f"AdasumState(reducer={self.reducer!r}, iteration={self.iteration})"


def bucket_sizes(bucket: dist.GradBucket) -> list[int]:
    """Element counts of the segments of ``bucket.buffer()``: one per parameter, in buffer order,
    plus a segment of its own for any gap between parameters (so coefficients never mix them).

    >>> bucket_sizes(bucket)        # e.g. [4096, 64, 64] for a weight, its bias and a norm's bias  # doctest: +SKIP

    On one process (a group of one rank), from a hook that records each bucket's segments, then combines it:

    >>> import torch.distributed as dist
    >>> from torch.nn.parallel import DistributedDataParallel
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> ddp_model, seen = DistributedDataParallel(torch.nn.Linear(3, 2)), []
    >>> def recording_hook(state, bucket):
    ...     seen.append(bucket_sizes(bucket))
    ...     return adasum_hook(state, bucket)
    >>> ddp_model.register_comm_hook(AdasumState(), recording_hook)
    >>> ddp_model(torch.ones(4, 3)).sum().backward()
    >>> seen                                        # one bucket: the weight (2 x 3) and the bias
    [[6, 2]]
    >>> dist.destroy_process_group()
    """
    buffer = bucket.buffer()
    if buffer.is_sparse:
        raise TypeError(
            "adasum_hook does not support sparse gradients; build the model's embeddings dense "
            "(nn.Embedding(..., sparse=False)) or leave the hook off"
        )
    base, storage = int(buffer.storage_offset()), buffer.untyped_storage().data_ptr()
    sizes: list[int] = []
    position = 0
    for grad in bucket.gradients():
        start = int(grad.storage_offset()) - base
        if grad.untyped_storage().data_ptr() != storage or start < position:
            raise RuntimeError(
                "a bucket's gradients are not consecutive views of its buffer (DDP's bucket layout): internal error; "
                "please report it with your torch version"
            )
        if start > position:
            sizes.append(start - position)
        sizes.append(grad.numel())
        position = start + grad.numel()
    if position < buffer.numel():
        sizes.append(buffer.numel() - position)
    return sizes


def _check_bucket(state: AdasumState, bucket: dist.GradBucket) -> None:
    """Raise NonFiniteError on every rank if a gradient of the bucket is non-finite on any rank."""
    params = bucket.parameters()
    names = [state.names.get(id(p), f"parameter {bucket.index()}.{i}") for i, p in enumerate(params)]
    what = f"the gradient (bucket {bucket.index()}) of parameter"
    apply_nonfinite_policy("raise", bucket.gradients(), state.group, names, operation="adasum_hook", what=what)


@dataclass(frozen=True)
class _BucketPlan:
    """What the hook learnt about one bucket's buffer: valid while that very buffer object lives (DDP keeps it
    across iterations; a rebuild or a compression wrapper makes new ones, so an address alone is not trusted)."""

    buffer: weakref.ref
    pointer: int
    sizes: tuple[int, ...]
    key: tuple  # names the bucket in a batch's graph key: its address, dtype and segments

    def holds(self, buffer: torch.Tensor) -> bool:
        return self.buffer() is buffer and self.pointer == buffer.data_ptr()


def _check_one_model(state: AdasumState, bucket: dist.GradBucket) -> None:
    """RuntimeError where a bucket holds parameters that the state's first backward pass did not have: the state
    is registered on a second model (one open batch cannot serve two backward passes). DDP's buckets cover every
    parameter on every pass, and a rebuild regroups the same ones."""
    if state._parameters is None:
        state._learning.update((id(p), p) for p in bucket.parameters())
        if bucket.is_last():
            state._parameters, state._learning = state._learning, weakref.WeakValueDictionary()
        return
    if any(state._parameters.get(id(p)) is not p for p in bucket.parameters()):
        raise RuntimeError(
            "adasum_hook: this AdasumState is registered on a second DDP model (bucket "
            f"{bucket.index()} holds parameters its first model does not have); make one AdasumState per model"
        )


def _plan(state: AdasumState, bucket: dist.GradBucket, buffer: torch.Tensor) -> _BucketPlan:
    plan = state._plans.get(bucket.index())
    if plan is None or not plan.holds(buffer):
        _check_one_model(state, bucket)
        sizes = tuple(bucket_sizes(bucket))
        plan = _BucketPlan(weakref.ref(buffer), buffer.data_ptr(), sizes, (buffer.data_ptr(), buffer.dtype, sizes))
        state._plans[bucket.index()] = plan
    return plan


def _take_open_batch(state: AdasumState) -> list[tuple[torch.Tensor, _BucketPlan, torch.futures.Future]]:
    batch, state._open, state._open_bytes = state._open, [], 0
    return batch


def _close_batch(state: AdasumState) -> None:
    """Combine the open batch and complete its Futures: through the reducer's plan of the batch (one bucket as a
    flat buffer, several as one list of their segments: per-tensor reducers only, the same coefficients either way),
    on NCCL enqueued on the side stream and replayed from a captured graph when the same batch comes again
    (`adasum.transport.communicator.Communicator.replay`); `Communicator.run` runs it eagerly elsewhere."""
    batch = _take_open_batch(state)
    if not batch:
        return
    device = batch[-1][0].device
    if device.type == "cuda":
        side = side_stream(device, "comm")
        side.wait_stream(torch.cuda.current_stream(device))
    key = ("ddp", id(state.reducer), tuple(plan.key for _, plan, _ in batch))
    if key not in state._agreed:
        _agree_batch(state, batch)
        state._agreed.add(key)
    buffers = [buffer for buffer, _, _ in batch]
    comm = communicator(state.group)
    entry = ("adasum_hook", key)  # the key names the reducer (its id) and each bucket's address and segments
    with torch.cuda.stream(side) if device.type == "cuda" else contextlib.nullcontext():
        with state._statistics.call(key, device):
            if not comm.replay(entry, buffers):  # a repeat of a captured batch: its graph, nothing else
                sizes = [n for _, plan, _ in batch for n in plan.sizes]
                comm.run(state.reducer._plan(entry, buffers, sizes, state.group, "none", "adasum_hook",
                                             "bucket segments", {}), buffers)
        for tensor, _, future in batch:
            future.set_result(tensor)


def _agree_batch(state: AdasumState, batch: list[tuple[torch.Tensor, _BucketPlan, Any]]) -> None:
    """A batch's first call: every rank must combine the same segments (DDP buckets of another ``bucket_cap_mb``
    on one rank differ here), checked across ranks once per batch (its plan, `adasum.checks.plan`)."""
    sizes = [n for _, plan, _ in batch for n in plan.sizes]
    buffers = [buffer for buffer, _, _ in batch]
    prepare(buffers, state.group, config=("adasum_hook", repr(state.reducer)), operation="adasum_hook",
            what="bucket segments", sizes=sizes, check="once")


def _drop_open_batch(state: AdasumState) -> None:
    """A backward pass stopped before its last bucket (module doc): fail the Futures it left, forget them."""
    for _, _, future in _take_open_batch(state):
        if not future.done():
            future.set_exception(RuntimeError("adasum_hook: the backward pass ended before its last bucket"))


def _check_batch_limit(state: AdasumState, operation: str) -> None:
    """Raise the same ValueError on every rank unless every rank has the same configuration: the reducer, the
    non-finite policy and the batch limit (the batches decide which collectives run, so ranks with different
    limits would pair different calls). Once per state: at construction, or at the first bucket of a state made
    before the process group or unpickled (then on every rank alike)."""
    batches = f"batch_mb={state._batch_mb:g}" if state.batch_bytes else "bucket by bucket"
    config = (f"reducer={state.reducer!r}", f"nonfinite={state.nonfinite}", batches)
    with failures_named(operation, "the configuration check", state.group):
        agree([], None, state.group, "the hook's configurations", operation, config)
    state._batch_checked = True
    warn_one_rank(state.group, operation, "torch")  # the hook's first bucket: the user's backward() on the CPU


def _follow_world(state: AdasumState, operation: str) -> None:
    """An unpickled state on another world size than it was pickled on (an elastic restart, docs/faults.md): the
    reducer's cross-call state (AdaCons' per-worker momentum, one entry per rank) starts afresh, the rest carries
    over; one warning on every rank says so."""
    saved = state.__dict__.pop("_saved_world", None)
    world = dist.get_world_size(state.group)
    if saved is None or int(saved) == world:
        return
    notes = ["the iteration counter carries over"]
    kept = state.reducer.state_dict()
    if kept.get("states"):
        state.reducer.load_state_dict({**kept, "states": {}})
        notes.append(f"{type(state.reducer).__name__}'s state (one entry per rank) starts afresh")
    warnings.warn(f"{operation}: the state was pickled on {saved} ranks and runs on {world}: " + "; ".join(notes),
                  stacklevel=3)


def adasum_hook(state: AdasumState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Combine one DDP bucket across the group with ``state.reducer``, per parameter, in place.

    Returns a Future of the bucket's buffer, completed when the bucket's batch is combined (see the
    module doc for batches, NCCL and gloo).

    >>> ddp_model.register_comm_hook(AdasumState(), adasum_hook)  # doctest: +SKIP
    >>> ddp_model.register_comm_hook(AdasumState(), fp16_compress_wrapper(adasum_hook))  # doctest: +SKIP

    On one process (a group of one rank; under torchrun every rank makes the same calls):

    >>> import torch.distributed as dist
    >>> from torch.nn.parallel import DistributedDataParallel
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> ddp_model, state = DistributedDataParallel(torch.nn.Linear(3, 2)), AdasumState()
    >>> ddp_model.register_comm_hook(state, adasum_hook)
    >>> ddp_model(torch.ones(4, 3)).sum().backward()
    >>> ddp_model.module.bias.grad, state           # one rank: the gradient as it was
    (tensor([4., 4.]), AdasumState(reducer=Adasum(per_tensor=True), iteration=1))
    >>> dist.destroy_process_group()
    """
    buffer = bucket.buffer()
    if bucket.index() == 0:
        state._statistics.discard_step()  # what a backward pass that stopped (an error) left
        if state._open:
            _drop_open_batch(state)
    if state.nonfinite == "raise":
        try:
            _check_bucket(state, bucket)
        except NonFiniteError:
            state.skipped_steps += 1
            raise
    if not state._batch_checked:
        _follow_world(state, "adasum_hook")
        _check_batch_limit(state, "adasum_hook")
    plan = _plan(state, bucket, buffer)
    last = bucket.is_last()
    if last:
        state.iteration += 1
    if state._open and state._open[-1][0].dtype != buffer.dtype:
        _close_batch(state)  # a batch holds one dtype
    future: torch.futures.Future = (
        torch.futures.Future(devices=[buffer.device]) if buffer.device.type == "cuda" else torch.futures.Future()
    )
    state._open.append((buffer, plan, future))
    state._open_bytes += buffer.numel() * buffer.element_size()
    if last or state._open_bytes >= state.batch_bytes:
        _close_batch(state)
    if last:
        state._statistics.finish_step()
    return future
