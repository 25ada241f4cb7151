"""Time adasum.all_reduce against one dist.all_reduce of the same bytes, in the same run.

    python benchmarks/bench_collective.py                       # gloo, 2 local CPU processes
    python benchmarks/bench_collective.py --backend nccl        # NCCL, one process per GPU

For each case both operations run alternately (after warm-up) `--repeats` times, each timed
between barriers (and CUDA synchronisation on GPUs); the medians are written as JSON lines to
benchmarks/results/collective.jsonl. `python benchmarks/render.py` turns them into docs/benchmarks.md.
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

from layouts import LAYOUTS  # noqa: E402
from machine import device_name  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_pair(fn_a, fn_b, device, repeats: int, warmup: int) -> tuple[float, float, list[float], list[float]]:
    for _ in range(warmup):
        fn_a()
        fn_b()
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, out in ((fn_a, times_a), (fn_b, times_b)):
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            fn()
            _sync(device)
            out.append(time.perf_counter() - start)
    # every rank reports the slowest rank's time for each repeat
    t = torch.tensor([times_a, times_b], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ta, tb = t.tolist()
    return statistics.median(ta), statistics.median(tb), ta, tb


def cases(args) -> list[tuple[str, list[tuple[int, ...]]]]:
    out = []
    for e in range(args.min_exp, args.max_exp + 1, args.step_exp):
        out.append((f"flat-2^{e}", [(1 << e,)]))
    for name in args.layouts:
        if name:
            out.append((name, LAYOUTS[name]()))
    return out


def worker(rank: int, world: int, store_path: str, args) -> None:
    torch.set_num_threads(1 if args.backend == "gloo" else torch.get_num_threads())
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        args.backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
        timeout=timedelta(seconds=600), device_id=device if device.type == "cuda" else None,
    )
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for layout, shapes in cases(args):
            numel = sum(math.prod(s) for s in shapes)
            g = torch.Generator(device=device).manual_seed(rank)
            tensors = [torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype) for s in shapes]
            flat = torch.randn(numel, generator=g, device=device, dtype=torch.float32).to(dtype)
            repeats = args.repeats if numel < (1 << 24) else max(3, args.repeats // 2)

            def run_adasum():
                adasum.all_reduce(tensors)

            def run_allreduce():
                dist.all_reduce(flat)

            a_s, r_s, a_all, r_all = time_pair(run_adasum, run_allreduce, device, repeats, args.warmup)
            flat_s = None
            if len(shapes) > 1:
                # the same layout already in one flat buffer (a DDP bucket): no fusion copies
                sizes = [math.prod(s) for s in shapes]
                flat_s, _, _, _ = time_pair(lambda: adasum.collectives.adasum_flat_(flat, sizes), lambda: None,
                                            device, repeats, args.warmup)
            row = {
                "date": datetime.date.today().isoformat(),
                "device": device_name(device),
                "backend": args.backend,
                "world_size": world,
                "layout": layout,
                "tensors": len(shapes),
                "dtype": dtype_name,
                "numel": numel,
                "adasum_s": a_s,
                "allreduce_s": r_s,
                "ratio": a_s / r_s,
                "adasum_flat_s": flat_s,
                "repeats": repeats,
                "adasum_all_s": a_all,
                "allreduce_all_s": r_all,
                "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.backend == "nccl" else None,
                "driver": _driver() if args.backend == "nccl" else None,
                "label": args.label,
            }
            rows.append(row)
            if rank == 0:
                extra = "" if flat_s is None else f"  flat buffer {flat_s * 1e3:9.3f} ms ({flat_s / r_s:5.2f})"
                print(f"{dtype_name:5s} {layout:14s} {numel:>11d}  adasum {a_s * 1e3:9.3f} ms  "
                      f"all_reduce {r_s * 1e3:9.3f} ms  ratio {a_s / r_s:5.2f}{extra}", flush=True)
            tensors = flat = None  # free before the next case
    if rank == 0:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _driver() -> str | None:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return None


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp32"])
    p.add_argument("--min-exp", type=int, default=10)
    p.add_argument("--max-exp", type=int, default=26)
    p.add_argument("--step-exp", type=int, default=2)
    p.add_argument("--layouts", type=lambda s: [x for x in s.split(",") if x], default=["resnet50"])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=os.path.join(here, "results", "collective.jsonl"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.world, os.path.join(tmp, "store"), args), nprocs=args.world,
                           start_method="spawn")


if __name__ == "__main__":
    main()
