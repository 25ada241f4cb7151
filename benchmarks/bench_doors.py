"""Host time per repeated call of each entry point ("door") that combines a list of tensors, on gloo: the wall time
of a call on the CPU (where gloo's own work is also host work), median over repeats, for a list shaped like
ResNet-50's gradients (161 tensors, scaled down so that the data's share is small). Prints a table and appends one
JSON row per door to ``--out``.

    python benchmarks/bench_doors.py --world 2 --out benchmarks/results/doors.jsonl --label "..."
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import adasum  # noqa: E402
from adasum.settings import override  # noqa: E402

from machine import device_name  # noqa: E402

TENSORS = 161
"""ResNet-50's parameter tensors."""


def sizes(count: int, scale: int) -> list[int]:
    """`count` tensor sizes cycling through small and larger ones (every `scale` elements a step)."""
    return [scale * (1 + (i * 7) % 16) for i in range(count)]


def _on_the_movers(adacons, flat, layout) -> None:
    """AdaCons' flat form on the slice-parallel movers (gloo's default is its two all-reduces)."""
    with override(transport_first="slices"):
        adacons.all_reduce_flat(flat, layout)


def worker(rank: int, world: int, store: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    layout = sizes(TENSORS, args.scale)
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(n, generator=g) for n in layout]
    flat = torch.cat(tensors)
    reducer, adacons = adasum.Adasum(), adasum.AdaCons()
    params = [torch.nn.Parameter(torch.zeros(n)) for n in layout]  # the same weights on every rank
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    optimizer = adasum.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), mode="gradient")
    doors = {
        "adasum.all_reduce(list)": lambda: adasum.all_reduce(tensors),
        "Adasum.all_reduce(list)": lambda: reducer.all_reduce(tensors),
        "Adasum.all_reduce_flat": lambda: reducer.all_reduce_flat(flat, layout),
        "AdaCons.all_reduce_flat": lambda: adacons.all_reduce_flat(flat, layout),
        "AdaCons.all_reduce_flat (slice movers)": lambda: _on_the_movers(adacons, flat, layout),
        "DistributedOptimizer.step (gradient)": optimizer.step,
    }
    rows = []
    for name, call in doors.items():
        for _ in range(args.warmup):
            call()
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        rows.append((name, statistics.median(times) * 1e6))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--scale", type=int, default=16, help="elements per size step (161 tensors of 16..256 x it)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.world, os.path.join(tmp, "store"), args, results), nprocs=args.world,
                           start_method="spawn")
    rows = results.get()
    machine = device_name(torch.device("cpu"))
    for name, us in rows:
        print(f"{name:40s} {us:9.1f} us")
    if args.out is not None:
        with args.out.open("a") as out:
            for name, us in rows:
                out.write(json.dumps({
                    "date": date.today().isoformat(), "device": machine, "backend": "gloo", "world_size": args.world,
                    "torch": torch.__version__, "label": args.label, "door": name, "tensors": TENSORS,
                    "elements": sum(sizes(TENSORS, args.scale)), "host_us_median": round(us, 1),
                    "repeats": args.repeats,
                }) + "\n")


if __name__ == "__main__":
    main()
