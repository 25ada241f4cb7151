"""The single-process Adasum tree (what the simulator runs) over P copies of a model, in memory
bandwidth against the device's measured copy bandwidth, in one run.

    python benchmarks/bench_tree.py --device cuda            # P=64 copies of ResNet-50's layout

`reduce_stacked` reads every level's rows twice (reduction, then combination) and writes half of
them: about 5 x P x N x 4 bytes in all for fp32 (the "moved" bandwidth). The "effective" bandwidth
counts only the bytes any method must move: each input read once. The copy bandwidth is a large
device-to-device copy, counting bytes read plus written. Appends to benchmarks/results/tree.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from adasum.kernels import reduce as ops  # noqa: E402

from layouts import LAYOUTS  # noqa: E402


def timed(fn, device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--layout", default="resnet50")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(here, "results", "tree.jsonl"))
    args = p.parse_args()
    device = torch.device(args.device)
    sizes = [math.prod(s) for s in LAYOUTS[args.layout]()]
    n = sum(sizes)
    stacked = torch.randn(args.workers, n, device=device)
    element = stacked.element_size()

    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, args.repeats)
    copy_bw = 2 * src.numel() * 4 / copy_s
    src = dst = None  # free the copy buffers before the tree runs

    tree_s = timed(lambda: ops.reduce_stacked(stacked, sizes), device, args.repeats)
    levels = int(math.log2(args.workers))
    moved = 2 * args.workers * n * element  # stack: read and write every row once
    groups = args.workers
    for _ in range(levels):
        moved += 2 * groups * n * element + groups // 2 * n * element
        groups //= 2
    minimal = args.workers * n * element
    row = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "workers": args.workers,
        "layout": args.layout,
        "tensors": len(sizes),
        "numel": n,
        "tree_s": tree_s,
        "copy_bandwidth_Bps": copy_bw,
        "moved_bandwidth_Bps": moved / tree_s,
        "effective_bandwidth_Bps": minimal / tree_s,
        "moved_fraction_of_copy": moved / tree_s / copy_bw,
        "effective_fraction_of_copy": minimal / tree_s / copy_bw,
    }
    print(f"{row['device']}: P={args.workers} x {args.layout} ({n} values): tree {tree_s * 1e3:.1f} ms; "
          f"copy {copy_bw / 1e9:.0f} GB/s; moved {row['moved_bandwidth_Bps'] / 1e9:.0f} GB/s "
          f"({row['moved_fraction_of_copy']:.0%}); effective {row['effective_bandwidth_Bps'] / 1e9:.0f} GB/s "
          f"({row['effective_fraction_of_copy']:.0%})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
