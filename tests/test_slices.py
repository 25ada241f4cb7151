"""The slice-parallel schedule (`adasum.collectives.slices`, ``transport="slices"``): its tree against the
independent NumPy reference, in one process and on real spawned groups (gloo here; NCCL with
ADASUM_TEST_BACKEND=nccl, where the mover is symmetric memory), with ranks bitwise equal, rounds included."""

import numpy as np
import pytest
import torch

import adasum
from adasum.collectives.slices import adasum_slices_, cut_round, rounds, tree_on_slice_
from adasum.core.layout import Layout
from adasum.core.tree import Tree, level_pairs
from adasum.transport.base import split
from recording import RecordingMover

import distributed
from reference import tree as reference_tree

SIZES = [1, 0, 7, 33, 5, 1000, 3, 0, 64, 129, 2, 17, 8, 511, 1, 1, 90, 4, 12, 6, 250, 31, 2, 9, 77, 3, 14, 1, 40, 5]
# the bound on the relative error of the tree against float64: a rounding to the dtype per level, with room
BOUNDS = {torch.float32: 1e-6, torch.float64: 1e-13}


def _data(seed: int, world: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in SIZES] for _ in range(world)]


def _worst_error(got: list[torch.Tensor], data: list[list[torch.Tensor]]) -> float:
    worst = 0.0
    for i, t in enumerate(got):
        ref = reference_tree([data[r][i].double().numpy() for r in range(len(data))])
        den = np.linalg.norm(ref)
        if den > 0:
            worst = max(worst, float(np.linalg.norm(t.double().cpu().numpy() - ref) / den))
    return worst


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cut_at", [None, 1000])
@pytest.mark.parametrize("world", [2, 3, 5, 6, 8])
def test_tree_on_one_slice_is_the_reference_tree(world, cut_at, dtype):
    # one process holding the whole buffer as its slice: the small all-reduces have nothing to add; `cut_at`: the
    # rows lie in two parts (as an in-place mover's do), and a piece of the last pass spans both. float64 runs
    # level by level, float32 from the Gram matrices beyond two ranks (`adasum.collectives.slices.by_gram`)
    data = _data(world, world, dtype)
    rows = [torch.cat(data[r]) for r in range(world)]
    layout = Layout(tuple(SIZES))
    out = torch.full_like(rows[0], float("nan"))
    if cut_at is None:
        parts = [(0, rows)]
    else:
        tails = [row[cut_at:].clone() for row in rows]  # elsewhere in memory, like the spare rows
        parts = [(0, [row[:cut_at] for row in rows]), (cut_at, tails)]
    finish = tree_on_slice_(parts, layout, (0, layout.numel), Tree(world), lambda sums: None, (0, len(SIZES)))
    for p0, p1 in ((0, 700), (700, 1500), (1500, layout.numel)):  # the last combination in pieces, as movers run it
        finish(p0, p1, [out[p0:p1]])
    assert _worst_error(list(out.split(SIZES)), data) < BOUNDS[dtype]


def test_level_pairs_cover_every_rank_once_and_carry_worker_counts():
    for world in range(2, 17):
        levels = level_pairs(Tree(world))
        absorbed = [b for pairs in levels for _, b, _, _ in pairs]
        assert sorted(absorbed) == list(range(1, world)) and len(set(absorbed)) == world - 1
        a, b, workers_a, workers_b = levels[-1][0]
        assert (a, len(levels[-1]), workers_a + workers_b) == (0, 1, world)


def test_rounds_keep_tensors_whole_and_cover_the_layout():
    sizes = [3, 0, 9, 2, 2, 20, 1]
    for capacity in (1, 4, 5, 11, 100, None):
        cut = rounds(sizes, capacity)
        assert cut[0][0] == 0 and cut[-1][1] == len(sizes) and cut[-1][3] == sum(sizes)
        for (f0, e0, lo0, hi0), (f1, _, lo1, _) in zip(cut, cut[1:]):
            assert e0 == f1 and hi0 == lo1
        for first, end, lo, hi in cut:
            assert hi - lo == sum(sizes[first:end])
            # over the capacity only with one tensor that holds elements (zero-size ones ride along)
            assert capacity is None or hi - lo <= capacity or sum(n > 0 for n in sizes[first:end]) == 1


class _RecordingMover(RecordingMover):
    """The recording mover (`recording.RecordingMover`) that also cuts one tensor's rounds itself."""

    def cut(self, numel: int):
        return split(0, numel, self.world)


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_the_schedule_scatters_rounds_ahead_and_drains_before_a_tensor_run_in_place(ahead):
    """With a mover that keeps `ahead` rounds in flight, round k + ahead - 1 is scattered before round k's tree
    (its join) and gather; rounds are gathered in order; a tensor run in place waits for every round before it."""
    calls: list[str] = []
    in_place_calls: list[str] = []
    mover = _RecordingMover(ahead, 8, calls, _RecordingMover(1, 8, in_place_calls))
    sizes = [3, 4, 2, 5, 1, 30, 3, 3]  # rounds: [3, 4], [2, 5, 1], 30 alone (in place), [3, 3]
    buffer = torch.randn(sum(sizes))
    adasum_slices_(buffer, Layout(tuple(sizes)), mover)
    assert in_place_calls == ["rows 0", "scatter 0", "join 0", "gather 0"]
    before = ["rows 0", "scatter 0", "join 0", "gather 0", "rows 1", "scatter 1", "join 1", "gather 1"]
    if ahead > 1:
        before = ["rows 0", "scatter 0", "rows 1", "scatter 1", "join 0", "gather 0", "join 1", "gather 1"]
    assert calls == [f"reserve {ahead}", *before, "rows 2", "scatter 2", "join 2", "gather 2"], calls
    calls.clear()
    adasum_slices_(torch.randn(25), Layout((5, 5, 5, 5, 5)), mover)  # five rounds of one tensor each
    order = []
    for k in range(5):  # round k's tree and gather come once round k + ahead - 1 is scattered, the rest at the end
        order += [f"rows {k}", f"scatter {k}"]
        if k >= ahead - 1:
            order += [f"join {k - ahead + 1}", f"gather {k - ahead + 1}"]
    for k in range(max(0, 5 - ahead + 1), 5):
        order += [f"join {k}", f"gather {k}"]
    assert calls == [f"reserve {ahead}", *order], calls
    calls.clear()  # a layout that fits one round of the whole buffer runs in one, with nothing in flight beside it
    adasum_slices_(torch.randn(12), Layout((3, 4, 5)), _RecordingMover(ahead, 8, calls, single=12))
    assert calls == ["reserve 1", "rows 0", "scatter 0", "join 0", "gather 0"], calls


def slice_parallel(rank, world, transport="slices"):
    dev = distributed.device_for(rank)
    out = {}
    # bf16 runs the tree from the Gram matrices (`adasum.collectives.slices.by_gram`; two ranks: one level, the
    # same formulas): float64 throughout, one rounding to bf16 at the end (relative 2**-9 per element, doubled for
    # the float32 step), so within 2**-8 of the float64 tree; float32 likewise within BOUNDS; float64 level by level
    for dtype, bound in [*BOUNDS.items(), (torch.bfloat16, 2.0**-8)]:
        data = _data(100 + world, world, dtype)
        mine = [t.clone().to(dev) for t in data[rank]]
        for call in range(3):  # repeated calls on the same tensors: captured and replayed graphs on GPUs
            for t, src in zip(mine, data[rank]):
                t.copy_(src)
            adasum.all_reduce(mine, transport=transport)
        worst = _worst_error(mine, data)
        assert worst < bound, (dtype, worst)
        out[str(dtype)] = torch.cat([t.cpu().reshape(-1) for t in mine]).view(torch.uint8).numpy().tobytes()
    return out


@pytest.mark.nccl
@pytest.mark.parametrize("transport", ["slices", "one-shot"])
@pytest.mark.parametrize("world", distributed.world_sizes(2, 3, 4) if distributed.BACKEND == "nccl" else [2, 3, 5])
def test_slice_parallel_matches_reference_and_ranks_agree(world, transport):
    # one-shot: every rank runs the whole tree on every copy; its ranks are equal only if their kernels read the
    # same rows the same way
    results = distributed.run(world, slice_parallel, transport)
    distributed.assert_ranks_agree(results)


@pytest.mark.nccl
@pytest.mark.parametrize("transport", ["slices", "one-shot"])
@pytest.mark.parametrize("world", distributed.world_sizes(2, 3, 4) if distributed.BACKEND == "nccl" else [4])
def test_slice_parallel_in_rounds_through_a_small_budget(world, transport):
    # a budget of a few KiB: the layout runs in many rounds, and tensors larger than a round make their own
    results = distributed.run(world, slice_parallel, transport, env={"ADASUM_MEMORY_MB": "0.004"})
    distributed.assert_ranks_agree(results)


def test_one_shot_rounds_give_every_rank_the_whole_round():
    class Mover:
        world, whole = 3, True

    assert cut_round(Mover(), 10, 70) == [(10, 70)] * 3
    Mover.whole = False
    assert cut_round(Mover(), 10, 70) == split(10, 70, 3)


GROWING = [200_000, 900_000, 50_000, 700_000, 300_000, 880_000]
"""Under a budget of 7.3 MiB (rounds of about a million fp32 elements at 3 and 4 ranks) these make rounds whose rows
grow and shrink. A rank's previous rank stores its result into the rank's output row while the rank's last pass
still reads its receive rows: the output row must lie where no round's receive rows reach
(`adasum.transport.symmetric.SliceRound`), and a round's stores into a half's rows must wait until every rank has
copied the results of the round before that used the half out of them (the next round's stores run beside this
round's tree)."""


def growing_rounds(rank, world, calls, transport):
    import hashlib

    dev = distributed.device_for(rank)
    g = torch.Generator().manual_seed(900 + world)
    data = [[torch.randn(n, generator=g, dtype=torch.float64).float() for n in GROWING] for _ in range(world)]
    mine = [t.clone().to(dev) for t in data[rank]]
    digests = []
    for _ in range(calls):  # the same inputs each call (an eager call, then captured and replayed graphs on GPUs)
        for t, src in zip(mine, data[rank]):
            t.copy_(src)
        adasum.all_reduce(mine, transport=transport)
        flat = torch.cat([t.cpu().reshape(-1) for t in mine])
        digests.append(hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest())
    assert len(set(digests)) == 1, f"rank {rank}: the calls' results differ: {digests}"
    worst = _worst_error(mine, data)
    assert worst < BOUNDS[torch.float32], worst
    return digests[0]


@pytest.mark.nccl
@pytest.mark.parametrize("world", distributed.world_sizes(2, 3, 4) if distributed.BACKEND == "nccl" else [3])
@pytest.mark.parametrize("transport", ["slices", "one-shot"])
def test_rounds_whose_rows_grow_and_shrink_agree_across_ranks_and_calls(world, transport):
    calls = 8 if distributed.BACKEND == "nccl" else 2
    # one-shot: a row holds a whole round, so the same budget makes rounds of a few tensors each
    results = distributed.run(world, growing_rounds, calls, transport, env={"ADASUM_MEMORY_MB": "7.3"})
    distributed.assert_ranks_agree(results)


IN_PLACE_SIZES = [0, 20003, 7, 300, 0, 9000, 1]
"""Under a budget of 0.05 MiB, 20003 and 9000 elements are larger than a round at 2 to 7 ranks (fp32): each runs
in place, through a ring of pieces, the 20003 with a tail for the last rank's spare rows; an empty tensor before
it rides in its round."""


def _kept_bytes(group=None) -> int:
    """What the group's movers keep: symmetric buffers and c10d workspaces."""
    from adasum.transport.communicator import communicator

    comm = communicator(group)
    kept = 0
    from adasum.transport.symmetric import SymmetricPool

    pool = comm.resources.get(SymmetricPool)
    if pool is not None:
        kept += sum(b.numel() * b.element_size() for b, _ in pool.buffers.values())
    movers = list(comm.transports.values())
    movers += [m.in_place for m in movers if m.in_place is not None]
    for mover in movers:
        for name in ("_rows", "_space"):
            space = getattr(mover, name, None)
            kept += 0 if space is None else space.numel() * space.element_size()
    return kept


def in_place(rank, world, transport):
    from adasum.transport.slices import buffer_bytes

    dev = distributed.device_for(rank)
    g = torch.Generator().manual_seed(500 + world)
    data = [[torch.randn(n, generator=g, dtype=torch.float64).float() for n in IN_PLACE_SIZES] for _ in range(world)]
    mine = [t.clone().to(dev) for t in data[rank]]
    for call in range(3):  # repeated calls on the same tensors: captured and replayed graphs on GPUs
        for t, src in zip(mine, data[rank]):
            t.copy_(src)
        adasum.all_reduce(mine, transport=transport)
    worst = _worst_error(mine, data)
    assert worst < BOUNDS[torch.float32], worst
    kept, allowed = _kept_bytes(), buffer_bytes() + buffer_bytes("ring")
    assert kept <= allowed, (kept, allowed)
    assert max(IN_PLACE_SIZES) * 4 > allowed  # the largest tensor alone would not have fitted
    return torch.cat([t.cpu() for t in mine]).view(torch.uint8).numpy().tobytes()


IN_PLACE_CASES = (
    [(w, t) for w in distributed.world_sizes(2, 3, 4) for t in ("slices", None)] if distributed.BACKEND == "nccl"
    else [(2, "slices"), (3, "slices"), (7, "slices")]
)
"""(ranks, transport): on NCCL the slice-parallel mover and the default (whose VHDD rounds run such a tensor in place
too); on gloo the slice-parallel mover at 2, 3 and 7 ranks (a job restarted on 7; the default there, point-to-point,
keeps no buffer)."""


@pytest.mark.nccl
@pytest.mark.parametrize("world, transport", IN_PLACE_CASES)
def test_tensors_larger_than_a_round_run_in_place_within_the_budget(world, transport):
    # transport None (NCCL): the default in one host, the symmetric transport at 2 and 4 ranks
    results = distributed.run(world, in_place, transport, env={"ADASUM_MEMORY_MB": "0.05"})
    distributed.assert_ranks_agree(results)


def vhdd_in_place(rank, world):
    from datetime import timedelta

    from adasum.collectives.vhdd import adasum_flat_
    from adasum.transport.c10d import PointToPointC10d
    from adasum.transport.slices import C10dInPlace

    class Budgeted(PointToPointC10d):  # the VHDD schedule's rounds with an in-place mover, as the symmetric one has
        mover = None

        def round_elements(self, element_size):
            return 1000

        @property
        def in_place(self):
            return self.mover

    class Recording(C10dInPlace):
        def __init__(self, *args):
            super().__init__(*args)
            self.seen: list[int] = []  # the sizes of the buffers it was handed

        def rows(self, buffer, bounds):
            self.seen.append(buffer.numel())
            return super().rows(buffer, bounds)

    transport = Budgeted(None, 1 << 20, timedelta(seconds=60))
    transport.mover = Recording(None, timedelta(seconds=60))
    g = torch.Generator().manual_seed(700 + world)
    data = [[torch.randn(n, generator=g, dtype=torch.float64) for n in IN_PLACE_SIZES] for _ in range(world)]
    flat = torch.cat(data[rank])
    adasum_flat_(flat, IN_PLACE_SIZES, transport=transport)
    assert transport.mover.seen == [20003, 9000]  # the two tensors larger than a round went through the mover
    assert _worst_error(list(flat.split(IN_PLACE_SIZES)), data) < BOUNDS[torch.float64]
    return flat.numpy().tobytes()


@pytest.mark.parametrize("world", [2, 3])
def test_vhdd_rounds_hand_a_tensor_larger_than_a_round_to_the_in_place_mover(world):
    distributed.assert_ranks_agree(distributed.run(world, vhdd_in_place))


def non_finite_slices(rank, world):
    dev = distributed.device_for(rank)
    tensors = [torch.ones(6, device=dev), torch.ones(4, device=dev), torch.full((3000,), 2.0, device=dev)]
    if rank == world - 1:
        tensors[0][2] = float("nan")
        tensors[2][2999] = float("inf")
    adasum.all_reduce(tensors, transport="slices")
    assert torch.isnan(tensors[0]).all() and not torch.isfinite(tensors[2]).any(), tensors
    assert torch.equal(tensors[1].cpu(), torch.ones(4))  # parallel copies: their mean
    return [t.cpu().numpy().tobytes() for t in tensors]


@pytest.mark.nccl
@pytest.mark.parametrize("world", distributed.world_sizes(3, 4) if distributed.BACKEND == "nccl" else [3, 4])
def test_a_non_finite_copy_makes_its_whole_tensor_non_finite_on_every_rank(world):
    distributed.assert_ranks_agree(distributed.run(world, non_finite_slices))


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_in_place_ring_slots_keep_a_call_off_the_slot_a_peer_may_still_copy_out_of(slots):
    """The in-place mover's slots in turn within a phase, and across calls: the scatter's pieces stored before its
    first barrier never land in the slot of the gather's last piece of the call before (the one slot a slower peer
    may still be copying out of)."""
    from adasum.transport.symmetric import ring_slots

    for pieces in range(1, 13):
        for gather in (False, True):
            order = ring_slots(pieces, slots, gather)
            assert all(order[c] == (order[c - 1] + 1) % slots for c in range(1, pieces)), order
        last = ring_slots(pieces, slots, True)[-1]
        for next_pieces in range(1, 13):
            unguarded = ring_slots(next_pieces, slots, False)[: slots - 1]
            assert last not in unguarded, (pieces, next_pieces, last, unguarded)


def default_choice(rank, world):
    from adasum.collectives.api import list_transport
    from adasum.settings import current

    limit = current().one_shot_bytes // (world - 1)  # bytes of a buffer whose peers' copies fill the limit
    return list_transport(None, None, limit).name, list_transport(None, None, limit + 1).name


@pytest.mark.nccl
@pytest.mark.parametrize("world", distributed.world_sizes(2, 3, 4) if distributed.BACKEND == "nccl" else [2, 3])
def test_the_default_runs_a_buffer_one_shot_up_to_the_limit(world):
    # NCCL inside one host: at two ranks one-shot up to the limit, then the push protocol; above, the slice schedule
    # (`adasum.transport.ONE_SHOT_WORLDS`); gloo: point-to-point whatever the size (one-shot only where named)
    results = distributed.run(world, default_choice, env={"ADASUM_TEST_TRANSPORT": ""})
    expected = ("p2p", "p2p") if distributed.BACKEND != "nccl" else (
        ("one-shot", "symmetric") if world == 2 else ("slices", "slices"))
    assert all(r == expected for r in results), results
