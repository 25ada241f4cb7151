"""Where the DDP hook's time goes in a training step: the host time of backward and of the hook's calls.

    python benchmarks/profile_hook.py                          # BERT-sized stack, every GPU
    python benchmarks/profile_hook.py --batch-mb 0,64,256,512 --steps 30
    python benchmarks/profile_hook.py --dry-run                # tiny model, 2 CPU processes, gloo

The autograd thread runs DDP's communication hook between the backward kernels it issues, so a
step whose backward is bound by that thread (the BERT-sized stack at batch 8 on an H100) pays the
hook's host time directly. Variants, built side by side and stepped in turn (one step each, round
after round, as `bench_e2e.py` does), all with DDP's default buckets:

* ``ddp``: DDP's own all-reduce (the baseline of the ratios);
* ``hook``: ``adasum_hook`` with ``AdasumState()`` as a user registers it (the default batches);
* ``hook-bN``: ``AdasumState(batch_mb=N)`` for each N of ``--batch-mb`` (0: bucket by bucket);
* ``nop``: a Python hook that only orders a side stream and returns the bucket uncombined: the host
  cost of any Python hook, and a step with no communication at all (its training is wrong; its time
  is what it is for).

Per variant: the median step (the slowest rank's time, between a barrier and a device sync), the
host time of ``loss.backward()``, the host time spent inside the hook summed over a step, the hook
calls and the batches (collectives) per step. The table goes to stdout; ``--out`` appends JSON lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e  # noqa: E402
from adasum.integrations import ddp as ddp_hook  # noqa: E402
from adasum.transport.communicator import side_stream  # noqa: E402

from machine import device_name  # noqa: E402

_clock = {"hook": 0.0, "calls": 0, "batches": 0}


def _timed(hook):
    def timed_hook(state, bucket):
        start = time.perf_counter()
        future = hook(state, bucket)
        _clock["hook"] += time.perf_counter() - start
        _clock["calls"] += 1
        return future

    return timed_hook


def _counting_close(close):
    def counted(state):
        if state._open:
            _clock["batches"] += 1
        return close(state)

    return counted


def nop_hook(state, bucket):
    """Orders a side stream after the gradients and returns the bucket as it is (no communication)."""
    buffer = bucket.buffer()
    future = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
    if buffer.is_cuda:
        side = side_stream(buffer.device, "comm")
        side.wait_stream(torch.cuda.current_stream(buffer.device))
        with torch.cuda.stream(side):
            future.set_result(buffer)
    else:
        future.set_result(buffer)
    return future


def build(variant: str, args, device: torch.device, rank: int):
    model, make_optimizer, x, y, loss_fn = bench_e2e.build(args.model, args.dry_run, device, rank)
    net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if variant == "hook":
        net.register_comm_hook(ddp_hook.AdasumState(), _timed(ddp_hook.adasum_hook))
    elif variant.startswith("hook-b"):
        net.register_comm_hook(ddp_hook.AdasumState(batch_mb=float(variant[6:])), _timed(ddp_hook.adasum_hook))
    elif variant == "nop":
        net.register_comm_hook(None, _timed(nop_hook))
    optimizer = make_optimizer(net.parameters())
    record: dict[str, list[float]] = {"step": [], "backward": [], "hook": [], "calls": [], "batches": []}

    def step(timed: bool) -> None:
        _clock.update(hook=0.0, calls=0, batches=0)
        bench_e2e._sync(device)
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        before = time.perf_counter()
        loss.backward()
        after = time.perf_counter()
        optimizer.step()
        bench_e2e._sync(device)
        if timed:
            record["step"].append(time.perf_counter() - start)
            record["backward"].append(after - before)
            record["hook"].append(_clock["hook"])
            record["calls"].append(_clock["calls"])
            record["batches"].append(_clock["batches"])

    return step, record


def worker(rank: int, world: int, store_path: str, args) -> None:
    device = bench_e2e.init_rank(rank, world, store_path, args.dry_run)
    ddp_hook._close_batch = _counting_close(ddp_hook._close_batch)
    try:
        variants = ["ddp", "hook", *[f"hook-b{n:g}" for n in args.batch_mb], "nop"]
        built = {v: build(v, args, device, rank) for v in variants}
        for _ in range(args.warmup):
            for step, _ in built.values():
                step(False)
        for _ in range(args.steps):
            for step, _ in built.values():
                step(True)
        records = [None] * world
        dist.all_gather_object(records, {v: r for v, (_, r) in built.items()})
        if rank == 0:
            report(records, variants, args, world, device)
    finally:
        dist.destroy_process_group()


def report(records: list[dict], variants: list[str], args, world: int, device: torch.device) -> None:
    rows = []
    for v in variants:
        steps = [max(r[v]["step"][i] for r in records) for i in range(args.steps)]

        def median(key: str, v=v) -> float:
            return statistics.median(x for r in records for x in r[v][key])

        rows.append({"variant": v, "step_s": statistics.median(steps), "backward_host_s": median("backward"),
                     "hook_host_s": median("hook"), "hook_calls": median("calls"), "batches": median("batches"),
                     "step_times_s": steps})
    base = rows[0]["step_s"]
    print(f"{device_name(device)} x {world}, torch {torch.__version__}, {args.model}, median of {args.steps} steps "
          f"after {args.warmup} (host times: median over ranks and steps)")
    print(f"{'variant':<12} {'step ms':>8} {'vs ddp':>7} {'backward host ms':>17} {'hook host ms':>13} "
          f"{'calls':>6} {'batches':>8}")
    for r in rows:
        r["ratio_to_ddp"] = r["step_s"] / base
        print(f"{r['variant']:<12} {1e3 * r['step_s']:>8.2f} {r['ratio_to_ddp']:>7.3f} "
              f"{1e3 * r['backward_host_s']:>17.2f} {1e3 * r['hook_host_s']:>13.2f} {r['hook_calls']:>6.0f} "
              f"{r['batches']:>8.0f}")
    if args.out:
        common = {"benchmark": "profile_hook", "device": device_name(device), "world": world, "model": args.model,
                  "torch": torch.__version__, "default_batch_mb": ddp_hook.BATCH_MB, "dry_run": args.dry_run,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**common, **r}) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=bench_e2e.MODELS, default="bert")
    p.add_argument("--batch-mb", type=lambda t: [float(x) for x in t.split(",") if x], default=[0.0],
                   help="comma-separated batch_mb values to run besides the default (default: 0)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--world", type=int, default=None, help="processes (default: every GPU; 2 in a dry run)")
    p.add_argument("--dry-run", action="store_true", help="tiny model, 2 CPU processes on gloo, 2 steps")
    p.add_argument("--out", default=None, help="JSON lines to append to")
    args = p.parse_args(argv)
    bench_e2e.spawn(worker, args, "profile_hook")

if __name__ == "__main__":
    main()
