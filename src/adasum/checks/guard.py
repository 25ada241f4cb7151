"""The guard of a process group's deferred layout checks: a thread that compares, across ranks, the fingerprint
of every checked call, off the calls' path (`adasum.checks.plan` says when checks are deferred).

The caller's side costs a list append per call (`Guard.post`); the thread runs *rounds* on a gloo group of its
own (a ``ProcessGroupGloo`` over the group's store, shared with no other thread, so its collectives pair up
across ranks in order). A round all-reduces (MAX) a fixed-size int64 vector: minus the number of calls this rank
brings (at most `SLOTS`), then per call its fingerprint, its negation, its message sizes' fingerprint
(`Guard.sizes_first`), its negation, a problem flag and a deferred flag, and last the number it brings. The first
``min`` over ranks of those calls are compared slot by slot: the i-th checked call of every rank against the i-th
of its peers, whatever their history. Rounds follow each other at
most every `ROUND_PAUSE_S` unless a caller waits for a verdict, so the thread takes the interpreter's lock rarely
however fast the calls come.

A call that must be compared before its data (a layout's first call, a local problem; `Guard.check`) posts its
slot and waits for its verdict. *Sizes first*: where the data group has no communicator abort (gloo), data of other
sizes than its peers' would abort the process inside the backend, so every call waits for its round (`Guard.post`
too): where the sizes of its messages (`adasum.checks.agreement.message_sizes`) differ across ranks, or some rank
has a problem with it, nothing moved on any rank, and the error is raised by the call on every rank, as where every
rank waited; a call whose sizes agree goes on (its data moves) before its layout's verdict, as on NCCL, so a layout
that differs in shapes only is named as below. A slot that differs (or has a problem on some rank) is named as the
synchronous check names it: every rank's configuration and description are gathered on the guard's group and
every rank gets the same error (`adasum.checks.agreement.named_difference`). Where every rank was waiting
for that slot, nothing moved: the error is raised by the waiting call and the guard goes on. Where some rank
had posted it without waiting (its data collectives enqueued), the error is *fatal*: it is kept, and every
rank raises it at the same call, the `LAG`-th after the divergent one (and at every call after it), so that no
rank enqueues a collective its peers never match: a rank runs at most `LAG` calls ahead of the verdicts (its
next call waits for the guard beyond that), so every rank reaches that call after the verdict. The calls in
between run on (their results, like the divergent call's, are undefined). Where the data group is NCCL and its
kernels wait for data no peer sends, its communicator is aborted, which ends them: by the call that raises the
error (on the caller's thread) if the device has not drained `ABORT_AFTER_S` after it, or by the guard if the
rank makes no call for `ABORT_AFTER_S` (the caller is blocked, e.g. on the device behind such a kernel); the
rank's next call then raises the error at once, so nothing is enqueued on the aborted communicator (a peer
still running towards the `LAG`-th call finds its own device blocked there, and aborts too). A
device that drains is left alone: an abort is itself a wait on the device (NCCL frees its memory), and the
communicator of a divergence whose kernels all ended (layouts of equal sizes) needs none.

*Fences*: ``torch.distributed.barrier``, `adasum.release`, ``destroy_process_group`` and the exit handler ask
the guard to compare everything posted, then to run a round in which this rank brings no call (`Guard.fence`,
`Guard.stop`). A rank only brings none to a round when fencing, so a round whose ``min`` is 0 is a fence: where
every rank brings none, the ranks made the same number of checked calls and the fence passes; where some rank
brings calls, the ranks made different numbers of them (one rank made an extra call before its barrier or
release), which is a fatal divergence named on every rank (`count_difference`). A kept fatal divergence that no
call has raised yet (found within the last `LAG` calls, or at the fence) is raised by the fence on every rank:
by the barrier (before it), by `adasum.release` and ``destroy_process_group`` (after the group's resources are
dropped, the process group destroyed), and written as one line on stderr by the exit handler. A caller still
waiting for a verdict when the guard ends (`adasum.release` on another thread) is woken with an error.
"""

from __future__ import annotations

import copy
import pickle
import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from adasum.checks.agreement import Problem, _entry, message_sizes, named_difference, signature
from adasum.transport.communicator import Communicator, next_guard
from adasum.transport.errors import failures_named
from adasum.transport.groups import group_timeout

SLOTS = 128
"""Calls compared per round at most (a round's vector has 2 + 6 x SLOTS int64)."""
ROUND_PAUSE_S = 0.05
"""Pause between two rounds while no caller waits for a verdict: a round's calls are batched over it (shorter
pauses name a divergence sooner but take the cores the data exchange runs on more often)."""
LAG = 2 * SLOTS
"""Calls a rank may run ahead of the guard's verdicts: its next call waits for the guard beyond that, and a
divergence found at call i is raised by call ``i + LAG`` on every rank (module doc)."""
EXIT_FENCE_S = 10.0
"""How long the exit handler waits for a guard's last comparison with its peers (`Guard.stop`)."""
ABORT_AFTER_S = 2.0
"""How long the guard waits, after a fatal divergence, for a rank that makes no further call (blocked, e.g. on the
device behind a kernel of the divergent call) before it aborts the NCCL communicator itself; and how long the call
that raises the divergence waits for the device to drain before it aborts."""


class _Waiter:
    """A caller waiting for the verdict of its slot: its layout's (`Guard.check`), or only its message sizes'
    (`Guard.post` where sizes come first: its data goes on before its layout's verdict)."""

    __slots__ = ("done", "error", "layout")

    def __init__(self, layout: bool = True) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.layout = layout


# one checked call: (plan, what, operation, problem, waiter); waiter None: posted without waiting
_Slot = tuple[Any, str, str, "Problem | None", "_Waiter | None"]


class Guard:
    """The thread that compares a group's checked calls across ranks (module doc). Made by `guard_of`."""

    EXIT_FENCE_S = EXIT_FENCE_S

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        prefix: str,
        abort: Callable[[], None] | None,
        drains: Callable[[float], bool] | None = None,
    ) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.timeout: timedelta = group_timeout(group)
        self.store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        self.abort = abort
        # no communicator abort (gloo, whose own abort of a message of another size kills the process): every call
        # waits for the comparison of its message sizes (module doc)
        self.sizes_first = abort is None
        # whether this rank's device finishes its queued work within s seconds
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.drains = drains if drains is not None else (lambda seconds: device_drains(seconds, device))
        self.slots: deque[_Slot] = deque()
        self.error: BaseException | None = None  # a fatal divergence or a failure of the guard's group
        self.checked = 0  # slots compared and found equal
        self.refused = 0  # slots compared and refused before their data (every rank waited for them)
        self.posted = 0  # slots the caller handed over (the index of the next call's slot)
        self.raise_at: int | None = None  # after a fatal divergence: the slot from which every call raises it
        self.aborted = False
        self.abort_error: BaseException | None = None
        self._fatal = False  # the kept error is a divergence of a call already under way
        self._delivered = False  # the kept fatal error was raised to a caller (by a call or a fence)
        self._fence_asked = False  # a caller waits for a fence round (`fence`, `stop`)
        self._fenced = threading.Event()  # set after a fence round passed
        self._abort_lock = threading.Lock()
        self._wake = threading.Event()
        self._raised = threading.Event()
        self._progress = threading.Event()  # set after each round
        self._idle = False
        self._stopping = False
        # the round's vector and the gathers' tensors outlive the guard's gloo group: its worker threads never drop
        # the last reference to a tensor (that needs the interpreter's lock; groups.py's module doc)
        self._vector = torch.zeros(2 + 6 * SLOTS, dtype=torch.int64)
        self._kept: list[torch.Tensor] = []
        self._thread = threading.Thread(target=self._run, name="adasum-guard", daemon=True)
        self._thread.start()

    # --- the caller's side

    def post(self, plan: Any, what: str, operation: str, reserved: bool = False) -> None:
        """Compare this call's fingerprint later (its data goes on now). What must come before the data moves
        comes first (`reserve`), unless the call `reserved` its slot already. Where sizes come first
        (`sizes_first`), the call waits for the comparison of its message sizes (module doc): raises the same
        error on every rank where they differ, else returns (its data goes on) before its layout's verdict."""
        if not reserved:
            self.reserve()
            if self.sizes_first and self.error is None:
                self._wait(plan, None, what, operation, self.posted - 1, _Waiter(layout=False))
                return
        self.slots.append((plan, what, operation, None, None))
        if self._idle:
            self._wake.set()

    def reserve(self) -> None:
        """Take the caller's next slot, which its `post` fills: raises a kept error first (a fatal one from its
        call on, module doc), and waits for the guard where this rank would run more than `LAG` calls ahead of
        its verdicts. A call that posts after launching its data (a replayed graph) reserves before."""
        index = self._next_index()
        if self.error is None and index - self.checked - self.refused >= LAG:
            self._catch_up(index - LAG)

    def _next_index(self) -> int:
        """The index of the caller's next slot, after raising a kept error that this call must raise: from the
        `raise_at`-th call on, or at once once this rank's communicator was aborted (a collective enqueued or
        captured on an aborted NCCL communicator waited inside torch, and kept the abort itself from returning)."""
        index = self.posted
        if self.error is not None and (self.raise_at is None or index >= self.raise_at or self.aborted):
            self._raise()
        self.posted += 1
        return index

    def _catch_up(self, index: int) -> None:
        """Wait until the guard has compared slot `index` (or kept an error, or ended)."""
        self._wake.set()
        while self.checked + self.refused <= index and self.error is None and self._thread.is_alive():
            self._progress.wait(0.05)
            self._progress.clear()

    def check(self, plan: Any, problem: Problem | None, what: str, operation: str) -> None:
        """Compare this call's fingerprint and problem across ranks now: returns when every rank's agrees, raises
        the same error on every rank otherwise."""
        index = self._next_index()
        if self.error is not None:  # a fatal divergence to be raised by a later call: no verdict comes
            self.slots.append((plan, what, operation, problem, None))
            return
        self._wait(plan, problem, what, operation, index, _Waiter())

    def _wait(self, plan: Any, problem: Problem | None, what: str, operation: str, index: int, waiter: _Waiter) -> None:
        """Post slot `index` with `waiter` and wait for its verdict (`check`, module doc)."""
        self.slots.append((plan, what, operation, problem, waiter))
        self._wake.set()
        while not waiter.done.wait(0.05) and self.error is None:
            if not self._thread.is_alive():  # stopped (`adasum.release` on another thread): no verdict comes
                if waiter.done.is_set() or self.error is not None:
                    break
                raise RuntimeError(
                    f"{operation}: the group's deferred layout check ended (adasum.release or destroy_process_group "
                    "on another thread) while this call waited for its verdict; nothing moved"
                )
        if self._fatal:  # a divergence of a call already under way: this call goes on as a posted one would
            if self.raise_at is not None and index >= self.raise_at:
                self._raise()
            return
        error = waiter.error or self.error
        if error is not None:
            if error is self.error:
                self._raise()
            raise error

    def _raise(self) -> None:
        """Raise the kept error; after a divergence whose kernels do not end (the device does not drain within
        `ABORT_AFTER_S`), abort the NCCL communicator first (here, on the caller's thread, so that no collective
        of this rank is being enqueued meanwhile)."""
        self._raised.set()
        self._delivered = True
        if self._fatal and self.abort is not None and not self.aborted and not self.drains(ABORT_AFTER_S):
            self._abort_once()
        raise _fresh(self.error)  # type: ignore[arg-type]

    def stop(self, wait_s: float | None = None) -> BaseException | None:
        """Let the thread compare what was posted and run a fence round (module doc), then end it. Returns a kept
        fatal divergence that no call raised (to be raised by the caller, on every rank alike), else None. Peers
        that posted the same calls answer when they stop or fence too; a missing peer fails the round within the
        group's timeout. `wait_s` bounds the wait instead (the exit handler's: a peer still running, or stalled,
        does not hold the process past it; the thread, a daemon, is left to its round)."""
        self._stopping = True
        self._fence_asked = True
        self._wake.set()
        self._raised.set()  # no abort once the group is being released
        self._thread.join(self.timeout.total_seconds() + 5 if wait_s is None else wait_s)
        return self._undelivered()

    def fence(self) -> None:
        """Compare every call posted so far with the peers', and their numbers (module doc), before a barrier:
        raises a kept fatal divergence that no call raised yet, or that this rank's next call would raise (the same
        on every rank: a rank that raised it at a call never enters a barrier its peers do not)."""
        if self._thread.is_alive() and self.error is None:
            self._fenced.clear()
            self._fence_asked = True
            self._wake.set()
            while not self._fenced.wait(0.05) and self._thread.is_alive() and self.error is None:
                pass
        if self.error is None or not self._fatal:
            return
        if not self._delivered or (self.raise_at is not None and self.posted >= self.raise_at):
            self._raise()  # as a call would: after a divergence whose kernels do not end, the abort first

    def _undelivered(self) -> BaseException | None:
        """A copy of the kept fatal divergence if no caller was handed it yet (then it counts as handed)."""
        if self.error is None or not self._fatal or self._delivered:
            return None
        self._delivered = True
        return _fresh(self.error)

    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    # --- the thread

    def _run(self) -> None:
        carry: list[_Slot] = []
        try:
            with failures_named("adasum", "the deferred layout check's connection", self.group, self.timeout):
                pg = dist.ProcessGroupGloo(self.store, self.rank, self.world, self.timeout)
            while self._next(carry):
                operation = carry[0][2] if carry else "adasum"
                with failures_named(operation, "the deferred layout check", self.group, self.timeout):
                    if not self._settle(pg, carry):
                        return
        except BaseException as error:  # noqa: BLE001 - kept, raised by the caller's next call
            self._fail(error, carry)

    def _take(self, carry: list[_Slot]) -> None:
        while self.slots and len(carry) < SLOTS:
            carry.append(self.slots.popleft())

    def _next(self, carry: list[_Slot]) -> bool:
        """Wait for slots to compare, or for a fence asked for (with `carry` empty: a fence round), pausing between
        rounds when no caller waits, so that a round takes every slot posted meanwhile."""
        self._take(carry)
        while not carry:
            if self._fence_asked:
                return True
            self._idle = True
            if not self.slots and not self._fence_asked:
                self._wake.wait()
            self._idle = False
            self._wake.clear()
            self._take(carry)
        if not self._fence_asked and all(slot[4] is None for slot in carry) and len(carry) < SLOTS:
            self._wake.wait(ROUND_PAUSE_S)  # a caller that waits sets it
            self._wake.clear()
            self._take(carry)
        return True

    def _settle(self, pg: Any, carry: list[_Slot]) -> bool:
        """One round over `carry`'s first slots; False once a fatal error was kept, or a fence passed while
        stopping (the thread ends)."""
        compared, bad, fatal, most = _round(pg, carry, self._vector, self.sizes_first)
        if compared == 0:  # some rank fences (module doc)
            if most == 0:  # every rank does: the same number of calls
                self._fence_asked = self._stopping
                self._fenced.set()
                return not self._stopping
            counts = self.checked + len(carry) + len(self.slots)
            first = carry[0] if carry else None
            mine = (counts, None if first is None else (first[2], first[1], list(first[0].description)))
            error: BaseException = count_difference(_gather(pg, mine, self.world, self._kept), self.checked)
            self.raise_at = self.checked + self.refused  # every rank's next call raises it
            self._fatal = True
            self._fail(error, carry)
            self._progress.set()
            self._fenced.set()
            self._abort_unless_raised()
            return False
        for slot in carry[: compared if bad is None else bad]:
            if slot[4] is not None:
                slot[4].done.set()
        if bad is None:
            self.checked += compared
            del carry[:compared]
            self._progress.set()
            return True
        self.checked += bad
        error = self._named(pg, carry[bad], fatal)
        if fatal:
            # the divergent slot's index + LAG: the same on every rank
            self.raise_at = self.checked + self.refused + LAG
            self._fatal = True
            self._fail(error, carry)
            self._progress.set()
            self._abort_unless_raised()
            return False
        waiter = carry[bad][4]  # every rank waits for this slot: nothing moved, the guard goes on
        self.refused += 1
        if waiter is not None:
            waiter.error = error
            waiter.done.set()
        del carry[: bad + 1]
        return True

    def _named(self, pg: Any, slot: _Slot, fatal: bool) -> BaseException:
        plan, what, operation, problem, _ = slot
        note = " (a call already under way on some rank: its result is undefined; destroy the process group)"
        note = note if fatal else ""
        item = (plan.config, list(plan.description), problem, operation, note)
        everyone = _gather(pg, item, self.world, self._kept)
        return named_difference(everyone, what)

    def _fail(self, error: BaseException, carry: list[_Slot]) -> None:
        """Keep `error` for every later call (the first one kept stays), and hand it to every caller still waiting."""
        if self.error is None:
            self.error = error
        error = self.error
        for slot in [*carry, *self.slots]:
            if slot[4] is not None:
                slot[4].error = error
                slot[4].done.set()

    def _abort_unless_raised(self) -> None:
        seen = -1
        while not self._raised.wait(ABORT_AFTER_S) and not self._stopping:
            if self.posted == seen and not self.drains(ABORT_AFTER_S):
                self._abort_once()  # no call, and the device does not drain: blocked behind a kernel
                return
            seen = self.posted  # the caller goes on towards the call that raises the error

    def _abort_once(self) -> None:
        with self._abort_lock:
            if self.abort is None or self.aborted:
                return
            self.aborted = True
        try:
            self.abort()
        except Exception as error:  # noqa: BLE001 - the divergence is what is raised; this is kept to be read
            self.abort_error = error


def _fresh(error: BaseException) -> BaseException:
    """A copy of the kept `error` to raise: the kept one never takes a caller's traceback, whose frames would keep
    that call's objects (the caller's tensors, a captured graph) alive as long as the guard, and the guard alive
    through the frame of its own method (a cycle only the garbage collector frees)."""
    fresh = copy.copy(error)
    fresh.__cause__ = error.__cause__
    return fresh


def device_drains(seconds: float, device: int | None) -> bool:
    """Whether GPU `device` finishes the work queued on it within `seconds` (True for None: no GPU): a thread
    of its own synchronises, so a device that never drains leaves that thread waiting, not the caller."""
    if device is None:
        return True
    done = threading.Event()

    def wait() -> None:
        torch.cuda.synchronize(device)
        done.set()

    threading.Thread(target=wait, name="adasum-drain", daemon=True).start()
    return done.wait(seconds)


def _round(
    pg: Any, carry: list[_Slot], vector: torch.Tensor, sizes_first: bool = False
) -> tuple[int, int | None, bool, int]:
    """All-reduce (MAX) the first `SLOTS` slots of `carry` in `vector`: how many every rank brought, the first of
    them that differs or has a problem on some rank (None: none), whether its divergence is fatal (some rank posted
    it without waiting for its layout's verdict; where sizes come first, and its message sizes differ or some rank
    has a problem with it, every rank waited and nothing moved: not fatal), and the most calls a rank brought."""
    brought = min(len(carry), SLOTS)
    values = [-brought]
    for plan, _, _, problem, waiter in carry[:SLOTS]:
        sizes = _sizes_fingerprint(plan) if sizes_first else 0
        values += (plan.fingerprint, -plan.fingerprint, sizes, -sizes, problem is not None,
                   waiter is None or not waiter.layout)
    vector.zero_()
    vector[: len(values)] = torch.tensor(values, dtype=torch.int64)
    vector[-1] = brought
    pg.allreduce([vector], _MAX).wait()
    out = vector.tolist()
    compared, most = -out[0], out[-1]
    for i in range(compared):
        high, neg_low, sizes_high, sizes_neg_low, problem, deferred = out[1 + 6 * i : 7 + 6 * i]
        if high != -neg_low or problem:
            moved = not (sizes_first and (sizes_high != -sizes_neg_low or problem))
            return compared, i, bool(deferred) and moved, most
    return compared, None, False, most


def _sizes_fingerprint(plan: Any) -> int:
    """The fingerprint of `plan`'s configuration and `message_sizes` (kept in the plan, made at its first round)."""
    if plan.sizes is None:
        plan.sizes = signature([plan.config, *message_sizes(plan.description)])
    return plan.sizes


def count_difference(everyone: list, checked: int) -> ValueError:
    """The error of ranks that made different numbers of checked calls on a group (found by a fence, module doc),
    from every rank's ``(calls, first call beyond the compared ones or None)``, the same on every rank: the
    counts, and the first call beyond the `checked` compared ones of the lowest rank that made one."""
    counts = ", ".join(f"rank {rank} made {calls}" for rank, (calls, _) in enumerate(everyone))
    rank, (operation, what, description) = next((r, first) for r, (_, first) in enumerate(everyone) if first)
    entries = "; ".join(_entry(e) for e in description) or "none"
    return ValueError(
        f"{operation}: the number of checked calls on the group differs across ranks: {counts}; rank {rank}'s call "
        f"{checked + 1} ({what}: {entries}) has no match on some rank (a call already under way on some rank: its "
        "result is undefined; destroy the process group)"
    )


_MAX = dist.AllreduceOptions()
_MAX.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # torch's stubs name the enum's type apart


def _gather(pg: Any, item: object, world: int, kept: list[torch.Tensor]) -> list:
    """Every rank's `item` (pickled), on a group torch.distributed's object collectives do not know; the tensors
    sent and received are appended to `kept`."""
    data = torch.frombuffer(bytearray(pickle.dumps(item)), dtype=torch.uint8)
    longest = torch.tensor([data.numel()], dtype=torch.int64)
    pg.allreduce([longest], _MAX).wait()
    padded = torch.zeros(int(longest), dtype=torch.uint8)
    padded[: data.numel()] = data
    everyone = [torch.empty_like(padded) for _ in range(world)]
    pg.allgather([everyone], [padded]).wait()
    kept += (data, longest, padded, *everyone)
    return [pickle.loads(t.numpy().tobytes()) for t in everyone]  # bytes past a pickle's end are ignored


def guard_of(comm: Communicator, group: dist.ProcessGroup | None) -> Guard:
    """The guard of `comm`'s group, started on its first deferred check (every rank starts it at the same call:
    its thread connects to its peers' on a store prefix of the group's name and how many guards it had)."""
    if comm.guard is None:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        name = pg.group_name
        made = next_guard(name)
        comm.guard = Guard(group, f"adasum/guard/{name}/{made}", _nccl_abort(pg))
    return comm.guard


def _nccl_abort(pg: dist.ProcessGroup) -> Callable[[], None] | None:
    """The abort of `pg`'s NCCL backend (None on other backends): ends its kernels, leaves torch's registry of
    groups as it is, so that ``destroy_process_group`` still works."""
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except RuntimeError:  # no CUDA backend
        return None
    return backend.abort if type(backend).__name__ == "ProcessGroupNCCL" else None
