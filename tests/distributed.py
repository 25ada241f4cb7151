"""Run a test body in real gloo (or NCCL) processes: started by a fork server, one FileStore per run,
OMP_NUM_THREADS=1.

The body is a module-level function ``body(rank, world_size, *args)``; whatever it returns comes back
to the test, one entry per rank, and an exception in any rank fails the test with that rank's traceback.
A rank that exits without a result fails the test too, unless ``allow_exit=True`` (fault tests that
kill a rank on purpose): its entry is then an `Exited` with its exit code.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKEND = os.environ.get("ADASUM_TEST_BACKEND", "gloo")
"""On NCCL, the transport every call of the suite prefers where the group can run it (the NCCL suite is run
once per transport: "symmetric", the default inside one host, then "p2p" and "collectives")."""


@dataclass(frozen=True)
class Exited:
    """The result of a rank that exited without returning (only with ``run(..., allow_exit=True)``)."""

    exitcode: int | None


def world_sizes(*sizes: int) -> list[int]:
    """The world sizes a test runs: all of them on gloo; on NCCL only those with a GPU per rank
    (NCCL refuses two ranks on one GPU)."""
    if BACKEND == "nccl":
        return [w for w in sizes if w <= torch.cuda.device_count()]
    return list(sizes)


def device_for(rank: int) -> torch.device:
    """The device a test rank uses: CPU on gloo, its own GPU on NCCL."""
    if BACKEND == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _worker(rank, world_size, store_path, backend, timeout_s, env, body, args, results):
    os.environ.update(env)
    torch.set_num_threads(1)
    # a rank still running at its timeout prints every thread's stack (pytest shows it with -s), then goes on
    faulthandler.dump_traceback_later(timeout_s, exit=False)
    try:
        if backend == "nccl":  # its own GPU, also where the suite's backend is gloo (a test asks for NCCL)
            torch.cuda.set_device(torch.device("cuda", rank % torch.cuda.device_count()))
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        try:
            results.put((rank, "ok", body(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _collect(procs, results, timeout_s: float, allow_exit: bool) -> dict:
    """{rank: (status, value)}: "ok"/"error" as reported, "exited" with the exit code for a rank whose
    process ended without reporting. Each result has `timeout_s` to arrive. Unless `allow_exit`, the
    first such exit ends the collection at once (the ranks still running are then killed)."""
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(procs):
        try:
            rank, status, value = results.get(timeout=0.5)
            got[rank] = (status, value)
            deadline = time.monotonic() + timeout_s
            continue
        except queue.Empty:
            pass
        gone = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
        if gone:
            try:  # a rank that finished normally may have left its result in the pipe
                while True:
                    rank, status, value = results.get(timeout=2)
                    got[rank] = (status, value)
            except queue.Empty:
                pass
            exited = [r for r in gone if r not in got]
            for r in exited:
                got[r] = ("exited", procs[r].exitcode)
            if exited and not allow_exit:
                return got
        if time.monotonic() > deadline:
            return got
    return got


def _context():
    """Ranks are forks of a server process that imported torch once, not of pytest's process: none inherits a
    thread, a process group or a CUDA context, and none pays torch's import (on a 2-core machine most of a small
    test's time); each rank imports its test module and adasum itself, after its environment is set."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy"])
    return ctx


def run(
    world_size: int,
    body,
    *args,
    timeout_s: float = 120,
    backend: str | None = None,
    env=None,
    allow_exit: bool = False,
) -> list:
    """Run `body` on `world_size` ranks and return the per-rank results, in rank order.

    With `allow_exit`, a rank that exits without a result gives an `Exited` entry instead of failing.
    """
    backend = backend or BACKEND
    ctx = _context()
    results = ctx.Queue()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, store_path, backend, timeout_s, env, body, args, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for p in procs:
                p.start()
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = old
        out: dict[int, object] = {}
        errors = []
        try:
            got = _collect(procs, results, timeout_s + 60, allow_exit)
            for rank in range(world_size):
                status, value = got.get(rank, ("missing", None))
                if status == "ok":
                    out[rank] = value
                elif status == "exited" and allow_exit:
                    out[rank] = Exited(value)
                elif status == "exited":
                    errors.append(f"rank {rank}: exited with code {value} without a result")
                elif status == "missing":
                    errors.append(f"rank {rank}: gave no result (timed out or stopped after another rank exited)")
                else:
                    errors.append(f"rank {rank}:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        if errors:
            raise AssertionError("\n".join(errors))
        return [out[r] for r in range(world_size)]


def assert_ranks_agree(results: list, skip: tuple = ()) -> None:
    """Every rank's result equals rank 0's; for dict results key by key (keys in `skip` left out),
    naming the first rank and key that differ."""
    first = results[0]
    for r, result in enumerate(results[1:], start=1):
        if isinstance(first, dict) and isinstance(result, dict):
            assert result.keys() == first.keys(), f"rank {r} has keys {sorted(result)}, rank 0 {sorted(first)}"
            for key in first:
                if key not in skip:
                    assert result[key] == first[key], f"rank {r} differs from rank 0 on {key!r}"
        else:
            assert result == first, f"rank {r} differs from rank 0"
