"""Variants of `adasum.all_reduce` alternated with NCCL's all_reduce of the same bytes in one run (the A/B scripts'
shared part: `ab_copy_kernel.py`, `ab_settings.py`).

Each variant runs on its own tensors (its own captured graph), in orders rotated and reversed; per order the medians
of 7 calls (slowest rank), per case the median (range) of the orders' ratios to NCCL. "variants equal": every
variant's result bitwise equal to the first's; "ranks equal": ranks bitwise equal; "repeats equal": equal again
after back-to-back repeats."""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench_collective import time_pair

from layouts import LAYOUTS


def case_tensors(case: str, rank: int, dev: torch.device) -> tuple[str, str, list[torch.Tensor]]:
    """(layout, dtype name, this rank's tensors) of a case "layout:dtype", the layout one of `layouts.LAYOUTS` or
    flat-<log2 elements>."""
    lname, dname = case.split(":")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
    shapes = [(1 << int(lname[5:]),)] if lname.startswith("flat-") else LAYOUTS[lname]()
    g = torch.Generator(device=dev).manual_seed(rank)
    return lname, dname, [torch.randn(s, generator=g, device=dev).to(dtype) for s in shapes]


def alternate(
    variants: dict[str, Callable[[list[torch.Tensor]], None]], case: str, rank: int, world: int, dev: torch.device,
    log: Callable[[str], None], same_bits: bool = True,
) -> None:
    """Time each variant (a call on a list of tensors) against NCCL in one run (module doc) and log the orders and
    a SUMMARY line. `same_bits`: the variants are meant to give bitwise equal results (else their equality is
    only reported)."""
    lname, dname, saved = case_tensors(case, rank, dev)
    names = list(variants)
    ts = {v: [t.clone() for t in saved] for v in names}
    flat = torch.randn(sum(t.numel() for t in saved), device=dev).to(saved[0].dtype)

    def restore() -> None:
        for tensors in ts.values():
            torch._foreach_copy_(tensors, saved)

    def run(v: str):
        return lambda: variants[v](ts[v])

    restore()
    for v in names:
        run(v)()
    same = all(all(torch.equal(a, b) for a, b in zip(ts[v], ts[names[0]])) for v in names)
    ranks = True
    for v in names:
        h = torch.stack([t.double().sum() for t in ts[v]]).sum().view(1)
        hs = [torch.zeros_like(h) for _ in range(world)]
        dist.all_gather(hs, h)
        ranks = ranks and all(torch.equal(x, hs[0]) for x in hs)
    first = {v: [t.clone() for t in ts[v]] for v in names}
    for _ in range(3):
        restore()
        for v in names:
            run(v)()
    repeat = all(all(torch.equal(a, b) for a, b in zip(ts[v], first[v])) for v in names)
    del first
    orders = [names[i:] + names[:i] for i in range(len(names))]
    orders = (orders + [list(reversed(o)) for o in orders])[: max(4, 2 * len(names))]
    ratios: dict[str, list[float]] = {v: [] for v in names}
    for order in orders:
        meds, _ = time_pair([run(o) for o in order] + [lambda: dist.all_reduce(flat)], restore, dev, 7, 2)
        nccl = meds[-1]
        r = dict(zip(order, meds))
        for v in names:
            ratios[v].append(r[v] / nccl)
        log(f"P={world} {lname} {dname} order {'/'.join(order)}: " + "  ".join(
            f"{v} {r[v]*1e3:.3f} ms {r[v]/nccl:.3f} x" for v in names) + f"  nccl {nccl*1e3:.3f} ms")
    equal = f"variants equal {same}" if same_bits else f"variants bitwise equal {same} (not expected)"
    log(f"P={world} {lname} {dname} SUMMARY medians " + " | ".join(
        f"{v} {statistics.median(ratios[v]):.3f} ({min(ratios[v]):.3f}-{max(ratios[v]):.3f})" for v in names)
        + f" | {equal}, ranks equal {ranks}, repeats equal {repeat}")


def start() -> tuple[int, int, torch.device, Callable[[str], None]]:
    """Join the NCCL group torchrun started: (rank, world size, this rank's GPU, a log that rank 0 prints)."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.all_reduce(torch.ones(1, device=dev))

    def log(s: str) -> None:
        if rank == 0:
            print(s, flush=True)

    return rank, world, dev, log


def finish() -> None:
    """Drain the device and the ranks, then exit at once (no teardown of the groups to wait for)."""
    torch.cuda.synchronize()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)
