r"""The statistics a combination computes anyway, kept to be read: Adasum's coefficients, the workers'
orthogonality and AdaCons' consensus weights, at no extra communication.

At every level of Adasum's tree and for every pair it combines, the collectives add up the per-tensor
float64 sums ``<a,b>``, ``|a|^2``, ``|b|^2`` over the group (one small all-reduce per level), so every
rank holds the same sums; AdaCons computes its consensus weights on every rank from gathered sums. While a
`recording` is open, each such result is recorded as it is: a reference to the tensor, with no copy, no
kernel and no host synchronisation. The single-process forms (`adasum.reduce`, `AdaCons.reduce`, hence
the simulator) record the same quantities at the same places. `summarize` turns the records into numbers
when they are read (on a GPU that waits for the device, once, at reading time).

What `summarize` reports, over every tensor of every recorded level, pair and call:

* ``coefficient_min``, ``coefficient_max``: the range of the coefficients Adasum applied,
  ``c_a = 1 - w_a <a,b> / |a|^2`` and ``c_b = 1 - w_b <a,b> / |b|^2`` (``w_a = n_a / (n_a + n_b)``,
  `adasum.core.operator`), over the sides with a nonzero vector. With equal worker counts, 1 means the
  pair was orthogonal (summed), 1/2 parallel and equal (averaged); values above 1 come from opposed
  vectors.
* ``orthogonality``: the orthogonality diagnostic ``O = sum_i |g_i|^2 / |sum_i g_i|^2``
  (`adasum.diagnostics`) of the pairs of single workers the tree combines (its first level: the fold
  where the group is not a power of two, else the pairs ``(2i, 2i+1)``), pooled over tensors and pairs:
  ``sum (|a|^2 + |b|^2) / sum (|a|^2 + |b|^2 + 2 <a,b>)``. 1 for orthogonal gradients, 1/2 for equal
  ones; for two workers it is exactly ``adasum.all_reduce_orthogonality(...).model``.
* ``cosine_abs_mean``: the mean of ``|<a,b>| / (|a| |b|)`` over the pairs of every level and every
  tensor where both sides are nonzero: 0 when every pair was orthogonal, 1 when every pair was parallel.
* ``consensus_weight_min``, ``consensus_weight_max``, ``consensus_weights``: AdaCons' normalized
  coefficients ``c_i`` (summing to 1 over the workers, `adasum.reducers.adacons`): their range, and each
  worker's mean over the segments (one segment for the whole model, the default).

A key is present only where something was recorded for it (Adasum's keys for Adasum, AdaCons' for
AdaCons; nothing for Sum and Mean). A NaN or Inf in the combined tensors makes the values NaN.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from adasum.core.operator import ZERO_NORM, coefficients


@dataclass(frozen=True)
class LevelSums:
    """One level of Adasum's tree as every rank of the group holds it after the level's all-reduce:
    `sums` is ``[pairs, 3, T]`` float64 (``<a,b>``, ``|a|^2``, ``|b|^2`` per pair and tensor), `workers`
    the worker counts (side a, side b) of each pair."""

    sums: torch.Tensor
    workers: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ConsensusWeights:
    """AdaCons' normalized coefficients of one call: ``[S, N]`` float64, S segments by N workers."""

    weights: torch.Tensor


Record = LevelSums | ConsensusWeights

_OPEN: ContextVar[tuple[list[Record], ...]] = ContextVar("adasum_statistics_recordings", default=())
_PER_PEER: ContextVar[int] = ContextVar("adasum_statistics_workers_per_peer", default=1)


@contextmanager
def recording() -> Iterator[list[Record]]:
    """Collect the records of the combinations run inside the block (in this thread), in a list.

    A CUDA graph replayed inside the block runs no Python and records nothing: the DDP hook and
    `adasum.DistributedOptimizer` keep the records of each call across replays (`StepStatistics`).

    >>> with recording() as records:
    ...     _ = adasum.reduce([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])])
    >>> summarize(records)["orthogonality"]
    1.0
    """
    records: list[Record] = []
    token = _OPEN.set((*_OPEN.get(), records))
    try:
        yield records
    finally:
        _OPEN.reset(token)


def active() -> bool:
    """Whether a `recording` is open (the collectives record only then)."""
    return bool(_OPEN.get())


def record(item: Record) -> None:
    """Add `item` to every open `recording` (nothing when none is open)."""
    for records in _OPEN.get():
        records.append(item)


def record_level(sums: torch.Tensor, workers: Sequence[tuple[int, int]]) -> None:
    """Record one level's summed ``[pairs, 3, T]`` sums and its pairs' worker counts (callers check `active`),
    counted in workers of the whole tree (`workers_per_peer`)."""
    per_peer = _PER_PEER.get()
    record(LevelSums(sums, tuple((int(a) * per_peer, int(b) * per_peer) for a, b in workers)))


@contextmanager
def workers_per_peer(count: int) -> Iterator[None]:
    """Inside the block, each worker of the trees recorded stands for `count` workers: the levels across hosts
    of the two-tier schedule, whose peers hold the subtrees of a host's `count` ranks."""
    token = _PER_PEER.set(_PER_PEER.get() * count)
    try:
        yield
    finally:
        _PER_PEER.reset(token)


def _adasum_values(levels: Sequence[LevelSums]) -> dict[str, float]:
    coefficient_min, coefficient_max = float("inf"), float("-inf")
    pooled = torch.zeros(2, dtype=torch.float64)  # sum (|a|^2 + |b|^2), sum |a + b|^2 over single-worker pairs
    cosine_sum, cosine_count = 0.0, 0
    finite = True
    for level in levels:
        sums = level.sums.detach().to("cpu", torch.float64)
        finite = finite and bool(torch.isfinite(sums).all())
        counts = torch.tensor(level.workers, dtype=torch.float64).reshape(-1, 2, 1)  # [pairs, 2, 1]
        total = counts.sum(1)
        coeff_a, coeff_b = coefficients(sums.transpose(0, 1), counts[:, 0] / total, counts[:, 1] / total)
        dot, norm_a, norm_b = sums.unbind(1)
        nonzero_a, nonzero_b = norm_a >= ZERO_NORM, norm_b >= ZERO_NORM
        applied = torch.cat([coeff_a[nonzero_a], coeff_b[nonzero_b]])
        if applied.numel():
            coefficient_min = min(coefficient_min, float(applied.min()))
            coefficient_max = max(coefficient_max, float(applied.max()))
        both = nonzero_a & nonzero_b
        cosine = dot[both].abs() / (norm_a[both] * norm_b[both]).sqrt()
        cosine_sum += float(cosine.sum())
        cosine_count += cosine.numel()
        single = (counts[:, 0, 0] == 1) & (counts[:, 1, 0] == 1)
        squares = (norm_a + norm_b)[single]
        pooled += torch.stack([squares.sum(), (squares + 2 * dot[single]).sum()])
    out: dict[str, float] = {}
    if coefficient_min <= coefficient_max:
        out.update(coefficient_min=coefficient_min, coefficient_max=coefficient_max)
    if bool((pooled != 0).any()):
        out["orthogonality"] = float(pooled[0] / pooled[1])
    if cosine_count:
        out["cosine_abs_mean"] = cosine_sum / cosine_count
    if not finite:  # a NaN or Inf was combined: no comparison above saw it
        out = dict.fromkeys(("coefficient_min", "coefficient_max", "orthogonality", "cosine_abs_mean"), math.nan)
    return out


def _consensus_values(calls: Sequence[ConsensusWeights]) -> dict[str, float | list[float]]:
    weights = [c.weights.detach().to("cpu", torch.float64) for c in calls]
    workers = {w.shape[-1] for w in weights}
    every = torch.cat([w.reshape(-1) for w in weights])  # torch's min and max keep a NaN
    out: dict[str, float | list[float]] = {
        "consensus_weight_min": float(every.min()),
        "consensus_weight_max": float(every.max()),
    }
    if len(workers) == 1:  # the same workers in every call (always, but for records of several groups)
        out["consensus_weights"] = torch.cat(weights).mean(0).tolist()
    return out


def summarize(records: Sequence[Record]) -> dict[str, float | list[float]]:
    """The numbers of the module doc from `records` (one call's, or a step's calls' together)."""
    devices = {r.sums.device if isinstance(r, LevelSums) else r.weights.device for r in records}
    for device in devices:
        if device.type == "cuda":  # recorded on the collectives' side stream: wait for it, once
            torch.cuda.synchronize(device)
    levels = [r for r in records if isinstance(r, LevelSums)]
    calls = [r for r in records if isinstance(r, ConsensusWeights)]
    out: dict[str, float | list[float]] = {}
    if levels:
        out.update(_adasum_values(levels))
    if calls:
        out.update(_consensus_values(calls))
    return out


def _snapshot(record: Record) -> Record:
    if isinstance(record, LevelSums):
        return LevelSums(record.sums.clone(), record.workers)
    return ConsensusWeights(record.weights.clone())


class StepStatistics:
    """The records of an owner's last step (the DDP hook's state, `adasum.DistributedOptimizer`,
    `adasum.SlowMo`), call by call.

    Each combination runs inside ``call(key, device)``, `key` naming what the call's launches depend on
    (its CUDA graph, where one is captured: the same buffers and layout); ``finish_step()`` closes a step.
    A call whose Python did not run (a replayed CUDA graph) keeps the records of the key's last run: the
    replay rewrote those very tensors. On a GPU each call's records are copied on the call's stream (a
    few float64 values per level), so that a later replay of the same graph within the step does not
    overwrite them; nothing waits for the device until `summary` reads them.
    """

    def __init__(self) -> None:
        self._by_key: dict[Hashable, list[Record]] = {}
        self._keys: list[Hashable] = []  # the current step's calls
        self._step: list[Record] = []
        self._last: list[Record] = []
        self.steps = 0

    @contextmanager
    def call(self, key: Hashable, device: torch.device) -> Iterator[None]:
        """Record the combination run inside the block as one call of the current step."""
        with recording() as records:
            yield
        if records:
            self._by_key[key] = records
        self._keys.append(key)
        kept = self._by_key.get(key, [])
        self._step.extend([_snapshot(r) for r in kept] if device.type == "cuda" else kept)

    def finish_step(self) -> None:
        """The calls since the last `finish_step` are the last step's."""
        self._last, self._step = self._step, []
        self._by_key = {k: self._by_key[k] for k in self._keys if k in self._by_key}  # forget calls gone
        self._keys = []
        self.steps += 1

    def discard_step(self) -> None:
        """Forget the calls of an unfinished step (a backward pass that stopped)."""
        self._step, self._keys = [], []

    def summary(self) -> dict[str, float | list[float]]:
        """`summarize` of the last step's records."""
        return summarize(self._last)
