"""Where a small adasum.all_reduce spends its time on 2 GPUs: each piece timed alone (median of
many calls, synchronised), so the fixed cost per call can be attributed. Prints a table."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import adasum
from adasum import kernels as ops
from adasum.checks.agreement import check_same_layout
from adasum.collectives import vhdd as collectives
from adasum.core.operator import coefficients
from adasum.transport.c10d import post, wait


def worker(rank: int, store: str) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=120), device_id=dev)
    x = torch.randn(1024, device=dev)
    half = torch.randn(512, device=dev)
    recv = torch.empty(512, device=dev)
    small64 = torch.zeros(3, 2, dtype=torch.float64, device=dev)
    parts = ops.dot_and_norms(half, recv, [512])
    ca, cb = coefficients(parts, 0.5, 0.5)
    probes = {
        "dist.all_reduce fp32 1024": lambda: dist.all_reduce(x),
        "dist.all_reduce f64 x6": lambda: dist.all_reduce(small64),
        "int64 all_reduce + tolist (layout check)": lambda: check_same_layout([x], None, dev),
        "batch_isend_irecv 512 + wait": lambda: wait(sum(post([half], [recv], 1 - rank, None), [])),
        "dot_and_norms (Triton) 512": lambda: ops.dot_and_norms(half, recv, [512]),
        "coefficients": lambda: coefficients(parts, 0.5, 0.5),
        "scale_add (Triton) 512": lambda: ops.scale_add(half, recv, ca, cb, [512], half),
        "adasum_flat_ 1024": lambda: collectives.adasum_flat_(x, [1024]),
        "adasum.all_reduce 1024": lambda: adasum.all_reduce(x),
        "adasum.all_reduce 1024 check_layout=False": lambda: adasum.all_reduce(x, check_layout=False),
    }
    rows = []
    for name, fn in probes.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(50):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rows.append((name, statistics.median(times) * 1e6))
    if rank == 0:
        for name, us in rows:
            print(f"{name:45s} {us:9.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(os.path.join(tmp, "s"),), nprocs=2, start_method="spawn")
