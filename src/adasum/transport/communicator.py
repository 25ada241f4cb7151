"""What adasum keeps for each process group, and the one registry of process-wide state: a `Communicator` per group
(made on the group's first collective, `communicator`; dropped by `release`), the side streams per device
(`side_stream`), the movers' table (`adasum.transport.registry`) and the guards' counts (`next_guard`).

At interpreter exit the communicators' guards stop and their control groups are let go before the group facts'
handler drains gloo's threads and destroys gloo-only groups (`adasum.transport.groups`, whose module doc says why).
"""

from __future__ import annotations

import atexit
import functools
import operator
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from adasum.kernels import clear_device_caches
from adasum.options import user_stacklevel
from adasum.transport.graphs import MAX_GRAPHS, Graphs, tensor_key
from adasum.transport.groups import check_group, group_timeout, register_exit_handler

R = TypeVar("R")


MOVED_CALLS = 8
"""List calls in a row of one layout re-made at new addresses (each run eagerly) before a group's communicator warns
(`Communicator.run`): a repeated call replays its CUDA graph only where its tensors lie where they lay."""

RECENT = MAX_GRAPHS
"""Captured calls a group remembers for the replay's fast path (`Communicator.replay`), as many as the graphs it keeps:
a step that combines several lists (one per block or parameter group, say) or buckets replays each without the plan
look-up, whose host time grows with the number of tensors (docs/benchmarks.md, settings)."""


class Runnable(Protocol):
    """What `Communicator.run` executes: a call's plan (`adasum.collectives.api.Execution`, made by
    `Communicator.plan`). Its fields, decided once per layout and configuration: `entry` (the entry point and the
    options a repeat must match to take the fast path), `key` (the plan's part of its CUDA graphs' keys), `device`,
    `capturable` (the work never waits on the host, so a graph may hold it), `moves` (a list whose tensors the
    caller re-makes: `MOVED_CALLS` counts them), `exact` (a repeat must match shapes and strides, not only numbers of
    elements: a flat buffer's segments follow its element order), `check` (the per-call cross-rank check around a
    replay, or None) and ``execute(tensors)`` (the eager work)."""

    entry: Hashable
    key: Hashable
    device: torch.device
    capturable: bool
    moves: bool
    exact: bool
    check: Callable[[Callable[[], None]], None] | None

    def execute(self, tensors: Sequence[torch.Tensor]) -> None:
        """Combine `tensors` as planned (eagerly, or into a capture)."""


# the per-tensor reads of the replay's fast path, as C-level callables for `map`
_data_ptr, _stride, _numel = torch.Tensor.data_ptr, torch.Tensor.stride, torch.Tensor.numel
_dtype, _shape, _requires_grad = (operator.attrgetter(a) for a in ("dtype", "shape", "requires_grad"))
_alive = weakref.ref.__call__


@dataclass(frozen=True)
class Recent:
    """One of the group's recent captured calls: a repeat of its entry on tensors at the same addresses with the same
    sizes replays its graph without the plan look-up (its checks passed at capture). The tensors are held weakly: a
    caller that drops them (``zero_grad(set_to_none=True)``) frees their memory, and the caching allocator may place
    the next ones there."""

    entry: Hashable
    tensors: tuple  # weak references
    pointers: tuple
    sizes: tuple  # numbers of elements
    shapes: tuple
    dtypes: tuple
    strides: tuple
    graph: tuple  # its graph's `adasum.transport.graphs.Graphs.handle`
    check: Callable[[Callable[[], None]], None] | None
    exact: bool

    @classmethod
    def of(cls, entry: Hashable, tensors: Sequence[torch.Tensor], graph: tuple,
           check: Callable[[Callable[[], None]], None] | None = None, exact: bool = False) -> Recent:
        """The record of a captured call of `entry` on `tensors` (checked, at least one)."""
        return cls(
            entry, tuple(map(weakref.ref, tensors)), tuple(map(_data_ptr, tensors)), tuple(map(_numel, tensors)),
            tuple(map(_shape, tensors)), tuple(map(_dtype, tensors)), tuple(map(_stride, tensors)),
            graph, check, exact,
        )

    @property
    def key(self) -> tuple[int, int]:
        """What finds it among the group's recent calls: its number of tensors and the first one's address (a
        repeat's own key: ``(len(tensors), tensors[0].data_ptr())``)."""
        return len(self.pointers), self.pointers[0]


def _placed_like(tensors: Sequence[torch.Tensor], last: Recent) -> bool:
    """Whether tensors at the addresses of the call `last`'s (new gradients that the caching allocator placed where
    the last ones were, or the same objects where the layout is exact) are what its graph was captured on: the same
    dtypes, shapes and strides, so the same memory, which that call found disjoint and its checks passed on (the
    dtypes floating, the layouts strided; equal addresses put them on its device: CUDA addresses are unified), and,
    where autograd records, none that requires grad (the checked path's own refusal of a leaf an in-place write would
    fail on)."""
    if tuple(map(_dtype, tensors)) != last.dtypes or tuple(map(_shape, tensors)) != last.shapes:
        return False
    if tuple(map(_stride, tensors)) != last.strides:
        return False
    return not (torch.is_grad_enabled() and any(map(_requires_grad, tensors)))


class Workspace:
    """Reusable host buffers of one group's collectives. Large fresh CPU allocations are returned to the OS on
    free and page-fault anew on every call (about as slow as the data exchange itself), so the CPU path keeps
    its fusion and receive buffers; CUDA's caching allocator already does this on GPUs. One per group: two
    threads that drive two groups never share one."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer of `numel` elements like `like` for `name` (kept and reused on the CPU, fresh on GPUs)."""
        if like.device.type != "cpu":
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        key = (name, like.dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype)
            self._buffers[key] = buf
        return buf[:numel]


class Communicator:
    """Everything adasum keeps for one process group, made on the group's first collective
    (`communicator`) and dropped by `release`: the transports (built once per name), the checks'
    control group, the plans per layout (`adasum.checks.plan`, each with the executions its entry points
    planned on it: `plan`), the captured CUDA graphs and their one capture point (`capture`, which `run` calls),
    the recent captured calls (`replay`), the resources by owner (`resource`: the symmetric memory,
    `adasum.transport.symmetric.SymmetricPool`),
    the tile addresses of lists the kernels read in place (`adasum.kernels.addresses.AddressTables`, made on first
    use), the CPU workspaces, and the guard thread of the deferred checks (stopped by `clear`).

    Every entry point that combines (`adasum.all_reduce`, a reducer's `all_reduce`, `all_reduce_flat` and
    `all_reduce_shards`, the DDP hook's batch, the delta combiner's bucket for `adasum.DistributedOptimizer` and
    `adasum.SlowMo`) takes one road: ``replay(entry, tensors)`` (a repeat of a recent captured call: its graph
    launched, nothing else), else ``run(plan(entry, tensors, op, topology, ...), tensors)``.

    Calls on one group must come from one thread at a time (as torch.distributed's own collectives
    must: their order pairs them across ranks); different groups may run on different threads.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.transports: dict[Hashable, Any] = {}
        self.control: dist.ProcessGroup | None = None
        self.plans: dict[Hashable, Any] = {}
        self.plans_built = 0
        self.graphs = Graphs()
        # per-group resources by owner (`resource`): the symmetric transports' `SymmetricPool`, say
        self.resources: dict[type, Any] = {}
        self._tiles: Any = None  # `tiles`, made on first use (the GPU kernels' lists)
        self.workspace = Workspace()
        # the recent captured calls (`Recent`), by (number of tensors, first tensor's address): their replays skip
        # the plan look-up (`replay`)
        self.recent: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self.guard: Any = None  # the thread that compares deferred checks (`adasum.checks.guard`)
        self.one_rank_warned = False  # a group of one rank was warned for (`adasum.transport.alone`)
        # the last list call's plan, a weak reference to its first tensor, and how many list calls in a row of that
        # plan ran eagerly on tensors re-made at new addresses (`capture`, `_note_moves`)
        self._moves: tuple[Hashable, Any, int] = (None, None, 0)

    @property
    def tiles(self) -> Any:
        """The group's tile addresses of lists the kernels read in place (`adasum.kernels.addresses.AddressTables`),
        made on first use."""
        if self._tiles is None:
            from adasum.kernels.addresses import AddressTables  # GPU kernels' tables: not on a CPU call's path

            self._tiles = AddressTables()
        return self._tiles

    def resource(self, owner: type[R], make: Callable[[], R]) -> R:
        """The group's resource of class `owner` (memory that several of its transports share), made once
        (``make()``); `clear` calls its ``release()`` (after the captured graphs, which may point into it). One
        whose ``held()`` is above 0 holds memory another group's graphs may point into (`release`)."""
        found = self.resources.get(owner)
        if found is None:
            found = self.resources[owner] = make()
        return cast(R, found)

    def holds_shared(self) -> bool:
        """Whether a resource of this group holds memory (``held() > 0``) that other groups' graphs may point into
        (hierarchical mode's node groups run the node group's mover inside the outer call)."""
        return any(getattr(r, "held", lambda: 0)() > 0 for r in self.resources.values())

    def transport(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The transport of `key`, built once (`build()`) for this group."""
        found = self.transports.get(key)
        if found is None:
            found = self.transports[key] = build()
        return found

    def plan(self, entry: Hashable, tensors: Sequence[torch.Tensor], op: Any, topology: Any = None,
             **how: Any) -> Runnable:
        """The plan of a call of `entry` on `tensors` (a list, or ``[buffer]`` with ``sizes=`` its segments), combined
        by `op` over `topology` (a placement, `adasum.transport.topology.Topology`, or None: the whole group): the
        checks' verdict for this call, then what was decided once for its layout and configuration (the schedule,
        the mover per dtype, the fusion, the graph key). The planner is the collectives layer's
        (`adasum.collectives.api.plan_call`, which documents `op` and `how`), registered when it is imported: the
        checks and schedules it reads lie above this layer."""
        planner = _registry.planner
        if planner is None:  # the collectives are imported with `adasum`; a bare transport import plans nothing
            raise RuntimeError("Communicator.plan: import adasum (its collectives register the planner)")
        return cast(Runnable, planner(self, entry, tensors, op, topology, **how))

    def run(self, plan: Runnable, tensors: Sequence[torch.Tensor]) -> None:
        """Execute `plan` (`plan`) on `tensors`: the one capture-and-replay point of every entry point. Eagerly where
        it is not capturable or graphs are off (the CPU); else through `capture` (eager on the tensors' first sight,
        captured on the second, replayed from then on), and a captured call is remembered for `replay`'s fast path
        (`RECENT` of them)."""
        if not plan.capturable or not self.graphs.backend.enabled(plan.device):
            plan.execute(tensors)
            return
        key = self.capture(plan.key, tensor_key(tensors), functools.partial(plan.execute, tensors), plan.device,
                           first=tensors[0] if plan.moves and tensors else None)
        handle = self.graphs.handle(key)
        if handle is not None and tensors:
            self.remember(Recent.of(plan.entry, tensors, handle, plan.check, plan.exact))

    def replay(self, entry: Hashable, tensors: Any, check: bool = False) -> bool:
        """`run`'s fast path: where `tensors` (the caller's argument, unchecked: a tensor, or a list or tuple of a
        recent captured call's tensors or of others placed like them) repeat a recent captured call of `entry`,
        launch its graph (with `check`, inside the call's cross-rank check: `Recent.check`) and return True; else
        False, and the caller plans and runs the call.

        Host time is what the GPU waits for between calls: C-level maps, not a Python loop, and numbers of elements
        rather than shapes for a recent call's own tensors (a shape is a new torch.Size per tensor; docs/benchmarks.md,
        where the time goes) unless its layout is exact; the addresses first for other objects, which most often
        differ (`_placed_like` after them). The graph reads and writes each tensor as the elements from its address
        on, so that call's tensors replay it wherever their addresses and sizes are the same."""
        if not self.recent:
            return False
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        elif type(tensors) not in (list, tuple) or not tensors or not isinstance(tensors[0], torch.Tensor):
            return False
        last = self.recent.get((len(tensors), _data_ptr(tensors[0])))  # a recent call's `Recent.key`
        if last is None or last.entry != entry:
            return False
        same = all(map(operator.is_, map(_alive, last.tensors), tensors))
        try:
            if tuple(map(_data_ptr, tensors)) != last.pointers:
                return False
            if same and not last.exact:
                if tuple(map(_numel, tensors)) != last.sizes:
                    return False
            elif not _placed_like(tensors, last):
                return False
        except (TypeError, RuntimeError):  # not a tensor, or one without storage or strides (sparse): the checked path
            return False
        graphs = self.graphs
        if not graphs.replayable(last.graph):  # before the check: the checked path that follows checks the call itself
            return False
        if check and last.check is not None:
            last.check(functools.partial(graphs.launch, last.graph))
        else:
            graphs.launch(last.graph)
        return True

    def remember(self, last: Recent) -> None:
        """Keep `last` among the recent captured calls (`RECENT`), by its `Recent.key`."""
        self.recent[last.key] = last
        self.recent.move_to_end(last.key)
        while len(self.recent) > RECENT:
            self.recent.popitem(last=False)

    def capture(
        self, plan: Hashable, where: Hashable, fn: Callable[[], None], device: torch.device,
        first: torch.Tensor | None = None,
    ) -> Hashable:
        """`fn()` eagerly, captured into a CUDA graph, or replayed (`adasum.transport.graphs`): the package's one
        capture point (`run` and the schedules' own runs call it). `plan` names the call's layout and configuration
        (a plan's key, or the schedule's), `where` the tensors (`adasum.transport.graphs.tensor_key`). A call made
        while another runs (the schedule inside a captured list call or hook) runs eagerly into it. `first`: a list
        call's first tensor, for the warning on tensors re-made at new addresses (`_note_moves`). Returns the graph's
        key."""
        key = (plan, where)
        first_sight = self.graphs.run(key, fn, device)
        if first is not None:
            self._note_moves(plan, first, first_sight)
        return key

    def _note_moves(self, plan: Hashable, first: torch.Tensor, first_sight: bool) -> None:
        """Count a list call on tensors whose first is `first` where it ran eagerly as a first sighting
        (`first_sight`) of the last list call's `plan` at new addresses while that call's tensors are gone
        (re-made, as gradients after ``zero_grad()``; other live lists of one layout, as per-block calls, do not
        count), and warn once `MOVED_CALLS` such calls come in a row: a graph replays only where its tensors lay."""
        last_plan, last_first, count = self._moves
        moved = first_sight and plan == last_plan and last_first is not None and last_first() is None
        self._moves = (plan, weakref.ref(first), count + 1 if moved else 0)
        if moved and count + 1 == MOVED_CALLS:
            warnings.warn(
                f"adasum: {MOVED_CALLS} calls in a row of the same layout found its tensors re-made at new addresses, "
                "so each ran eagerly, with its full host work, rather than replaying a captured CUDA graph; pass the "
                "same tensors every call (optimizer.zero_grad(set_to_none=False) keeps gradients where they lie), or "
                "combine through adasum.DistributedOptimizer or the DDP hook, which keep their own buffers",
                RuntimeWarning, stacklevel=user_stacklevel(),
            )

    def retire_graphs(self) -> None:
        """Drop the graphs captured so far (`adasum.transport.graphs.Graphs.clear`: every key starts again from an
        eager call), and the recent list calls': a symmetric buffer they may load and store at was outgrown, and the
        device has drained (`retire_graphs`)."""
        self.graphs.clear()
        self.recent.clear()

    def control_group(self) -> dist.ProcessGroup | None:
        """See `control_group`."""
        if self.group is not None and self.group is not dist.GroupMember.WORLD:
            return self.group
        if self.control is None:
            self.control = dist.new_group(timeout=group_timeout(None), backend="gloo")
        return self.control

    def clear(self) -> BaseException | None:
        """Drop everything, and destroy the control group this communicator made (local but for the guard's fence,
        `adasum.checks.guard.Guard.stop`). Returns the guard's fatal divergence that no call raised, if any."""
        undelivered = None
        if self.control is not None and dist.is_initialized():
            _registry.destroy(self.control)
        self.graphs.clear()  # first: a captured graph loads and stores at the symmetric buffers' addresses
        for resource in self.resources.values():
            resource.release()
        self.resources.clear()
        if self._tiles is not None:
            self._tiles.clear()
        self.transports.clear()
        self.plans.clear()
        if self.guard is not None:
            undelivered = self.guard.stop()
            self.guard = None
        self.recent.clear()
        self.control = None
        return undelivered


class _Registry:
    """The transport layer's process-wide mutable state: communicators by process group, side streams by device,
    the transports' table by name (`adasum.transport.registry.register_transport`), the planner
    (`register_planner`), how many guard threads each group name had (`adasum.checks.guard`; never emptied), the
    caches objects keep for the groups (`emptied_by_release`), and whether the teardown hook is in place.
    `release` empties the first two and the caches. (The reducers' names are the reducers' own:
    `adasum.reducers.base`.)"""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.communicators: dict[dist.ProcessGroup, Communicator] = {}
        self.streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self.reducers: dict[str, type] = {}
        self.transports: dict[str, Any] = {}  # the movers' table by name (`adasum.transport.registry`)
        self.planner: Callable[..., Any] | None = None  # `Communicator.plan`'s (`register_planner`)
        self.guards_made: dict[str, int] = {}
        # the caches `release` empties besides the communicators' (`adasum.transport.caches.Released`), by id
        self.caches: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.exit_handler = False
        self.teardown_hook = False
        self.destroy = dist.destroy_process_group  # torch's own, also once the teardown hook wraps it


_registry = _Registry()


def emptied_by_release(cache: Any) -> None:
    """Have `release` (of every group) empty `cache` (``cache.clear()``), held weakly: what an object that outlives
    the groups keeps for them (`adasum.transport.caches.Released`)."""
    with _registry.lock:
        _registry.caches[id(cache)] = cache


def register_planner(planner: Callable[..., Any]) -> None:
    """Make `planner` the one `Communicator.plan` calls (``planner(comm, entry, tensors, op, topology, **how)``): the
    collectives layer's, `adasum.collectives.api.plan_call`, registered when that module is imported."""
    _registry.planner = planner


def next_guard(name: str) -> int:
    """The number of the next guard thread of the group named `name` in this process (0, 1, ...): a group's next
    guard (after `adasum.release`) rendezvouses on a fresh store prefix, never on the keys of the one before."""
    with _registry.lock:
        made = _registry.guards_made[name] = _registry.guards_made.get(name, -1) + 1
    return made


def retire_graphs() -> None:
    """Every group's `Communicator.retire_graphs`: a symmetric buffer was outgrown, and a graph of one group may
    point into another's buffers (the two tiers' outer call runs the node group's mover). Retiring is local and
    only costs a capture again; it never makes a rank's launches differ from its peers'."""
    with _registry.lock:
        comms = list(_registry.communicators.values())
    for comm in comms:
        comm.retire_graphs()


def _resolved(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def communicator(group: dist.ProcessGroup | None = None) -> Communicator:
    """The communicator of `group` (None: the default group), made on first use (thread-safe)."""
    pg = _resolved(group)
    found = _registry.communicators.get(pg)
    if found is not None:
        return found
    with _registry.lock:
        found = _registry.communicators.get(pg)
        if found is None:
            _install_teardown_hook()
            _register_exit_handler()
            default = pg is dist.distributed_c10d._get_default_group()
            found = _registry.communicators[pg] = Communicator(None if default else pg)
        return found


def release(group: dist.ProcessGroup | None = None) -> None:
    """Drop what adasum keeps for process groups: captured CUDA graphs, then the groups' resources (symmetric
    buffers), then transports, control groups, plans, tile addresses, workspaces, side streams, the caches that
    objects keep for the groups (AdaCons' momentum per layout: `adasum.transport.caches.Released`), the device tensors
    of the process's caches (tile tables and the kernels' index tensors: `adasum.kernels.clear_device_caches`), and
    the guard threads of deferred checks (each first compares what it was given with its peers', which gave it the
    same).
    Otherwise local (no collective). With a `group`, only that group's communicator goes; if it holds
    symmetric memory, every group's captured graphs go first (a graph of one group may point into another's
    buffers: hierarchical mode's node groups).

    With deferred checks (`adasum.checks.plan`) each guard first compares what was posted and the number of
    calls with its peers' (they do the same in their own release, or barrier): a divergence that no call raised yet
    (found within the last `adasum.checks.guard.LAG` calls, or ranks that made different numbers of calls) is
    raised as its ValueError on every rank, once everything is dropped. A call of another thread still waiting for
    a guard's verdict raises RuntimeError.

    For teardown: ``torch.distributed.destroy_process_group`` calls it first (once adasum has worked on
    a group). Collectives after a full release are not supported on GPUs: a benchmark that released
    between two models and went on training hung in the second model's first steps.

    A `group` that is not a process group (nor None) raises TypeError.

    >>> adasum.release()  # doctest: +SKIP

    On one process (a group of one rank):

    >>> import torch.distributed as dist
    >>> from adasum.transport.communicator import communicator
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> adasum.all_reduce([torch.ones(2)])
    >>> kept = communicator()                  # what adasum keeps for the default group
    >>> adasum.release()
    >>> communicator() is kept                 # dropped: the next use makes a new one
    False
    >>> dist.destroy_process_group()
    """
    check_group(group, "adasum.release")
    with _registry.lock:
        if group is not None:
            found = _registry.communicators.pop(_resolved(group), None)
            if found is None:
                return
            shared = found.holds_shared()
            others = list(_registry.communicators.values()) if shared else []
            _synchronize_if(found.graphs.count() > 0 or any(c.graphs.count() for c in others))
            for comm in others:
                comm.graphs.clear()
            undelivered = found.clear()
        else:
            comms = list(_registry.communicators.values())
            _synchronize_if(any(c.graphs.count() for c in comms))
            for comm in comms:  # every graph before any buffer (a graph may point into another group's buffers)
                comm.graphs.clear()
            kept = [comm.clear() for comm in comms]
            undelivered = next((error for error in kept if error is not None), None)
            _registry.communicators.clear()
            _registry.streams.clear()
            for cache in list(_registry.caches.values()):  # AdaCons' momentum per layout, say
                cache.clear()
            clear_device_caches()  # the tile tables and the kernels' small index tensors, kept per device
    if undelivered is not None:
        raise undelivered


def held() -> dict[str, int]:
    """How many communicators (one per process group adasum worked on) and side streams the process holds now:
    what a full `release` drops (local, no collective; for leak checks)."""
    with _registry.lock:
        return {"communicators": len(_registry.communicators), "streams": len(_registry.streams)}


def _synchronize_if(graphs_alive: bool) -> None:
    if graphs_alive and torch.cuda.is_available():
        torch.cuda.synchronize()


def _install_teardown_hook() -> None:
    """Make ``torch.distributed.destroy_process_group`` call `release` first (a process hung in
    ``destroy_process_group`` with a captured graph alive; the group is destroyed even where `release` raises a
    divergence its guard found), and ``torch.distributed.barrier`` fence the group's guard first
    (`adasum.checks.guard.Guard.fence`: a divergence no call raised yet is raised before the barrier)."""
    if _registry.teardown_hook:
        return
    _registry.teardown_hook = True
    original = _registry.destroy = dist.destroy_process_group
    barrier = dist.barrier

    def destroy_process_group(group=None, *args, **kwargs):
        try:
            release(group)
        finally:
            original(group, *args, **kwargs)

    @functools.wraps(barrier)  # torch's name, signature and documentation
    def fenced_barrier(group=None, *args, **kwargs):
        if dist.is_initialized() and (group is None or isinstance(group, dist.ProcessGroup)):
            found = _registry.communicators.get(_resolved(group))
            guard = found.guard if found is not None else None
            if guard is not None:
                guard.fence()
        return barrier(group, *args, **kwargs)

    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
    dist.barrier = fenced_barrier
    dist.distributed_c10d.barrier = fenced_barrier


def _let_go_at_exit() -> None:
    """At interpreter exit (module doc), before the group facts' handler: stop the guards of deferred checks and
    let go of the control groups (no reference of ours keeps a group, and its threads, alive)."""
    with _registry.lock:
        for comm in _registry.communicators.values():
            if comm.guard is not None:
                guard = comm.guard
                undelivered = guard.stop(guard.EXIT_FENCE_S)  # its gloo group is gone with its thread
                comm.guard = None
                if guard.alive():
                    undelivered = RuntimeError(
                        f"the deferred layout check could not compare the last calls with every peer within "
                        f"{guard.EXIT_FENCE_S:g} s (a peer gone, stalled or still running)"
                    )
                if undelivered is not None:  # one write: a whole line beside the other ranks' under torchrun
                    sys.stderr.write(f"adasum: at exit: {undelivered}\n")
                    sys.stderr.flush()
            comm.control = None


@functools.cache
def _register_exit_handler() -> None:
    register_exit_handler()  # first: atexit runs the last registered first, so this one's handler runs after ours
    atexit.register(_let_go_at_exit)


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """One CUDA stream per device and `purpose`, made on first use: "comm" for collectives that overlap the
    compute stream (the DDP hook, `DistributedOptimizer`), "fsdp" for `adasum.fsdp`'s reductions, "copies" for
    the symmetric transport's staging copies (which overlap its own kernels, on whatever stream those run),
    "pushes" for the in-place mover's stores of results into its peers, "signals" for its barriers, "stores" for
    the slice mover's stores of the next round beside the current round's math (`adasum.transport.symmetric`).
    "stores" has the high priority: a copy kernel beside a kernel bound by local memory overlaps it only when its
    blocks are scheduled first."""
    key = (torch.device(device), purpose)
    stream = _registry.streams.get(key)
    if stream is None:
        priority = -1 if purpose == "stores" else 0  # lower is higher (out of range: the nearest valid one)
        stream = _registry.streams[key] = torch.cuda.Stream(key[0], priority=priority)
    return stream


def control_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The group the small cross-rank checks (layouts, parameter checksums) run on: for the default
    group, a gloo group over all ranks, created on first use (every rank checks there, so every rank
    creates it at the same point) and kept by the group's `Communicator`; for any other group, that
    group itself.

    The checks never share the default group with the data they guard: when ranks' control flow
    diverges (one rank checks a new parameter group while its peer already combines gradients), a
    check paired with a data collective of another size aborts the process inside gloo (SIGABRT);
    on their own group both simply wait, and fail within the timeout with a `CollectiveError`.
    Sub-groups keep their checks on themselves: a group made lazily by some ranks only
    (``use_local_synchronization``) deadlocked when ranks had made different numbers of groups.
    """
    return communicator(group).control_group()
