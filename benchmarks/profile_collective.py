"""Profile adasum.all_reduce on local ranks with torch.profiler; rank 0 prints the top kernels.

    python benchmarks/profile_collective.py --backend nccl --numel 16777216 [--layout resnet50] [--world 3]
        [--dtype bf16] [--timeline]

With ``ADASUM_CUDA_GRAPHS=0`` every kernel of the call shows on its own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import adasum  # noqa: E402

from layouts import LAYOUTS  # noqa: E402


def worker(rank: int, world: int, store: str, args) -> None:
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    dist.init_process_group(args.backend, store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    shapes = LAYOUTS[args.layout]() if args.layout else [(args.numel,)]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    tensors = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
    for _ in range(3):
        adasum.all_reduce(tensors, transport=args.transport or None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    # host time per call (nothing waits for the device): what the GPU idles for when the host is behind
    host = []
    for _ in range(20):
        t0 = time.perf_counter()
        adasum.all_reduce(tensors, transport=args.transport or None)
        host.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if rank == 0:
        print(f"{args.layout or args.numel}: host time per call, median of 20: {statistics.median(host) * 1e6:.1f} us")
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            adasum.all_reduce(tensors, transport=args.transport or None)
        if device.type == "cuda":
            torch.cuda.synchronize()
    if rank == 0:
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
        if args.trace:
            prof.export_chrome_trace(args.trace)
    if args.timeline and device.type == "cuda":
        timeline(tensors, args, rank)
    dist.barrier()
    dist.destroy_process_group()


def timeline(tensors, args, rank: int) -> None:
    """Rank 0 prints the device work of one call, in order of start: stream, start and length (us) from the
    call's first kernel or copy. The ranks pass a barrier and the device is idle before the call."""
    import json

    dist.barrier()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        adasum.all_reduce(tensors, transport=args.transport or None)
        torch.cuda.synchronize()
    if rank != 0:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    work = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not work:
        return
    t0 = work[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in work)
    print(f"timeline of one call ({len(work)} kernels and copies, {end - t0:.1f} us from first start to last end):")
    for e in work:
        name = e["name"].split("(")[0][:60]
        print(f"  stream {e['args'].get('stream', '?'):>3}  start {e['ts'] - t0:9.1f}  len {e['dur']:8.1f}  {name}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="nccl")
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--layout", default="")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--trace", default="")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--transport", default="")
    p.add_argument("--timeline", action="store_true", help="print the device work of one call in order")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.world, os.path.join(tmp, "s"), args), nprocs=args.world,
                           start_method="spawn")


if __name__ == "__main__":
    main()
