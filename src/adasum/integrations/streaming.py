r"""Streaming DiLoCo's schedule (Douillard et al. 2025, arXiv 2501.18512): the parameters split into K fragments,
fragment k synced at step ``k H / K`` of each round of H inner steps, its combination running while the inner
steps go on, and its outer step applied `delay` inner steps later, mixed into the local weights::

    at step t with t mod H = offset_k:     s_k = x_k (snapshot);  start R(s_k - x_{0,k}) in the background
    at step t + delay:                     wait for it;  Delta_k = -R(...)
                                           x_{0,k} = outer.step(x_{0,k}; gradient Delta_k)
                                           x_k = (1 - a) x_k + a x_{0,k}        (a = mixing; 1: x_k = x_{0,k})

``offset_k = (k H) // K`` for k = 0 .. K - 1 (fragment 0 at the end of the round, as SlowMo syncs).
The combinations run one after another on one background thread, in the same order on every rank (they are
started at the same steps), each through a `adasum.integrations.delta.DeltaCombiner`; the layout check of each
runs on that thread just before its data, so every collective of the group is in one order. The inner steps wait
only at `delay`, and only when the combination has not finished by then. With ``mixing=1`` the ranks end every
synced fragment bitwise equal (the same x_{0,k}).

`fragment_bounds` (by size) and `sync_offsets` are the pure parts, used by the simulator too.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from adasum.checks.nonfinite import apply_nonfinite_policy
from adasum.integrations.delta import CombineFlat, DeltaCombiner, buckets

FRAGMENT_KEY = 2**20
"""Bucket keys of fragment k start at k * FRAGMENT_KEY (a compressed combine's residuals, one per bucket)."""


def make_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A process group of `group`'s ranks for the background combinations (None where nothing is combined: no
    process group, or one rank). Collective over the default group, as `torch.distributed.new_group` is."""
    if group is None and not dist.is_initialized():
        return None
    if dist.get_world_size(group) == 1:
        return group
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks)


def fragment_bounds(sizes: list[int], fragments: int) -> list[tuple[int, int]]:
    """`fragments` consecutive ranges ``(start, stop)`` of tensor indices, each at least one tensor, balanced by
    size: range k ends at the first tensor whose cumulative size reaches ``(k + 1) / fragments`` of the total.

    >>> fragment_bounds([4, 4, 4, 4], 2), fragment_bounds([10, 1, 1], 2)
    ([(0, 2), (2, 4)], [(0, 1), (1, 3)])
    """
    if not 1 <= fragments <= len(sizes):
        raise ValueError(f"fragments must be in [1, {len(sizes)}] (one tensor at least each), got {fragments}; pass "
                         "fewer fragments")
    total, bounds, start, seen = sum(sizes), [], 0, 0
    for k in range(fragments - 1):
        stop = start + 1
        seen += sizes[start]
        while stop < len(sizes) - (fragments - 1 - k) and seen < total * (k + 1) / fragments:
            seen += sizes[stop]
            stop += 1
        bounds.append((start, stop))
        start = stop
    bounds.append((start, len(sizes)))
    return bounds


def sync_offsets(local_steps: int, fragments: int) -> list[int]:
    """The step of each round (mod `local_steps`) at which fragment k starts its sync: ``(k H) // K``.

    >>> sync_offsets(12, 3)
    [0, 4, 8]
    """
    return [(k * local_steps) // fragments for k in range(fragments)]


@dataclass
class _InFlight:
    """A fragment's combination under way: due at inner step `due`, its pseudo-gradients filled by `future`."""

    due: int
    future: concurrent.futures.Future | None
    grads: dict[int, torch.Tensor] = field(default_factory=dict)


class Streaming:
    """The fragments, their snapshots and the background combinations of one `adasum.SlowMo` (module doc).

    Args:
        params: the parameters, in order.
        anchor: the round's start weights x_0, per parameter (SlowMo's).
        outer_params: the outer optimizer's parameters (float32/float64 copies of the anchor), per parameter.
        step_outer: steps the outer optimizer (the gradients of the fragment's outer parameters are set).
        reducer, group, bucket_cap_bytes: the combination (`adasum.integrations.delta.DeltaCombiner`).
        combine: a replacement of the reducer's call per bucket (compressed deltas), or None; its group must be
            `Streaming.group`'s (`make_group`).
        nonfinite: "raise": a NaN/Inf in a fragment on any rank raises `adasum.NonFiniteError` on every rank
            before it is combined (on the background thread; `finish` raises it); "propagate": no check.
        fragments, local_steps, delay, mixing: the schedule.

    The combinations run on their own process group (`make_group`, one per `Streaming`): the background thread's
    collectives never meet the foreground's (the user's, the next wrapper's checks) on one group.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        anchor: list[torch.Tensor],
        outer_params: list[torch.Tensor],
        step_outer: Callable[[], None],
        reducer: Any,
        group: dist.ProcessGroup | None,
        bucket_cap_bytes: int | None,
        combine: CombineFlat | None,
        nonfinite: str,
        *,
        fragments: int,
        local_steps: int,
        delay: int,
        mixing: float,
    ) -> None:
        self.params, self.anchor, self.outer_params = params, anchor, outer_params
        self.step_outer = step_outer
        self.combine_fn = combine
        self.nonfinite = nonfinite
        self.group = group
        self.delay, self.mixing, self.local_steps = delay, mixing, local_steps
        self.bounds = fragment_bounds([p.numel() for p in params], fragments)
        self.offsets = sync_offsets(local_steps, fragments)
        with torch.no_grad():
            self.snapshots = [[params[i].detach().clone() for i in range(a, b)] for a, b in self.bounds]
        self.combiners = [DeltaCombiner(reducer, group, bucket_cap_bytes) for _ in self.bounds]
        self.in_flight: dict[int, _InFlight] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def due_to_start(self, step: int) -> list[int]:
        """The fragments whose sync starts after inner step `step` (1-based)."""
        return [k for k, offset in enumerate(self.offsets) if step % self.local_steps == offset and step > 0]

    @torch.no_grad()
    def start(self, k: int, step: int, world: int) -> None:
        """Snapshot fragment k and start its combination (at once on one worker); due at `step` + delay."""
        a, b = self.bounds[k]
        torch._foreach_copy_(self.snapshots[k], [p.detach() for p in self.params[a:b]])
        flight = _InFlight(step + self.delay, None)
        if world == 1:  # the combination of one delta is itself
            for i, s in zip(range(a, b), self.snapshots[k]):
                flight.grads[i] = (self.anchor[i] - s).to(self.outer_params[i].dtype)
        else:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="adasum-streaming")
            flight.future = self._executor.submit(self._combine, k, flight)
        self.in_flight[k] = flight

    def _combine(self, k: int, flight: _InFlight) -> None:
        """On the background thread: the layout check, then x_0 - R(s_k - x_0) into `flight.grads`."""
        a, b = self.bounds[k]
        with torch.no_grad():
            combiner = self.combiners[k]
            combiner.check(self.snapshots[k], "adasum.SlowMo.step")  # the same dtypes and shapes on every rank
            if self.nonfinite == "raise":
                apply_nonfinite_policy(
                    "raise", self.snapshots[k], self.group, None, operation="adasum.SlowMo.step", what="parameter"
                )
            combiner.save(self.anchor[a:b])  # x_0 of the fragment, in the combiner's flat buckets
            cuts = buckets(self.snapshots[k], combiner.bucket_cap_bytes)

            def take(number: int, flat: torch.Tensor) -> None:
                sizes = [self.snapshots[k][j].numel() for j in cuts[number]]
                for j, delta in zip(cuts[number], flat.split(sizes)):
                    i = a + j
                    flight.grads[i] = delta.reshape(self.anchor[i].shape).to(self.outer_params[i].dtype).neg()

            combine = self.combine_fn
            if combine is not None:  # its per-bucket state (error feedback's residuals) keyed by fragment too
                inner = combine

                def combine(flat: torch.Tensor, sizes: list[int], number: int) -> None:
                    inner(flat, sizes, k * FRAGMENT_KEY + number)

            combiner.combine(self.snapshots[k], advance=False, combine=combine, apply=take)

    def finish_due(self, step: int) -> None:
        """Apply every fragment due at inner step `step` (or earlier)."""
        for k in sorted(k for k, f in self.in_flight.items() if f.due <= step):
            self.finish(k)

    @torch.no_grad()
    def finish(self, k: int) -> None:
        """Wait for fragment k's combination, take its outer step and mix it into the local weights."""
        flight = self.in_flight.pop(k)
        if flight.future is not None:
            flight.future.result()  # raises the combination's error (the same on every rank)
        a, b = self.bounds[k]
        for i in range(a, b):
            self.outer_params[i].grad = flight.grads[i]
        with torch.enable_grad():
            self.step_outer()
        for i in range(a, b):
            o, anchor, p = self.outer_params[i], self.anchor[i], self.params[i].detach()
            o.grad = None
            anchor.copy_(o)
            if self.mixing == 1.0:
                p.copy_(anchor)
            else:
                p.mul_(1.0 - self.mixing).add_(anchor, alpha=self.mixing)

    def finish_all(self) -> None:
        """Apply every fragment in flight now."""
        for k in sorted(self.in_flight):
            self.finish(k)

    def state_dict(self) -> dict[str, Any]:
        """The fragments in flight, their combinations waited for: ``{k: (due step, pseudo-gradients)}``."""
        out = {}
        for k, flight in self.in_flight.items():
            if flight.future is not None:
                flight.future.result()
            out[k] = (flight.due, dict(flight.grads))
        return {"in_flight": out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (no combination runs: they finished before the save)."""
        self.in_flight = {
            int(k): _InFlight(int(due), None, {int(i): g.clone() for i, g in grads.items()})
            for k, (due, grads) in state.get("in_flight", {}).items()
        }

    def close(self) -> None:
        """End the background thread (after the combinations under way)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
