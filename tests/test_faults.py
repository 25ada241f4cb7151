"""A dead or stalled peer in the middle of adasum.all_reduce ends in a clear CollectiveError on the
survivors within the group's timeout, never a hang (gloo). One rank is made to exit (os._exit) or to
sleep past the timeout at a chosen step, by wrapping a function inside that rank only."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import adasum
from adasum.transport import c10d

import distributed

TIMEOUT_S = 3
NO_HANG_S = TIMEOUT_S + 20  # generous: a bound on hanging, not a speed check


def _inject(victim_action: str, target: str, call: int, group) -> object:
    """Make this rank exit or stall at its `call`-th (1-based) call of `target`; the transport to pass
    (None: the default one)."""
    calls = [0]

    def act():
        calls[0] += 1
        if calls[0] == call:
            if victim_action == "exit":
                os._exit(17)
            time.sleep(TIMEOUT_S + 4)

    if target == "exchange":  # every point-to-point batch of the transport is posted through its post function

        def post(*args, **kwargs):
            act()
            return c10d.post(*args, **kwargs)

        return c10d.PointToPointC10d(group, 4 << 20, adasum.group_timeout(group), post)
    else:  # the small float64 all-reduces (the layout check is call 1)
        real_all_reduce = dist.all_reduce

        def all_reduce(*args, **kwargs):
            act()
            return real_all_reduce(*args, **kwargs)

        dist.all_reduce = all_reduce
        return None


def fault_body(rank, world, victim, action, target, call):
    # the world group keeps a long timeout (spawn skew); the short one is a group made after a barrier
    dist.barrier()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    dist.barrier(group=group)
    injected = _inject(action, target, call, group) if rank == victim else None
    transport = injected if injected is not None else "p2p"  # every rank asks for the same transport (checked)
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(1001, generator=g), torch.randn(7, 3, generator=g, dtype=torch.float64)]
    start = time.monotonic()
    try:
        adasum.all_reduce(tensors, group=group, transport=transport)
    except adasum.CollectiveError as error:
        cause = error.__cause__
        return {
            "outcome": "error",
            "message": str(error),
            "seconds": time.monotonic() - start,
            "cause": type(cause).__name__ if cause is not None else None,
            "cause_is_runtime": isinstance(cause, RuntimeError),
            "timeout": adasum.group_timeout(group).total_seconds(),
            "world_timeout": adasum.group_timeout().total_seconds(),
        }
    return {"outcome": "finished", "seconds": time.monotonic() - start}


# (world, victim, action, target, call, {survivor: the step its error must name})
SCENARIOS = {
    # world 3: rank 1 is folded into rank 0, then ranks 0 and 2 run the tree
    "exit-before-the-fold-w3": (
        3, 1, "exit", "exchange", 1,
        {0: "the fold (receiving from rank 1)", 2: "the reduce-scatter exchange at level 1 of 1 with rank 0"},
    ),
    "stall-at-level-2-exchange-w4": (
        4, 1, "stall", "exchange", 2,
        {
            0: "the dot-product all-reduce at level 2 of 2",
            2: "the dot-product all-reduce at level 2 of 2",
            3: "the reduce-scatter exchange at level 2 of 2 with rank 1",
        },
    ),
    # the folded rank takes part in the dot-product all-reduces (its call 1 is the layout check)
    "exit-in-dot-product-all-reduce-w3": (
        3, 1, "exit", "all_reduce", 2,
        {r: "the dot-product all-reduce at level 1 of 1" for r in (0, 2)},
    ),
    # world 2: post 1 is the reduce-scatter, post 2 the (last level's) gather
    "exit-in-gather-w2": (2, 0, "exit", "exchange", 2, {1: "the gather exchange at level 1 of 1 with rank 0"}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_dead_or_stalled_peer_raises_clear_error_within_timeout(name):
    world, victim, action, target, call, expected = SCENARIOS[name]
    results = distributed.run(world, fault_body, victim, action, target, call, allow_exit=True)
    if action == "exit":
        assert results[victim] == distributed.Exited(17)
    else:
        # the stalled rank wakes to find its peers gone: it fails too, never finishes silently
        assert results[victim]["outcome"] == "error", results[victim]
    for rank, step in expected.items():
        r = results[rank]
        assert r["outcome"] == "error", (rank, r)
        message = r["message"]
        assert message.startswith(f"adasum.all_reduce on rank {rank} of {world}: {step} failed"), message
        assert f"(group timeout {TIMEOUT_S:g} s)" in message and "\n" not in message, message
        assert r["cause_is_runtime"], r["cause"]
        assert r["timeout"] == TIMEOUT_S and r["world_timeout"] == 120  # the harness's default timeout_s
        assert r["seconds"] < NO_HANG_S, (rank, r["seconds"])
        if action == "stall" and "exchange" in step:
            # the stalled peer's partner notices only when the timeout runs out
            assert "Timed out" in message and r["seconds"] >= TIMEOUT_S - 0.5, message


def group_argument_body(rank, world):
    errors = []
    for call in (adasum.group_timeout, adasum.release):
        for group in ("world", 3):
            try:
                call(group)
                errors.append(None)
            except TypeError as error:
                errors.append(str(error))
    sub = dist.new_group([0], timeout=timedelta(seconds=7))
    return errors, adasum.group_timeout(sub).total_seconds(), adasum.group_timeout().total_seconds()


def test_group_timeout_and_release_refuse_what_is_not_a_group():
    """Not the default timeout (or nothing released) for a name or a number given as the group: TypeError."""
    [(errors, sub, world)] = distributed.run(1, group_argument_body)
    assert errors == [
        "adasum.group_timeout: group must be a torch.distributed ProcessGroup or None, got 'world'; pass "
        "dist.new_group(...) or None",
        "adasum.group_timeout: group must be a torch.distributed ProcessGroup or None, got 3; pass "
        "dist.new_group(...) or None",
        "adasum.release: group must be a torch.distributed ProcessGroup or None, got 'world'; pass "
        "dist.new_group(...) or None",
        "adasum.release: group must be a torch.distributed ProcessGroup or None, got 3; pass dist.new_group(...) or "
        "None",
    ]
    assert (sub, world) == (7, 120)
