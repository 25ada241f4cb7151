"""The one capture point (`Communicator.capture`, which `Communicator.run` calls, over
`adasum.transport.graphs.Graphs`), run on the CPU with a capture that records the calls' launches instead of a
CUDA graph: eager on a key's first call, captured on its second, replayed from then on; a call made inside a run
goes into it; a key whose capture fails runs eagerly from then on; graph keys name the plan and the tensors."""

import functools
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from adasum.transport import graphs as graphs_module
from adasum.transport.communicator import Communicator
from adasum.transport.graphs import Graphs

CPU = torch.device("cpu")
SRC = Path(__file__).resolve().parents[1] / "src" / "adasum"


class RecordingCapture:
    """Captures by recording the launches `fn` logs (they do not run), replays by logging them again."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.active = False
        self.refuse = False  # the next capture fails, as a capture of an op CUDA graphs cannot hold does

    def enabled(self, device: torch.device) -> bool:
        return True

    def capturing(self) -> bool:
        return self.active

    def capture(self, fn, device):
        start = len(self.log)
        self.active = True
        try:
            if self.refuse:
                raise RuntimeError("operation not permitted when stream is capturing")
            fn()
        finally:
            self.active = False
        recorded = self.log[start:]
        del self.log[start:]
        return Recorded(lambda: self.log.extend(f"replay {entry}" for entry in recorded))

    def free(self, graph) -> None:
        graph.freed = True


class Recorded:
    """A recorded capture: ``replay()`` logs its launches again, until it is freed."""

    def __init__(self, replay) -> None:
        self._replay = replay
        self.freed = False

    def replay(self) -> None:
        assert not self.freed, "a freed graph replayed"
        self._replay()


def _communicator(log: list) -> tuple[Communicator, RecordingCapture]:
    comm = Communicator(None)
    backend = RecordingCapture(log)
    comm.graphs = Graphs(backend)
    return comm, backend


def test_eager_then_captured_then_replayed():
    log: list = []
    comm, _ = _communicator(log)
    for _ in range(4):
        key = comm.capture("plan", (1, 2), lambda: log.append("launch"), CPU)
    assert log == ["launch", "replay launch", "replay launch", "replay launch"]
    assert key == ("plan", (1, 2)) and comm.graphs.handle(key) is not None and comm.graphs.count() == 1
    handle = comm.graphs.handle(key)
    assert handle is not None and comm.graphs.replayable(handle)
    comm.graphs.launch(handle)
    assert log[-1] == "replay launch"
    del log[:]
    comm.graphs.clear()  # a handle taken before a graph was dropped replays nothing
    assert not comm.graphs.replayable(handle) and log == [] and comm.graphs.handle(key) is None
    assert handle[0].freed  # freed though the handle still refers to it (NCCL's destroy waits for live graphs)


def test_a_handle_goes_stale_when_the_oldest_graph_is_evicted(monkeypatch):
    monkeypatch.setattr(graphs_module, "MAX_GRAPHS", 2)
    log: list = []
    comm, _ = _communicator(log)
    handles = []
    for where in (1, 2, 3):
        for _ in range(2):  # eager, then captured
            key = comm.capture("plan", where, lambda w=where: log.append(w), CPU)
        handles.append(comm.graphs.handle(key))
    # the third capture evicted the first graph: every handle taken before it is stale, the last one is not
    assert comm.graphs.handle(("plan", 1)) is None and comm.graphs.count() == 2
    del log[:]
    assert not comm.graphs.replayable(handles[0]) and not comm.graphs.replayable(handles[1])
    assert comm.graphs.replayable(handles[2]) and log == []
    comm.graphs.launch(handles[2])
    assert log == ["replay 3"]
    comm.graphs.clear()  # the evicted graph is freed too while a handle still refers to it
    assert all(handle[0].freed for handle in handles)


def test_a_call_inside_a_run_goes_into_it_and_is_not_captured_on_its_own():
    log: list = []
    comm, _ = _communicator(log)

    def inner():
        comm.capture("schedule", 7, lambda: log.append("schedule"), CPU)

    def outer():
        log.append("fusion")
        inner()

    for _ in range(3):
        comm.capture("list", 7, outer, CPU)
    assert log == ["fusion", "schedule", "replay fusion", "replay schedule", "replay fusion", "replay schedule"]
    assert comm.graphs.count() == 1  # the list call's graph holds the schedule's launches
    del log[:]
    inner()  # on its own, the schedule is a first sighting: the nested calls were not counted
    inner()
    assert log == ["schedule", "replay schedule"]


def test_a_key_whose_capture_fails_runs_eagerly_from_then_on():
    log: list = []
    comm, backend = _communicator(log)
    backend.refuse = True
    for _ in range(4):
        key = comm.capture("plan", 1, lambda: log.append("launch"), CPU)
    assert log == ["launch"] * 4 and comm.graphs.handle(key) is None and comm.graphs.count() == 0
    assert comm.graphs.handle(key) is None


def test_graphs_are_keyed_by_plan_and_tensors():
    log: list = []
    comm, _ = _communicator(log)
    for plan, where in [("a", 1), ("b", 1), ("a", 2)] * 2:
        comm.capture(plan, where, lambda p=plan, w=where: log.append(f"{p}{w}"), CPU)
    assert comm.graphs.count() == 3
    assert log == ["a1", "b1", "a2", "replay a1", "replay b1", "replay a2"]
    comm.clear()
    assert comm.graphs.count() == 0


def test_off_the_gpu_every_call_runs_eagerly():
    comm = Communicator(None)  # the CUDA capture: on the CPU nothing is captured
    log: list = []
    for _ in range(3):
        key = comm.capture("plan", 1, lambda: log.append("launch"), CPU)
    assert log == ["launch"] * 3 and comm.graphs.handle(key) is None


def test_the_communicator_is_the_only_caller_of_the_graphs():
    callers = []
    for path in sorted(SRC.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"graphs\.run\(", line):
                callers.append(f"{path.relative_to(SRC).as_posix()}:{number}")
    assert [c.split(":")[0] for c in callers] == ["transport/communicator.py"], callers


def test_an_outgrown_symmetric_buffer_retires_the_groups_graphs():
    """A graph loads and stores at the symmetric buffer it was captured on. Ranks capture a key at different calls
    (keys hold addresses), so after the buffer grows (at the same call on every rank) a graph replayed on the old
    buffer would meet a peer running the call on the new one: every graph is dropped (the device drained first, so
    none is running), and so is the outgrown buffer; each key starts again from an eager call."""
    import weakref

    from adasum.transport.symmetric import SymmetricPool

    log: list = []
    comm, _ = _communicator(log)
    made: list = []
    backend = SimpleNamespace(
        empty=lambda n, dtype, device: made.append(torch.empty(n, dtype=dtype, device=device)) or made[-1],
        rendezvous=lambda buffer, name: SimpleNamespace(name=name),
    )
    pool = SymmetricPool(SimpleNamespace(group_name="fake"), backend, outgrown=comm.retire_graphs)
    like = torch.empty(0)
    pool.staging(10, like)
    for _ in range(3):
        key = comm.capture("plan", (1,), lambda: log.append("launch"), CPU)
    assert comm.graphs.handle(key) is not None and log == ["launch", "replay launch", "replay launch"]
    graph = weakref.ref(comm.graphs.handle(key)[0])
    comm.recent[(1, 0)] = key
    pool.staging(5, like)  # fits: nothing changes
    assert comm.graphs.handle(key) is not None and comm.recent == {(1, 0): key}
    old = weakref.ref(made[-1])
    pool.staging((1 << 20) + 1, like)  # outgrown
    assert comm.graphs.handle(key) is None and comm.graphs.count() == 0 and not comm.recent
    assert graph() is None and comm.graphs.count() == 0  # dropped
    made.clear()
    assert old() is None and len(pool.buffers) == 1  # the outgrown buffer is not kept
    log.clear()
    for _ in range(3):
        comm.capture("plan", (1,), lambda: log.append("launch"), CPU)
    assert log == ["launch", "replay launch", "replay launch"]
    assert comm.graphs.count() == 1  # what release() waits for the device for


def test_an_outgrown_buffer_retires_the_graphs_of_every_group():
    """A graph of one group may point into another group's buffers (the two tiers' outer call runs the node group's
    mover), so a growth retires the graphs of every group's communicator."""
    import torch.distributed as dist

    from adasum.transport import communicator as communicators

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        log: list = []
        comms = [communicators.communicator(None), communicators.communicator(dist.new_group([0]))]
        for comm in comms:
            comm.graphs = Graphs(RecordingCapture(log))
            for _ in range(2):
                key = comm.capture("plan", (1,), lambda: log.append("launch"), CPU)
            comm.recent[(1, 0)] = key
            assert comm.graphs.handle(key) is not None
        communicators.retire_graphs()
        assert all(c.graphs.count() == 0 and not c.recent for c in comms)
    finally:
        dist.destroy_process_group()


def test_a_repeat_on_the_same_memory_replays_before_any_check_of_the_list():
    """`adasum.all_reduce`'s replay path takes the caller's argument unchecked: the very tensors of a recent
    captured call (a list, a tuple or the one tensor), or other tensor objects placed where they were with the
    same dtypes, shapes and strides (new gradients from the caching allocator), replay its graph; the very tensors
    replay it after an in-place change of view over the same memory (each is combined as one vector), not after
    a change of size; the group's `RECENT` latest lists replay, so lists that alternate do; anything else (other
    objects of another shape or stride, a generator, a dict) takes the checked path, whose errors are unchanged.
    The recent calls' tensors are held weakly: dropping them frees them."""
    import gc
    import weakref

    import pytest
    import torch.distributed as dist

    import adasum
    from adasum.checks.plan import prepare, recheck
    from adasum.transport import communicator as communicators

    def remember(comm, tensors, key, plan):
        check = functools.partial(recheck, plan, None, "adasum.all_reduce")
        comm.remember(communicators.Recent.of(("adasum.all_reduce", None), tensors, comm.graphs.handle(key), check))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        log: list = []
        comm = communicators.communicator(None)
        comm.graphs = Graphs(RecordingCapture(log))
        tensors = [torch.ones(2, 3), torch.ones(4)]
        config = ("adasum.all_reduce", "transport=None", "nonfinite=propagate")
        plan = prepare(tensors, None, config=config, operation="adasum.all_reduce", check="none")
        for _ in range(2):
            key = comm.capture(plan.key, ("tensors",), lambda: log.append("launch"), CPU)
        remember(comm, tensors, key, plan)
        log.clear()
        adasum.all_reduce(tensors, check_layout=False)
        adasum.all_reduce(tuple(tensors), check_layout=False)
        adasum.all_reduce([t.view(t.shape) for t in tensors], check_layout=False)  # other objects, same memory
        assert log == ["replay launch"] * 3
        log.clear()
        adasum.all_reduce(iter(tensors), check_layout=False)  # not a list: checked, and one rank runs nothing
        adasum.all_reduce(tensors[:1], check_layout=False)  # other tensors
        adasum.all_reduce([tensors[0].view(3, 2), tensors[1]], check_layout=False)  # same memory, another shape
        adasum.all_reduce([tensors[0].t().t(), tensors[1].double()], check_layout=False)  # another dtype
        with pytest.raises(TypeError, match="pass list"):
            adasum.all_reduce({"a": tensors[0]}, check_layout=False)
        with pytest.raises(TypeError, match="element 1 is a str"):  # the checked path: the first a tensor where the
            # last call's was, the second not one
            adasum.all_reduce([tensors[0], "tensor"], check_layout=False)

        def leaf(t):  # a leaf that requires grad, on the memory of `t`
            return torch.empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride()).requires_grad_()

        other_strides = torch.empty(0).set_(tensors[0].untyped_storage(), 0, (2, 3), (1, 2))  # the same memory
        adasum.all_reduce([other_strides, tensors[1]], check_layout=False)  # and shape: checked
        adasum.all_reduce([leaf(t) for t in tensors], check_layout=False)  # the checked path (which refuses one
        assert log == []  # above one rank)
        with torch.no_grad():  # nothing records: the write is allowed, as on the checked path
            adasum.all_reduce([leaf(t) for t in tensors], check_layout=False)
        assert log == ["replay launch"]
        log.clear()
        tensors[1].resize_(3)  # the same tensor object and address, fewer elements
        adasum.all_reduce(tensors, check_layout=False)
        assert log == []
        tensors[1].resize_(4)
        tensors[0].t_()  # the same tensor object, address and elements, another shape and strides
        adasum.all_reduce(tensors, check_layout=False)
        assert log == ["replay launch"]
        log.clear()
        remember(comm, tensors[1:], key, plan)
        adasum.all_reduce(tensors[1], check_layout=False)  # the one tensor, not in a list
        adasum.all_reduce(tensors, check_layout=False)  # a recent call before it: two lists alternate
        adasum.all_reduce([tensors[1]], check_layout=False)
        assert log == ["replay launch"] * 3
        log.clear()
        others = [[torch.ones(1)] for _ in range(communicators.RECENT - 1)]
        for other in others:
            remember(comm, other, key, plan)
        adasum.all_reduce(tensors, check_layout=False)  # the oldest of RECENT + 1: forgotten
        adasum.all_reduce(others[0], check_layout=False)
        assert log == ["replay launch"] and len(comm.recent) == communicators.RECENT
        held = weakref.ref(tensors[1])
        del tensors
        gc.collect()
        assert held() is None  # the recent calls do not keep their tensors alive
    finally:
        dist.destroy_process_group()


def test_a_layout_whose_tensors_are_remade_elsewhere_every_call_warns_once():
    """A repeated call replays its graph only where its tensors lie where they lay: `MOVED_CALLS` list calls in a
    row of one layout, each a first sighting run eagerly while the last call's tensors are gone (re-made, as
    gradients after ``zero_grad()``), warn once, naming the remedy. Other live lists of one layout (per-block calls),
    calls that come back to one place (captured, then replayed), two layouts in turn, and calls where graphs are
    off do not count."""
    import warnings

    import pytest

    from adasum.transport import communicator as communicators

    log: list = []
    comm, _ = _communicator(log)

    def call(plan, where, tensor):
        comm.capture(plan, where, lambda: None, CPU, first=tensor)

    held = [torch.ones(1) for _ in range(3 * communicators.MOVED_CALLS)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails these
        for where, tensor in enumerate(held):  # per-block lists: all alive, each at its own place
            call("plan", ("block", where), tensor)
        for where in range(3 * communicators.MOVED_CALLS):  # two layouts in turn, re-made every call
            call(("plan", where % 2), ("turns", where), torch.ones(1))
        for _ in range(3 * communicators.MOVED_CALLS):  # re-made at one place: eager, captured, replayed
            call("plan", "here", torch.ones(1))
        for where in range(communicators.MOVED_CALLS - 1):  # one short of the count, then back to a known place
            call("plan", ("short", where), torch.ones(1))
        call("plan", "here", torch.ones(1))
        off = Communicator(None)  # graphs off (the CPU): nothing is counted
        for where in range(3 * communicators.MOVED_CALLS):
            off.capture("plan", where, lambda: None, CPU, first=torch.ones(1))
    with pytest.warns(RuntimeWarning, match="set_to_none=False") as caught:
        for where in range(3 * communicators.MOVED_CALLS):  # re-made at new addresses every call
            call("plan", ("moved", where), torch.ones(1))
    assert len(caught) == 1
    assert caught[0].filename == __file__  # the caller's line, not adasum's


def test_a_graph_keeps_what_its_capture_read_from_a_cache():
    """A graph holds the addresses its kernels read, not the tensors: a table its capture read from a bounded cache
    (the group's address tables) lives as long as the graph, though the cache evicts it, and goes with the graph."""
    import gc
    import weakref

    from adasum.core.layout import Scattered
    from adasum.kernels.addresses import AddressTables

    log: list = []
    comm, _ = _communicator(log)
    tables = AddressTables()
    tables.MOST = 1  # the next table evicts the last
    listed = [torch.ones(4), torch.ones(4)]
    read: list = []

    def call():
        read.append(weakref.ref(tables.get(Scattered(listed), 0, 8)))
        log.append("launch")

    comm.capture("plan", "here", call, CPU)  # eager: builds the table
    comm.capture("plan", "here", call, CPU)  # captured: reads it from the cache
    tables.get(Scattered([torch.ones(2)]), 0, 2)  # another layout's table evicts it from the cache
    gc.collect()
    assert read[-1]() is not None  # the graph keeps it
    assert comm.graphs.count() == 1
    comm.graphs.clear()
    gc.collect()
    assert read[-1]() is None  # gone with the graph


def test_a_replayed_call_posts_its_fingerprint_once_after_the_launch_and_a_stale_one_posts_none(monkeypatch):
    """A repeat of a captured list call (`adasum.transport.communicator.Communicator.replay`) takes its guard slot
    (which raises a kept error, or waits for the guard) before the replay and posts its fingerprint after it; a
    repeat whose graph was dropped posts nothing, since the checked path it falls back to posts the call's own."""
    from adasum.checks import plan as plan_module
    from adasum.settings import override
    from adasum.transport.communicator import Recent

    events: list = []

    class Guard:
        def reserve(self):
            events.append("reserve")

        def post(self, plan, what, operation, reserved=False):
            events.append(("post", plan, reserved))

    monkeypatch.setattr(plan_module, "guard_of", lambda comm, group: Guard())
    monkeypatch.setattr(plan_module, "communicator", lambda group: None)
    log: list = []
    comm, _ = _communicator(log)
    tensors = [torch.zeros(3), torch.zeros(5)]
    for _ in range(2):  # eager, then captured
        key = comm.capture("plan", (1, 2), lambda: log.append("launch"), CPU)
    handle = comm.graphs.handle(key)
    entry = ("adasum.all_reduce", None)
    comm.remember(Recent.of(entry, tensors, handle, functools.partial(plan_module.recheck, "the plan", None, "op")))
    del log[:]
    original = comm.graphs.launch
    monkeypatch.setattr(comm.graphs, "launch", lambda h: events.append("launch") or original(h))
    with override(deferred_checks=True):  # the checks are deferred, as on a GPU
        assert comm.replay(entry, tensors, True)
        assert events == ["reserve", "launch", ("post", "the plan", True)]
        assert log == ["replay launch"]
        del events[:], log[:]
        comm.graphs.clear()
        assert not comm.replay(entry, tensors, True)
        assert events == [] and log == []
