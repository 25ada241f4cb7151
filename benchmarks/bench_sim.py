"""Simulated training steps per second: P workers of Horovod's 2-layer MNIST CNN, B examples each.

    python benchmarks/bench_sim.py                         # P=64, B=32, on cuda if available
    python benchmarks/bench_sim.py --workers 16 --methods mean,adasum --device cpu
    python benchmarks/bench_sim.py --dry-run               # P=64, B=32 on CPU: 1 warm-up, 1 step, no file

One line per method is printed and appended to benchmarks/results/sim.jsonl, with the device name.
Each step is one `SimulatedWorkers.step` on random MNIST-shaped data: the batched per-worker
backward (torch.func.vmap), the reducer and the optimizer step; timed after warm-up with device
synchronisation, the median of `--repeats` timed blocks of `--steps` steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from adasum.experiments.methods import get_method, method_reducer  # noqa: E402
from adasum.experiments.models import HorovodCNN  # noqa: E402
from adasum.sim import SimulatedWorkers  # noqa: E402

from machine import device_name  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(
    method_name: str, workers: int, batch: int, device: torch.device, steps: int, repeats: int, chunk_size,
    diagnostics: bool, warmup: int = 3,
) -> dict:
    method = get_method(method_name)
    torch.manual_seed(0)
    model = HorovodCNN((1, 28, 28), 10).to(device)
    sim = SimulatedWorkers(
        model,
        workers,
        lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.5),
        reducer=method_reducer(method),
        combine=method.combine,
        local_steps=4 if method.local else 1,
        slow_momentum=0.5 if method.slow_momentum else None,
        chunk_size=chunk_size,
        diagnostics=diagnostics,
    )
    x = torch.randn(workers, batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (workers, batch), device=device)
    for _ in range(warmup):
        sim.step(x, y)
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            sim.step(x, y)
        sync(device)
        times.append((time.perf_counter() - start) / steps)
    step_s = statistics.median(times)
    return {
        "benchmark": "sim",
        "method": method_name,
        "workers": workers,
        "batch_per_worker": batch,
        "model": "cnn",
        "device": device_name(device),
        "device_type": device.type,
        "chunk_size": chunk_size,
        "diagnostics": diagnostics,
        "step_s": step_s,
        "steps_per_s": 1.0 / step_s,
        "examples_per_s": workers * batch / step_s,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--methods", default="mean,adasum,adasum-delta")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument(
        "--dry-run", action="store_true", help="CPU, 1 warm-up step, 1 timed step, no results file unless --out"
    )
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--no-diagnostics", action="store_true", help="skip the per-step orthogonality diagnostic")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument(
        "--out", default=None, help="JSON lines to append to (default benchmarks/results/sim.jsonl; none in a dry run)"
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.steps, args.repeats, args.warmup = "cpu", 1, 1, 1
    if args.out is None and not args.dry_run:
        args.out = str(Path(__file__).resolve().parent / "results" / "sim.jsonl")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out = Path(args.out) if args.out is not None else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.methods.split(","):
        row = bench(
            name,
            args.workers,
            args.batch,
            device,
            args.steps,
            args.repeats,
            args.chunk_size,
            not args.no_diagnostics,
            args.warmup,
        )
        print(
            f"{name}: P={row['workers']} x B={row['batch_per_worker']} on {row['device']}: "
            f"{row['steps_per_s']:.2f} steps/s ({row['examples_per_s']:.0f} examples/s)",
            flush=True,
        )
        if out is not None:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
