"""Adasum as a DistributedDataParallel communication hook.

>>> state = adasum.ddp.AdasumState()                 # Adasum over the default group
>>> ddp_model.register_comm_hook(state, adasum.ddp.adasum_hook)  # doctest: +SKIP

DDP hands the hook one bucket at a time: a flat buffer holding several parameters' gradients end
to end (``bucket.gradients()`` are views of ``bucket.buffer()`` at their offsets). The hook gives
every parameter its own Adasum coefficients, with one VHDD collective per bucket (one small
float64 all-reduce of dot products per tree level), and returns a completed Future of the buffer.
On NCCL all the work is enqueued on a side stream that waits for the gradients by an event, so
the backward pass keeps computing while a bucket is combined; the Future completes on that
stream, and the host never waits for the GPU (repeated buckets replay a captured CUDA graph); on
gloo, whose point-to-point operations have no futures, the work completes before the hook
returns (a correct synchronous fallback).

It composes with what DDP offers: bucket rebuilding after the first iteration, ``no_sync()``,
``join()`` (ranks that have finished contribute zero buckets: ``adasum(0, b) = b``, never NaN),
``static_graph=True``, ``gradient_as_bucket_view=True``, and torch's
``fp16_compress_wrapper`` / ``bf16_compress_wrapper``. Gradients are not divided by the world
size before the hook (DDP leaves that to hooks): Adasum needs no division.

This module deliberately has no ``from __future__ import annotations``: DDP compares the hook's
annotations with ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects.
"""

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from adasum.collectives.nonfinite import apply_nonfinite_policy, check_policy
from adasum.deprecated import _UNSET, renamed
from adasum.reducers import Adasum, Reducer, get_reducer
from adasum.transport.groups import side_stream

HOOK_POLICIES = ("propagate", "raise")


class AdasumState:
    """What `adasum_hook` needs: the process group, the reducer and the iteration count.

    `reducer` is any `adasum.reducers.Reducer` or its name ("adasum", "mean", "sum", ...);
    ``hierarchical=True`` (with `local_size`, default LOCAL_WORLD_SIZE) selects Adasum over node
    means (`adasum.hierarchical`). When torch.distributed is initialised, construction runs the
    reducer's collective set-up (on every rank), so that placement errors surface here.
    The state pickles without its process group (the default group is used after unpickling).
    ``group`` is the process group (``process_group=`` is its deprecated alias). The hook skips the
    reducer's per-call layout check: DDP verifies the parameters across ranks at construction and
    keeps the buckets identical on every rank.

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
        group: dist.ProcessGroup | None = _UNSET,
        reducer: str | Reducer = "adasum",
        *,
        hierarchical: bool = False,
        local_size: int | None = None,
        nonfinite: str = "propagate",
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        process_group: dist.ProcessGroup | None = _UNSET,
    ) -> None:
        group = renamed("AdasumState", "process_group", "group", process_group, group, default=None)
        if nonfinite == "skip":
            raise ValueError(
                "nonfinite='skip' is not available in a DDP hook (it cannot skip the optimizer step); "
                "use 'raise' and catch adasum.NonFiniteError, or check the gradients before optimizer.step()"
            )
        check_policy(nonfinite, HOOK_POLICIES)
        if hierarchical:
            if isinstance(reducer, Reducer) or reducer != "adasum":
                raise ValueError(
                    f"hierarchical=True goes with reducer='adasum', got {reducer!r}; "
                    "pass Adasum(hierarchical=True, local_size=...) as the reducer instead"
                )
            reducer = Adasum(hierarchical=True, local_size=local_size)
        elif local_size is not None:
            raise ValueError("local_size needs hierarchical=True")
        self.group = group
        self.reducer = get_reducer(reducer)
        self.iteration = 0
        self.nonfinite = nonfinite
        self.names = {id(p): n for n, p in named_parameters} if named_parameters is not None else {}
        if dist.is_initialized():
            self.reducer.setup(group)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group (``group``; this name is kept for code that reads it)."""
        return self.group

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "group"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.group = None

    def __repr__(self) -> str:
        return f"AdasumState(reducer={self.reducer!r}, iteration={self.iteration})"


def bucket_sizes(bucket: dist.GradBucket) -> list[int]:
    """Element counts of the segments of ``bucket.buffer()``: one per parameter, in buffer order,
    plus a segment of its own for any gap between parameters (so coefficients never mix them).

    >>> bucket_sizes(bucket)        # e.g. [4096, 64, 64] for a weight, its bias and a norm's bias  # doctest: +SKIP
    """
    buffer = bucket.buffer()
    if buffer.is_sparse:
        raise TypeError("adasum_hook does not support sparse gradients")
    base, storage = buffer.storage_offset(), buffer.untyped_storage().data_ptr()
    sizes: list[int] = []
    position = 0
    for grad in bucket.gradients():
        start = grad.storage_offset() - base
        if grad.untyped_storage().data_ptr() != storage or start < position:
            raise RuntimeError("a bucket's gradients are not consecutive views of its buffer")
        if start > position:
            sizes.append(start - position)
        sizes.append(grad.numel())
        position = start + grad.numel()
    if position < buffer.numel():
        sizes.append(buffer.numel() - position)
    return sizes


def completed_future(tensor: torch.Tensor) -> torch.futures.Future:
    """A Future already holding `tensor`; on CUDA it makes its consumers' streams wait for the
    current stream, so work enqueued before it is ordered with no host synchronisation."""
    future: torch.futures.Future = (
        torch.futures.Future(devices=[tensor.device]) if tensor.device.type == "cuda" else torch.futures.Future()
    )
    future.set_result(tensor)
    return future


def _check_bucket(state: AdasumState, bucket: dist.GradBucket) -> None:
    """Raise NonFiniteError on every rank if a gradient of the bucket is non-finite on any rank."""
    params = bucket.parameters()
    names = [state.names.get(id(p), f"parameter {bucket.index()}.{i}") for i, p in enumerate(params)]
    what = f"the gradient (bucket {bucket.index()}) of parameter"
    apply_nonfinite_policy("raise", bucket.gradients(), state.group, names, operation="adasum_hook", what=what)


def adasum_hook(state: AdasumState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Combine one DDP bucket across the group with ``state.reducer``, per parameter, in place.

    Returns a completed Future of the bucket's buffer (see the module doc for NCCL and gloo).

    >>> ddp_model.register_comm_hook(AdasumState(), adasum_hook)  # doctest: +SKIP
    >>> ddp_model.register_comm_hook(AdasumState(), fp16_compress_wrapper(adasum_hook))  # doctest: +SKIP
    """
    buffer = bucket.buffer()
    if getattr(state, "nonfinite", "propagate") == "raise":
        _check_bucket(state, bucket)
    sizes = bucket_sizes(bucket)
    if bucket.is_last():
        state.iteration += 1
    if buffer.device.type != "cuda":
        state.reducer.all_reduce_flat(buffer, sizes, state.group, check_layout=False)
        return completed_future(buffer)
    # On a side stream, ordered after the gradients by an event: backward keeps computing while the
    # bucket is combined; the Future completes on the side stream (DDP's consumers wait for it).
    side = side_stream(buffer.device, "comm")
    side.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(side):
        state.reducer.all_reduce_flat(buffer, sizes, state.group, check_layout=False)
        return completed_future(buffer)

