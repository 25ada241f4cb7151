"""The slice mover's copy kernel (`adasum.kernels.triton.copy_tiles`) against other shapes of it, on GPUs (NCCL).

Variants, each the library's kernel launched with another shape: ``d`` as the library launches it; ``o`` a program
per tile, 4 warps and 1024 elements a step (the shape before the current one); ``p<G>w<W>b<B>`` G programs of W warps,
B elements a step, program k copying tiles k, k + G, ...

``--part kernel``: the scatter's pattern alone (every rank stores slice j of its buffer into peer j's symmetric memory,
tiles of 16384 dealt over the peers in turn), each variant captured in a CUDA graph, medians of 9 replays, slowest
rank; "both": the same stores with the Gram kernel over 4 local rows of the slice on a second stream, launched after
them; "landed": every peer received the sender's slice.

``--part ab``: ``adasum.all_reduce`` with each variant's copy kernel, each variant on its own tensors (its own
captured graph), alternated with NCCL's all_reduce of the same bytes in one run, the order rotated; per order the
medians of 7 calls (slowest rank), per case the median (range) of the orders' ratios to NCCL. "variants equal": every
variant's result bitwise equal to the first's; "ranks equal": ranks bitwise equal; "repeats equal": equal again after
back-to-back repeats.

    torchrun --standalone --nproc-per-node 4 benchmarks/ab_copy_kernel.py --part ab --variants d,o,p264w8b8192 \\
        --cases bert-large:bf16,resnet50:fp32,flat-26:bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

import adasum
from adasum.kernels import triton as tk
from adasum.kernels.addresses import CopyTable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import alternate, finish, start  # noqa: E402

CURRENT = tk.copy_tiles


def shaped(programs: int | None, warps: int, block: int):
    """The library's copy kernel launched with `programs` programs (None: one per tile), `warps` warps and `block`
    elements a step."""
    def copy(table, like) -> None:
        if table.n:
            grid = table.n if programs is None else min(programs, table.n)
            tk.launch_copy(table, like, grid, warps, block, -(-tk.TILE // block))
    return copy


def parse(variant: str):
    """The copy function of a variant name (module doc)."""
    if variant == "d":
        return CURRENT
    if variant == "o":
        return shaped(None, 4, 1024)
    g, rest = variant[1:].split("w")
    w, b = rest.split("b")
    return shaped(int(g), int(w), int(b))


def timed_graph(fn, dev: torch.device) -> float:
    """Median of 9 replays of `fn` captured in a CUDA graph, in us, the slowest rank's."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(11):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    med = torch.tensor([statistics.median(times[2:])], device=dev)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def kernel_part(variants: list[str], rank: int, world: int, dev: torch.device, log) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    name = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(name)
    for dtype in (torch.bfloat16, torch.float32):
        for exp in (26, 24):
            n = 1 << exp
            width = n // world
            buf = symm_mem.empty(n, dtype=dtype, device=dev)
            hdl = symm_mem.rendezvous(buf, name)
            src = torch.randn(n, device=dev).to(dtype)
            size = src.element_size()
            tile = 16384
            rows = []
            for j in range(world):
                if j != rank:
                    remote = hdl.get_buffer(j, (n,), dtype, 0)
                    rows.append([(src.data_ptr() + (j * width + s) * size,
                                  remote.data_ptr() + (rank * width + s) * size, min(tile, width - s))
                                 for s in range(0, width, tile)])
            dealt = [r[k] for k in range(len(rows[0])) for r in rows]
            cols = torch.tensor(dealt, dtype=torch.int64)
            table = CopyTable(cols[:, 0].to(dev), cols[:, 1].to(dev), cols[:, 2].to(dev), len(dealt), True)
            gram_rows = [torch.randn(width, device=dev).to(dtype) for _ in range(4)]
            side = torch.cuda.Stream(dev)
            srcs = [torch.empty_like(src) for _ in range(world)]
            dist.all_gather(srcs, src)

            def gram() -> None:
                tk.gram(gram_rows, [width])

            gram_alone = timed_graph(gram, dev)
            parts = []
            for v in variants:
                copy = parse(v)
                alone = timed_graph(lambda: copy(table, src), dev)

                def both() -> None:
                    main = torch.cuda.current_stream()
                    side.wait_stream(main)
                    copy(table, src)
                    with torch.cuda.stream(side):
                        gram()
                    main.wait_stream(side)

                together = timed_graph(both, dev)
                buf.zero_()
                hdl.barrier(channel=0)
                torch.cuda.synchronize()
                copy(table, src)
                hdl.barrier(channel=0)
                torch.cuda.synchronize()
                landed = buf.view(world, width)
                ok = all(torch.equal(landed[j], srcs[j][rank * width:(rank + 1) * width])
                         for j in range(world) if j != rank)
                flag = torch.tensor([int(ok)], device=dev)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                parts.append(f"{v} {alone:.0f}us ({(world - 1) * width * size / alone / 1e3:.0f}GB/s) both "
                             f"{together:.0f} landed {bool(flag.item())}")
                hdl.barrier(channel=0)
                torch.cuda.synchronize()
            log(f"P={world} {str(dtype)[6:]} 2^{exp} gram alone {gram_alone:.0f}us | " + " | ".join(parts))
            del buf, hdl
            torch.cuda.empty_cache()


def ab_part(variants: list[str], cases: list[str], rank: int, world: int, dev: torch.device, log) -> None:
    def with_copy(v: str):
        copy = parse(v)

        def run(tensors) -> None:
            tk.copy_tiles = copy
            adasum.all_reduce(tensors)
        return run

    for case in cases:
        alternate({v: with_copy(v) for v in variants}, case, rank, world, dev, log)
        tk.copy_tiles = CURRENT
        adasum.release()
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("kernel", "ab"), default="ab")
    p.add_argument("--variants", default="d,o")
    p.add_argument("--cases", default="bert-large:bf16,bert-large:fp32,resnet50:bf16,flat-26:bf16,flat-24:fp32",
                   help="layout:dtype, layout one of resnet50, bert-large, flat-<log2 elements>")
    args = p.parse_args()
    rank, world, dev, log = start()
    variants = args.variants.split(",")
    if args.part == "kernel":
        kernel_part(variants, rank, world, dev, log)
    else:
        ab_part(variants, args.cases.split(","), rank, world, dev, log)
    finish()


if __name__ == "__main__":
    main()
