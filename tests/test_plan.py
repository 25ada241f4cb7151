"""One road for every call: each entry point builds its plan once per layout and reuses it; the
communicator of a group owns its state, per group and per thread; `adasum.release()` leaves
nothing behind."""

import functools
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import adasum
from adasum.core.layout import Scattered
from adasum.ddp import AdasumState, adasum_hook
from adasum.transport import communicator as communicators
from adasum.transport import symmetric

import distributed
from reference import tree as reference_tree


def _built() -> int:
    return communicators.communicator(None).plans_built


def entry_points_body(rank, world):
    """Each entry point, called three times on one layout, builds one plan (all_reduce_async reuses all_reduce's);
    a new layout builds one more; the DDP hook builds none after its buckets are rebuilt."""
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(5, generator=g), torch.randn(2, 3, generator=g)]
    flat = torch.randn(11, generator=g)
    calls = {
        "all_reduce": lambda: adasum.all_reduce(grads),
        "all_reduce_async": lambda: adasum.all_reduce_async(grads).wait(),
        "Adasum.all_reduce": lambda: adasum.Adasum().all_reduce(grads),
        "Mean.all_reduce_flat": lambda: adasum.Mean().all_reduce_flat(flat, [5, 6]),
        "AdaCons.all_reduce": lambda: adasum.AdaCons().all_reduce(grads),
    }
    built = {}
    for name, call in calls.items():
        before = _built()
        for _ in range(3):
            call()
        built[name] = _built() - before
    before = _built()
    adasum.all_reduce([torch.randn(7, generator=g)])
    built["new layout"] = _built() - before
    # the list call's plan records the transport chosen and the fusion (two float32 tensors: one flat buffer)
    plans = communicators.communicator(None).plans.values()
    listed = [p for p in plans if p.config[0] == "adasum.all_reduce" and len(p.description) == 2]
    built["list plan"] = [(p.transport.name, p.fusion) for p in listed]

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), bucket_cap_mb=0.0001)
    model.register_comm_hook(AdasumState(), adasum_hook)
    counts = []
    for step in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x).sum().backward()
        counts.append(_built())
    built["hook after its first rebuilt step"] = counts[-1] - counts[1]
    return built


def test_each_entry_point_builds_its_plan_once():
    results = distributed.run(2, entry_points_body)
    distributed.assert_ranks_agree(results)
    assert results[0] == {
        "all_reduce": 1, "all_reduce_async": 0, "Adasum.all_reduce": 1, "Mean.all_reduce_flat": 1,
        "AdaCons.all_reduce": 1, "new layout": 1, "hook after its first rebuilt step": 0,
        "list plan": [("p2p", ("fused",))],
    }, results[0]


def release_body(rank, world):
    adasum.all_reduce([torch.ones(4) * (rank + 1)])
    adasum.Adasum().all_reduce([torch.ones(3)])
    before = communicators.held()["communicators"]
    comm = communicators.communicator(None)
    control = comm.control
    # the group's symmetric memory, on a backend that allocates host memory, and the tile addresses of a list
    host_memory = SimpleNamespace(empty=lambda n, dtype, device: torch.empty(n, dtype=dtype, device=device),
                                  rendezvous=lambda buffer, name: SimpleNamespace(name=name))
    pool = symmetric.pool(None, backend=host_memory)
    buffer = weakref.ref(pool.staging(1 << 21, torch.empty(0))[0])
    comm.tiles.get(Scattered([torch.ones(3), torch.ones(5)]), 0, 8)
    had = (len(comm.plans), len(comm.transports), control is not None, pool.held(), len(comm.tiles))
    from adasum.core.tiles import tiles

    table = tiles((3, 5), torch.device("cpu"))  # a cached device tile table (the process's, not the group's)
    adasum.release()
    after = {
        "communicators": communicators.held()["communicators"],
        "plans": len(comm.plans),
        "transports": len(comm.transports),
        "graphs": comm.graphs.count(),
        "control": comm.control,
        "control group alive": control in dist.distributed_c10d._world.pg_map,
        "streams": communicators.held()["streams"],
        "resources": comm.resources,
        "symmetric buffers": pool.held(),
        "buffer alive": buffer() is not None,
        "tile addresses": len(comm.tiles),
        "tile tables": tiles((3, 5), torch.device("cpu")) is table,
    }
    t = torch.ones(4) * (rank + 1)
    adasum.all_reduce([t])  # a released group starts afresh on CPU
    return before, had, after, t.tolist()


def test_release_leaves_nothing_behind():
    results = distributed.run(2, release_body)
    distributed.assert_ranks_agree(results)
    before, had, after, values = results[0]
    assert before == 1 and had[0] >= 2 and had[1] >= 1 and had[2] and had[3] == 1 and had[4] == 1, had
    assert after == {"communicators": 0, "plans": 0, "transports": 0, "graphs": 0, "control": None,
                     "control group alive": False, "streams": 0, "resources": {}, "symmetric buffers": 0,
                     "buffer alive": False, "tile addresses": 0, "tile tables": False}
    assert np.allclose(values, reference_tree([np.ones(4), 2 * np.ones(4)]))


def threads_body(rank, world):
    """Two threads, each on its own process group, call adasum.all_reduce 20 times at once on fused lists (the
    CPU fusion and receive buffers): every result equals the reference."""
    pair = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    wrong = [0, 0]
    errors = []

    def work(k):
        try:
            for i in range(20):
                data = [[torch.randn(n, generator=torch.Generator().manual_seed(1000 * k + 10 * i + r)) for n in
                         (257 + 31 * k, 3)] for r in range(2)]
                mine = [t.clone() for t in data[rank]]
                adasum.all_reduce(mine, group=pair[k])
                for j, t in enumerate(mine):
                    expected = reference_tree([d[j].double().numpy() for d in data])
                    if not torch.allclose(t.double(), torch.from_numpy(expected), rtol=1e-5, atol=1e-6):
                        wrong[k] += 1
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(repr(error))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wrong, errors


def test_two_threads_on_two_groups_get_right_results():
    results = distributed.run(2, threads_body)
    for wrong, errors in results:
        assert errors == [] and wrong == [0, 0], (wrong, errors)


SHAPED = {
    "transport_first": "p2p", "piece_elements": (1000, 1000), "symmetric_push": False, "symmetric_chunks": False,
    "symmetric_chunk_bytes": 1024, "symmetric_max_chunks": 2, "one_shot_bytes": 0, "memory_mb": 64.0,
}
"""A value other than the default of each schedule-shaping setting compared by the call's check (``deferred_checks``
picks where that check runs: left out)."""


def shaped_body(rank, world):
    """`adasum.all_reduce` where rank 1 overrides each schedule-shaping setting in turn: (error type, message)."""
    from adasum.settings import override

    out = {}
    for name, value in SHAPED.items():
        t = [torch.ones(6) * (rank + 1)]
        try:
            with override(**({name: value} if rank == 1 else {})):
                adasum.all_reduce(t)
        except ValueError as error:
            out[name] = ("ValueError", str(error))
        else:
            out[name] = (None, None)
    return out


def test_a_schedule_shaping_setting_on_one_rank_is_refused_on_every_rank():
    from adasum.settings import SHAPING

    assert set(SHAPED) == set(SHAPING) - {"deferred_checks"}
    results = distributed.run(2, shaped_body, timeout_s=30)
    distributed.assert_ranks_agree(results)
    for name, value in SHAPED.items():
        assert results[0][name] == (
            "ValueError",
            "adasum.all_reduce: the configuration differs across ranks: rank 0 has adasum.all_reduce transport=None "
            f"nonfinite=propagate, rank 1 has adasum.all_reduce transport=None nonfinite=propagate {name}={value}",
        ), name


def remade_body(rank, world, calls):
    """`calls` calls on gradients re-made every call (``zero_grad()``: new tensors at new addresses, kept alive
    meanwhile so that the allocator cannot hand back the last ones' memory), each layout's cache measured: the
    memory-overlap verdicts and the plans stay within their bounds (the prepare step of every entry point; a run
    of real calls last), and release frees them."""
    from adasum.checks.plan import DISJOINT, MAX_PLANS, prepare

    model = [torch.ones(3, 2), torch.ones(5), torch.ones(4)]
    config = ("test",)
    comm = communicators.communicator(None)
    held = []
    sizes = []
    for i in range(calls):
        grads = [torch.ones_like(p) for p in model]
        held = [*held[-16:], grads]
        prepare(grads, None, config=config, operation="test", check="none")
        if i % 1000 == 999:
            sizes.append(sum(len(p.disjoint) for p in comm.plans.values()))
    for i in range(600):  # a new layout every call, more than a group keeps
        prepare([torch.ones(i + 1)], None, config=config, operation="test", check="none")
    plans = len(comm.plans)
    for _ in range(50):  # the whole call
        adasum.all_reduce([torch.ones_like(p) for p in model])
    disjoint = max(len(p.disjoint) for p in comm.plans.values())
    adasum.release()
    return sizes, plans, disjoint, DISJOINT, MAX_PLANS, len(communicators.communicator(None).plans)


def test_gradients_remade_every_call_keep_the_caches_flat():
    results = distributed.run(2, remade_body, 10_000)
    sizes, plans, disjoint, most, max_plans, after = results[0]
    assert len(sizes) == 10 and all(n == most for n in sizes), sizes  # flat from the first thousand calls on
    assert plans == max_plans and disjoint <= most and after == 0, results[0]


class CountedReplays:
    """A capture for `adasum.transport.graphs.Graphs` on the CPU: a capture runs the call (so it takes part in the
    call's collectives, as a CUDA capture's launches do on every rank at the same call), a replay runs no Python of
    adasum and is counted."""

    def __init__(self) -> None:
        self.replays = 0

    def enabled(self, device: torch.device) -> bool:
        return True

    def capturing(self) -> bool:
        return False

    def capture(self, fn, device):
        fn()
        return SimpleNamespace(replay=self._replay)

    def _replay(self) -> None:
        self.replays += 1

    def free(self, graph) -> None:
        pass


SRC = str(Path(adasum.__file__).resolve().parent)
SEAM_FILES = 5
"""The most files of adasum that a repeat of any entry point passes through below it before its graph replays."""
FIRST_WALK = 22
"""The most files of adasum that a first `adasum.all_reduce` of a list passes through on gloo (checks, plan, schedule,
mover, kernels)."""


def _files_below(door, call) -> set[str]:
    """The files of adasum (relative to the package) whose Python runs below the frame of `door` (a function) during
    ``call()``, from ``sys.setprofile``."""
    import os
    import sys

    code, depth, files = door.__code__, [0], set()

    def profile(frame, event, arg):
        if event == "call":
            if frame.f_code is code:
                depth[0] += 1
            elif depth[0] and frame.f_code.co_filename.startswith(SRC):
                files.add(os.path.relpath(frame.f_code.co_filename, SRC).replace(os.sep, "/"))
        elif event == "return" and frame.f_code is code:
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return files


def doors_body(rank, world):
    """Each entry point, repeated on one layout until its call is captured, then once more under ``sys.setprofile``:
    the files its Python passes through below the door (the door's own module and, for the integrations, their step
    records aside) and whether that call replayed."""
    from adasum.collectives import api
    from adasum.integrations import ddp as ddp_module
    from adasum.integrations.delta import DeltaCombiner
    from adasum.reducers.base import Reducer, ShardGroups
    from adasum.transport.graphs import Graphs

    first = [torch.ones(n) for n in range(1, 40)]  # a first call: the walk from the door to the data
    walk = _files_below(api.all_reduce, lambda: adasum.all_reduce(first)) | {"collectives/api.py"}
    capture = CountedReplays()
    communicators.communicator(None).graphs = Graphs(capture)
    g = torch.Generator().manual_seed(rank)
    sizes = [3, 16, 5, 32, 7]
    tensors = [torch.randn(n, generator=g) for n in sizes]
    flat = torch.cat(tensors)
    shards = torch.cat(tensors)
    reducer = adasum.Adasum()
    alone = [dist.new_group([r]) for r in range(world)]
    grid = ShardGroups(None, dist.new_group(list(range(world))), alone[rank], tuple(range(world)), world, 1)

    def parameters():
        made = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        for p, t in zip(made, tensors):
            p.grad = t.clone()
        return made

    optimizer = adasum.DistributedOptimizer(torch.optim.SGD(parameters(), lr=0.0), reducer="adasum", mode="gradient")
    slowmo = adasum.SlowMo(torch.optim.SGD(parameters(), lr=0.0), local_steps=1, reducer="adasum")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    model.register_comm_hook(AdasumState(), adasum_hook)
    x = torch.randn(3, 4, generator=g)

    def backward():
        model.zero_grad(set_to_none=False)
        model(x).sum().backward()

    statistics = {"core/statistics.py"}  # an integration's records of its step, kept per call
    doors = {
        "adasum.all_reduce": (api.all_reduce, lambda: adasum.all_reduce(tensors, check_layout=False), set()),
        "Reducer.all_reduce": (Reducer.all_reduce, lambda: reducer.all_reduce(tensors, check_layout=False), set()),
        "Reducer.all_reduce_flat": (
            Reducer.all_reduce_flat, lambda: reducer.all_reduce_flat(flat, sizes, check_layout=False), set(),
        ),
        "the DDP batch": (ddp_module._close_batch, backward, statistics),
        "the optimizer's bucket": (DeltaCombiner.combine_flat, optimizer.step, statistics),
        "SlowMo's sync": (DeltaCombiner.combine_flat, slowmo.step, statistics),
        "the FSDP unit": (Reducer.all_reduce_shards, lambda: reducer.all_reduce_shards(shards, sizes, grid), set()),
    }
    out = {}
    for name, (door, call, own) in doors.items():
        for _ in range(4):  # eager, captured, replayed (the DDP hook's buckets are rebuilt after its first step)
            call()
        before = capture.replays
        files = _files_below(door, call)
        own = own | {door.__code__.co_filename.removeprefix(SRC + "/")}
        out[name] = (sorted(files - own), capture.replays - before)
    return out, sorted(walk)


def test_a_repeat_of_every_door_reaches_the_replay_by_the_same_files():
    """`adasum.all_reduce`, a reducer's `all_reduce`, `all_reduce_flat` and `all_reduce_shards` (the FSDP unit's),
    the DDP hook's batch and the delta combiner's bucket (`DistributedOptimizer`, `SlowMo`) go through one plan and one
    run (`Communicator.plan`, `Communicator.run`): a repeat of a captured call replays its graph at the same depth
    from each door, through the same few files."""
    results = distributed.run(2, doors_body)
    distributed.assert_ranks_agree(results)
    out, walk = results[0]
    assert len(walk) <= FIRST_WALK, walk
    paths = {name: files for name, (files, _) in out.items()}
    assert all(replays >= 1 for _, replays in out.values()), str({name: r for name, (_, r) in out.items()})
    assert len(set(map(tuple, paths.values()))) == 1, paths
    assert len(paths["adasum.all_reduce"]) <= SEAM_FILES, paths


def follows_body(rank, world):
    """What each list call's plan records (its schedules' movers and fusions, the verdict's transport and fusion)
    against what its schedules were given when it ran, and how many movers were chosen below the plan."""
    from adasum.collectives import api, vhdd

    given, chosen = [], []
    original, choose = api.adasum_flat_, vhdd.transport_for
    vhdd.transport_for = functools.partial(_chosen, chosen, choose)  # a choice below the plan

    def recording(buffer, sizes, group=None, placement=None, *, transport=None, op=None):
        given.append((transport.name, type(buffer).__name__, len(sizes)))
        original(buffer, sizes, group, placement, transport=transport, op=op)

    api.adasum_flat_ = recording
    try:
        g = torch.Generator().manual_seed(rank)
        mixed = [torch.randn(5, generator=g), torch.randn(3, generator=g, dtype=torch.float64),
                 torch.randn(4, generator=g)]
        out = {}
        for transport in (None, "one-shot", "slices"):
            given.clear()
            chosen.clear()
            adasum.all_reduce(mixed, transport=transport)
            verdicts = [p for p in communicators.communicator(None).plans.values()
                        if p.config[:2] == ("adasum.all_reduce", f"transport={transport}")]
            (execution,) = [run for p in verdicts for run in p.runs.values()]
            planned = [(s.mover.name, s.fusion, s.kind, len(s.sizes)) for s in execution.schedules]
            out[transport] = (planned, list(given), execution.verdict.transport.name, execution.verdict.fusion,
                              len(chosen))
        return out
    finally:
        api.adasum_flat_, vhdd.transport_for = original, choose


def test_the_run_follows_the_plan():
    """A list's plan decides per dtype the mover, the schedule it serves and the fusion; the run hands each dtype's
    buffer to that very mover (none is chosen again below the plan), and the plan's recorded transport and fusion
    are the ones that ran."""
    results = distributed.run(2, follows_body)
    distributed.assert_ranks_agree(results)
    for transport, (planned, given, recorded, fusion, chosen) in results[0].items():
        assert [(name, "Tensor", n) for name, _, _, n in planned] == given and chosen == 0, (transport, planned, given)
        assert recorded == planned[0][0] and fusion == tuple(f for _, f, _, _ in planned), (transport, planned)
    assert [kind for _, _, kind, _ in results[0]["one-shot"][0]] == ["one-shot", "one-shot"]
    assert results[0][None][0][0][:3] == ("p2p", "fused", "vhdd")  # gloo's default: the VHDD levels on c10d


def _chosen(log, choose, *args, **kwargs):
    log.append(args[1] if len(args) > 1 else kwargs.get("name"))
    return choose(*args, **kwargs)


def follows_tiers_body(rank, world):
    """On a grid of 2 replicas x 2 shards (the FSDP unit's door) and 2 nodes of 2 ranks (hierarchical Adasum, over
    node means and in two tiers), per tensor and whole-model: the movers each call's plan chose, whether the
    trees and the node schedules ran on those very objects, and how many movers were chosen below the plan."""
    from adasum.collectives import api, hierarchical, vhdd
    from adasum.reducers.base import ShardGroups

    given, chosen = [], []
    originals = {(m, name): getattr(m, name) for m in (api, hierarchical) for name in ("adasum_flat_",)}
    originals[(hierarchical, "adasum_slices_")] = hierarchical.adasum_slices_
    for module in (vhdd, hierarchical):  # a choice below the plan (the plan's own is `api.transport_for`)
        originals[(module, "transport_for")] = module.transport_for
        module.transport_for = functools.partial(_chosen, chosen, module.transport_for)

    def tree(original):
        def recording(buffer, sizes, group=None, placement=None, *, transport=None, op=None):
            given.append(("tree", transport))
            original(buffer, sizes, group, placement, transport=transport, op=op)

        return recording

    def node(buffer, layout, mover, across=None, op=None):
        given.append(("node", mover))
        originals[(hierarchical, "adasum_slices_")](buffer, layout, mover, across, op)

    api.adasum_flat_ = tree(originals[(api, "adasum_flat_")])
    hierarchical.adasum_flat_ = tree(originals[(hierarchical, "adasum_flat_")])
    hierarchical.adasum_slices_ = node
    try:
        replicates = [dist.new_group([s, s + 2]) for s in range(2)]
        shard_groups = [dist.new_group([2 * k, 2 * k + 1]) for k in range(2)]
        replica, shard = divmod(rank, 2)
        grid = ShardGroups(None, replicates[shard], shard_groups[replica], (shard, shard + 2), 2, 2)
        g = torch.Generator().manual_seed(rank)
        mixed = [torch.randn(5, generator=g), torch.randn(3, generator=g, dtype=torch.float64),
                 torch.randn(4, generator=g)]
        flat = torch.randn(12, generator=g)
        reducers = {
            "shards": adasum.Adasum(), "whole shards": adasum.Adasum(per_tensor=False),
            "node means": adasum.Adasum(hierarchical=True, local_size=2),
            "two tiers": adasum.Adasum(hierarchical="exact", local_size=2),
            "whole": adasum.Adasum(per_tensor=False),
        }
        calls = {
            "shards": lambda r: r.all_reduce_shards(flat, [5, 7], grid),
            "whole shards": lambda r: r.all_reduce_shards(flat, [5, 7], grid),
            "node means": lambda r: (r.all_reduce(mixed), r.all_reduce_flat(flat, [5, 7])),
            "two tiers": lambda r: (r.all_reduce(mixed), r.all_reduce_flat(flat, [5, 7])),
            "whole": lambda r: (r.all_reduce(mixed), r.all_reduce_flat(flat, [5, 7])),
        }
        out = {}
        for name, reducer in reducers.items():
            given.clear()
            chosen.clear()
            calls[name](reducer)
            runs = [run for p in communicators.communicator(None).plans.values() for run in p.runs.values()
                    if run.entry[1] is reducer]
            movers = [s.mover for run in runs for s in run.schedules]
            inners = [s.inner for run in runs for s in run.schedules if s.inner is not None]
            out[name] = (
                sorted({(s.mover.name, s.kind, s.inner.name if s.inner else None) for run in runs
                        for s in run.schedules}),
                len(given) > 0 and all(any(m is t for m in (movers if what == "tree" else inners))
                                       for what, t in given),
                all(run.verdict.transport is run.schedules[0].mover for run in runs),
                len(chosen),
            )
        return out
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


def test_the_run_follows_the_plan_on_shards_and_tiers():
    """The FSDP unit's door (a reducer's `all_reduce_shards`), hierarchical Adasum (over node means and in two
    tiers) and the whole-model variant: their plans choose the movers (the tree's, and the two tiers' node
    schedule's), and every tree and node schedule that runs is handed that very mover, which the plan records."""
    results = distributed.run(4, follows_tiers_body)
    distributed.assert_ranks_agree(results)
    for name, (planned, followed, recorded, chosen) in results[0].items():
        assert followed and recorded and chosen == 0, (name, results[0][name])
    assert results[0]["shards"][0] == [("p2p", "vhdd", None)], results[0]
    assert results[0]["node means"][0] == [("p2p", "node means", None)], results[0]
    assert results[0]["two tiers"][0] == [("p2p", "two tiers", "slices")], results[0]
