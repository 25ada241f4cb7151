"""The symmetric-memory transport (NVLink inside one host): torch's
``torch.distributed._symmetric_memory`` maps every rank's staging buffer `S` into every other
rank's address space, and Triton kernels move the bytes with ordinary loads and stores.

For a level with kept slice K and given slice G (positions in the flat buffer B):

1. ``barrier``: the partner's ``S[K]`` (its copy of the slice this rank keeps) is current;
2. one kernel reads ``B[K]`` and the partner's ``S[K]`` (NVLink loads), keeps the partner's copy
   in ``theirs`` and reduces the three float64 sums in the same pass;
3. the float64 partial sums are all-reduced (NCCL);
4. one kernel writes the combination into ``B[K]`` and, in the same pass, into ``S[K]`` (what the
   next level's partner reads) or, on the last level, into the partner's ``S[K]`` as well (the
   gather's first step is a store into the peer's memory);
5. the gather's remaining levels copy from the partner's ``S``; the result is copied from ``S``
   into ``B`` outside this rank's final slice.

The first level's given slice is staged into ``S`` first (one local copy of half the buffer),
unless `B` *is* ``S`` (a buffer fused there, `fusion_buffer`). `B` may also be a list of
tensors where they lie (`adasum.core.layout.Scattered`, what `adasum.all_reduce` passes for lists
of contiguous tensors): the kernels load and store them through per-tile addresses, so a list costs
the same copies as one tensor (the given half staged, the partner's results copied out) instead of
a fusion of the whole list and a copy of all of it back.

In a group of two, a staged half of at least 2 x `CHUNK_BYTES` is **pipelined** in up to
`MAX_CHUNKS` pieces, so the local copies overlap the NVLink passes: a side stream stages piece
c + 1 while piece c is pulled (a barrier before each pull: the partner's piece is staged), and
copies the partner's combined piece c out of ``S`` while piece c + 1 is combined (a barrier after
each combination: the partner's piece has landed).

**Push protocol (groups of two, the default there; ``ADASUM_SYMMETRIC_PUSH=0`` keeps the pull above).** The
pulls read the partner's staged copy more slowly than the combination's stores write into it, and the
first staged piece stays exposed. With the push protocol each rank stores the pieces of its given
half straight from `B` into the partner's receive buffer ``R`` (a symmetric buffer of half a run), a
barrier follows each piece, and the sums of the kept piece are read locally on a
side stream while the next piece is pushed; the combination reads the partner's copy there, and stores each
combined piece into the partner's results buffer (a second symmetric buffer of half a run), which the
partner copies into `B` on a side stream while the next piece is combined. Nothing is staged, no ``theirs``
copy is written, and no ``S`` is made: ``R`` and the results buffer hold half a run each, so a run is as
large as the budget (docs/benchmarks.md compares the two protocols).

**Memory budget.** ``S`` and ``R`` hold one run of the schedule, and a layout larger than the budget
(``memory_mb``, `adasum.settings`; `round_elements`) runs in rounds of whole tensors, each an Adasum of its
own tensors (`adasum.collectives.vhdd.adasum_flat_`); a single tensor larger than a round runs in place
(`SymmetricInPlace`, through a ring of fixed size), so no buffer grows past the budget.

Every rank must be a leader of the tree (a power-of-two group); NVLink multicast is never used (no
multimem operations, no multicast objects). Only signal-pad barriers order the ranks; nothing
synchronises the host.
"""

from __future__ import annotations

import contextlib
import socket
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from adasum.core.layout import Scattered
from adasum.kernels import triton as triton_kernels
from adasum.kernels.addresses import AddressTables, CopyTables
from adasum.settings import current
from adasum.transport.base import CUT_ALIGN, GatherStep, Level, Transport, split
from adasum.transport.caches import Bounded
from adasum.transport.communicator import communicator, retire_graphs, side_stream
from adasum.transport.groups import uses_nccl
from adasum.transport.slices import InPlace, buffer_bytes, round_elements

try:  # pragma: no cover - CUDA builds only
    import torch.distributed._symmetric_memory as symm_mem
except ImportError:  # pragma: no cover
    symm_mem = None  # type: ignore[assignment]

OUTPUT_ALIGN = 16
"""Elements the slice mover's output row is aligned to (16 bytes or more in every dtype: vector accesses)."""
CHUNK_BYTES = 32 << 20
"""Bytes per pipelined piece of a staged half, at least (``ADASUM_SYMMETRIC_CHUNK_BYTES`` overrides it;
``ADASUM_SYMMETRIC_CHUNKS=0``: never pipelined)."""
MAX_CHUNKS = 4
"""Pieces per half at most (``ADASUM_SYMMETRIC_MAX_CHUNKS`` overrides it): more pieces overlap more of the
copies but each costs one barrier more."""


def _group_name(group) -> str:
    return (group if group is not None else cast(dist.ProcessGroup, dist.group.WORLD)).group_name


class SymmetricPool:
    """One process group's symmetric memory: whether the group can run these transports, its symmetric buffers
    (by dtype and purpose), and the views of peers' buffers. Owned by the group's
    `adasum.transport.communicator.Communicator` (`pool`) and freed by its teardown (`adasum.release()`), after
    the captured graphs that point into it.

    `backend` is torch's ``torch.distributed._symmetric_memory`` unless given: an object with ``empty(numel,
    dtype=, device=)`` and ``rendezvous(buffer, group_name)`` (tests pass one that allocates host memory)."""

    def __init__(self, group, backend=None, outgrown: Callable[[], None] | None = None) -> None:
        self.group = group
        self.name = _group_name(group)
        self.backend = backend if backend is not None else symm_mem
        self.outgrown = outgrown  # called when a buffer is replaced by a larger one (`staging`)
        self.verdict: bool | None = None
        self.buffers: dict[tuple[torch.dtype, str], tuple[torch.Tensor, object]] = {}
        # the peers' views by (handle, peer, elements, dtype), bounded: a new layout every call keeps memory flat
        self.remote: Bounded[tuple[int, int, int, torch.dtype], torch.Tensor] = Bounded()

    def supported(self) -> bool:
        """Whether the group can run this transport: NCCL, Triton, a symmetric-memory backend, every rank on one
        host, and ``ADASUM_SYMMETRIC`` not ``0``. The first call is collective (one exchange of host names); the
        answer is the same on every rank."""
        if self.verdict is None:
            local = (
                self.backend is not None
                and uses_nccl(self.group)
                and triton_kernels.triton is not None
                and current().symmetric
            )
            hosts: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(hosts, (socket.gethostname(), local), group=self.group)
            self.verdict = all(ok for _, ok in hosts) and len({h for h, _ in hosts}) == 1
        return self.verdict

    def staging(self, numel: int, like: torch.Tensor | Scattered, purpose: str = "stage", most: int | None = None):
        """(S, handle): the group's symmetric buffer for `like`'s dtype and `purpose` ("stage": ``S``;
        "receive": the push protocol's ``R``; "slices": the slice-parallel mover's rows, in bytes; "ring": the
        in-place mover's ring, in bytes), at least `numel` elements; a growth doubles the capacity, but not past
        `most` elements (unless `numel` needs it). Growing it is collective (a rendezvous): every rank asks for the
        same sizes in the same order.

        A growth first waits for the device (the only wait on the host here): kernels and CUDA graphs captured on
        the outgrown buffer may still be running. Then every group's graphs are dropped (`outgrown`,
        `adasum.transport.communicator.retire_graphs`: a graph of one group may point into another's buffers), and so is
        the outgrown buffer with its peers' views: nothing keeps memory for an earlier, smaller layout. A graph
        replayed on the old buffer would also meet a peer that had not captured the same call (keys hold
        addresses) running it on the new buffer, and the two would wait at different signal pads."""
        key = (like.dtype, purpose)
        entry = self.buffers.get(key)
        if entry is None or entry[0].numel() < numel:
            if like.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "adasum: the symmetric buffer cannot grow during CUDA graph capture; run the same call once "
                    "before capturing it (a warm-up), so that its buffer has its size"
                )
            most = most if most is not None else 1 << 62
            capacity = max(numel, min(1 << 20, most))
            if entry is not None:
                capacity = max(capacity, min(2 * entry[0].numel(), most))
                if like.device.type == "cuda":
                    torch.cuda.synchronize(like.device)
                if self.outgrown is not None:
                    self.outgrown()
                del self.buffers[key]
                for gone in [k for k in self.remote if k[0] == id(entry[1])]:
                    del self.remote[gone]
                entry = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if hasattr(self.backend, "enable_symm_mem_for_group"):
                    self.backend.enable_symm_mem_for_group(self.name)
            buffer = self.backend.empty(capacity, dtype=like.dtype, device=like.device)
            entry = self.buffers[key] = (buffer, self.backend.rendezvous(buffer, self.name))
        return entry

    def peer_view(self, handle, peer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`peer`'s buffer of `handle` as a flat tensor of `numel` elements of `dtype` (made once, and kept among the
        pool's last `adasum.transport.caches.MOST` views: one evicted is made again)."""
        key = (id(handle), peer, numel, dtype)
        view = self.remote.get(key)
        if view is None:
            view = self.remote[key] = handle.get_buffer(peer, (numel,), dtype, 0)
        return view

    def held(self) -> int:
        """How many buffers and peer views the pool holds."""
        return len(self.buffers) + len(self.remote)

    def release(self) -> None:
        """Forget the buffers (after the captured graphs that point into them)."""
        self.remote.clear()
        self.buffers.clear()


def pool(group: dist.ProcessGroup | None, backend=None) -> SymmetricPool:
    """`group`'s `SymmetricPool`, kept by its communicator; made on first use with `backend` (`SymmetricPool`).
    A group's memory comes from one backend: another one for a group whose pool exists is a ValueError."""
    found = communicator(group).resource(SymmetricPool, lambda: SymmetricPool(group, backend, outgrown=retire_graphs))
    if backend is not None and found.backend is not backend:
        raise ValueError(
            "this group's symmetric memory comes from another backend; call adasum.release() first to drop it, or "
            "leave backend= out to use the one it has"
        )
    return found


def supported(group: dist.ProcessGroup | None) -> bool:
    """Whether `group` can run the symmetric transports (`SymmetricPool.supported`; collective on first use)."""
    return pool(group).supported()


def _bytes_like(like) -> torch.Tensor:
    """An empty byte tensor on `like`'s device: what `SymmetricPool.staging` takes for a buffer of bytes."""
    return torch.empty(0, dtype=torch.uint8, device=like.device)


def _among_peers(sender: int, receiver: int) -> int:
    """`sender`'s place among `receiver`'s P - 1 peers (ranks in order, the receiver left out): which of the
    receiver's rows or slots for peers holds what the sender stores there."""
    return sender - (sender > receiver)


def _group_in_place(transport: Transport) -> SymmetricInPlace:
    """The mover of a single tensor larger than a round (`SymmetricInPlace`, made on first use): the transport's
    group's one (`in_place_mover`), for both symmetric transports."""
    return in_place_mover(transport.group)


class SymmetricMemory(Transport):
    """See the module doc."""

    name = "symmetric"
    timeout = None
    scattered = True  # reads and writes a list of tensors in place (`Scattered`): no fusion copy

    def __init__(self, group: dist.ProcessGroup | None, backend=None) -> None:
        super().__init__(group)
        self.world = dist.get_world_size(group)
        self.pool = pool(group, backend)  # the group's buffers (`backend`: see `SymmetricPool`)
        self.tiles = communicator(group).tiles  # the group's tile addresses of `Scattered` slices
        self._gathered = False  # the last combination was pipelined and did the gather's copy

    def _push(self) -> bool:
        """Whether the exchange pushes (module doc): a group of two, unless ``ADASUM_SYMMETRIC_PUSH=0``."""
        return self.world == 2 and current().symmetric_push

    def fusion_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor | None:
        """The group's symmetric staging buffer, where a list fused there needs no staging copy; None (anywhere)
        for a list larger than a round (`round_elements`), which runs in rounds through a smaller ``S``, and with
        the push protocol, which has no ``S``."""
        if self._push() or numel > self.round_elements(like.element_size()):
            return None
        return self._stage(numel, like)[0][:numel]

    def round_elements(self, element_size: int) -> int:
        """The most elements one run holds within the memory budget: with the push protocol, ``R`` and the
        results buffer hold half a run each; with the pull protocol ``S`` holds a run, and the partner's copy of a
        kept half, half of one, lies in ``R`` (two ranks) or in the schedule's workspace, which an eager call and
        a captured graph each keep (more ranks)."""
        if self._push():
            return max(1, buffer_bytes() // element_size - 4 * CUT_ALIGN)
        return max(1, buffer_bytes() // ((2 if self.world == 2 else 3) * element_size))

    in_place = property(_group_in_place)

    def _stage(self, numel: int, like, purpose: str = "stage"):
        """The group's buffer of `purpose` (`SymmetricPool.staging`), its growth capped at a round (``S``) or at
        the larger half of one (the push protocol's ``R`` and results)."""
        most = self.round_elements(like.element_size())
        if purpose != "stage":
            most = (most + 1) // 2 + 2 * CUT_ALIGN
        return self.pool.staging(numel, like, purpose, most=most)

    def exchange(self, send, recv, peer):
        """Not supported: the symmetric transport runs power-of-two groups (no fold)."""
        raise RuntimeError(
            "the symmetric-memory transport runs power-of-two groups only (no fold), and the schedules never ask it "
            "to fold: internal error; please report"
        )

    def _setup(self, buffer: torch.Tensor | Scattered):
        shared, handle = self._stage(buffer.numel(), buffer)
        return shared, handle, isinstance(buffer, torch.Tensor) and shared.data_ptr() == buffer.data_ptr()

    def _chunks(self, level: Level) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """The (kept, given) pieces a group of two pipelines a level in (module doc): one piece below
        `CHUNK_BYTES` per piece, at most `MAX_CHUNKS`; the same count on both partners (their halves swap).
        It depends on sizes alone, never on whether this rank's buffer is staged: a partner whose list was
        fused into ``S`` (a non-contiguous tensor) runs the same barriers as one whose list is `Scattered`."""
        (klo, khi), (glo, ghi) = level.kept, level.given
        count = 1
        settings = current()
        if self.world == 2 and settings.symmetric_chunks:
            smallest = settings.symmetric_chunk_bytes  # tests shrink it
            most = settings.symmetric_max_chunks
            count = max(1, min(most, max(khi - klo, ghi - glo) * level.buffer.element_size() // max(1, smallest)))
        return list(zip(split(klo, khi, count), split(glo, ghi, count)))

    def exchange_and_dot(self, level: Level) -> None:
        """The level's exchange through symmetric memory (push or pull, pipelined; module doc), sums included.

        The pull's streams on a first level in pieces 0, 1, 2 (``|b|``: a barrier with the partner; the current
        stream waits for the staging of piece c before its barrier)::

            copies   B 0 -> S   B 1 -> S   B 2 -> S
            current          |b| pull 0 + sums |b| pull 1 + sums |b| pull 2 + sums
        """
        buffer = level.buffer
        self._gathered = False
        if self._push():
            self._push_exchange(level)
            return
        shared, handle, staged = self._setup(buffer)
        (klo, khi), (glo, ghi) = level.kept, level.given
        first_level = min(klo, glo) == 0 and max(khi, ghi) == buffer.numel()
        pieces = self._chunks(level) if first_level else [((klo, khi), (glo, ghi))]
        peer = self.pool.peer_view(handle, level.peer, shared.numel(), shared.dtype)
        main = side = None
        if len(pieces) > 1 and not staged:  # stage piece c + 1 on a side stream while piece c is pulled
            main = torch.cuda.current_stream(shared.device)
            side = side_stream(shared.device, "copies")
            side.wait_stream(main)
        staged_events = []
        for _, (g0, g1) in pieces if not staged and first_level else ():
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                _copy(shared, buffer, g0, g1)
            if side is not None:
                staged_events.append(side.record_event())
        for c, ((k0, k1), _) in enumerate(pieces):
            if staged_events:
                assert main is not None  # staged on the side stream
                main.wait_event(staged_events[c])
            handle.barrier(channel=0)  # the partner's copy of this piece is staged
            first, lengths = level.overlap(k0, k1)
            if lengths:
                triton_kernels.pull_dot_and_norms(
                    _slice(buffer, k0, k1, self.tiles), peer[k0:k1], level.theirs[k0 - klo : k1 - klo], lengths,
                    level.sums[:, first : first + len(lengths)], level.lower,
                )

    def _receive(self, kept: tuple[int, int], given: tuple[int, int], like):
        """(R, handle): the push protocol's receive buffer. Both partners ask for the larger half, so a growth
        (a rendezvous) happens on both or neither."""
        return self._stage(max(kept[1] - kept[0], given[1] - given[0]), like, "receive")

    def receive_space(self, kept, given, like):
        """With the push protocol the partner's copy lands in ``R`` (the partner stores it there), so `Level.theirs`
        is ``R``'s head; the pull protocol keeps it in the schedule's workspace."""
        if not self._push():
            return None
        return self._receive(kept, given, like)[0][: kept[1] - kept[0]]

    def _push_exchange(self, level: Level) -> None:
        """The exchange of a group of two by pushes: each piece of the given half is stored straight from `B`
        into the partner's ``R`` (NVLink stores; nothing staged), then a barrier, then the sums of the kept
        piece are read locally (`Level.theirs`, this rank's ``R``) on a side stream while the next piece is
        pushed.

        ``R`` is free when the first piece is pushed: the partner read it last in the previous call's
        combination, which ended before that call's last barrier.

        The streams, for pieces 0, 1, 2 (``|b|``: a barrier with the partner; the side stream waits for the
        current one after each barrier, and the current one for the side stream at the end)::

            current  push 0 -> R' |b| push 1 -> R' |b| push 2 -> R' |b|               join
            copies                    sums 0 (R)       sums 1 (R)       sums 2 (R) ---^
        """
        buffer = level.buffer
        klo, glo = level.kept[0], level.given[0]
        received, handle = self._receive(level.kept, level.given, buffer)
        peer = self.pool.peer_view(handle, level.peer, received.numel(), received.dtype)
        main = torch.cuda.current_stream(received.device)
        side = side_stream(received.device, "copies")
        for (k0, k1), (g0, g1) in self._chunks(level):
            _, given_lengths = level.overlap(g0, g1)
            if given_lengths:
                triton_kernels.add(_slice(buffer, g0, g1, self.tiles), None, peer[g0 - glo : g1 - glo], given_lengths)
            handle.barrier(channel=0)  # both partners' pushes of this piece have landed
            first, lengths = level.overlap(k0, k1)
            if lengths:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    triton_kernels.pull_dot_and_norms(
                        _slice(buffer, k0, k1, self.tiles), level.theirs[k0 - klo : k1 - klo], None, lengths,
                        level.sums[:, first : first + len(lengths)], level.lower,
                    )
        main.wait_stream(side)

    def combine(self, level: Level) -> None:
        """Combine `kept` and store it into the partner's buffer too."""
        if self._push():
            self._push_combine(level)
            return
        buffer = level.buffer
        shared, handle, staged = self._setup(buffer)
        klo, khi = level.kept
        pieces = self._chunks(level) if level.last else [(level.kept, level.given)]
        if len(pieces) > 1:  # a group of two: each piece pushed, then copied out on a side stream
            self._pipelined_combine(level, shared, handle, pieces, staged)
            return
        outs = []
        if not staged and (not level.last or self.world > 2):
            outs.append(shared[klo:khi])  # what the next level's (or the gather's) partner reads
        if level.last:
            outs.append(self.pool.peer_view(handle, level.peer, shared.numel(), shared.dtype)[klo:khi])
        self._combine(level, klo, khi, outs)

    def _combine(self, level: Level, lo: int, hi: int, outs: list[torch.Tensor]) -> None:
        first, lengths = level.overlap(lo, hi)
        if not lengths:
            return
        sums = level.sums[:, first : first + len(lengths)]
        mine = _slice(level.buffer, lo, hi, self.tiles)
        theirs = level.theirs[lo - level.kept[0] : hi - level.kept[0]]
        # the partner's copy from the local one the pull kept: reading it over NVLink again would run against the
        # direction of this kernel's stores into the partner
        a, b = (mine, theirs) if level.lower else (theirs, mine)
        level.op.pair(a, b, sums, level.workers_a, level.workers_b, lengths, mine, *outs)

    def _push_combine(self, level: Level) -> None:
        """The push protocol's combination (one level: a group of two), in the exchange's pieces: combine piece c
        into `B` and into the partner's results buffer (a symmetric buffer of half a run beside ``R``), barrier
        (the partner's piece c has landed in this rank's), then copy it into `B` on a side stream while piece
        c + 1 is combined. The gather then has nothing left to do.

        The results buffer is free when a piece is stored into it: this rank copied it out last in the previous
        run, before that run's side stream joined, which precedes this run's first barrier.

        The streams, for pieces 0, 1, 2 (``|b|``: a barrier with the partner; the side stream starts each copy
        after the barrier of its piece)::

            current  combine 0 -> B, peer's results |b| combine 1 -> ... |b| combine 2 -> ... |b|             join
            copies                                      results 0 -> B       results 1 -> B       results 2 ---^
        """
        klo, glo = level.kept[0], level.given[0]
        results, handle = self._stage(max(level.kept[1] - klo, level.given[1] - glo), level.buffer, "results")
        peer = self.pool.peer_view(handle, level.peer, results.numel(), results.dtype)
        main = torch.cuda.current_stream(results.device)
        side = side_stream(results.device, "copies")
        for (k0, k1), (g0, g1) in self._chunks(level):
            self._combine(level, k0, k1, [peer[k0 - klo : k1 - klo]])
            handle.barrier(channel=0)  # both partners' results of this piece have landed
            side.wait_event(main.record_event())
            with torch.cuda.stream(side):
                _move(level.buffer, g0, g1, results[g0 - glo : g1 - glo], level, False, self.tiles)
        main.wait_stream(side)
        self._gathered = True

    def _pipelined_combine(self, level: Level, shared: torch.Tensor, handle, pieces, staged: bool) -> None:
        """The last level of a group of two in pieces: combine piece c into B and the partner's S, barrier (the
        partner's piece c has landed in this rank's S), then copy it out of S into B on a side stream while
        piece c + 1 is combined (nothing to copy when B is S). The gather then has nothing left to do::

            current  combine 0 -> B, peer's S |b| combine 1 -> ... |b| combine 2 -> ... |b|         join
            copies                                S 0 -> B             S 1 -> B             S 2 ---^
        """
        peer = self.pool.peer_view(handle, level.peer, shared.numel(), shared.dtype)
        main = torch.cuda.current_stream(shared.device)
        side = side_stream(shared.device, "copies")
        for (k0, k1), (g0, g1) in pieces:
            self._combine(level, k0, k1, [peer[k0:k1]])
            handle.barrier(channel=0)
            if not staged:
                side.wait_event(main.record_event())
                with torch.cuda.stream(side):
                    _copy(level.buffer, shared, g0, g1)
        if not staged:
            main.wait_stream(side)
        self._gathered = True

    def gather(self, buffer: torch.Tensor | Scattered, steps: Sequence[GatherStep], finals=None) -> None:
        """The gather's remaining levels, copying the partner's results out of symmetric memory."""
        if self._gathered:  # the pipelined combination copied the partner's half out already
            self._gathered = False
            return
        shared, handle, staged = self._setup(buffer)
        handle.barrier(channel=0)  # the partners' stores of the last level have landed
        for step in steps[1:]:
            peer = self.pool.peer_view(handle, step.peer, shared.numel(), shared.dtype)
            shared[step.given[0] : step.given[1]].copy_(peer[step.given[0] : step.given[1]])
            handle.barrier(channel=0)
        if not staged:
            lo, hi = steps[0].kept
            _copy(buffer, shared, 0, lo)
            _copy(buffer, shared, hi, buffer.numel())


def _move(
    buffer: torch.Tensor | Scattered, lo: int, hi: int, flat: torch.Tensor, layout, store: bool, tables: AddressTables
) -> None:
    """``flat = buffer[lo:hi]`` (`store`) or ``buffer[lo:hi] = flat``, `flat` typically in a peer's memory: a copy
    by the copy engines where `buffer` is a flat tensor (no multiprocessor is taken from the kernels that run
    beside it), one Triton kernel through per-tile addresses where it is a `Scattered` list."""
    if isinstance(buffer, torch.Tensor):
        if store:
            flat.copy_(buffer[lo:hi], non_blocking=True)
        else:
            buffer[lo:hi].copy_(flat, non_blocking=True)
        return
    _, lengths = layout.overlap(lo, hi)
    if store:
        triton_kernels.add(_slice(buffer, lo, hi, tables), None, flat, lengths)
    else:
        triton_kernels.add(flat, None, _slice(buffer, lo, hi, tables), lengths)


def _slice(buffer: torch.Tensor | Scattered, lo: int, hi: int, tables: AddressTables):
    """Positions [lo, hi) of the buffer as the kernels take them: a flat view, or a `Scattered` slice's addresses
    (kept in `tables`, the group's)."""
    return buffer[lo:hi] if isinstance(buffer, torch.Tensor) else tables.get(buffer, lo, hi)


def _copy(dst: torch.Tensor | Scattered, src: torch.Tensor | Scattered, lo: int, hi: int) -> None:
    """``dst[lo:hi] = src[lo:hi]``, one of them the flat symmetric buffer."""
    if hi <= lo:
        return
    if isinstance(src, Scattered):
        src.read_into(cast(torch.Tensor, dst), lo, hi)
    elif isinstance(dst, Scattered):
        dst.write_from(src, lo, hi)
    else:
        dst[lo:hi].copy_(src[lo:hi])


class SliceRound:
    """One round's place in `SymmetricSlices`' buffer: its half (``size`` elements from ``base``), the width of its
    rows and the buffer's handle. The half holds the P receive rows from its start and the output row at its end,
    aligned down, past the receive rows of any round of the layout (the half holds ``(P + 1) C + 2 OUTPUT_ALIGN``
    for the widest, ``C``): a peer's result stored there never reaches a row that the last pass still reads."""

    __slots__ = ("shared", "handle", "row", "base", "size")

    def __init__(self, shared: torch.Tensor, handle, row: int, half: int, size: int) -> None:
        self.shared, self.handle, self.row = shared, handle, row
        self.base, self.size = half * size, size

    def at(self, rank: int) -> int:
        """Where row `rank` starts in the buffer."""
        return self.base + rank * self.row

    def output(self) -> int:
        """Where the output row starts in the buffer."""
        return self.base + (self.size - self.row) // OUTPUT_ALIGN * OUTPUT_ALIGN


def slices_bytes(world: int, halves: int, row: int, element_size: int) -> int:
    """Bytes of `SymmetricSlices`' buffer of `halves` halves for rows of `row` elements: per half (`SliceRound`),
    the `world` receive rows, the output row and the room to align the half and its output row."""
    return halves * ((world + 1) * row + 2 * OUTPUT_ALIGN) * element_size


class SymmetricSlices(Transport):
    """The slice-parallel schedule's mover (`adasum.collectives.slices`) on symmetric memory, any group size
    inside one host. One symmetric buffer of bytes per group, viewed in the dtype of the call, holds `ahead`
    halves, and round k of a call takes half k mod `ahead`: P receive rows of ``C`` elements each at its start and
    one output row at its end (`SliceRound`; the halves' ``ahead (P + 1) C`` at most the memory budget,
    `adasum.transport.slices.round_elements`; a tensor larger than a round runs in place, `SymmetricInPlace`).
    Every move is a store into a peer's memory: NVLink stores measured faster than loads.

    * scatter: each slice is cut into the same number of pieces on every rank (one per `CHUNK_BYTES` of the
      longest slice, at most `pieces`); for each piece, rank r stores its copy of that piece of every slice j
      straight from `B` (a flat tensor or a `Scattered` list, read in place) into row r of rank j's half, then a
      signal-pad barrier. With rounds in flight (a layout of several rounds) the stores and their barriers (on
      channel 1; the gather's are on channel 0) run on a high-priority stream ("stores") that first waits for
      what the current stream was given so far: the schedule scatters round k + 1 before it runs round k's tree,
      so the stores of round k + 1 follow the gather of round k - 1 (the last to read that half) and run beside
      the tree of round k; a layout of one round stores on the current stream. The schedule's sums of a landed
      piece run on a side stream; `scatter` returns the join the schedule calls before the round's tree. A flat
      `B`'s own slice serves as its row r where it lies (a list's is staged);
    * the tree runs on the rows; its last pass (`adasum.collectives.slices.tree_on_slice_`) reads every row;
    * gather: sender s's slot on rank j is j's output row where j is s's next rank (j = s + 1 mod P), else j's
      receive row s. The last pass writes rank r's result into `B`'s slice and straight into its slot on the
      next rank (the output row, which no pass reads); a barrier (every rank's last pass is done, so the receive
      rows are free, and r's output row holds the previous rank's result); one copy kernel stores the result from
      `B` into the other peers' slots and copies the previous rank's result out of r's output row into `B`
      (`early_copy_out`); a barrier; then one kernel copies the other peers' results out of r's receive rows into
      `B`; a barrier.

    One-shot (``whole``; `adasum.collectives.slices`): every rank's slice is the whole round, so the scatter stores
    this rank's whole copy into row r of every peer's half, and into its own row r too (the rows then lie alike in
    every rank's buffer, so every rank's kernels read the same rows the same way and the ranks end bitwise equal);
    the tree's last pass writes the result into `B`, and one barrier (every rank has read its rows) ends the round.

    Each step's moves to or from every peer are **one kernel** (`adasum.kernels.triton.copy_tiles`): its tiles
    are dealt in turn over the peers, so the multiprocessors store into all P - 1 peers at once, and its few programs
    (two per multiprocessor) leave room for the next or last round's math beside it. Moves one peer
    after another (the copy engines for a flat `B`, one copy kernel per peer for a list) measured slower for
    lists and the same for one flat tensor; the gather by stores into the slots measured faster than loading
    every peer's output row (docs/benchmarks.md, settings).

    A round's stores into a peer's half come after that peer's last barrier of the gather of the round before
    that used the half (in this call or an earlier one), which follows its copies out of its slots. Nothing
    synchronises the host."""

    name = "slices"
    whole = False  # one-shot (`adasum.collectives.slices`): set by the constructor
    scattered = True
    timeout = None
    ahead = 2
    """Rounds in flight: the buffer holds this many halves, round k takes half k mod `ahead`, and the schedule
    stores round k + 1 into its half while round k's tree runs (`adasum.collectives.slices`); a layout that fits
    one round of the whole buffer runs in one (`adasum.collectives.slices.slice_rounds`). Measured faster than one
    round at a time for layouts of several rounds, with the same bits (docs/benchmarks.md, settings)."""
    early_copy_out = True
    """Above two ranks, whether the previous rank's result is copied out of the output row by the copy kernel that
    stores into the other peers (a local copy beside NVLink stores), rather than after the next barrier with the
    other peers' results."""
    pieces = 1
    """Pieces per slice at most (one per `CHUNK_BYTES`): one, since cutting the rounds into 4 pieces with the math
    of one piece on a side stream measured slower (the kernels beside the moves share the multiprocessors)."""

    def __init__(self, group: dist.ProcessGroup | None, backend=None, whole: bool = False) -> None:
        super().__init__(group)
        if whole:
            self.whole, self.name = True, "one-shot"
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.pool = pool(group, backend)  # the group's buffers (`backend`: see `SymmetricPool`)
        self.tiles = communicator(group).tiles  # the group's tile addresses of `Scattered` slices
        self.copies = CopyTables()  # the tables of the steps' copy kernels, by memory and positions
        self._halves = 1  # the current layout's rounds in flight (`reserve`): round k takes half k mod this
        self._issued = 0  # rounds given rows since the layout's `reserve`
        self._rounds: deque[SliceRound] = deque()  # rounds given rows and not yet gathered, oldest first

    def round_elements(self, element_size: int, ahead: int = 1) -> int:
        """The most elements one round holds within the memory budget with the buffer cut into `ahead` halves (each:
        P receive rows, an output row; one-shot, a row holds the whole round)."""
        return round_elements(self.world, ahead * (self.world + 1), element_size, self.whole)

    def reserve(self, row: int, like, ahead: int = 1) -> None:
        """Make the buffer hold `ahead` halves of rows of `row` elements like `like` (the largest round of a layout,
        asked for before its first round, so that a layout grows the buffer once). One buffer of bytes serves every
        dtype."""
        self._halves = ahead
        size = like.element_size()
        budget = buffer_bytes()
        need = slices_bytes(self.world, ahead, row, size)
        self.pool.staging(need, _bytes_like(like), "slices", most=budget - budget % 16)
        self._issued = 0
        self._rounds.clear()

    in_place = property(_group_in_place)

    def rows(self, buffer, bounds):
        """The P receive rows of the next half of this group's symmetric buffer (grown collectively when needed)."""
        row = max(hi - lo for lo, hi in bounds)
        size = buffer.element_size()
        need = slices_bytes(self.world, self._halves, row, size)
        raw, handle = self.pool.staging(need, _bytes_like(buffer), "slices")
        shared = raw[: raw.numel() - raw.numel() % size].view(buffer.dtype)
        half = shared.numel() // self._halves // OUTPUT_ALIGN * OUTPUT_ALIGN
        state = SliceRound(shared, handle, row, self._issued % self._halves, half)
        self._issued += 1
        self._rounds.append(state)
        lo, hi = bounds[self.rank]
        rows = [shared[state.at(j) : state.at(j) + hi - lo] for j in range(self.world)]
        if isinstance(buffer, torch.Tensor) and not self.whole:  # its own copy is read (and overwritten) where it lies
            rows[self.rank] = buffer[lo:hi]
        return [(0, rows)]

    def _pieces(self, row: int, size: int, element_size: int) -> list[tuple[int, int]]:
        count = max(1, min(self.pieces, row * element_size // CHUNK_BYTES))
        return split(0, size, count)

    def _order(self) -> list[int]:
        return [(self.rank + step) % self.world for step in range(1, self.world)]

    def scatter(self, buffer, bounds, landed):
        """Store each piece of this rank's copies into the owners' rows of the latest round's half, a barrier per
        piece, then ``landed`` on a side stream. With rounds in flight the stores run on a stream of their own
        that waits for what the current stream was given so far (the gather that last read this half among it),
        not for what it is given later (class doc); a layout of one round stores on the current stream. Returns
        the join that makes the current stream wait for the landed rows and sums."""
        state = self._rounds[-1]
        shared, handle, row, me = state.shared, state.handle, state.row, self.rank
        element_size = buffer.element_size()
        main = torch.cuda.current_stream(shared.device)
        in_flight = self._halves > 1
        stores = side_stream(shared.device, "stores") if in_flight else main
        side = side_stream(shared.device, "copies")
        peers = {j: self.pool.peer_view(handle, j, shared.numel(), shared.dtype) for j in self._order()}
        if not isinstance(buffer, torch.Tensor) or self.whole:  # its own copy staged in its row like the peers'
            peers[me] = shared
        pieces = {j: self._pieces(row, bounds[j][1] - bounds[j][0], element_size) for j in [me, *peers]}
        mine = pieces[me]
        if in_flight:
            stores.wait_stream(main)
        for c in range(len(mine)):
            moves = []
            for j, view in peers.items():
                p0, p1 = pieces[j][c]
                lo = bounds[j][0]
                if p1 > p0:
                    moves.append(((buffer, lo + p0, lo + p1), (view, state.at(me) + p0, state.at(me) + p1)))
            with torch.cuda.stream(stores):
                self._moves(moves, shared)
                # piece c of every rank's copy of this rank's slice has landed (a channel apart from the gather's,
                # which may wait beside it on the current stream)
                handle.barrier(channel=1 if in_flight else 0)
            side.wait_stream(stores)
            with torch.cuda.stream(side):
                landed(*mine[c])
        done = torch.cuda.Event()
        done.record(side)

        def join() -> None:
            main.wait_event(done)

        return join

    def all_reduce_sums(self, sums: torch.Tensor) -> None:
        """SUM all-reduce of the small float64 sums over the group."""
        dist.all_reduce(sums, group=self.group)

    def discard(self, buffer, bounds) -> None:
        """The oldest round given rows is done with and no gather follows (`adasum.collectives.slices.SliceMover`):
        one barrier (every rank has read its rows, the joined sums among it), after which the next round that takes
        its half may store into it, as after a one-shot gather."""
        state = self._rounds.popleft()
        state.handle.barrier(channel=0)  # every rank has read its rows: the next round (or call) may store into them

    def gather(self, buffer, bounds, finish):
        """Store this rank's result into its next peer's output row by the last pass itself; once every rank's last
        pass is done, into the other peers' receive rows by one copy kernel; then copy the peers' results out of
        this rank's slots into `B` (class doc)."""
        state = self._rounds.popleft()
        shared, handle, me = state.shared, state.handle, self.rank
        peers = {j: self.pool.peer_view(handle, j, shared.numel(), shared.dtype) for j in self._order()}

        def slot(sender: int, receiver: int) -> int:  # where sender's result lands in receiver's buffer
            return state.output() if receiver == (sender + 1) % self.world else state.at(sender)

        lo, hi = bounds[me]
        size = hi - lo
        if self.whole:  # every rank wrote the whole round into `B`
            finish(0, size, [_slice(buffer, lo, hi, self.tiles)])
            handle.barrier(channel=0)  # every rank has read its rows: the next round (or call) may store into them
            return
        first, *rest = peers

        def out(j: int):  # sender j's result, from its slot in this rank's buffer into `B`
            return (shared, slot(j, me), slot(j, me) + bounds[j][1] - bounds[j][0]), (buffer, *bounds[j])

        finish(0, size, [_slice(buffer, lo, hi, self.tiles), peers[first][slot(me, first) : slot(me, first) + size]])
        early = []
        if rest:
            handle.barrier(channel=0)  # every rank's last pass is done: its receive rows are free
            # the previous rank's last pass filled this rank's output row: copied out beside the stores
            early = [(me - 1) % self.world] if self.early_copy_out else []
            self._moves([((buffer, lo, hi), (peers[j], slot(me, j), slot(me, j) + size)) for j in rest]
                        + [out(j) for j in early], shared)
        handle.barrier(channel=0)  # every peer's result is in this rank's slots
        self._moves([out(j) for j in peers if j not in early], shared)
        handle.barrier(channel=0)  # every rank's slots are read: the next round (or call) may store into them

    def _moves(self, moves, like: torch.Tensor) -> None:
        """Copy each (source run, target run) of `moves`, one side `B` and the other a flat symmetric row, in one
        kernel (class doc)."""
        triton_kernels.copy_tiles(self.copies.get(moves, like.device), like)


class SymmetricInPlace(InPlace, Transport):
    """`InPlace` on symmetric memory: a single tensor larger than the rounds runs with no buffer sized to it. The
    group's ring (a symmetric buffer of `buffer_bytes` ("ring"), made once) holds `slots` slots of P - 1 rows of a
    piece each (one per peer: rank j's row on rank r is j, less one above r), and P + 1 spare rows (the tails of
    the last slice: one from each rank, and the last rank's result).

    * scatter, piece c (slot c mod `slots`): rank r stores its copy of piece c of slice j straight from `B` into
      its row of the slot on rank j, for every j != r; then, on a "signals" stream, a signal-pad barrier once its
      copies out of piece c - 1 are done; then, on a side stream, it copies rows j of its own slot into `B` where
      its copies of the slices j were, and adds the piece's sums. The stores of piece c + 1 wait for the barrier
      of piece c + 2 - `slots` (every rank has copied that slot out by then): with two slots, piece c's own, so
      the ranks keep step; with three, the barriers and the copies out run beside the stores.
    * gather, piece c: the last combination writes the result into `B`'s slice; on a second side stream rank r
      stores it from there into its row of the slot on every peer (the scatter's moves in reverse: the copy
      engines store into a peer faster than they load from it), the slot freed the same way; a barrier on the
      signals stream; then, on the first side stream, it copies rows j of its own slot into `B`'s slices j. The
      combinations run ahead on the current stream. The last rank's result tail lands in the peers' last spare
      row, which only the last rank's scatter uses.

    The slots run in turn, the scatter's first piece in slot 0 and the gather's last piece in the last slot: a
    call's first stores go into slots whose gather pieces of the call before ended before a barrier every rank
    has passed, and its stores into the last slot wait for the scatter's first barrier, which every rank passes
    only after copying the last gather piece out. The gather's stores come after the tree's sums were all-reduced,
    which every rank joins only after its scatter's copies out of its ring. Nothing synchronises the host; the
    copies by the copy engines where `B` is a flat tensor (it always is: one tensor)."""

    timeout = None
    slots: int | None = None
    """Slots in the ring (None: three for two ranks, two above). Three let a piece's stores run beside the previous
    piece's barrier, which measured faster for two ranks; above two, the ranks then drift out of step, a rank
    receives from several peers at once, and the stores measured much slower (docs/benchmarks.md, settings)."""

    def __init__(self, group: dist.ProcessGroup | None, backend=None) -> None:
        Transport.__init__(self, group)
        InPlace.__init__(self, dist.get_world_size(group), dist.get_rank(group))
        self.pool = pool(group, backend)
        self._handle: Any = None

    @property
    def _slots(self) -> int:
        return self.slots or (3 if self.world == 2 else 2)

    def _ring(self, like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The ring in `like`'s dtype, and the elements of a piece."""
        width = like.element_size()
        rows = self._slots * (self.world - 1)
        piece = self.piece_elements(rows, width)
        size = buffer_bytes("ring")
        # the spare rows and the slots of the smallest piece, where the budget is smaller than that
        size = max(size - size % 16, ((self.world + 1) * self.spare + rows * piece) * width)
        raw, self._handle = self.pool.staging(size, _bytes_like(like), "ring", most=size)
        return raw[: raw.numel() - raw.numel() % width].view(like.dtype), piece

    def _slot_row(self, slot: int, sender: int, receiver: int, piece: int) -> int:
        """Where `sender`'s row of slot `slot` starts in `receiver`'s ring."""
        row = _among_peers(sender, receiver)
        return (self.world + 1) * self.spare + (slot * (self.world - 1) + row) * piece

    @staticmethod
    def _store(moves: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The (peer's row, source) copies of one piece, by the copy engines, one after another on the current
        stream in the order r + 1, r + 2, ...: while the ranks keep step (a barrier a piece), every rank then
        receives from one peer at a time. Each on a stream of its own measured slower (docs/benchmarks.md,
        settings)."""
        for row, source in moves:
            row.copy_(source, non_blocking=True)

    def _from_slot(self, ring, buffer: torch.Tensor, bounds, slot: int, p0: int, p1: int, piece: int) -> None:
        """Copy every peer's row of slot `slot` of this rank's ring into `B`: positions [p0, p1) of that peer's
        slice (the scatter: the peers' copies of this rank's slice; the gather: their results)."""
        for step in range(1, self.world):  # the peers in the order r + 1, r + 2, ... (`_start`)
            j = (self.rank + step) % self.world
            at = self._slot_row(slot, j, self.rank, piece)
            buffer[bounds[j][0] + p0 : bounds[j][0] + p1].copy_(ring[at : at + p1 - p0])

    def rows(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]]):
        """The rows in `buffer` and the spare rows (`InPlace.parts`)."""
        ring, _ = self._ring(buffer)
        spare = [ring[j * self.spare : (j + 1) * self.spare] for j in range(self.world)]
        return self.parts(buffer, bounds, spare)

    def _start(self, buffer: torch.Tensor):
        """(the ring, a piece's elements, the peers' rings in the order r + 1, r + 2, ..., the side stream) for a
        scatter or gather of `buffer`."""
        ring, piece = self._ring(buffer)
        order = [(self.rank + step) % self.world for step in range(1, self.world)]
        peers = {j: self.pool.peer_view(self._handle, j, ring.numel(), ring.dtype) for j in order}
        return ring, piece, peers, side_stream(ring.device, "copies")

    def _pieces(self, buffer: torch.Tensor, width: int, piece: int, stores: torch.cuda.Stream,
                side: torch.cuda.Stream, gather: bool, move: Callable[[int, int, int], None],
                landed: Callable[[int, int, int], None]) -> None:
        """Piece c, positions [p0, p1) of the slices' first `width` elements in pieces of `piece`, in its slot
        (`ring_slots`): ``move(slot, p0, p1)`` on `stores` once the slot is free on every rank, a barrier on the
        signals stream once this rank's copies out of piece c - 1 are done, then ``landed(slot, p0, p1)`` on `side`
        (the copies out of the slot). `stores`, the signals stream and `side` join the current stream at the end."""
        signals = side_stream(buffer.device, "signals")
        passed: list[torch.cuda.Event] = []
        cuts = self.pieces(width, piece)
        for c, ((p0, p1), slot) in enumerate(zip(cuts, ring_slots(len(cuts), self._slots, gather))):
            if c >= self._slots - 1:  # every rank copied piece c - slots out of this slot before that barrier
                stores.wait_event(passed[c - self._slots + 1])
            with torch.cuda.stream(stores):
                move(slot, p0, p1)
            signals.wait_stream(stores)
            if c:  # the copies out of piece c - 1 (a join only once forked: capture)
                signals.wait_stream(side)
            with torch.cuda.stream(signals):
                self._handle.barrier(channel=0)  # piece c has landed in every rank's slot
            passed.append(torch.cuda.Event())
            passed[-1].record(signals)
            side.wait_stream(signals)
            with torch.cuda.stream(side):
                landed(slot, p0, p1)
        main = torch.cuda.current_stream(buffer.device)
        for stream in (stores, signals, side):
            if stream is not main:
                main.wait_stream(stream)

    def scatter(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]], landed) -> None:
        """Store this rank's copies into the owners' ring, piece by piece (class doc)."""
        ring, piece, peers, side = self._start(buffer)
        me, last = self.rank, self.world - 1
        width, tail = self.widths(bounds)
        if tail and me != last:  # this rank's copy of the last slice's tail, into the last rank's spare row
            at = bounds[last][0] + width
            peers[last][me * self.spare : me * self.spare + tail].copy_(buffer[at : at + tail], non_blocking=True)

        def move(slot: int, p0: int, p1: int) -> None:
            rows = {j: self._slot_row(slot, me, j, piece) for j in peers}
            self._store([(view[rows[j] : rows[j] + p1 - p0], buffer[bounds[j][0] + p0 : bounds[j][0] + p1])
                         for j, view in peers.items()])

        def copied(slot: int, p0: int, p1: int) -> None:
            self._from_slot(ring, buffer, bounds, slot, p0, p1, piece)
            landed(p0, p1)

        self._pieces(buffer, width, piece, torch.cuda.current_stream(buffer.device), side, False, move, copied)
        if tail and me == last:  # the spare rows were stored into before the first barrier
            landed(width, width + tail)

    def gather(self, buffer: torch.Tensor, bounds: Sequence[tuple[int, int]], finish) -> None:  # type: ignore[override]
        """Push this rank's results into its peers' rings, and copy theirs out of its own (class doc)."""
        ring, piece, peers, side = self._start(buffer)
        main, pushes = torch.cuda.current_stream(buffer.device), side_stream(ring.device, "pushes")
        me, last = self.rank, self.world - 1
        width, tail = self.widths(bounds)
        out_tail = self.world * self.spare  # where the last rank's result tail lands (a spare row free elsewhere)
        lo = bounds[me][0]
        if tail and me == last:
            finish(width, width + tail, [buffer[lo + width : lo + width + tail]])
            pushes.wait_stream(main)
            with torch.cuda.stream(pushes):
                for view in peers.values():
                    view[out_tail : out_tail + tail].copy_(buffer[lo + width : lo + width + tail], non_blocking=True)

        def move(slot: int, p0: int, p1: int) -> None:
            with torch.cuda.stream(main):
                finish(p0, p1, [buffer[lo + p0 : lo + p1]])  # the next piece's combination follows at once
            pushes.wait_stream(main)
            rows = {j: self._slot_row(slot, me, j, piece) for j in peers}
            self._store([(view[rows[j] : rows[j] + p1 - p0], buffer[lo + p0 : lo + p1]) for j, view in peers.items()])

        def copied(slot: int, p0: int, p1: int) -> None:
            self._from_slot(ring, buffer, bounds, slot, p0, p1, piece)
            if p0 == 0 and tail and me != last:
                at = bounds[last][0] + width
                buffer[at : at + tail].copy_(ring[out_tail : out_tail + tail])

        self._pieces(buffer, width, piece, pushes, side, True, move, copied)


def ring_slots(pieces: int, slots: int, gather: bool) -> list[int]:
    """The slot of each of a phase's `pieces` in `SymmetricInPlace`'s ring of `slots` slots: in turn, the scatter's
    first in slot 0, the gather's last in the last slot. The first ``slots - 1`` pieces of a phase are stored before
    any barrier of that phase: the scatter's then never land in the slot of the gather's last piece of the call
    before, which a peer may still be copying out of; every other gather piece was copied out before a barrier
    that the storing rank passed."""
    first = (slots - pieces % slots) % slots if gather else 0
    return [(first + c) % slots for c in range(pieces)]


def in_place_mover(group: dist.ProcessGroup | None) -> SymmetricInPlace:
    """`group`'s `SymmetricInPlace` (one per group, kept by its communicator)."""
    return cast(SymmetricInPlace, communicator(group).transport(("in place",), lambda: SymmetricInPlace(group)))
