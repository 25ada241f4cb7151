"""Step time and peak memory of FSDP2 with Adasum across replicas vs FSDP2's own HSDP, under torchrun.

The ranks form a ("replicate", "shard") mesh of --mesh REPLICASxSHARDS (default: every rank one
replica with one shard, WORLDx1); bf16 MixedPrecisionPolicy (fp32 reduction by default,
--reduce-dtype bfloat16), a decoder-only transformer (default about 1.04 B parameters), AdamW.
Every variant's model is built and warmed up in turn, then they take turns step by step (the order rotated
each round), so drift and noise between steps hit all alike; `--sequential` instead runs one variant's model
at a time, --repeats times (for a card that cannot hold every variant's model at once):

* ``native``: native HSDP, ``fully_shard(mesh=mesh)`` on the 2-D mesh (FSDP's own averaging);
* ``mean``: the same custom-HSDP hook as Adasum (`adasum.fsdp.enable`) with the Mean reducer;
* ``adasum``: `adasum.fsdp.enable(model, mesh)`.

A step is forward, backward and the optimizer step, timed with CUDA events. A variant's time is
the median over all its timed steps (every repeat) of the slowest rank's step, and its ratio to native the
median over rounds of its step over native's step of the same round (interleaved; sequential: the ratio of
the medians). Its peak memory is the largest growth of ``max_memory_allocated`` over what was allocated
before its model was built, of any rank (its own footprint, whatever other models are resident), and its kept
memory the device memory outside the caching allocator that it took (symmetric-memory buffers, captured
graphs; sequential: what stays once its model is gone), the largest of any rank. Rows (one per variant and
repeat, the card named) go to --out (jsonl); a table of medians, ratios to native and peaks ends the output.

    torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --steps 40 --out benchmarks/results/fsdp.jsonl
    torchrun --nproc-per-node 4 benchmarks/bench_fsdp.py --mesh 4x1 --steps 40 --out benchmarks/results/fsdp.jsonl
    torchrun --nproc-per-node 4 benchmarks/bench_fsdp.py --mesh 2x2 --steps 40 --out benchmarks/results/fsdp.jsonl
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


def one_step(model, opt, tokens: torch.Tensor, device: torch.device) -> float:
    """Forward, backward and the optimizer step; this rank's seconds (CUDA events on a GPU)."""
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
        return start.elapsed_time(end) / 1e3
    return time.perf_counter() - t0


def profile(variant: str, model, opt, tokens: torch.Tensor, rows: int) -> None:
    """Two more steps under torch.profiler: where the time goes (printed on rank 0)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            model(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print(f"== profile of 2 steps: {variant} ==")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows))


def memory(device: torch.device) -> tuple[int, int, int]:
    """(free device bytes, bytes the caching allocator reserves, bytes it has allocated) once the device is idle,
    after handing back its unused cache; zeros on the CPU."""
    if device.type != "cuda":
        return 0, 0, 0
    free = free_memory(device, empty_cache=True)
    return free, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)


def slowest(values: list[float], device: torch.device) -> list[float]:
    """Each value's largest of any rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.tolist()


def prepared(variant: str, args, mesh, device) -> dict:
    """`variant`'s model and optimizer after --warmup steps, with its own peak and kept memory and the free device
    memory before it was built (this rank's)."""
    free, reserved, allocated = memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build(variant, args, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    for _ in range(args.warmup):
        one_step(model, opt, tokens, device)
    peak = torch.cuda.max_memory_allocated(device) - allocated if device.type == "cuda" else 0
    free_after, reserved_after, _ = memory(device)
    kept = (free - free_after) - (reserved_after - reserved)  # taken outside the caching allocator
    return {"variant": variant, "model": model, "opt": opt, "tokens": tokens, "peak": peak, "kept": kept, "free": free,
            "params": sum(p.numel() for p in model.parameters())}  # DTensors: the whole model's count


def row(state: dict, times: list[float], device: torch.device, **extra) -> dict:
    """A variant's row: its slowest-rank step times, and its largest peak and kept memory of any rank."""
    *times, peak, kept = slowest([*times, state["peak"], state["kept"]], device)
    return {"variant": state["variant"], "params": state["params"], "step_s": statistics.median(times),
            "step_times_s": times, "peak_gib": round(peak / 2**30, 3), "kept_mib": round(kept / 2**20, 1), **extra}


def interleaved(variants: list[str], args, mesh, device) -> list[dict]:
    """Every variant's model resident at once, one step of each in turn, the order rotated each round."""
    states = [prepared(variant, args, mesh, device) for variant in variants]
    times: list[list[float]] = [[] for _ in states]
    for round_ in range(args.steps):
        for i in (*range(round_ % len(states), len(states)), *range(round_ % len(states))):
            state = states[i]
            times[i].append(one_step(state["model"], state["opt"], state["tokens"], device))
    if args.profile and device.type == "cuda":
        for state in states:
            profile(state["variant"], state["model"], state["opt"], state["tokens"], args.profile)
    rows = [row(state, t, device, schedule="interleaved") for state, t in zip(states, times)]
    native = next((r for r in rows if r["variant"] == "native"), None)
    for r in rows:
        if native is not None:  # paired by round: the steps of one round ran within a few hundred ms
            r["ratio"] = statistics.median(a / b for a, b in zip(r["step_times_s"], native["step_times_s"]))
    return rows


def sequential(variant: str, args, mesh, device) -> dict:
    """One variant's model alone: warmed up, --steps timed; its kept memory what stays once it is gone."""
    state = prepared(variant, args, mesh, device)
    times = [one_step(state["model"], state["opt"], state["tokens"], device) for _ in range(args.steps)]
    if args.profile and device.type == "cuda":
        profile(variant, state["model"], state["opt"], state["tokens"], args.profile)
    state.pop("model"), state.pop("opt")
    gc.collect()  # the hooks' closures hold the model in a reference cycle
    # memory outside the caching allocator that the variant keeps once its model is gone (symmetric-memory
    # buffers, captured graphs' pools, communicators): not in max_memory_allocated, so reported beside it
    state["kept"] = state["free"] - memory(device)[0]
    return row(state, times, device, schedule="sequential")


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
                    "kept_mib": max(r.get("kept_mib", 0.0) for r in mine),
                    "ratio": statistics.median(r["ratio"] for r in mine) if all("ratio" in r for r in mine) else None})
    return out


def table(summaries: list[dict], card: str, mesh: tuple[int, int], repeats: int) -> str:
    """A markdown table of the summaries, ratios to native where native ran."""
    native = next((s for s in summaries if s["variant"] == "native"), None)
    lines = [f"mesh {mesh[0]} x {mesh[1]} (replicas x shards) on {card}, {repeats} repeat(s), "
             "medians of the slowest rank's step",
             "| variant | step (ms) | repeats' medians (ms) | x native | peak (GiB) | peak x native | kept (MiB) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in summaries:
        ratio = s["ratio"] if s["ratio"] is not None else s["step_s"] / native["step_s"] if native else None
        ratio = "-" if ratio is None else f"{ratio:.3f}"
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
    parser.add_argument("--steps", type=int, default=40, help="timed steps (rounds, interleaved) per variant")
    parser.add_argument("--sequential", action="store_true",
                        help="one variant's model at a time, --repeats times (alternated), instead of interleaved")
    parser.add_argument("--repeats", type=int, default=1, help="with --sequential: run the variants this many times")
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
        "batch": args.batch, "warmup": args.warmup, "repeats": args.repeats if args.sequential else 1,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    variants = args.variants.split(",")
    if args.sequential:
        runs = [[sequential(variant, args, mesh, device)] for _ in range(args.repeats) for variant in variants]
    else:
        runs = [interleaved(variants, args, mesh, device)]
    rows = []
    for repeat, run in enumerate(runs):
        for r in run:
            rows.append({**meta, "repeat": repeat // (len(variants) if args.sequential else 1), **r})
            if dist.get_rank() == 0:
                print(f"{r['variant']}: {r['step_s'] * 1e3:.1f} ms/step, peak {r['peak_gib']:.2f} GiB "
                      f"({r['params'] / 1e9:.3f} B params)", flush=True)
    if dist.get_rank() == 0:
        if args.out:
            with open(args.out, "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        print(table(summary(rows), card, (replicas, shards), meta["repeats"]), flush=True)
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
