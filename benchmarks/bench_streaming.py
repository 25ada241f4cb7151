"""Inner-step time of Streaming DiLoCo against blocking DiLoCo, over a link that delays each combination.

    python benchmarks/bench_streaming.py                       # 2 gloo ranks on the CPU, 50 ms a message
    python benchmarks/bench_streaming.py --latency-ms 200 --local-steps 8

Two ranks train a small MLP with `adasum.SlowMo` (SGD inner steps, `adasum.diloco_outer()`); every bucket's
combination first sleeps ``--latency-ms`` (the reducer wraps Mean: a link whose every message takes that long).
Blocking DiLoCo (one fragment, no delay) waits for it once a round; streaming (``--fragments`` fragments, each
applied ``--delay`` inner steps after its sync starts) combines on its background thread while the inner steps
go on. One JSON line per configuration is printed and appended to benchmarks/results/streaming.jsonl: the
median and the largest inner step (``step()`` with its backward), in ms, over ``--steps`` steps after warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import adasum  # noqa: E402
from adasum.reducers import Mean  # noqa: E402


class SlowLinkMean(Mean):
    """The mean over a link whose every message takes `latency` seconds (a sleep before each combination)."""

    def __init__(self, latency: float) -> None:
        super().__init__()
        self.latency = latency

    def _all_reduce_flat(self, buffer, sizes, group=None):  # type: ignore[no-untyped-def]
        time.sleep(self.latency)
        return super()._all_reduce_flat(buffer, sizes, group)

    def __repr__(self) -> str:
        return f"SlowLinkMean({self.latency})"


def worker(rank: int, world: int, store: str, args: argparse.Namespace, configs: list, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    out = []
    for name, fragments, delay in configs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
        opt = adasum.SlowMo(
            torch.optim.SGD(model.parameters(), lr=0.01), local_steps=args.local_steps,
            outer_optimizer=adasum.diloco_outer(), reducer=SlowLinkMean(args.latency_ms / 1000),
            fragments=fragments, delay=delay, nonfinite="propagate",
        )
        x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(rank))
        times = []
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        opt.sync()
        out.append((name, fragments, delay, statistics.median(times) * 1e3, max(times) * 1e3, sum(times) * 1e3))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--local-steps", type=int, default=8)
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--delay", type=int, default=None, help="inner steps (default: local_steps // fragments - 1)")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--no-file", action="store_true")
    args = parser.parse_args()
    delay = args.delay if args.delay is not None else max(1, args.local_steps // args.fragments - 1)
    configs = [
        ("no network (latency 0: blocking)", 1, 0),
        ("blocking DiLoCo", 1, 0),
        (f"streaming, {args.fragments} fragments, delay {delay}", args.fragments, delay),
    ]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, config in enumerate(configs):
            latency = 0.0 if index == 0 else args.latency_ms
            run_args = argparse.Namespace(**{**vars(args), "latency_ms": latency})
            store = os.path.join(tmp, f"store{index}")
            procs = [ctx.Process(target=worker, args=(r, 2, store, run_args, [config], queue)) for r in range(2)]
            for p in procs:
                p.start()
            (name, fragments, d, median, largest, total), = queue.get(timeout=600)
            for p in procs:
                p.join()
            rows.append({
                "bench": "streaming", "config": name, "latency_ms": latency, "local_steps": args.local_steps,
                "fragments": fragments, "delay": d, "median_step_ms": round(median, 2),
                "max_step_ms": round(largest, 2), "total_ms": round(total, 1), "steps": args.steps,
                "ranks": 2, "backend": "gloo", "device": "cpu", "torch": torch.__version__,
                "date": datetime.date.today().isoformat(),
            })
    for row in rows:
        print(json.dumps(row))
    if not args.no_file:
        path = Path(__file__).resolve().parent / "results" / "streaming.jsonl"
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
