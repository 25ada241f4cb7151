"""A short demonstration: adasum.all_reduce over a few local gloo processes.

    python -m adasum.demo [--workers 4]

Adasum sums gradients that are orthogonal across workers, averages gradients that are parallel,
and lands in between otherwise: it needs no learning-rate scaling with the number of workers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import adasum


def _worker(rank: int, workers: int, store_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, workers), rank=rank, world_size=workers, timeout=timedelta(seconds=60)
    )
    basis, _ = torch.linalg.qr(torch.randn(64, workers, generator=torch.Generator().manual_seed(0)))
    rng = torch.Generator().manual_seed(rank)
    same = torch.arange(6.0)
    grads = [
        basis[:, rank].clone(),  # orthogonal across workers
        2.0 * same,  # identical on every worker
        torch.randn(5, 5, generator=rng),  # ordinary, independent
    ]
    local = [g.clone() for g in grads]
    adasum.all_reduce(grads)  # one call, three tensors, each with its own coefficients
    everyone = [[torch.zeros_like(g) for _ in range(workers)] for g in local]
    for gathered, g in zip(everyone, local):
        dist.all_gather(gathered, g)
    results = [torch.zeros(3) for _ in range(workers)]
    dist.all_gather(results, torch.stack([g.double().sum() for g in grads]).float())
    if rank == 0:
        print(f"{workers} gloo workers, one adasum.all_reduce of 3 tensors (64, 6 and 5x5 values):")
        ortho_sum = sum(everyone[0])
        print(
            "  orthogonal gradients -> their sum:     max |adasum - sum|  = "
            f"{float((grads[0] - ortho_sum).abs().max()):.1e}"
        )
        print(
            "  identical gradients  -> that gradient: max |adasum - grad| = "
            f"{float((grads[1] - 2.0 * same).abs().max()):.1e}"
        )
        ref = adasum.reduce(everyone[2])
        total = sum(everyone[2], torch.zeros_like(ref))
        print(
            f"  independent 5x5      -> adasum.reduce:  max |difference|    = {float((grads[2] - ref).abs().max()):.1e}"
            f"  (norm: mean {float(total.norm() / workers):.2f}, adasum {float(grads[2].norm()):.2f},"
            f" sum {float(total.norm()):.2f})"
        )
        print(f"  bitwise identical on every rank: {all(torch.equal(r, results[0]) for r in results)}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Run the demonstration (the module doc) from the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(args.workers, os.path.join(tmp, "store")), nprocs=args.workers, start_method="spawn"
        )


if __name__ == "__main__":
    main()
