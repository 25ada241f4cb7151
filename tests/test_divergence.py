"""Ranks that diverge after agreed calls, or are configured differently, get the same clear error on
every rank before data moves: never a silent mix, a hang or an abort (gloo, 2 and 3 ranks)."""

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import adasum
from adasum.checks import agreement
from adasum.checks.guard import LAG
from adasum.checks.plan import prepare
from adasum.ddp import AdasumState, adasum_hook
from adasum.settings import override
from adasum.transport import communicator as communicators

import distributed
from reference import combine_with_bound

BOUND_S = 10  # the promise: named within 10 s


def _error_of(call):
    start = time.monotonic()
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return None, None, time.monotonic() - start


def _until_raised(call, most: int = 4 * LAG):
    """Call `call` until it raises (at most `most` times): (kind, message, how many calls, the raising one
    included). After a fatal divergence every rank raises at the same call, the LAG-th after the divergent one."""
    for calls in range(1, most + 1):
        kind, message, _ = _error_of(call)
        if kind is not None:
            return kind, message, calls
    return None, None, most


def swapped_body(rank, world, equal_sizes):
    """Two layouts, each agreed once by every rank, then called in different orders."""
    a = [torch.full((4, 2), 1.0 + rank)]
    b = [torch.full((8,) if equal_sizes else (5,), 2.0 + rank)]
    adasum.all_reduce(a)
    adasum.all_reduce(b)
    mine = [t.clone() for t in (b if rank == world - 1 else a)]
    before = [t.clone() for t in mine]
    kind, message, seconds = _error_of(lambda: adasum.all_reduce(mine))
    untouched = all(torch.equal(x, y) for x, y in zip(mine, before))
    after = [torch.full((3,), float(rank))]
    adasum.all_reduce(after)  # the group is still usable: nothing moved
    return kind, message, seconds < BOUND_S, untouched, after[0].tolist()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("equal_sizes", [True, False])
def test_layouts_agreed_once_then_swapped_are_named_on_every_rank(world, equal_sizes):
    results = distributed.run(world, swapped_body, equal_sizes)
    distributed.assert_ranks_agree([r[:4] for r in results])
    kind, message, in_time, untouched, _ = results[0]
    other = "float32 [8] on cpu" if equal_sizes else "float32 [5] on cpu"
    assert kind == "ValueError" and in_time and untouched, results[0]
    assert message == (f"adasum.all_reduce: tensors differ across ranks at index 0: rank 0 has float32 [4, 2] on cpu, "
                       f"rank {world - 1} has {other}"), message
    assert all(r[4] == results[0][4] for r in results)
    # the call after the refused one combines every rank's own tensor: the independent reference tree, within
    # its bound (computed in float64, stored in float32)
    ref, bound = combine_with_bound([torch.full((3,), float(r)) for r in range(world)])
    err = float((torch.tensor(results[0][4], dtype=torch.float64) - ref).norm())
    assert err <= bound, (results[0][4], ref, err, bound)


def _with_budget(memory_mb, call):
    """`call` under another memory budget (one rank's ``ADASUM_MEMORY_MB``), or as it is."""
    from adasum.settings import override

    if memory_mb is None:
        return call()
    with override(memory_mb=memory_mb):
        return call()


def config_body(rank, world):
    """Ranks configured differently: a reducer, a non-finite policy, a reducer option, a transport."""
    out = {}
    last = rank == world - 1
    t = lambda: [torch.ones(6) * (rank + 1)]  # noqa: E731
    cases = {
        "reducer": lambda: (adasum.Mean() if last else adasum.Adasum()).all_reduce(t()),
        "reducer option": lambda: adasum.Adasum(per_tensor=not last).all_reduce(t()),
        "policy": lambda: adasum.all_reduce(t(), nonfinite="raise" if last else "propagate"),
        "entry point": lambda: (
            adasum.Mean().all_reduce_flat(torch.ones(6), [6]) if last else adasum.Mean().all_reduce(t())
        ),
        "schedule setting": lambda: _with_budget(64.0 if last else None, lambda: adasum.all_reduce(t())),
    }
    for name, call in cases.items():
        kind, message, seconds = _error_of(call)
        out[name] = (kind, message, seconds < BOUND_S)
    return out


def test_ranks_configured_differently_get_one_error_on_every_rank():
    results = distributed.run(3, config_body)
    distributed.assert_ranks_agree(results)
    out = results[0]
    for name, (kind, message, in_time) in out.items():
        assert kind == "ValueError" and in_time and "rank 0 has" in message and "rank 2 has" in message, (name, message)
    assert "the configuration differs across ranks: rank 0 has adasum.Adasum.all_reduce Adasum(per_tensor=True) []" \
           ", rank 2 has adasum.Mean.all_reduce Mean() []" in out["reducer"][1]
    assert "nonfinite=propagate" in out["policy"][1] and "nonfinite=raise" in out["policy"][1]
    assert out["schedule setting"][1].endswith(
        "the configuration differs across ranks: rank 0 has adasum.all_reduce transport=None nonfinite=propagate, "
        "rank 2 has adasum.all_reduce transport=None nonfinite=propagate memory_mb=64.0"), out["schedule setting"]


def stride0_body(rank, world):
    adasum.all_reduce([torch.zeros(4)])  # agreed before
    t = torch.ones(1).expand(4) if rank == 1 else torch.ones(4)
    kind, message, _ = _error_of(lambda: adasum.all_reduce([t]))
    return kind, message


def test_an_expanded_tensor_on_one_rank_is_refused_on_every_rank():
    results = distributed.run(2, stride0_body)
    distributed.assert_ranks_agree(results)
    kind, message = results[0]
    assert kind == "ValueError" and "tensor 0 has elements that share memory (an expanded view, stride 0)" in message
    assert ": on rank 1, tensor 0 has elements" in message, message


def test_the_overlap_check_is_near_linear():
    matrix = torch.zeros(64, 1000)
    columns = [matrix[:, i] for i in range(1000)]
    start = time.monotonic()
    assert agreement.overlapping(columns) is None
    assert agreement.overlapping([*columns, matrix[3:5, 7]]) == (7, 1000)
    assert time.monotonic() - start < 5


def overlap_once_body(rank, world):
    matrix = torch.zeros(8, 300)
    columns = [matrix[:, i] for i in range(300)]
    config = ("test",)
    first = prepare(columns, None, config=config, operation="test")
    second = prepare(columns, None, config=config, operation="test")
    return first is second, len(first.disjoint), communicators.communicator(None).plans_built


def test_the_overlap_check_runs_once_per_layout_and_addresses():
    results = distributed.run(2, overlap_once_body)
    assert results[0] == (True, 1, 1), results[0]


def dead_peer_body(rank, world):
    dist.barrier()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))
    dist.barrier(group=group)
    if rank == 1:
        import os

        os._exit(17)
    time.sleep(1)
    try:
        adasum.Mean().all_reduce([torch.ones(3)], group)
    except adasum.CollectiveError as error:
        return "CollectiveError", str(error).splitlines()[0]
    except RuntimeError as error:
        return type(error).__name__, str(error)
    return None, None


def test_a_reducer_after_its_peer_died_raises_collective_error():
    results = distributed.run(2, dead_peer_body, allow_exit=True)
    kind, message = results[0]
    assert kind == "CollectiveError" and "the layout check failed" in message, (kind, message)


def test_a_dict_or_a_number_as_group_is_a_type_error():
    t = torch.ones(3)
    with pytest.raises(TypeError, match="got a dict; pass list"):
        adasum.all_reduce({"w": t})
    with pytest.raises(TypeError, match="got a dict; pass list"):
        adasum.Adasum().all_reduce({"w": t})
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup or None, got 1"):
        adasum.all_reduce([t], group=1)
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup or None, got 1"):
        adasum.Mean().all_reduce([t], group=1)
    with pytest.raises(TypeError, match="element 1 is a float"):
        adasum.all_reduce([t, 1.0])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def hook_config_body(rank, world):
    out = {}
    last = rank == world - 1
    for name, kwargs in {
        "reducer": dict(reducer="mean" if last else "adasum"),
        "policy": dict(nonfinite="raise" if last else "propagate"),
        "batch": dict(batch_mb=1.0 if last else 2.0),
    }.items():
        out[name] = _error_of(lambda: AdasumState(**kwargs))[:2]
    return out


def test_hook_configurations_that_differ_are_named_on_every_rank():
    results = distributed.run(2, hook_config_body)
    distributed.assert_ranks_agree(results)
    out = results[0]
    assert out["reducer"] == (
        "ValueError", "adasum.ddp.AdasumState: the configuration differs across ranks: rank 0 has "
        "reducer=Adasum(per_tensor=True) nonfinite=propagate batch_mb=256, rank 1 has "
        "reducer=Mean() nonfinite=propagate batch_mb=256"), out["reducer"]
    assert out["policy"][0] == "ValueError" and "nonfinite=raise" in out["policy"][1]
    assert out["batch"][0] == "ValueError" and "batch_mb=1" in out["batch"][1]


def two_models_body(rank, world):
    state = AdasumState()
    first, second = DDP(_model()), DDP(_model())
    first.register_comm_hook(state, adasum_hook)
    second.register_comm_hook(state, adasum_hook)
    first(torch.ones(2, 4)).sum().backward()
    return _error_of(lambda: second(torch.ones(2, 4)).sum().backward())[:2]


def test_one_state_on_two_models_is_refused():
    results = distributed.run(2, two_models_body)
    distributed.assert_ranks_agree(results)
    kind, message = results[0]
    assert kind == "RuntimeError" and "registered on a second DDP model" in message, message


def _guard_threads():
    return [t for t in threading.enumerate() if t.name == "adasum-guard"]


def _gan_step(g, d):
    """One step of a GAN's two gradient lists (equal total sizes): G's, then D's."""
    for layout in (g, d):
        adasum.all_reduce(layout)


def gan_blocked_body(rank, world):
    """Deferred checks (as on NCCL), run on gloo: G and D agreed, a few matching steps, then rank 1 swaps them
    and no rank calls adasum again (as if blocked on the device): every rank's guard names the divergence within
    the bound, without a next call; blocked past ABORT_AFTER_S, the communicator is aborted (a stand-in here:
    gloo has none) by the guard's thread; the next call raises the same error on every rank (nothing is enqueued on
    an aborted communicator); release ends the thread."""
    g, d = [torch.ones(4, 2)], [torch.ones(8)]  # one tensor each: gloo aborts on dot products of other sizes
    aborted = []
    with override(deferred_checks=True):
        _gan_step(g, d)
        guard = communicators.communicator(None).guard
        guard.abort = lambda: aborted.append((time.monotonic(), threading.current_thread().name))
        guard.drains = lambda seconds: False  # the device behind the divergent call never drains (a stand-in)
        for _ in range(5):
            _gan_step(g, d)
        start = time.monotonic()
        adasum.all_reduce(d if rank == 1 else g)  # the swapped step's first call
        while guard.error is None and time.monotonic() - start < BOUND_S:
            time.sleep(0.01)
        named = time.monotonic() - start
        while not aborted and time.monotonic() - start < BOUND_S:
            time.sleep(0.05)
        first = _until_raised(lambda: adasum.all_reduce(g))
        again = _error_of(lambda: adasum.all_reduce([torch.ones(2)]))
    adasum.release()
    return (first[0], first[1], again[:2] == first[:2], named < BOUND_S, len(aborted),
            aborted[0][0] - start < BOUND_S if aborted else None, aborted[0][1] if aborted else None, guard.alive(),
            len(_guard_threads()), first[2])


def test_a_gan_whose_lists_swap_on_one_rank_is_named_on_every_rank_without_a_next_call():
    results = distributed.run(2, gan_blocked_body)
    distributed.assert_ranks_agree([r[:2] for r in results])
    for kind, message, same_again, named_in_time, aborts, aborted_in_time, by, alive, threads, calls in results:
        assert kind == "ValueError" and same_again and named_in_time, (kind, message)
        assert calls == 1, calls  # the communicator aborted, the next call raises it: no collective on it
        assert aborts == 1 and aborted_in_time and by == "adasum-guard" and not alive and threads == 0, results
    assert results[0][1] == (
        "adasum.all_reduce: tensors differ across ranks at index 0: rank 0 has float32 [4, 2] on cpu, rank 1 has "
        "float32 [8] on cpu (a call already under way on some rank: its result is undefined; destroy the process "
        "group)"), results[0][1]


def gan_going_on_body(rank, world, drains):
    """The same divergence, ranks going on: the same later call (the LAG-th after the divergent one) raises it on
    every rank; where the device does not drain (`drains` False, a stand-in: gloo has no device) it first aborts
    the communicator (a stand-in too), on the caller's thread, and where it drains it leaves it alone.
    (Each rank waits until its guard holds the error before calling again: on gloo a call whose data goes out
    after its peer raised would wait for that peer until the group's timeout; on NCCL the abort ends that wait.)"""
    g, d = [torch.ones(4, 2)], [torch.ones(8)]
    aborted = []
    with override(deferred_checks=True):
        _gan_step(g, d)
        guard = communicators.communicator(None).guard
        guard.abort = lambda: aborted.append(threading.current_thread().name)
        guard.drains = lambda seconds: drains
        start = time.monotonic()
        adasum.all_reduce(d if rank == 1 else g)
        while guard.error is None and time.monotonic() - start < BOUND_S:
            time.sleep(0.01)
        kind, message, steps = _until_raised(lambda: _gan_step(g, d))
        seconds = time.monotonic() - start
    time.sleep(0.2)
    kept_frames = guard.error.__traceback__ is not None  # what it raised were copies: no caller's frames kept
    adasum.release()
    return kind, message, seconds < BOUND_S, aborted, len(_guard_threads()), steps, kept_frames


@pytest.mark.parametrize("drains", [False, True])
def test_a_gan_whose_lists_swap_is_raised_by_a_later_call_on_every_rank(drains):
    results = distributed.run(2, gan_going_on_body, drains)
    distributed.assert_ranks_agree(results)
    kind, message, in_time, aborted, threads, steps, kept_frames = results[0]
    assert kind == "ValueError" and in_time and threads == 0 and not kept_frames, results[0]
    assert aborted == ([] if drains else ["MainThread"]), aborted
    assert steps == LAG // 2, steps  # two calls a step: the LAG-th call after the divergent one is a step's second
    assert message.startswith("adasum.all_reduce: tensors differ across ranks at index 0: rank 0 has float32 [4, 2] "
                              "on cpu, rank 1 has float32 [8] on cpu (a call already under way"), message


def matching_body(rank, world):
    """Deferred checks over many matching calls, new layouts (compared before their data) among them: nothing is
    raised, every checked call is compared, and release ends the thread."""
    g, d = [torch.ones(4, 2)], [torch.ones(8)]  # one tensor each: gloo aborts on dot products of other sizes
    calls = 0
    with override(deferred_checks=True):
        for step in range(150):
            _gan_step(g, d)
            calls += 2
            if step % 50 == 0:
                adasum.Mean().all_reduce([torch.ones(step + 1)])  # a new layout: waits for its verdict
                calls += 1
        # a new layout with a problem on one rank: every rank waits for its verdict, so nothing moved; the guard
        # goes on
        t = torch.ones(1).expand(5) if rank == 1 else torch.ones(5)
        problem = _error_of(lambda: adasum.all_reduce([t]))[:2]
        for _ in range(10):
            _gan_step(g, d)
            calls += 2
        guard = communicators.communicator(None).guard
    adasum.release()
    return guard.error, guard.checked == calls, guard.alive(), len(_guard_threads()), problem


def test_matching_calls_raise_nothing_and_are_all_compared():
    results = distributed.run(2, matching_body)
    assert all(r[:4] == (None, True, False, 0) for r in results), results
    distributed.assert_ranks_agree([r[4] for r in results])
    kind, message = results[0][4]
    assert kind == "ValueError" and "tensor 0 has elements that share memory" in message, message
    assert ": on rank 1, tensor 0 has elements" in message, message


def new_layout_on_one_rank_body(rank, world):
    """A layout's first call (compared before its data) on rank 0 against an agreed one that rank 1 posts without
    waiting (`prepare` alone: the check, no data): both go on to the LAG-th call after it, which raises the same
    error on every rank; each aborts the communicator (a stand-in) as it raises, its device not draining (a
    stand-in too)."""
    config, a = ("test",), [torch.ones(6)]
    aborted = []
    with override(deferred_checks=True):
        prepare(a, None, config=config, operation="test")
        guard = communicators.communicator(None).guard
        guard.abort = lambda: aborted.append(threading.current_thread().name)
        guard.drains = lambda seconds: False
        mine = [torch.ones(2, 3)] if rank == 0 else a
        kind, message, seconds = _error_of(lambda: prepare(mine, None, config=config, operation="test"))
        start = time.monotonic()
        while kind is None and guard.error is None and time.monotonic() - start < BOUND_S:
            time.sleep(0.01)
        calls = 1
        if kind is None:
            kind, message, more = _until_raised(lambda: prepare(a, None, config=config, operation="test"))
            calls += more
        seconds += time.monotonic() - start
    adasum.release()
    return kind, message, seconds < BOUND_S, aborted, rank == 0 or guard.checked == 1, calls


def test_a_new_layout_on_one_rank_against_a_posted_one_is_named_on_every_rank():
    results = distributed.run(2, new_layout_on_one_rank_body)
    distributed.assert_ranks_agree(results)
    kind, message, in_time, aborted, _, calls = results[0]
    assert kind == "ValueError" and in_time and aborted == ["MainThread"] and all(r[4] for r in results), results
    assert calls == LAG + 1, calls  # the divergent call, then up to the LAG-th after it, on every rank
    assert message == ("test: tensors differ across ranks at index 0: rank 0 has float32 [2, 3] on cpu, rank 1 has "
                       "float32 [6] on cpu (a call already under way on some rank: its result is undefined; destroy "
                       "the process group)"), message


def swapped_on_backend_body(rank, world):
    """Swapped equal-size layouts on the test backend's devices: gloo names the divergent call itself, NCCL a later
    call (the guard compares it off the call's path); either way every rank raises the same error within the bound."""
    dev = distributed.device_for(rank)
    a, b = [torch.ones(4, 2, device=dev)], [torch.ones(8, device=dev)]
    adasum.all_reduce(a)
    adasum.all_reduce(b)

    def diverge_then_go_on():
        adasum.all_reduce(b if rank == world - 1 else a)
        start = time.monotonic()
        while time.monotonic() - start < BOUND_S:  # NCCL: a later call raises what the guard found
            adasum.all_reduce(a)

    kind, message, seconds = _error_of(diverge_then_go_on)
    return kind, (message or "").split(" (a call")[0], seconds < BOUND_S


def _named_on_every_rank_of_the_backend(world, body, last_rank_has: str) -> None:
    """`body`'s divergence (rank 0 calls float32 [4, 2], the last rank `last_rank_has`) raised as the same
    ValueError on every rank within the bound, named as on gloo (the NCCL suffix taken off by the body)."""
    results = distributed.run(world, body)
    distributed.assert_ranks_agree(results)
    kind, message, in_time = results[0]
    device = "cuda" if distributed.BACKEND == "nccl" else "cpu"
    assert kind == "ValueError" and in_time, results[0]
    assert message == (f"adasum.all_reduce: tensors differ across ranks at index 0: rank 0 has float32 [4, 2] on "
                       f"{device}, rank {world - 1} has float32 {last_rank_has} on {device}"), message


@pytest.mark.nccl
@pytest.mark.parametrize("world", distributed.world_sizes(2, 4) if distributed.BACKEND == "nccl" else [2])
def test_swapped_layouts_are_named_on_every_rank_of_the_test_backend(world):
    _named_on_every_rank_of_the_backend(world, swapped_on_backend_body, "[8]")


def blocked_on_backend_body(rank, world):
    """Layouts of different sizes, each agreed, then one rank calls the other: gloo names the call itself; on NCCL
    its kernels wait for sizes no peer sends and the host blocks on the device: the guard names it and aborts the
    communicator, which ends them, and the LAG-th call after the divergent one raises the same error on every
    rank."""
    dev = distributed.device_for(rank)
    a, c = [torch.ones(4, 2, device=dev)], [torch.ones(5, device=dev)]
    adasum.all_reduce(a)
    adasum.all_reduce(c)
    start = time.monotonic()
    kind, message, _ = _error_of(lambda: adasum.all_reduce(c if rank == world - 1 else a))
    if kind is None:
        torch.cuda.synchronize()  # where the data waits for sizes no peer sends: until the guard aborts NCCL
        kind, message, _ = _until_raised(lambda: adasum.all_reduce(a))
    return kind, (message or "").split(" (a call")[0], time.monotonic() - start < BOUND_S


@pytest.mark.nccl
@pytest.mark.parametrize("world", distributed.world_sizes(2, 4) if distributed.BACKEND == "nccl" else [2])
def test_a_divergent_call_that_blocks_on_the_device_is_named_on_every_rank(world):
    _named_on_every_rank_of_the_backend(world, blocked_on_backend_body, "[5]")


def subgroup_body(rank, world):
    """Deferred checks on a group of ranks 0 and 1 out of 3: the guard connects the members only (rank 2 never
    calls), and names a swap on both."""
    sub = dist.new_group([0, 1])
    if rank == 2:
        return None
    g, d = [torch.ones(4, 2)], [torch.ones(8)]
    with override(deferred_checks=True):
        for _ in range(3):
            adasum.all_reduce(g, group=sub)
            adasum.all_reduce(d, group=sub)
        guard = communicators.communicator(sub).guard
        adasum.all_reduce(d if rank == 1 else g, group=sub)
        start = time.monotonic()
        while guard.error is None and time.monotonic() - start < BOUND_S:
            time.sleep(0.01)
        kind, message, calls = _until_raised(lambda: adasum.all_reduce(g, group=sub))
    adasum.release()
    return kind, message, len(_guard_threads()), calls


def test_deferred_checks_on_a_subgroup_name_a_swap_on_its_members():
    results = distributed.run(3, subgroup_body)
    assert results[2] is None and results[0] == results[1], results
    kind, message, threads, calls = results[0]
    assert kind == "ValueError" and threads == 0 and calls == LAG, results[0]
    assert message.startswith("adasum.all_reduce: tensors differ across ranks at index 0: rank 0 has float32 [4, 2] "
                              "on cpu, rank 1 has float32 [8] on cpu (a call already under way"), message


NOTE = " (a call already under way on some rank: its result is undefined; destroy the process group)"
SWAPPED = ("adasum.all_reduce: tensors differ across ranks at index 0: rank 0 has float32 [4, 2] on cpu, rank 1 has "
           "float32 [8] on cpu" + NOTE)


def _wait_for_error(guard):
    start = time.monotonic()
    while guard.error is None and guard.alive() and time.monotonic() - start < BOUND_S:
        time.sleep(0.01)


def late_divergence_body(rank, world, where, end):
    """A swap fewer than LAG calls before the end (at call `where` of 40, or the very last call when `where` is None),
    then the end of the run: ``end`` is "release", "destroy" or "barrier". The kept error is raised there on every
    rank, and only once."""
    g, d = [torch.ones(4, 2)], [torch.ones(8)]
    with override(deferred_checks=True):
        _gan_step(g, d)
        guard = communicators.communicator(None).guard
        calls = 40
        where = calls - 1 if where is None else where
        for step in range(calls):
            swap = step == where and rank == 1
            adasum.all_reduce(d if swap else g)
        if where < calls - 1:
            _wait_for_error(guard)  # found by the guard; nothing raised it: raise_at is LAG calls on
        ending = {"release": adasum.release, "destroy": dist.destroy_process_group, "barrier": dist.barrier}[end]
        kind, message, seconds = _error_of(ending)
        again = _error_of(adasum.release)[0]  # handed once: a release after it raises nothing
    if end == "destroy":  # the harness destroys the default group after the body: make one to destroy
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return kind, message, seconds < BOUND_S, again, len(_guard_threads())


@pytest.mark.parametrize("where, end", [(10, "release"), (None, "release"), (10, "destroy"), (20, "barrier")])
def test_a_divergence_within_lag_of_the_end_is_raised_on_every_rank_at_the_end(where, end):
    results = distributed.run(2, late_divergence_body, where, end)
    distributed.assert_ranks_agree(results)
    kind, message, in_time, again, threads = results[0]
    assert (kind, message) == ("ValueError", SWAPPED), results[0]
    assert in_time and again is None and threads == 0, results[0]


def extra_call_body(rank, world, end):
    """Rank 1 makes one checked call more than rank 0 (a repeat, posted), then both end (release or barrier): the
    same ValueError on every rank, naming the counts and the extra call, not "a peer died". On gloo, where a call
    waits for its message sizes' comparison (no abort), rank 1's extra call raises it (nothing moved), and rank 0's
    end; elsewhere both ends (the extra call's data went on)."""
    config, a = ("test",), [torch.ones(6)]
    with override(deferred_checks=True):
        for _ in range(3):
            prepare(a, None, config=config, operation="test")
        extra = _error_of(lambda: prepare(a, None, config=config, operation="test")) if rank == 1 else (None,)
        kind, message, seconds = _error_of(adasum.release if end == "release" else dist.barrier)
        if extra[0] is not None:
            kind, message, seconds = extra
        later = _error_of(lambda: prepare(a, None, config=config, operation="test"))[:2] if end == "barrier" else None
    adasum.release()
    return kind, message, seconds < BOUND_S, later


@pytest.mark.parametrize("end", ["release", "barrier"])
def test_one_extra_call_on_one_rank_is_named_on_every_rank_at_the_end(end):
    results = distributed.run(2, extra_call_body, end)
    distributed.assert_ranks_agree(results)
    kind, message, in_time, later = results[0]
    assert kind == "ValueError" and in_time, results[0]
    assert message == ("test: the number of checked calls on the group differs across ranks: rank 0 made 3, "
                       "rank 1 made 4; rank 1's call 4 (tensors: float32 [6] on cpu) has no match on some rank"
                       + NOTE), message
    if end == "barrier":  # the kept error: every later call raises it too
        assert later == (kind, message), later


def matching_then_barrier_body(rank, world):
    """Matching calls, a barrier (the fence passes), more matching calls, release: nothing raised, all compared."""
    g, d = [torch.ones(4, 2)], [torch.ones(8)]
    with override(deferred_checks=True):
        for _ in range(5):
            _gan_step(g, d)
        dist.barrier()
        for _ in range(5):
            _gan_step(g, d)
        guard = communicators.communicator(None).guard
        dist.barrier()
    adasum.release()
    return guard.error, guard.checked, guard.alive()


def test_matching_calls_pass_the_barrier_fence():
    results = distributed.run(2, matching_then_barrier_body)
    assert all(r == (None, 20, False) for r in results), results


def release_while_waiting_body(rank, world):
    """Another thread's call waits for its verdict (a new layout that rank 0 alone calls) while this thread releases
    the group: the waiter is woken with an error on every rank that waits, and release returns; no thread is left."""
    config = ("test",)
    with override(deferred_checks=True):
        prepare([torch.ones(2)], None, config=config, operation="test")
        out = {}

        def call():
            with override(deferred_checks=True):  # settings overridden are the thread's own
                out["error"] = _error_of(lambda: prepare([torch.ones(3)], None, config=config, operation="test"))[:2]

        thread = threading.Thread(target=call)
        if rank == 0:
            thread.start()
            time.sleep(0.3)
        start = time.monotonic()
        released = _error_of(adasum.release)[:2]
        if rank == 0:
            thread.join(BOUND_S)
    return out.get("error"), released, time.monotonic() - start < BOUND_S, len(_guard_threads())


def test_release_while_another_thread_waits_for_a_verdict_wakes_it():
    results = distributed.run(2, release_while_waiting_body)
    waiter, released, in_time, threads = results[0]
    assert waiter is not None and waiter[0] == "ValueError", results
    assert "rank 0 made 2, rank 1 made 1" in waiter[1], waiter
    assert in_time and threads == 0 and results[1][2] and results[1][3] == 0, results
    assert results[1][1] == (waiter[0], waiter[1]), results  # the peer's release raises the same error


def new_sizes_against_an_agreed_layout_body(rank, world, other):
    """Deferred checks forced on gloo, which has no abort: a layout agreed by both ranks, then rank 1 calls a layout
    whose messages have other sizes (`other`: another number of elements, or of tensors) while rank 0 calls the agreed
    one (posted without waiting, as on NCCL). gloo would abort the process on data of another size, so those sizes
    are compared before the data: the same ValueError on every rank, nothing moved, the group and its guard go on."""
    a = [torch.full((4, 2), 1.0 + rank)]
    with override(deferred_checks=True):
        adasum.all_reduce(a)
        adasum.all_reduce(a)
        guard = communicators.communicator(None).guard
        mine = [torch.full(shape, 2.0 + rank) for shape in other] if rank == 1 else [a[0].clone()]
        before = [t.clone() for t in mine]
        kind, message, _ = _error_of(lambda: adasum.all_reduce(mine))
        untouched = all(torch.equal(x, y) for x, y in zip(mine, before))
        after = [torch.full((3,), float(rank))]
        adasum.all_reduce(after)  # the group is still usable: nothing moved
        adasum.all_reduce(a)
        dist.barrier()  # the guard's fence: every posted call compared
        kept = guard.error
    adasum.release()
    return kind, message, untouched, after[0].tolist(), kept, len(_guard_threads())


@pytest.mark.parametrize("other, named", [([(5,)], "float32 [5] on cpu"),
                                          ([(4,), (4,)], "float32 [4] on cpu")])
def test_deferred_checks_on_gloo_refuse_a_new_size_against_an_agreed_layout_on_every_rank(other, named):
    results = distributed.run(2, new_sizes_against_an_agreed_layout_body, other)
    distributed.assert_ranks_agree(results)
    kind, message, untouched, after, kept, threads = results[0]
    assert kind == "ValueError" and untouched and kept is None and threads == 0, results[0]
    if len(other) == 1:
        assert message == ("adasum.all_reduce: tensors differ across ranks at index 0: rank 0 has float32 [4, 2] on "
                           f"cpu, rank 1 has {named}"), message
    else:
        assert message == "adasum.all_reduce: tensors differ across ranks: rank 0 passed 1, rank 1 passed 2", message
    ref, bound = combine_with_bound([torch.full((3,), float(r)) for r in range(2)])
    err = float((torch.tensor(after, dtype=torch.float64) - ref).norm())
    assert err <= bound, (after, ref, err, bound)


def test_the_overlap_check_of_ten_thousand_columns_is_fast():
    matrix = torch.zeros(256, 10_000)
    columns = [matrix[:, i] for i in range(10_000)]
    start = time.monotonic()
    assert agreement.overlapping(columns) is None
    assert agreement.overlapping([*columns, matrix[3:5, 9_998]]) == (9_998, 10_000)
    assert time.monotonic() - start < 3  # a range over each column's span: 3.5-16 s


def _shares_a_byte(tensors):
    """Whether two of `tensors` share a byte, from explicit byte sets (the reference)."""
    seen: set = set()
    for t in tensors:
        size = t.element_size()
        # each element's storage offset: an index of the whole storage seen with t's own shape, strides and offset
        index = torch.arange(t.untyped_storage().nbytes() // size).as_strided(t.shape, t.stride(), t.storage_offset())
        mine = {o * size + b for o in index.reshape(-1).tolist() for b in range(size)}
        if seen & mine:
            return True
        seen |= mine
    return False


def test_the_overlap_check_agrees_with_explicit_byte_sets():
    g = torch.Generator().manual_seed(3)
    floats = torch.zeros(240)
    raw = floats.view(torch.uint8)  # the same storage in bytes: views of two element sizes
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    for _ in range(300):
        views = []
        for _ in range(draw(2, 5)):
            base, scale = (raw, 4) if draw(0, 5) == 0 else (floats, 1)
            shape, stride = (draw(1, 5), draw(1, 5)), (draw(1, 12) * scale, draw(1, 4))
            views.append(base.as_strided(shape, stride, draw(0, 100) * scale))
        got = agreement.overlapping(views)
        assert (got is not None) == _shares_a_byte(views), [(v.shape, v.stride(), v.storage_offset()) for v in views]
