"""Run a test body in real gloo (or NCCL) processes: spawned, one FileStore per run, OMP_NUM_THREADS=1.

The body is a module-level function ``body(rank, world_size, *args)``; whatever it returns comes back
to the test, one entry per rank, and an exception in any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKEND = os.environ.get("ADASUM_TEST_BACKEND", "gloo")


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
    try:
        if backend == "nccl":
            torch.cuda.set_device(device_for(rank))
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


def run(world_size: int, body, *args, timeout_s: float = 120, backend: str | None = None, env=None) -> list:
    """Run `body` on `world_size` ranks and return the per-rank results, in rank order."""
    backend = backend or BACKEND
    ctx = mp.get_context("spawn")
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
        deadline = time.monotonic() + timeout_s + 60
        try:
            while len(out) + len(errors) < world_size:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    # a rank that died without reporting (crash at start-up, os._exit) fails the run now
                    reported = set(out) | {int(e.split()[1].rstrip(":")) for e in errors}
                    dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
                    if dead and results.empty():
                        time.sleep(0.5)
                        if results.empty():
                            errors += [f"rank {r}: exited with code {procs[r].exitcode} without a result" for r in dead]
                            break
                    if time.monotonic() > deadline:
                        errors.append(f"timed out after {timeout_s + 60:.0f} s")
                        break
                    continue
                if status == "ok":
                    out[rank] = value
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
