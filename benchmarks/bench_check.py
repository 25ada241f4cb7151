"""Host cost of the cross-rank layout check per call: `prepare` and a small `adasum.all_reduce` with the
check off, compared before the data (``deferred_checks=False``) and compared off the call's path
(``deferred_checks=True``; on gloo the guard runs as on NCCL, its calls not waiting for the comparison of their
message sizes that gloo needs, docs/faults.md), and the pieces a fingerprint exchange is made of. Prints a table, µs
per call.

    python benchmarks/bench_check.py                   # 2 gloo ranks, CPU tensors
    python benchmarks/bench_check.py --backend nccl    # 2 GPUs: the same on CUDA tensors (the checks stay on CPU)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import adasum
from adasum.checks.agreement import describe, local_problem
from adasum.checks.plan import plan_for, prepare
from adasum.settings import override
from adasum.transport.communicator import communicator, control_group
from adasum.transport.groups import group_device


def per_call_us(fns: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, float]:
    """Per function, the median over `repeats` of the mean time of `calls` back-to-back calls, in µs; the
    functions take turns within each repeat (a shared machine's drift hits them alike; ranks start together).
    A function may be a pair (settings to run it under, function)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for repeat in range(repeats + 1):
        for name, fn in fns.items():
            settings, fn = fn if isinstance(fn, tuple) else ({}, fn)
            with override(**settings):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls if repeat else min(calls, 50)):  # the first round warms up
                    fn()
                if repeat:
                    times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def probes(tensors: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    """The pieces of a fingerprint exchange and of a plan's per-call part, each alone."""
    control = control_group(None)
    comm = communicator(None)
    device = group_device(None)
    probe = torch.zeros(3, dtype=torch.int64)
    config = ("bench",)

    def launch_and_wait():
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=control, async_op=True).wait()

    def launch_only():
        works.append(dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=control, async_op=True))
        if len(works) == 100:  # waited outside the timed launches but for one in a hundred
            for work in works:
                work.wait()
            works.clear()

    works: list = []

    return {
        "torch.tensor([fp, -fp, 0])": lambda: torch.tensor([1, -1, 0], dtype=torch.int64),
        "probe.tolist()": probe.tolist,
        "gloo all_reduce(MAX) 3 x int64, launch + wait": launch_and_wait,
        "gloo all_reduce(MAX) 3 x int64, launch (waits batched)": launch_only,
        "plan look-up (plan_for)": lambda: plan_for(comm, tensors, None, config),
        "describe(tensors)": lambda: describe(tensors),
        "local_problem (overlap known)": lambda: local_problem(tensors, device, group=None, disjoint=True),
    }


def worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    dev = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    tensors = [torch.randn(n, device=dev) for n in (64, 32, 16, 8)]
    config = ("bench",)
    rows = list(per_call_us(probes(tensors), args.calls, args.repeats).items())
    with override(deferred_checks=True):  # the guard, made now, runs as on NCCL: calls go on without waiting for
        prepare(tensors, None, config=config, operation="bench")  # the sizes' comparison gloo needs (every rank's
    communicator(None).guard.sizes_first = False  # calls match here, so no message of another size is sent)
    modes = {"check off": ("none", {}), "compared before the data": ("call", dict(deferred_checks=False)),
             "compared off the path (deferred)": ("call", dict(deferred_checks=True))}

    def prepared(check):
        return lambda: prepare(tensors, None, config=config, operation="bench", check=check)

    def reduced(check):
        return lambda: adasum.all_reduce(tensors, check_layout=check != "none")

    timed = per_call_us({f"prepare(), {mode}": (settings, prepared(check)) for mode, (check, settings) in
                         modes.items()}, args.calls, args.repeats)
    rows += timed.items()
    rows.append(("  the deferred check's cost (deferred - off)",
                 timed["prepare(), compared off the path (deferred)"] - timed["prepare(), check off"]))
    whole = {f"adasum.all_reduce of 4 tensors, {mode}": (settings, reduced(check)) for mode, (check, settings) in
             modes.items()}
    rows += per_call_us(whole, max(args.calls // 10, 1), args.repeats).items()
    if args.backend == "nccl":
        torch.cuda.synchronize()
    adasum.release()
    if rank == 0:
        width = max(len(name) for name, _ in rows)
        print(f"{args.backend}, {world} ranks, {args.calls} calls x {args.repeats}: µs per call (median)")
        for name, us in rows:
            print(f"  {name:<{width}}  {us:8.1f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.world, os.path.join(tmp, "store"), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
