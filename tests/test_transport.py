"""The transport protocol on gloo: the VHDD schedule through each transport a CPU group can run
(point-to-point; the NCCL-collectives transport's all-gather, which gloo also has) against the
independent NumPy tree of `reference.py`, ranks bitwise identical; and what `select` accepts."""

import time

import pytest
import torch

from adasum.collectives.vhdd import adasum_flat_, final_slices
from adasum.transport import select
from adasum.transport.base import aligned_cut
from adasum.transport.c10d import Collectives, post
from adasum.transport.groups import group_timeout

import distributed
from reference import tree as reference_tree

SIZES = [5, 0, 130, 1, 77, 3001, 2, 0, 64]


def body(rank, world, transport):
    g = torch.Generator().manual_seed(world)
    every = [torch.randn(sum(SIZES), generator=g, dtype=torch.float64) for _ in range(world)]
    errors, results = [], []
    for piece in (1 << 20, 100):  # whole halves, and pieces that cut tensors
        mine = every[rank].clone()
        if transport == "collectives":
            chosen = Collectives(None, piece * 8, group_timeout(), post)
        else:
            chosen = select(None, "p2p", piece_elements=(piece * 2, piece * 2))
        adasum_flat_(mine, SIZES, transport=chosen)
        start = 0
        for n in SIZES:
            if n:
                ref = torch.from_numpy(reference_tree([v[start : start + n].numpy() for v in every]))
                errors.append(float((mine[start : start + n] - ref).norm() / ref.norm()))
            start += n
        results.append(mine.numpy().tobytes())
    with pytest.raises(ValueError, match="needs NCCL"):
        select(None, "symmetric")
    with pytest.raises(ValueError, match="transport must be one of"):
        select(None, "carrier-pigeon")
    if world > 1:
        assert select(None, "one-shot").whole and not select(None, "slices").whole
        with pytest.raises(ValueError, match="no hierarchical placement"):
            select(None, "one-shot", placed=True)
        assert select(None, None, nbytes=8).name == "p2p"  # gloo: one-shot only where asked for
    return max(errors, default=0.0), results


def test_one_shot_takes_buffers_whose_peer_copies_fit_the_setting():
    from unittest.mock import patch

    from adasum.settings import override
    from adasum.transport import one_shot

    with override(one_shot_bytes=1000):
        assert one_shot(2, 1000) and not one_shot(2, 1001)
        assert not one_shot(1, 8) and not one_shot(2, None)
        with patch("adasum.transport.ONE_SHOT_WORLDS", (2, 5)):
            assert one_shot(5, 250) and not one_shot(5, 251)  # four peers' copies of 250 bytes
        assert not one_shot(5, 250)  # a group size where one-shot was not measured
    with override(one_shot_bytes=0):
        assert not one_shot(2, 1)


# 8 ranks (three levels) run through the same transport in test_collectives
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_point_to_point_transport_matches_reference(world):
    results = distributed.run(world, body, "p2p")
    assert all(err < 1e-12 for err, _ in results), [err for err, _ in results]
    assert all(r[1] == results[0][1] for r in results)


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_transport_gathers_every_slice_in_place(world):
    results = distributed.run(world, body, "collectives")
    assert all(err < 1e-12 for err, _ in results), [err for err, _ in results]
    assert all(r[1] == results[0][1] for r in results)


def test_final_slices_tile_the_buffer_in_halving_order():
    for world, levels in [(2, [1]), (4, [1, 2]), (8, [1, 2, 4])]:
        for numel in (0, 1, 7, 64, 1001):
            finals = final_slices(numel, world, levels)
            assert sorted(finals) == sorted(set(finals)) or numel < world
            covered = sorted((lo, hi) for lo, hi in finals if hi > lo)
            assert sum(hi - lo for lo, hi in covered) == numel
            segment = (0, numel)
            for d in levels:  # rank 0 always keeps the lower half, cut where the transports cut
                lo, hi = segment
                segment = (lo, aligned_cut(lo, lo + (hi - lo) // 2))
            assert finals[0] == segment


def fake_symmetric_memory(made: list):
    """A symmetric-memory backend for `SymmetricPool` that allocates host tensors (kept in `made`)."""
    from types import SimpleNamespace

    def empty(n, dtype, device):
        made.append(torch.empty(n, dtype=dtype, device=device))
        return made[-1]

    return SimpleNamespace(empty=empty, rendezvous=lambda buffer, name: SimpleNamespace(name=name))


def test_a_symmetric_buffer_grows_within_its_cap_and_the_outgrown_one_is_dropped():
    """A growth doubles a buffer but never past `most` (unless one call needs more), the first buffer is at least
    a mebi-element only where `most` allows it, and the outgrown buffer is not kept (the device drained first, and
    the graphs captured on it were dropped: `test_graphs`)."""
    import weakref
    from types import SimpleNamespace

    from adasum.transport.symmetric import SymmetricPool

    made: list = []
    pool = SymmetricPool(SimpleNamespace(group_name="fake"), backend=fake_symmetric_memory(made))
    like = torch.empty(0)
    first, _ = pool.staging(10, like, most=1000)
    assert first.numel() == 1000  # the floor of a mebi-element, capped
    alive = weakref.ref(first)
    assert pool.staging(5, like, most=1000)[0] is first  # big enough: kept
    grown, _ = pool.staging(1001, like, most=1500)
    assert grown.numel() == 1500  # doubled, capped at `most`
    assert pool.staging(4000, like, most=1500)[0].numel() == 4000  # one call needs more than the cap
    del first, grown
    made.clear()
    assert alive() is None and len(pool.buffers) == 1  # outgrown, dropped
    pool.release()
    assert not pool.buffers


def test_the_views_of_peers_buffers_are_bounded_and_released():
    """A view of a peer's buffer per (buffer, peer, elements, dtype): a new size every call keeps at most `MOST`
    views, the most recently used (one in use every call stays the very view); the pool's release drops them."""
    from types import SimpleNamespace

    from adasum.transport.caches import MOST
    from adasum.transport.symmetric import SymmetricPool

    pool = SymmetricPool(SimpleNamespace(group_name="fake"), backend=fake_symmetric_memory([]))
    _, handle = pool.staging(10, torch.empty(0))
    handle.get_buffer = lambda peer, shape, dtype, offset: torch.empty(shape, dtype=dtype)
    kept = pool.peer_view(handle, 1, 3, torch.float32)
    for numel in range(4, MOST + 200):
        pool.peer_view(handle, 1, numel, torch.float32)
        assert pool.peer_view(handle, 1, 3, torch.float32) is kept
    assert pool.held() == 1 + MOST, pool.held()  # the buffer and its peers' views
    pool.release()
    assert pool.held() == 0


def test_the_symmetric_transports_take_their_memory_backend_and_share_the_groups_pool():
    """The backend comes through the transport's constructor; both symmetric transports of a group use its one
    pool, which `adasum.release()` frees; another backend for a group whose pool exists is refused."""
    import weakref

    import torch.distributed as dist

    import adasum
    from adasum.transport.communicator import communicator
    from adasum.transport.symmetric import SymmetricMemory, SymmetricPool, SymmetricSlices

    made: list = []
    backend = fake_symmetric_memory(made)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        moving = SymmetricMemory(None, backend=backend)
        fused = moving.fusion_buffer(10, torch.zeros(1))
        assert fused.numel() == 10 and fused.data_ptr() == made[0].data_ptr()
        slices = SymmetricSlices(None, backend=backend)
        assert slices.pool is moving.pool is communicator(None).resources[SymmetricPool]
        with pytest.raises(ValueError, match="another backend"):
            SymmetricMemory(None, backend=fake_symmetric_memory([]))
        alive = weakref.ref(made.pop())
        del fused, moving, slices
        adasum.release()
        assert alive() is None
    finally:
        dist.destroy_process_group()


def test_the_slice_movers_output_row_lies_past_every_rounds_receive_rows():
    """A round's stores into a peer's receive rows start at once, while other ranks may still load the previous
    round's results from that peer's output row: the output row sits where no round's receive rows reach, in any
    buffer large enough for the round, however the rounds' rows grow or shrink (a layout's or the next call's); and
    each half of the buffer (rounds in flight, `SymmetricSlices.ahead`) keeps its rows and output row to itself."""
    from adasum.transport.symmetric import OUTPUT_ALIGN, SliceRound, slices_bytes

    g = torch.Generator().manual_seed(0)
    for world in range(2, 9):
        for ahead in (1, 2, 3):
            rows = [int(x) for x in torch.randint(1, 5000, (12,), generator=g)] + [1, 4999, 5000]
            extra = int(torch.randint(0, 40, (1,), generator=g))
            numel = max(slices_bytes(world, ahead, r, 4) for r in rows) // 4 + extra
            size = numel // ahead // OUTPUT_ALIGN * OUTPUT_ALIGN  # as `SymmetricSlices.rows` cuts the halves
            for half in range(ahead):
                base = half * size
                assert base % OUTPUT_ALIGN == 0 and base + size <= numel, (world, ahead, numel)
                for row in rows:
                    state = SliceRound(torch.empty(0), None, row, half, size)
                    start = state.output()
                    assert state.at(0) == base and state.at(world) == base + world * row
                    assert start % OUTPUT_ALIGN == 0 and start + row <= base + size, (world, ahead, row, numel)
                    assert all(base + world * other <= start for other in rows), (world, ahead, row, numel)


def test_the_slice_movers_gather_routes_every_result_once_its_rows_are_read(monkeypatch):
    """`SymmetricSlices.gather` on P threads standing in for the ranks (their symmetric buffers CPU tensors, each
    barrier a thread barrier, each copy kernel its copies in order, random pauses between steps): the last pass
    (here the sum of the rank's rows) reads every receive row before any peer stores into it, the previous rank's
    result is copied out of the output row only once its last pass is done, and every rank's `B` ends with every
    rank's result, for P = 2..6 and rows of odd lengths. The movers are made on a group of one process, each then
    told its thread's rank and given its thread's memory; `rows` lays out the round the gather then routes."""
    import random
    import threading
    from types import SimpleNamespace

    import torch.distributed as dist

    import adasum
    from adasum.kernels import triton as triton_kernels
    from adasum.transport.symmetric import SymmetricSlices, slices_bytes

    host_memory = SimpleNamespace(empty=lambda n, dtype, device: torch.empty(n, dtype=dtype, device=device),
                                  rendezvous=lambda buffer, name: SimpleNamespace(name=name))
    chance = random.Random(0)

    def pause() -> None:
        time.sleep(chance.random() * 0.002)

    def moves(pairs, like) -> None:  # the copy kernel: its (source run, target run) pairs in order
        for (src, a, b), (dst, c, d) in pairs:
            pause()
            dst[c:d].copy_(src[a:b])

    monkeypatch.setattr(triton_kernels, "copy_tiles", moves)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for world in range(2, 7):
            rows = [5 + 3 * j for j in range(world)]  # slices of different lengths
            bounds = [(sum(rows[:j]), sum(rows[: j + 1])) for j in range(world)]
            width = max(rows)
            g = torch.Generator().manual_seed(world)
            buffers = [torch.randn(bounds[-1][1], generator=g, dtype=torch.float64) for _ in range(world)]
            size = slices_bytes(world, 1, width, 8) // 8
            shared = [torch.randn(size, generator=g, dtype=torch.float64) for _ in range(world)]
            barrier = threading.Barrier(world, timeout=30)  # a rank that never arrives breaks it instead of hanging
            handle = SimpleNamespace(barrier=lambda channel: barrier.wait())
            movers, received = [], []
            for rank in range(world):
                mover = SymmetricSlices(None, backend=host_memory)
                mover.world, mover.rank = world, rank
                mover.pool = SimpleNamespace(
                    staging=lambda numel, like, purpose, most=None, r=rank: (shared[r].view(torch.uint8), handle),
                    peer_view=lambda handle, j, numel, dtype: shared[j],
                )
                mover.copies = SimpleNamespace(get=lambda pairs, device: pairs)  # the copy kernel's table: its pairs
                (offset, views), = mover.rows(buffers[rank], bounds)  # the round's receive rows, its own copy in `B`
                assert offset == 0 and [v.numel() for v in views] == [rows[rank]] * world
                movers.append(mover)
                received.append(views)

            def last_pass(r: int) -> torch.Tensor:  # rank r's result: its own copy plus every receive row
                return sum(received[r][1:], received[r][0].clone())

            expected = [last_pass(r) for r in range(world)]

            def run(r: int) -> None:
                def finish(p0, p1, outs):  # the last pass reads every row of this rank's slice
                    pause()
                    result = last_pass(r)
                    for out in outs:
                        out.copy_(result[p0:p1])

                movers[r].gather(buffers[r], bounds, finish)

            threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for r in range(world):
                for j in range(world):
                    assert torch.equal(buffers[r][bounds[j][0] : bounds[j][1]], expected[j]), (world, r, j)
            adasum.release()  # the group's pool (its memory from `host_memory`), for the next world's movers
    finally:
        dist.destroy_process_group()


def test_nccl_is_found_behind_a_group_of_several_backends(monkeypatch):
    """``init_process_group()`` with no backend makes "cpu:gloo,cuda:nccl" on a GPU host, which ``get_backend``
    reports as "undefined": its CUDA tensors go through NCCL (they were refused as needing CPU tensors). A CPU
    group of that kind, or one whose CUDA backend is gloo, is not NCCL."""
    import torch.distributed as dist

    from adasum.transport.groups import uses_nccl

    class ProcessGroupNCCL:  # the class name is what `uses_nccl` reads (no CUDA build here)
        pass

    class ProcessGroupGloo:
        pass

    class Group:
        def __init__(self, cuda):
            self.cuda = cuda

        def _get_backend(self, device):
            if self.cuda is None:
                raise RuntimeError("No backend type associated with device type cuda")
            return self.cuda()

    names = {"nccl": "nccl", "gloo": "gloo"}
    monkeypatch.setattr(dist, "get_backend", lambda group=None: names.get(group, "undefined"))
    assert uses_nccl("nccl") and not uses_nccl("gloo")
    assert uses_nccl(Group(ProcessGroupNCCL))
    assert not uses_nccl(Group(ProcessGroupGloo)) and not uses_nccl(Group(None))


def test_a_cpu_group_without_a_named_backend_serves_cpu_tensors():
    import torch.distributed as dist

    import adasum
    from adasum.transport.groups import group_device, uses_nccl

    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)  # no backend: "undefined" on this torch
    try:
        assert not uses_nccl() and group_device() == torch.device("cpu")
        x = [torch.ones(3)]
        adasum.all_reduce(x)
        assert torch.equal(x[0], torch.ones(3))
    finally:
        dist.destroy_process_group()


def test_the_transport_put_first_is_part_of_the_groups_choice(monkeypatch):
    """The group keeps the transport it chose for a call, per choice: the same call under another ``transport_first``
    (`adasum.settings.override`) gets the transport that setting puts first, not the one chosen before it. An
    NCCL group stands in: `select` reads the backend (patched), the symmetric verdict is no."""
    import torch.distributed as dist

    import adasum.transport
    from adasum.collectives.vhdd import transport_for
    from adasum.settings import override
    from adasum.transport import symmetric

    monkeypatch.setattr(adasum.transport, "uses_nccl", lambda group=None: True)
    monkeypatch.setattr(symmetric, "supported", lambda group: False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert transport_for(None, None, True).name == "p2p"
        with override(transport_first="collectives"):
            assert transport_for(None, None, True).name == "collectives"
        assert transport_for(None, None, True).name == "p2p"
    finally:
        dist.destroy_process_group()


def refused_body(rank, world, names):
    """`adasum.all_reduce` with transport `names[rank]` (one the group may not run): (error type, message, whether
    it came within 10 s, the tensor untouched)."""
    import adasum

    t = torch.ones(6) * (rank + 1)
    start = time.monotonic()
    try:
        adasum.all_reduce([t], transport=names[rank])
    except (ValueError, RuntimeError) as error:
        return type(error).__name__, str(error), time.monotonic() - start < 10, bool((t == rank + 1).all())
    return None, None, time.monotonic() - start < 10, bool((t == rank + 1).all())


def test_a_transport_the_group_cannot_run_is_refused_on_every_rank():
    """A transport named that a gloo group cannot run is a ValueError naming the call on every rank, after the
    cross-rank check of the transports asked for: where only some ranks name it, every rank gets the
    configuration's difference at once (the others do not wait for the group's timeout)."""
    needs = ("transport='symmetric' needs NCCL and a power-of-two group (no hierarchical placement); "
             "pass transport=None to let adasum choose")
    results = distributed.run(2, refused_body, ["symmetric", "symmetric"], timeout_s=30)
    assert results == [("ValueError", f"adasum.all_reduce: {needs}", True, True)] * 2, results
    results = distributed.run(2, refused_body, ["symmetric", "p2p"], timeout_s=30)
    differ = ("adasum.all_reduce: the configuration differs across ranks: rank 0 has adasum.all_reduce "
              "transport=symmetric nonfinite=propagate, rank 1 has adasum.all_reduce transport=p2p nonfinite=propagate")
    assert results == [("ValueError", differ, True, True)] * 2, results
    results = distributed.run(3, refused_body, [None, "collectives", None], timeout_s=30)
    differ = ("adasum.all_reduce: the configuration differs across ranks: rank 0 has adasum.all_reduce "
              "transport=None nonfinite=propagate, rank 1 has adasum.all_reduce transport=collectives "
              "nonfinite=propagate")  # what each rank asked for: compared before the (possibly collective) choice
    assert results == [("ValueError", differ, True, True)] * 3, results


def test_the_table_holds_the_built_in_transports_in_the_names_order():
    """The names ``transport=`` takes, the settings' names and the `TransportName` type are the table's rows."""
    from adasum.options import TransportName, choices
    from adasum.settings import TRANSPORT_NAMES
    from adasum.transport import BUILT_IN
    from adasum.transport.registry import entry, register_transport, transport_names

    assert transport_names()[: len(BUILT_IN)] == BUILT_IN == choices(TransportName) == TRANSPORT_NAMES
    assert [entry(n).serves for n in BUILT_IN] == ["vhdd", "vhdd", "vhdd", "slices", "slices"]
    with pytest.raises(ValueError, match="serves must be one of"):
        register_transport("bad", lambda need: None, serves="ring")
    with pytest.raises(ValueError, match="requirements must be among"):
        register_transport("bad", lambda need: None, requires=("infiniband",))
    assert "bad" not in transport_names()


def toy_body(rank, world):
    import adasum
    import toy_transport
    from adasum.transport.communicator import communicator
    from adasum.transport.registry import register_transport

    toy_transport.register()
    g = torch.Generator().manual_seed(world)
    every = [[torch.randn(n, generator=g, dtype=torch.float64) for n in SIZES] for _ in range(world)]
    mine = [t.clone() for t in every[rank]]
    adasum.all_reduce(mine, transport="toy")
    posts = sum(m.posts for m in communicator().transports.values() if isinstance(m, toy_transport.Toy))
    errors = [float((m - torch.from_numpy(reference_tree([w[i].numpy() for w in every]))).norm())
              for i, m in enumerate(mine) if m.numel()]
    # a row whose requirement the group lacks is refused on every rank, after the cross-rank check
    register_transport("toy-nccl", toy_transport.Toy, requires=("nccl",))
    with pytest.raises(ValueError, match=r"transport='toy-nccl' needs NCCL"):
        adasum.all_reduce([torch.ones(2)], transport="toy-nccl")
    with pytest.raises(ValueError, match=r"one of \[.*'toy', 'toy-nccl'\]"):
        adasum.all_reduce([torch.ones(2)], transport="toy-pigeon")
    return max(errors), posts, b"".join(m.numpy().tobytes() for m in mine)


@pytest.mark.parametrize("world", [2, 3])
def test_a_registered_toy_transport_carries_all_reduce(world):
    results = distributed.run(world, toy_body)
    assert all(err < 1e-12 for err, _, _ in results), results
    assert all(posts > 0 for _, posts, _ in results)  # the schedule moved its bytes through the toy
    assert all(r[2] == results[0][2] for r in results)  # ranks end bitwise equal
