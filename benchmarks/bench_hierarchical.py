"""Hierarchical Adasum (mean inside each node, Adasum across nodes) against flat Adasum over all
ranks, on one multi-GPU host emulating nodes of `--local-size` GPUs: time per call (median,
slowest rank) and agreement of the hierarchical result with the single-process definition
(`adasum.hierarchical.reduce_hierarchical` of every rank's input). Appends to
benchmarks/results/hierarchical.jsonl.

    python benchmarks/bench_hierarchical.py --world 4 --local-size 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
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
from adasum.collectives.hierarchical import reduce_hierarchical  # noqa: E402

from layouts import LAYOUTS  # noqa: E402


def worker(rank: int, world: int, store: str, args) -> None:
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300), device_id=device if gpu else None)

    def sync():
        if gpu:
            torch.cuda.synchronize()

    flat = adasum.Adasum()
    hier = adasum.Adasum(hierarchical=True, local_size=args.local_size)
    rows = []
    for layout in args.layouts:
        shapes = LAYOUTS[layout]() if layout in LAYOUTS else [(1 << int(layout.split("^")[1]),)]
        sizes = [math.prod(s) for s in shapes]
        g = torch.Generator(device=device).manual_seed(1000 + rank)
        buffer = torch.randn(sum(sizes), generator=g, device=device)
        # agreement with the definition, on the first 2^20 values' tensors (every rank's input gathered)
        probe = buffer[: min(buffer.numel(), 1 << 20)].clone()
        probe_sizes = [n for n in _prefix_sizes(sizes, probe.numel())]
        everyone = [torch.empty_like(probe) for _ in range(world)]
        dist.all_gather(everyone, probe)
        result = probe.clone()
        hier.all_reduce_flat(result, probe_sizes)
        ref = torch.cat([reduce_hierarchical([e[o:o + n] for e in everyone], args.local_size)
                         for o, n in zip(_offsets(probe_sizes), probe_sizes)])
        rel = float((result.double() - ref.double()).norm() / ref.double().norm())
        times = {}
        for name, reducer in (("flat", flat), ("hierarchical", hier)):
            work = buffer.clone()
            for _ in range(3):
                reducer.all_reduce_flat(work, sizes)
            samples = []
            for _ in range(args.repeats):
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                reducer.all_reduce_flat(work, sizes)
                sync()
                samples.append(time.perf_counter() - t0)
            t = torch.tensor(samples, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name] = statistics.median(t.tolist())
        base = buffer.clone()
        for _ in range(3):
            dist.all_reduce(base)
        samples = []
        for _ in range(args.repeats):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(base)
            sync()
            samples.append(time.perf_counter() - t0)
        row = {
            "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
            "world_size": world, "local_size": args.local_size, "layout": layout, "numel": sum(sizes),
            "flat_adasum_s": times["flat"], "hierarchical_adasum_s": times["hierarchical"],
            "allreduce_s": statistics.median(samples), "hierarchical_vs_definition_rel_err": rel,
        }
        rows.append(row)
        if rank == 0:
            print(f"{layout:12s} flat {times['flat'] * 1e3:8.3f} ms  hierarchical {times['hierarchical'] * 1e3:8.3f} ms"
                  f"  all_reduce {row['allreduce_s'] * 1e3:8.3f} ms  |hier - definition|/|definition| {rel:.1e}",
                  flush=True)
    if rank == 0:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _offsets(sizes):
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def _prefix_sizes(sizes, limit):
    out, total = [], 0
    for n in sizes:
        if total >= limit:
            break
        out.append(min(n, limit - total))
        total += out[-1]
    return out


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=torch.cuda.device_count() or 4)
    p.add_argument("--local-size", type=int, default=2)
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["flat-2^26", "resnet50", "bert-large"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=os.path.join(here, "results", "hierarchical.jsonl"))
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.world, os.path.join(tmp, "s"), args), nprocs=args.world,
                           start_method="spawn")


if __name__ == "__main__":
    main()
