r"""AdaCons: adaptive consensus gradient aggregation (Choukroun, Azoulay, Kisilev, arXiv 2411.03742).

For N workers with gradients ``g_i`` (by default the whole call's tensors taken as one vector)::

    m     = (1/N) sum_j g_j                                   (first all-reduce)
    a_i   = <g_i, m> / |g_i|                                  (mean projected on worker i's direction)
    s_t   = beta s_{t-1} + (1 - beta) sort(a)                 (subspace momentum over sorted values;
    â_i   = s_t[position of a_i in sort(a)]                     s_1 = sort(a_1))
    c_i   = max(â_i, 0) / sum_j max(â_j, 0)                   (1/N each if that sum is not positive)
    d     = scale * sum_i c_i g_i / |g_i|                     (second all-reduce)

Rules chosen here (the paper leaves them open):

* **Sort momentum, the permutation the right way round.** With ``idx = argsort(a)`` (stable, so
  ties go by worker index), worker ``idx[k]`` holds rank position ``k`` and receives ``s[k]``:
  ``â[idx] = s``, i.e. ``â = s[argsort(idx)]``. The authors' sample code writes ``s[idx]``, which
  is the same only when ``idx`` is its own inverse (always for N <= 2, not in general).
* **Negative coefficients are clipped to 0**: a worker whose gradient points away from the mean
  (after smoothing) gets no weight. When all are positive nothing changes, unlike a shift by
  ``min(a)``, which would always drop one worker.
* **Non-positive sum**: if no coefficient is positive (the mean is zero, or every gradient is
  orthogonal to or opposed to it), every worker gets ``1/N``. With the default scale the result
  is then ``|m| * d``, which is 0 whenever ``m = 0``.
* **Zero gradients**: a worker with ``|g_i|^2`` below `adasum.ZERO_NORM` has ``a_i = 0`` and
  contributes nothing (its direction is undefined); never NaN.
* **Scale**: ``scale="mean_norm"`` (the default) multiplies by ``|m|``, so identical worker
  gradients aggregate to that very gradient and plain SGD works unchanged; ``scale="unit"`` is the
  paper's ``d`` (``|d| <= 1``), for scale-invariant optimizers (Adam, LAMB).
* **Granularity**: by default one set of coefficients for all tensors of a call, across dtypes
  (``per_tensor=False``); ``per_tensor=True`` gives each tensor its own coefficients and momentum.
  In a DDP communication hook each bucket is one call, so "whole model" means "whole bucket".

Communication per call. Where the group's movers are NVLink's (every rank on one host; anywhere the settings put
"slices" first), a call runs on the slice-parallel schedule's movers (`adasum.collectives.slices.combine_slices_`)
with AdaCons' weights as its combine op (`Consensus`), within the memory budget (`adasum.settings`): each rank
receives every rank's copy of its slice, adds the slice's share of each tensor's Gram matrix of the N copies
(``G_ij = <g_i, g_j>``, float64), one small all-reduce of the ``[N, N, T]`` sums gives every rank
``<g_i, m> = (1/N) sum_j G_ij``, ``|g_i|^2 = G_ii`` and ``|m|^2 = (1/N^2) sum_ij G_ij``, hence the same weights,
and one pass writes its slice of ``sum_i w_i g_i`` (float64, rounded once to the dtype), which the gather hands to
every rank: the bytes of one all-reduce for a call of one buffer that fits one round. Whole-model weights over
several rounds or several dtypes take two sweeps (the Gram sums round by round, then the weighted sums: 3/4 of the
two all-reduces' bytes); per-tensor weights run round by round as Adasum does. The sharded form adds the Gram
sums up over the shard group first. Elsewhere (gloo's default): two all-reduces of
the gradient buffer (one flat buffer per dtype each, never one per tensor) and one all-gather of ``3 x S`` float64
values per rank (S = 1 whole-model, S = number of tensors per-tensor), with dot products and norms accumulated in
float64 and the scaled gradient computed in float32 or float64 (the wider of the tensor's dtype and float32) and
written back in the tensor's dtype before the second all-reduce.

CUDA graphs. AdaCons is `capturable`: a call, on either road, is device work only, so on a GPU each entry point's
plan captures the whole call in a CUDA graph on its second sight and replays it from then on
(`adasum.transport.communicator.Communicator.run`), as Adasum's calls are. What makes a call the same launches every
time: the momentum state is a `Momentum` of device tensors read and written in place, whose first-call rule is a
device-side flag per segment (``torch.where``, not a host branch); the index tensors a call reads (the call order of
the tensors, the segment counts) are made once per layout and device (`adasum.transport.caches.DeviceIndices`,
emptied by `adasum.release()`); nothing reads a device value on the host. `load_state_dict` copies into the live
state (a replayed graph reads what was loaded). The statistics (`adasum.core.statistics`) record a reference to the
consensus weights the call computes: a replay rewrites that tensor, so the records of the key's captured call (the
DDP hook's and the optimizers' `StepStatistics`) read the replay's weights when they are summarized; a replay
inside a plain `recording` block records nothing, as for Adasum.

Momentum state is kept per call site: one float64 ``[S, N]`` tensor per *layout key*, by default a
digest of the call's tensor dtypes and element counts in order (``key=`` overrides it). So the
buckets of a DDP model, which differ in layout, each keep their own momentum; two calls with the
same layout (identical buckets, or one object used for gradients and for model deltas of the same
parameters) share one state, updated once per call. Use one AdaCons object per purpose, or pass
`key`. The states travel in `state_dict()`. An object keeps the states of its last 512 keys
(`adasum.transport.caches.MOST`; a key that comes back after that starts afresh, as a first call, while a graph
captured on the evicted state keeps it and goes on replaying it),
and `adasum.release()` (so ``destroy_process_group``) empties them: they belong to the group they were
made on (one entry per rank); take `state_dict()` before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from adasum.collectives.api import fused_per_dtype
from adasum.collectives.slices import CombineOp, SliceMover, combine_slices_
from adasum.collectives.vhdd import transport_for
from adasum.core import statistics
from adasum.core.gram import consensus_sums
from adasum.core.keep import kept
from adasum.core.layout import Layout
from adasum.core.operator import ZERO_NORM
from adasum.kernels import dot_and_norms
from adasum.options import Scale, check_number, check_option
from adasum.reducers.base import Reducer, check_state_keys, check_workers, is_float8, widened
from adasum.settings import current
from adasum.transport.caches import DeviceIndices, Released
from adasum.transport.errors import failures_named
from adasum.transport.groups import uses_nccl
from adasum.transport.topology import Topology

# --- the coefficient math: pure functions on [S, N] float64 tensors (segments x workers), shared by
# --- the single-process and the distributed forms


def projections(dots: torch.Tensor, sq_norms: torch.Tensor) -> torch.Tensor:
    """``a_i = <g_i, m> / |g_i|`` per segment and worker; 0 where ``|g_i|^2 < ZERO_NORM``.

    >>> projections(torch.tensor([[2.0, 0.0]]).double(), torch.tensor([[4.0, 0.0]]).double())
    tensor([[1., 0.]], dtype=torch.float64)
    """
    nonzero = sq_norms >= ZERO_NORM
    return torch.where(nonzero, dots / sq_norms.clamp_min(ZERO_NORM).sqrt(), torch.zeros_like(dots))


def sort_momentum(
    a: torch.Tensor, state: torch.Tensor | None, beta: float, primed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Subspace momentum over the sorted coefficients: ``(smoothed a, new state)``.

    ``s = beta * state + (1 - beta) * sort(a)`` along the last (worker) dim, ``s = sort(a)`` when
    `state` is None (the first call); each worker gets the value of its rank position,
    ``smoothed[idx] = s`` with ``idx = argsort(a)`` (stable: ties go by worker index). `primed` (bool, one per
    row of `a`) decides the first call on the device instead: ``s = sort(a)`` in the rows where it is False, the
    same launches either way (a CUDA graph replays them whatever the flags hold).

    >>> smoothed, state = sort_momentum(torch.tensor([[3.0, 1.0, 2.0]]), None, 0.9)
    >>> state
    tensor([[1., 2., 3.]])
    >>> sort_momentum(torch.tensor([[3.0, 1.0, 2.0]]), torch.zeros(1, 3), 0.9, torch.tensor([False]))[1]
    tensor([[1., 2., 3.]])
    """
    ordered, idx = torch.sort(a, dim=-1, stable=True)
    if state is None:
        state = ordered
    else:
        blended = state * beta + ordered * (1 - beta)
        state = blended if primed is None else torch.where(primed.unsqueeze(-1), blended, ordered)
    smoothed = torch.empty_like(a).scatter_(-1, idx, state)
    return smoothed, state


def normalize(a: torch.Tensor) -> torch.Tensor:
    """Coefficients summing to 1 per segment: ``max(a, 0) / sum(max(a, 0))``, or ``1/N`` each where
    that sum is not positive.

    >>> normalize(torch.tensor([[3.0, -1.0, 1.0], [-1.0, 0.0, -2.0]]))
    tensor([[0.7500, 0.0000, 0.2500],
            [0.3333, 0.3333, 0.3333]])
    """
    clipped = a.clamp_min(0)
    total = clipped.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(a, 1.0 / a.shape[-1])
    return torch.where(total > 0, clipped / torch.where(total > 0, total, torch.ones_like(total)), uniform)


def worker_weights(
    c: torch.Tensor, sq_norms: torch.Tensor, mean_sq_norm: torch.Tensor, scale: Scale = "mean_norm"
) -> torch.Tensor:
    """The factor each worker's gradient is multiplied by before summing: ``c_i * scale / |g_i|``,
    with scale ``|m|`` ("mean_norm") or 1 ("unit"); 0 for a zero gradient.

    `mean_sq_norm` is ``|m|^2`` per segment, shape [S].

    >>> worker_weights(torch.tensor([[0.5, 0.5]]), torch.tensor([[4.0, 4.0]]), torch.tensor([4.0]))
    tensor([[0.5000, 0.5000]])
    """
    check_option("scale", scale, Scale)
    nonzero = sq_norms >= ZERO_NORM
    w = c / sq_norms.clamp_min(ZERO_NORM).sqrt()
    if scale == "mean_norm":
        w = w * mean_sq_norm.sqrt().unsqueeze(-1)
    return torch.where(nonzero, w, torch.zeros_like(w))


def consensus(
    dots: torch.Tensor, sq_norms: torch.Tensor, state: torch.Tensor | None, beta: float,
    primed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalized coefficients ``c`` ([S, N], summing to 1 over the workers) and the new momentum state,
    from the per-worker ``<g_i, m>`` and ``|g_i|^2``: projections, sort momentum (`primed`: `sort_momentum`'s),
    normalization.

    >>> c, state = consensus(torch.tensor([[3.0, 1.0]]).double(), torch.tensor([[9.0, 1.0]]).double(), None, 0.0)
    >>> c
    tensor([[0.5000, 0.5000]], dtype=torch.float64)
    """
    smoothed, state = sort_momentum(projections(dots, sq_norms), state, beta, primed)
    return normalize(smoothed), state


def coefficients(
    dots: torch.Tensor,
    sq_norms: torch.Tensor,
    mean_sq_norm: torch.Tensor,
    state: torch.Tensor | None,
    beta: float,
    scale: Scale = "mean_norm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaCons from the per-worker ``<g_i, m>`` and ``|g_i|^2`` ([S, N]) and ``|m|^2`` ([S]):
    ``(weights [S, N], new momentum state [S, N])``; the aggregate is ``sum_i weights_i g_i``.

    Two workers with the same gradient [3, 4] (``<g_i, m> = |g_i|^2 = |m|^2 = 25``) get 1/2 each:

    >>> dots = sq_norms = torch.tensor([[25.0, 25.0]], dtype=torch.float64)
    >>> w, state = coefficients(dots, sq_norms, torch.tensor([25.0], dtype=torch.float64), None, beta=0.0)
    >>> w
    tensor([[0.5000, 0.5000]], dtype=torch.float64)
    """
    c, state = consensus(dots, sq_norms, state, beta)
    return worker_weights(c, sq_norms, mean_sq_norm, scale), state


def scale_segments_(
    flat: torch.Tensor, weights: torch.Tensor, sizes: Sequence[int], counts: torch.Tensor | None = None
) -> None:
    """``flat[segment s] *= weights[s]`` in place; one weight for the whole buffer if ``len(weights) == 1``.

    Computed in the wider of flat's dtype and float32, written back in flat's dtype. `counts`: `sizes` as an int64
    tensor on flat's device, made once by the caller (`adasum.transport.caches.DeviceIndices`; without it, one is
    copied from the host).
    """
    compute = torch.promote_types(flat.dtype, torch.float32)
    w = weights.to(device=flat.device, dtype=compute)
    if w.numel() > 1:
        if counts is None:
            counts = torch.tensor(list(sizes), dtype=torch.int64, device=flat.device)
        w = torch.repeat_interleave(w, counts, output_size=flat.numel())
    else:
        w = w.reshape(())
    if flat.dtype == compute:
        flat.mul_(w)
    else:
        flat.copy_(flat.to(compute) * w)


def check_key(key: object, operation: str) -> None:
    """Raise TypeError, before anything moves, unless `key` (the name of a momentum state) is a str or None."""
    if key is not None and not isinstance(key, str):
        raise TypeError(f"{operation}: key must be a str or None, got {key!r}; pass a name")


def layout_key(description: Sequence[tuple[torch.dtype, int]], per_tensor: bool) -> str:
    """The default momentum key of a call: a digest of its tensors' dtypes and element counts."""
    digest = hashlib.blake2b(repr([(str(d), int(n)) for d, n in description]).encode(), digest_size=8)
    return f"{'tensor' if per_tensor else 'model'}:{len(description)}:{digest.hexdigest()}"


@dataclass(eq=False)
class Momentum:
    """One key's momentum state on one device: `values` ``[S, N]`` float64 (the sorted coefficients' momentum per
    segment) and `primed` ``[S]`` bool (a row holds momentum once a call wrote it; until then a call takes the
    row's first-call rule, `sort_momentum`). Both are read and written in place, by eager calls and replayed CUDA
    graphs alike (`AdaCons._update`); `AdaCons.load_state_dict` copies into them."""

    values: torch.Tensor
    primed: torch.Tensor


def _primed(values: torch.Tensor) -> Momentum:
    """A state that holds momentum in every row: `values` ([S, N] float64) with its flags, on its device."""
    return Momentum(values, torch.ones(values.shape[:1], dtype=torch.bool, device=values.device))


class Consensus(CombineOp):
    """AdaCons as the slice-parallel schedule's combine rule (`adasum.collectives.slices.CombineOp`): from the
    [P, P, T] Gram sums ``G_ij = <g_i, g_j>`` of T tensors, ``<g_i, m> = (1/P) sum_j G_ij``, ``|g_i|^2 = G_ii``
    and ``|m|^2 = (1/P^2) sum_ij G_ij`` (`adasum.core.gram.consensus_sums`), then the reducer's weights
    (`consensus`, `worker_weights`) with the momentum state of `key`. Whole-model (``per_tensor=False``) couples
    every tensor of the call (`coupled`).

    The state is the reducer's `Momentum` for `key` on the data's `device` (`state`: its values), updated in place,
    so that a CUDA graph of the call replays the momentum too (`AdaCons._momentum`); `fresh`: the key had no state
    before (the device-side flags, not this, decide the first-call rule). `order`: the call position of each of the
    schedule's columns (None: the same order), as a device tensor made once per order. `shard`: a group over which
    the Gram sums of tensor shards are added up first (the sharded form: coefficients of the whole tensors)."""

    def __init__(self, reducer: AdaCons, key: str, count: int, workers: int, device: torch.device,
                 order: Sequence[int] | None = None, shard: dist.ProcessGroup | None = None,
                 operation: str = "adasum.AdaCons.all_reduce") -> None:
        self.reducer, self.key, self.shard, self.operation = reducer, key, shard, operation
        self.coupled = not reducer.per_tensor
        shape = (count if reducer.per_tensor else 1, workers)
        self.momentum, self.fresh = reducer._momentum(key, shape, device)
        self.state = self.momentum.values
        in_order = order is None or list(order) == list(range(count))
        self.order = None if order is None or in_order else reducer._indices.of(order, device)

    def weights(self, gram: torch.Tensor, first: int) -> torch.Tensor:
        """The [P, T] weights of the P copies per tensor (the whole model's, repeated, unless `per_tensor`)."""
        if self.shard is not None and dist.get_world_size(self.shard) > 1:
            with failures_named(self.operation, "the shard sums", self.shard):
                dist.all_reduce(gram, group=self.shard)
        workers, _, count = gram.shape
        dots, sq_norms, mean_sq = consensus_sums(gram)  # [T, P], [T, P], [T]
        rows: slice | torch.Tensor = slice(first, first + count)
        if not self.reducer.per_tensor:
            dots, sq_norms, mean_sq = (x.sum(0, keepdim=True) for x in (dots, sq_norms, mean_sq))
            rows = slice(0, 1)
        elif self.order is not None:
            rows = kept(self.order)[first : first + count]
        weights = self.reducer._update(self.momentum, rows, dots, sq_norms, mean_sq)
        return weights.T.expand(workers, count).contiguous()


class AdaCons(Reducer):
    """Adaptive consensus aggregation (module docstring for the formula and the rules).

    `momentum` is the subspace momentum beta, a number in [0, 1) (0: none; the paper's demo uses 0.99). `per_tensor`
    gives each tensor its own coefficients; `scale` is "mean_norm" (identical gradients aggregate to
    themselves) or "unit" (the paper's ``|d| <= 1``).

    The distributed forms take ``key=`` (the momentum state's name, a str; default: the call's layout).

    >>> reducer = adasum.AdaCons(momentum=0.9)
    >>> reducer.all_reduce([p.grad for p in model.parameters()])   # across the process group  # doctest: +SKIP
    >>> w0, w1, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([2.0])
    >>> reducer.reduce([[w0, b], [w1, b]])          # single process: one list of tensors per worker
    [tensor([0.4743, 0.4743]), tensor([1.8974])]
    """

    name = "adacons"
    capturable = True
    """Every call's work is device work (the momentum's first-call rule on device flags, the index tensors made once
    per layout): on NCCL a repeated call is captured in a CUDA graph once and replayed (module doc)."""
    call_options = frozenset({"key"})
    state_keys = ("momentum", "per_tensor", "scale", "states")
    """What `state_dict` saves; `load_state_dict` takes a state with these keys only."""

    def __init__(self, momentum: float = 0.0, per_tensor: bool = False, scale: Scale = "mean_norm") -> None:
        check_number("adasum.AdaCons", "momentum", momentum, "a number in [0, 1)", lambda v: 0 <= v < 1)
        check_option("scale", scale, Scale)
        if not isinstance(per_tensor, bool):
            raise TypeError(f"per_tensor must be True or False, got {per_tensor!r}; pass a bool")
        self.momentum = float(momentum)
        self.per_tensor = per_tensor
        self.scale = scale
        self._states: Released[str, Momentum] = Released()  # bounded; adasum.release() empties it
        self._indices = DeviceIndices()  # the calls' index tensors per layout and device (released alike)

    # -- shared by both forms

    def _weights(
        self, key: str, dots: torch.Tensor, sq_norms: torch.Tensor, mean_sq: torch.Tensor
    ) -> torch.Tensor:
        """Weights [S, N] from per-tensor (or already summed) partials ([T, N], [T, N], [T]); updates
        the key's state."""
        if not self.per_tensor:
            dots, sq_norms, mean_sq = (x.sum(0, keepdim=True) for x in (dots, sq_norms, mean_sq))
        state, _ = self._momentum(key, tuple(dots.shape), dots.device)
        return self._update(state, slice(None), dots, sq_norms, mean_sq)

    def _momentum(self, key: str, shape: tuple[int, ...], device: torch.device) -> tuple[Momentum, bool]:
        """The key's momentum state (`Momentum`: float64 `shape` ([S, N]) values and [S] flags) on `device`, and
        whether it was made now (no state under the key yet: every row unprimed, so the call takes the first-call
        rule). ValueError, the same on
        every rank, where the key's state has another shape and holds momentum (a state of another shape that
        holds none, as `load_state_dict` leaves one it did not have, is made anew: reading its flags waits on the
        host, only here, where a call's layout changed under its key)."""
        state = self._states.get(key)
        if state is not None and tuple(state.values.shape) != tuple(shape):
            if bool(state.primed.any()):
                raise ValueError(
                    f"AdaCons momentum state {key!r} has shape {list(state.values.shape)}, this call needs "
                    f"{list(shape)} (the number of workers or tensors changed)"
                )
            state = None
        if state is None:
            state = self._states[key] = Momentum(
                torch.zeros(shape, dtype=torch.float64, device=device),
                torch.zeros(shape[:1], dtype=torch.bool, device=device),
            )
            return state, True
        if state.values.device != device:
            state.values, state.primed = state.values.to(device), state.primed.to(device)
        return state, False

    def _update(self, state: Momentum, rows: slice | torch.Tensor, dots: torch.Tensor, sq_norms: torch.Tensor,
                mean_sq: torch.Tensor) -> torch.Tensor:
        """Weights [S, N] from summed partials ([S, N], [S, N], [S]) with the momentum of `state`'s rows `rows`
        (the first-call rule where a row is not primed), written back into those rows in place and the rows marked
        primed: device work only, so a replayed graph updates the state as an eager call does. A graph being captured
        keeps the tensors it reads and writes (`adasum.core.keep.kept`): a state replaced later (loaded with another
        shape, moved to another device, evicted) never frees memory a graph writes."""
        kept((state.values, state.primed))
        c, smoothed = consensus(dots, sq_norms, state.values[rows], self.momentum, state.primed[rows])
        if isinstance(rows, slice):
            state.values[rows] = smoothed
            state.primed[rows].fill_(True)
        else:
            state.values.index_copy_(0, rows, smoothed)
            state.primed.index_fill_(0, rows, True)
        if statistics.active():  # a reference to the tensor: a replayed graph rewrites it (module doc)
            statistics.record(statistics.ConsensusWeights(c))
        return worker_weights(c, sq_norms, mean_sq, self.scale)

    def _check_options(self, options: dict[str, Any], operation: str) -> None:
        """`Reducer._check_options`, and TypeError unless ``key`` is a str or None (it names a momentum state)."""
        super()._check_options(options, operation)
        check_key(options.get("key"), operation)

    def _key(self, description: Sequence[tuple[torch.dtype, int]], key: str | None) -> str:
        return key if key is not None else layout_key(description, self.per_tensor)

    # -- single process

    def reduce(self, per_worker: Sequence[Sequence[torch.Tensor]], *, key: str | None = None) -> list[torch.Tensor]:
        """AdaCons of the workers' copies, one list of tensors per worker, in worker order; `key` names the
        momentum state (a str; default: the layout)."""
        check_key(key, "adasum.AdaCons.reduce")
        count = check_workers(per_worker, f"adasum.{type(self).__name__}.reduce")
        if count == 0:
            return []
        workers = len(per_worker)
        first = per_worker[0]
        if any(is_float8(t.dtype) for t in first):  # combined in float32, rounded once (as the distributed form)
            key = self._key([(t.dtype, t.numel()) for t in first], key)
            wide = self.reduce([[t.float() if is_float8(t.dtype) else t for t in w] for w in per_worker], key=key)
            return [r.to(t.dtype) for r, t in zip(wide, first)]
        # every worker's copy of a tensor as one segment of a [workers, n] stack: one kernel for the sums and one
        # for the scaling per tensor, one host read per call (a loop over workers read each worker's sums
        # separately: hundreds of device synchronisations per simulated step on a GPU). Per segment the sums
        # and products are those of the per-worker calls, bit for bit.
        stacks = [torch.stack([w[i].reshape(-1) for w in per_worker]) for i in range(count)]
        means = [stack.sum(0) / workers for stack in stacks]
        sums = torch.stack([
            dot_and_norms(stack.reshape(-1), m.repeat(workers), [m.numel()] * workers)
            for stack, m in zip(stacks, means)
        ]).cpu()  # [count, 3, workers] float64: <g_j, m>, |g_j|^2, |m|^2
        dots, sq_norms, mean_sq = sums[:, 0], sums[:, 1], sums[:, 2, 0]
        weights = self._weights(self._key([(t.dtype, t.numel()) for t in first], key), dots, sq_norms, mean_sq)
        out = []
        for i, stack in enumerate(stacks):
            row = weights[i if self.per_tensor else 0]
            scale_segments_(stack.reshape(-1), row[:workers], [first[i].numel()] * workers)  # stack is a copy
            out.append(stack.sum(0).view(first[i].shape))
        return out

    # -- distributed: `Reducer.all_reduce(tensors, group, *, check_layout=True, key=None)` and
    # -- `Reducer.all_reduce_flat(buffer, sizes, group, *, check_layout=True, key=None)` check the
    # -- layout, then call these; `key` names the momentum state (module doc)

    def _all_reduce_flat(self, buffer, sizes, group=None, key=None):
        self._all_reduce_buffers(
            [buffer],
            [sizes],
            [list(range(len(sizes)))],
            len(sizes),
            group,
            self._key([(buffer.dtype, n) for n in sizes], key),
        )

    def _all_reduce(self, tensors, group=None, key=None):
        description = [(t.dtype, t.numel()) for t in tensors]
        fused_per_dtype(
            tensors,
            lambda flats, sizes, indices: self._all_reduce_buffers(
                flats, sizes, indices, len(tensors), group, self._key(description, key)
            ),
            together=True,
            group=group,
        )

    def _all_reduce_buffers(
        self,
        flats: list[torch.Tensor],
        sizes: list[list[int]],
        indices: list[list[int]],
        count: int,
        group: dist.ProcessGroup | None,
        key: str,
        shard: dist.ProcessGroup | None = None,
        operation: str = "adasum.AdaCons.all_reduce",
    ) -> None:
        """The distributed form over flat buffers, across the workers of `group`; `indices[b]` places buffer b's
        tensors in call order. With a `shard` group (the sharded form), each buffer holds this rank's shards of the
        tensors, and each worker's partial sums are first added up over its shard group (coefficients of the whole
        tensors); every rank of the grid then computes the same weights. 8-bit floats are combined in float32 and
        rounded once (`adasum.reducers.base.widened`)."""
        if count == 0:
            return
        if any(is_float8(f.dtype) for f in flats):
            with ExitStack() as stack:
                wide = [stack.enter_context(widened(f)) for f in flats]
                self._all_reduce_buffers(wide, sizes, indices, count, group, key, shard, operation)
            return
        if self._on_movers(flats, sizes, indices, count, group, key, shard, operation):
            return
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        device = flats[0].device if flats else torch.device("cpu")
        partials = torch.zeros(3, count, dtype=torch.float64, device=device)
        for flat, segment_sizes, where in zip(flats, sizes, indices):
            mean = flat.clone()
            with failures_named(operation, "the mean all-reduce", group):
                dist.all_reduce(mean, group=group)
            mean.div_(world)
            # rows: <g_i, m>, |g_i|^2, |m|^2 for each tensor of this buffer
            part = dot_and_norms(flat, mean, segment_sizes)  # float64 sums, no float64 copies
            partials.index_copy_(1, self._indices.of(where, device), part.to(device))
            del mean
        if shard is not None and dist.get_world_size(shard) > 1:
            with failures_named(operation, "the shard sums", shard):
                dist.all_reduce(partials, group=shard)
        if not self.per_tensor:  # whole model: gather 3 numbers per rank, not 3 per tensor
            partials = partials.sum(1, keepdim=True)
        gathered = [torch.empty_like(partials) for _ in range(world)]
        with failures_named(operation, "the all-gather of dot products", group):
            dist.all_gather(gathered, partials, group=group)
        stacked = torch.stack(gathered)  # [N, 3, T]
        # |m|^2 from rank 0 so that every rank uses the very same value
        weights = self._weights(key, stacked[:, 0].T, stacked[:, 1].T, stacked[0, 2])
        mine = weights[:, rank]
        for flat, segment_sizes, where in zip(flats, sizes, indices):
            if self.per_tensor:  # the index and count tensors made once per layout (no host copy: capturable)
                counts = self._indices.of(segment_sizes, flat.device)
                scale_segments_(flat, mine[self._indices.of(where, mine.device)], segment_sizes, counts)
            else:
                scale_segments_(flat, mine, segment_sizes)
            with failures_named(operation, "the weighted-sum all-reduce", group):
                dist.all_reduce(flat, group=group)

    def _on_movers(self, flats: list[torch.Tensor], sizes: list[list[int]], indices: list[list[int]], count: int,
                   group: dist.ProcessGroup | None, key: str, shard: dist.ProcessGroup | None, operation: str) -> bool:
        """The call on the slice-parallel schedule's movers (`adasum.collectives.slices.combine_slices_`, with
        AdaCons' weights as its rule, `Consensus`; on NVLink symmetric memory), within the memory budget: every
        rank's copy of its slice arrives, one pass adds the slice's share of each tensor's Gram matrix of the P
        copies, one small all-reduce completes them (and one over the `shard` group, the sharded form), the weights
        come from them, and one pass writes the slice of ``sum_i w_i g_i`` that the gather hands to every rank: the
        traffic of one all-reduce where the call fits one round of one buffer; a whole-model call of several rounds
        or dtypes takes two sweeps (the sums, then the weighted sums: ``3 N (P-1)/P`` bytes per rank against the two
        all-reduces' ``4 N (P-1)/P``). Where the movers are NVLink's (one host, `adasum.transport.symmetric.supported`;
        elsewhere only where the settings put "slices" first, the test suite's ``ADASUM_TEST_TRANSPORT``: on gloo the
        two all-reduces measured faster for a ResNet-50-shaped bucket, docs/benchmarks.md). On a GPU the whole call,
        this schedule within it, is what the entry point's plan captures and replays
        (`adasum.transport.communicator.Communicator.run`; `capturable`), the momentum state updated in place. False
        where the movers do not serve the group (the two all-reduces then run, `_all_reduce_buffers`)."""
        if dist.get_world_size(group) == 1:
            return False
        if current().transport_first != "slices":
            if not uses_nccl(group):
                return False
            from adasum.transport import symmetric  # loads Triton: never in a CPU process

            if not symmetric.supported(group):
                return False
        mover = cast(SliceMover, transport_for(group, "slices", whole_group=True))
        device = flats[0].device
        order = [i for where in indices for i in where]
        op = Consensus(self, key, count, mover.world, device, order, shard, operation)
        buffers = [(flat, Layout(tuple(n))) for flat, n in zip(flats, sizes)]
        with failures_named(operation, "the slice-parallel schedule", group, mover.timeout):
            combine_slices_(buffers, mover, op)
        return True

    # -- sharded: `Reducer.all_reduce_shards`

    @property
    def homogeneous(self) -> bool:
        """``scale="unit"`` gives ``|d| <= 1`` whatever the inputs' scale."""
        return self.scale == "mean_norm"

    def check_shards(self, shards: int) -> None:
        """Any number of shards: the partials are summed over the shard group."""

    def _all_reduce_shards(self, buffer, sizes, groups: Topology, *, key=None):
        """As `all_reduce_flat` over the replicate group, except that each replica's per-tensor partial
        ``<g_i, m>``, ``|g_i|^2``, ``|m|^2`` are first summed over its shard group (coefficients of the
        whole tensors): the one distributed form (`_all_reduce_buffers`) with the grid's shard group. `key`
        names the momentum state (default: the layout of the shards)."""
        check_key(key, "adasum.AdaCons.all_reduce_shards")
        sizes = [int(n) for n in sizes]
        key = self._key([(buffer.dtype, n) for n in sizes], key)
        self._all_reduce_buffers([buffer], [sizes], [list(range(len(sizes)))], len(sizes), groups.replicate, key,
                                 groups.shard, "adasum.AdaCons.all_reduce_shards")

    # -- state

    def state_dict(self) -> dict[str, Any]:
        """The momentum states (CPU float64), keyed by call site, and the settings. A key's state is saved once a
        call wrote momentum into it (its flags are read from the device: this waits for the device)."""
        entries = list(self._states.items())
        held = torch.stack([s.primed.any().cpu() for _, s in entries]).tolist() if entries else []
        return {
            "momentum": self.momentum,
            "per_tensor": self.per_tensor,
            "scale": self.scale,
            "states": {k: s.values.detach().cpu().clone() for (k, s), keep in zip(entries, held) if keep},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the momentum states from what `state_dict` saved (its four keys, `state_keys`; another
        reducer's state or a misspelt key raises ValueError); the settings must match this object's.

        In place, so that a captured CUDA graph of a call goes on reading the live state: a key this reducer holds
        with the loaded shape has the loaded values copied into its tensors (kept on their device) and every row
        primed; a key it holds that the state lacks keeps its tensors with every row unprimed (its next call,
        eager or replayed, is a first call); a new key, or one of another shape, gets the loaded values as new
        tensors (a graph captured on a state of the old shape is one of another layout or group, whose eager call
        would refuse the state)."""
        check_state_keys(self, state, self.state_keys)
        for name in ("momentum", "per_tensor", "scale"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"adasum.AdaCons.load_state_dict: the state has {name}={state[name]!r}, this reducer has "
                    f"{getattr(self, name)!r}; build AdaCons({name}={state[name]!r}) to load it"
                )
        loaded = {k: v.detach() for k, v in state["states"].items()}
        for key, held in self._states.items():
            if key not in loaded:
                held.primed.fill_(False)
        for key, values in loaded.items():
            held = self._states.get(key)
            if held is not None and tuple(held.values.shape) == tuple(values.shape):
                held.values.copy_(values)
                held.primed.fill_(True)
            else:
                self._states[key] = _primed(values.clone().to(torch.float64))

    def __getstate__(self) -> dict[str, Any]:
        # the index tensors are the device's, made again on first use
        return {**self.__dict__, "_indices": DeviceIndices()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        states = state.get("_states")
        if states is not None and any(isinstance(v, torch.Tensor) for v in states.values()):
            # pickled by an earlier version, a plain tensor per key: every row primed
            for key, value in list(states.items()):
                if isinstance(value, torch.Tensor):
                    states[key] = _primed(value)
        self.__dict__.update(state)
        if "_indices" not in state:
            self._indices = DeviceIndices()

    def __repr__(self) -> str:
        return f"AdaCons(momentum={self.momentum}, per_tensor={self.per_tensor}, scale={self.scale!r})"
