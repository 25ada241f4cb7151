"""Step time and peak memory of FSDP2 with Adasum across replicas vs FSDP2's own HSDP, under torchrun.

The ranks form a ("replicate", "shard") mesh of --mesh REPLICASxSHARDS (default: every rank one
replica with one shard, WORLDx1); bf16 MixedPrecisionPolicy (fp32 reduction by default,
--reduce-dtype bfloat16), a decoder-only transformer (default about 1.04 B parameters), AdamW.
Variants, each a fresh model, run in turn --repeats times (alternated, so drift hits all alike):

* ``native``: native HSDP, ``fully_shard(mesh=mesh)`` on the 2-D mesh (FSDP's own averaging);
* ``mean``: the same custom-HSDP hook as Adasum (`adasum.fsdp.enable`) with the Mean reducer;
* ``adasum``: `adasum.fsdp.enable(model, mesh)`.

A step is forward, backward and the optimizer step, timed with CUDA events. A variant's time is
the median over all its timed steps (every repeat) of the slowest rank's step; its peak memory
is the largest ``max_memory_allocated`` of any rank, and its kept memory the device memory outside the
caching allocator that stays once its model is gone (symmetric-memory buffers, captured graphs), the
largest of any rank. Rows (one per variant and repeat, the card
named) go to --out (jsonl); a table of medians, ratios to native and peaks ends the output.

    torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --repeats 3 --out benchmarks/results/fsdp.jsonl
    torchrun --nproc-per-node 4 benchmarks/bench_fsdp.py --mesh 4x1 --repeats 3 --out benchmarks/results/fsdp.jsonl
    torchrun --nproc-per-node 4 benchmarks/bench_fsdp.py --mesh 2x2 --repeats 3 --out benchmarks/results/fsdp.jsonl
    torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --dry-run      # tiny model on CPU/gloo
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import adasum.fsdp  # noqa: E402

from machine import device_name, free_memory  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.up, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(variant: str, args, mesh, device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(args.vocab, args.dim, args.layers, args.heads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=getattr(torch, args.reduce_dtype))
    where = mesh if variant == "native" else mesh["shard"]
    for block in model.blocks:
        fully_shard(block, mesh=where, mp_policy=policy)
    fully_shard(model, mesh=where, mp_policy=policy)
    if variant != "native":
        adasum.fsdp.enable(model, mesh, variant)
    return model


def time_variant(variant: str, args, mesh, device) -> dict:
    free_before = free_memory(device, empty_cache=True) or 0
    model = build(variant, args, mesh, device)
    params = sum(p.numel() for p in model.parameters())  # DTensors: the whole model's count
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    times = []
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            elapsed = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(elapsed)
    if args.profile and device.type == "cuda":  # two more steps under torch.profiler: where the time goes
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                model(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        if dist.get_rank() == 0:
            print(f"== profile of 2 steps: {variant} ==")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile))
    del model, opt, logits, loss
    gc.collect()  # the hooks' closures hold the model in a reference cycle
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    # memory outside the caching allocator that the variant keeps once its model is gone (symmetric-memory
    # buffers, captured graphs' pools, communicators): not in max_memory_allocated, so reported beside it
    kept = free_before - (free_memory(device, empty_cache=True) or 0)
    # the slowest rank's time of each step, and the largest peak and kept memory of any rank
    mine = torch.tensor([*times, peak, kept], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    *slowest, peak, kept = mine.tolist()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return {"variant": variant, "params": params, "step_s": statistics.median(slowest), "step_times_s": slowest,
            "peak_gib": round(peak / 2**30, 3), "kept_mib": round(kept / 2**20, 1)}


def parse_mesh(text: str | None, world: int) -> tuple[int, int]:
    """(replicas, shards) from "RxS" (default: world x 1); their product must be the world size."""
    replicas, shards = (world, 1) if text is None else (int(n) for n in text.lower().split("x"))
    if replicas * shards != world:
        raise SystemExit(f"--mesh {text}: {replicas} x {shards} ranks, but the world has {world}")
    return replicas, shards


def summary(rows: list[dict]) -> list[dict]:
    """Per variant: the median of all its timed steps, the range of the repeats' medians, the peak."""
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        steps = [t for r in mine for t in r["step_times_s"]]
        out.append({"variant": variant, "step_s": statistics.median(steps), "low_s": min(r["step_s"] for r in mine),
                    "high_s": max(r["step_s"] for r in mine), "peak_gib": max(r["peak_gib"] for r in mine),
                    "kept_mib": max(r.get("kept_mib", 0.0) for r in mine)})
    return out


def table(summaries: list[dict], card: str, mesh: tuple[int, int], repeats: int) -> str:
    """A markdown table of the summaries, ratios to native where native ran."""
    native = next((s for s in summaries if s["variant"] == "native"), None)
    lines = [f"mesh {mesh[0]} x {mesh[1]} (replicas x shards) on {card}, {repeats} repeat(s), "
             "medians of the slowest rank's step",
             "| variant | step (ms) | repeats' medians (ms) | x native | peak (GiB) | peak x native | kept (MiB) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in summaries:
        ratio = f"{s['step_s'] / native['step_s']:.3f}" if native else "-"
        peak_ratio = f"{s['peak_gib'] / native['peak_gib']:.3f}" if native and native["peak_gib"] > 0 else "-"
        lines.append(f"| {s['variant']} | {s['step_s'] * 1e3:.1f} | {s['low_s'] * 1e3:.1f}-{s['high_s'] * 1e3:.1f} | "
                     f"{ratio} | {s['peak_gib']:.2f} | {peak_ratio} | {s['kept_mib']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny model, CPU/gloo, 2 timed steps")
    parser.add_argument("--variants", default="native,mean,adasum")
    parser.add_argument("--reduce-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="run the variants this many times, alternated")
    parser.add_argument("--mesh", default=None, metavar="RxS",
                        help="replicas x shards, e.g. 2x2 (default: the world size x 1)")
    parser.add_argument("--out", default=None, help="append rows to this jsonl file (rank 0)")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after timing, profile 2 steps per variant and print the top ROWS ops (rank 0)")
    args = parser.parse_args()
    if args.dry_run:
        args.layers, args.dim, args.heads, args.vocab, args.seq, args.batch = 2, 32, 4, 64, 16, 2
        args.warmup, args.steps = 1, 2
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available() and not args.dry_run
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world = dist.get_world_size()
    replicas, shards = parse_mesh(args.mesh, world)
    mesh = init_device_mesh(device.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    card = device_name(device)
    meta = {
        "benchmark": "fsdp", "device": card, "world": world, "replicas": replicas, "shards": shards,
        "mesh": f"{replicas}x{shards}", "backend": dist.get_backend(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "driver": driver_version() if cuda else None, "bf16": cuda, "dry_run": args.dry_run,
        "reduce_dtype": args.reduce_dtype, "layers": args.layers, "dim": args.dim, "seq": args.seq,
        "batch": args.batch, "warmup": args.warmup, "repeats": args.repeats,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows = []
    for repeat in range(args.repeats):
        for variant in args.variants.split(","):
            rows.append({**meta, "repeat": repeat, **time_variant(variant, args, mesh, device)})
            if dist.get_rank() == 0:
                print(f"{variant}: {rows[-1]['step_s'] * 1e3:.1f} ms/step, peak {rows[-1]['peak_gib']:.2f} GiB "
                      f"({rows[-1]['params'] / 1e9:.3f} B params)", flush=True)
    if dist.get_rank() == 0:
        if args.out:
            with open(args.out, "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        print(table(summary(rows), card, (replicas, shards), args.repeats), flush=True)
    dist.destroy_process_group()


def driver_version() -> str | None:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    main()
