"""A slice mover for the schedules' order tests: rank 0 of two, in one process, that records the calls the
schedule makes (which round is given rows, scattered, joined and gathered, in what order) and checks that rounds
are let go in the order they were given rows. Every rank's copy of a slice is this rank's, so the two workers are
equal; only the order of the calls counts."""

from __future__ import annotations


class RecordingMover:
    """The calls go into `calls`; `ahead` rounds may be in flight, each of at most `capacity` elements (`single`
    with one round in flight; None: `capacity`); `in_place`: the mover of a tensor run in place."""

    name, scattered, world, rank, timeout, whole = "recording", False, 2, 0, None, False

    def __init__(self, ahead: int, capacity: int, calls: list, in_place=None, single: int | None = None) -> None:
        self.ahead, self.capacity, self.calls, self.in_place = ahead, capacity, calls, in_place
        self.single = capacity if single is None else single  # a round's elements with one round in flight
        self.given = 0
        self.waiting: list[tuple[int, list]] = []

    def round_elements(self, element_size: int, ahead: int = 1) -> int:
        return self.single if ahead == 1 else self.capacity

    def reserve(self, row: int, like, ahead: int = 1) -> None:
        self.calls.append(f"reserve {ahead}")
        self.given = 0

    def rows(self, buffer, bounds):
        k, self.given = self.given, self.given + 1
        self.waiting.append((k, list(bounds)))
        self.calls.append(f"rows {k}")
        lo, hi = bounds[self.rank]
        return [(0, [buffer[lo:hi].clone() for _ in range(self.world)])]

    def scatter(self, buffer, bounds, landed):
        k = self.waiting[-1][0]
        self.calls.append(f"scatter {k}")
        landed(0, bounds[self.rank][1] - bounds[self.rank][0])
        return lambda: self.calls.append(f"join {k}")

    def all_reduce_sums(self, sums) -> None:
        pass

    def done(self, bounds, what: str) -> None:
        """Let the oldest round go (`what`: gather or discard), checking it is the one given these bounds."""
        k, given = self.waiting.pop(0)
        assert given == list(bounds), (k, given, bounds)  # in the order they were given rows
        self.calls.append(f"{what} {k}")

    def gather(self, buffer, bounds, finish) -> None:
        self.done(bounds, "gather")
        lo, hi = bounds[self.rank]
        finish(0, hi - lo, [buffer[lo:hi]])
