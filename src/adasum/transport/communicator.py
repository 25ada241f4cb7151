"""What adasum keeps for each process group, and the one registry of process-wide state: a `Communicator` per group
(made on the group's first collective, `communicator`; dropped by `release`), the side streams per device
(`side_stream`), the movers' table (`adasum.transport.registry`) and the guards' counts (`next_guard`).

At interpreter exit the communicators' guards stop and their control groups are let go before the group facts'
handler drains gloo's threads and destroys gloo-only groups (`adasum.transport.groups`, whose module doc says why).
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from adasum.kernels import clear_device_caches
from adasum.kernels.addresses import AddressTables
from adasum.options import user_stacklevel
from adasum.transport.graphs import Graphs
from adasum.transport.groups import check_group, group_timeout, register_exit_handler

R = TypeVar("R")


MOVED_CALLS = 8
"""List calls in a row of one layout re-made at new addresses (each run eagerly) before a group's communicator warns
(`Communicator.run`): a repeated call replays its CUDA graph only where its tensors lie where they lay."""


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
    control group, the plans per layout (`adasum.checks.plan`), the captured CUDA graphs and
    their one capture point (`run`), the resources by owner (`resource`: the symmetric memory,
    `adasum.transport.symmetric.SymmetricPool`),
    the tile addresses of lists the kernels read in place (`adasum.kernels.addresses.AddressTables`),
    the CPU workspaces, and the guard thread of the deferred checks (stopped by `clear`).

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
        self.tiles = AddressTables()
        self.workspace = Workspace()
        # the recent captured list calls, by (number of tensors, first tensor's address): their replays skip the plan
        # look-up (`adasum.collectives.api`)
        self.recent: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self.guard: Any = None  # the thread that compares deferred checks (`adasum.checks.guard`)
        self.one_rank_warned = False  # a group of one rank was warned for (`adasum.transport.alone`)
        # the last list call's plan, a weak reference to its first tensor, and how many list calls in a row of that
        # plan ran eagerly on tensors re-made at new addresses (`run`, `_note_moves`)
        self._moves: tuple[Hashable, Any, int] = (None, None, 0)

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

    def run(
        self, plan: Hashable, where: Hashable, fn: Callable[[], None], device: torch.device,
        first: torch.Tensor | None = None,
    ) -> Hashable:
        """`fn()` eagerly, captured into a CUDA graph, or replayed (`adasum.transport.graphs`): the package's one
        capture point. `plan` names the call's layout and configuration (`adasum.checks.plan.Plan.key`, or
        the schedule's), `where` the tensors (`adasum.transport.graphs.tensor_key`). A call made while another
        runs (the schedule inside a captured list call or hook) runs eagerly into it. `first`: a list call's first
        tensor, for the warning on tensors re-made at new addresses (`_note_moves`). Returns the graph's key."""
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
        self.tiles.clear()
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
    the transports' table by name (`adasum.transport.registry.register_transport`), how many guard threads each
    group name had (`adasum.checks.guard`; never emptied), the caches objects keep for the groups
    (`emptied_by_release`), and whether the teardown hook is in place. `release` empties the first two and the
    caches. (The reducers' names are the reducers' own: `adasum.reducers.base`.)"""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.communicators: dict[dist.ProcessGroup, Communicator] = {}
        self.streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self.reducers: dict[str, type] = {}
        self.transports: dict[str, Any] = {}  # the movers' table by name (`adasum.transport.registry`)
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
