"""End-to-end training step time: default DDP against DDP with Adasum's hook and against
``adasum.DistributedOptimizer(mode="delta")``, on ResNet-50 and a BERT-Large-sized encoder stack.

    python benchmarks/bench_e2e.py                              # every GPU, NCCL, both models
    python benchmarks/bench_e2e.py --models bert --bf16 --steps 50
    python benchmarks/bench_e2e.py --dry-run                    # tiny models, 2 CPU processes, gloo

One process per GPU, spawned here (FileStore in a temporary folder; NCCL_NVLS_ENABLE=0 unless
set). Each step is forward, backward, communication and optimizer step on synthetic data, timed
between a barrier and ``torch.cuda.synchronize``; a step's time is the slowest rank's; the median
over `--steps` steps after `--warmup` steps is reported. The variants of a model are built side by
side and stepped in turn, one step each, round after round (the machine's drift reaches all alike;
run one after the other, DDP's own median moved from 75 to 87 ms between two runs on one H100 host).
Variants:

* ``ddp``: DistributedDataParallel with its default all-reduce (the baseline of the ratios);
* ``ddp-adasum``: the same DDP model with ``adasum.ddp.adasum_hook`` and ``AdasumState()`` (its default batches
  of buckets, ``hook_batch_mb`` in the rows);
* ``delta``: the plain model, ``adasum.DistributedOptimizer(opt, reducer="adasum", mode="delta")``;
* ``delta-mean`` (not run unless named): the same with ``reducer="mean"``, whose combination is NCCL's
  all_reduce of the deltas: delta mode's own cost, the bound of ``delta`` (the deltas exist only after the
  whole backward pass and the local step, so no combination of them overlaps the backward pass);
* ``gradient`` (not run unless named): the plain model, ``adasum.DistributedOptimizer(opt, mode="gradient")``:
  the gradients combined bucket by bucket in ``step()``, then the local step (Horovod's per-gradient usage);
* ``list`` (not run unless named): the plain model, ``adasum.all_reduce([p.grad for p in params])`` after the
  backward pass, then the optimizer's step: the bare collective in a training loop, its gradients re-made by
  ``zero_grad()`` every step; ``list-kept``: the same with ``zero_grad(set_to_none=False)``, which keeps the
  gradients where they lie.

Models: ResNet-50 (torchvision, 3x224x224 images, batch 64 per GPU, SGD with momentum) and
24 ``nn.TransformerEncoderLayer`` (hidden 1024, 16 heads, FFN 4096, GELU, post-norm as BERT) with
token and position embeddings and a tied output layer (about 335M parameters), sequence 128,
batch 8 per GPU, Adam; ``--bf16`` runs the forward pass under bf16 autocast. Every variant
uses the same optimizer. The table goes to stdout; rows are appended as JSON lines to
benchmarks/results/e2e.jsonl (not in a dry run unless --out is given).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import adasum  # noqa: E402
from adasum.ddp import AdasumState, adasum_hook  # noqa: E402

from machine import device_name  # noqa: E402

MODELS = ("resnet50", "bert")
VARIANTS = ("ddp", "ddp-adasum", "delta", "delta-mean", "gradient", "list", "list-kept")
DEFAULT_VARIANTS = VARIANTS[:3]
WRAPPED = {"delta": ("adasum", "delta"), "delta-mean": ("mean", "delta"), "gradient": ("adasum", "gradient")}
"""The variants that wrap the optimizer in `adasum.DistributedOptimizer`: (reducer, mode)."""
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "e2e.jsonl"


# -- models and data ------------------------------------------------------------------------------


class EncoderStack(nn.Module):
    """A BERT-shaped encoder: token and position embeddings, `layers` post-norm encoder layers,
    a final LayerNorm and an output layer tied to the token embedding (masked-LM shaped)."""

    def __init__(self, vocab: int, seq: int, hidden: int, heads: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.encoder(self.tokens(tokens) + self.positions(positions))))


class TinyCNN(nn.Module):
    """The dry run's stand-in for ResNet-50 (with BatchNorm, as ResNet-50 has)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(8, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def resnet50_builder():
    """torchvision's resnet50 constructor, or a clear exit without torchvision."""
    try:
        from torchvision.models import resnet50
    except ImportError:
        raise SystemExit(
            "bench_e2e: ResNet-50 needs torchvision (pip install torchvision), or pass --models bert"
        ) from None
    return resnet50


def build(name: str, dry_run: bool, device: torch.device, rank: int):
    """(model, make_optimizer, inputs, targets, loss_fn) for one model; synthetic data per rank."""
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    torch.manual_seed(0)  # the same initial model on every rank
    if name == "resnet50":
        model, batch, size, classes = (TinyCNN(), 4, 16, 10) if dry_run else (resnet50_builder()(), 64, 224, 1000)
        inputs = torch.randn(batch, 3, size, size, generator=g, device=device)
        targets = torch.randint(0, classes, (batch,), generator=g, device=device)
        make_optimizer = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731
        loss_fn = nn.functional.cross_entropy
    else:
        vocab, seq, hidden, heads, ffn, layers, batch = (
            (100, 16, 32, 4, 64, 2, 2) if dry_run else (30522, 128, 1024, 16, 4096, 24, 8)
        )
        model = EncoderStack(vocab, seq, hidden, heads, ffn, layers)
        inputs = torch.randint(0, vocab, (batch, seq), generator=g, device=device)
        targets = torch.randint(0, vocab, (batch, seq), generator=g, device=device)
        make_optimizer = lambda ps: torch.optim.Adam(ps, lr=1e-4)  # noqa: E731

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))

    return model.to(device), make_optimizer, inputs, targets, loss_fn


# -- one variant --------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_variant(name: str, variant: str, args, device: torch.device, rank: int):
    """One (model, variant) ready to train: its step function (zero_grad, forward, backward, step)."""
    model, make_optimizer, x, y, loss_fn = build(name, args.dry_run, device, rank)
    device_ids = [device.index] if device.type == "cuda" else None
    if variant in WRAPPED or variant.startswith("list"):
        with torch.no_grad():  # DDP broadcasts rank 0's model; without DDP, do it here
            for t in model.state_dict().values():
                dist.broadcast(t, 0)
        net: nn.Module = model
        optimizer: torch.optim.Optimizer = make_optimizer(model.parameters())
        if variant in WRAPPED:
            optimizer = adasum.DistributedOptimizer(optimizer, reducer=WRAPPED[variant][0], mode=WRAPPED[variant][1])
    else:
        net = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        if variant == "ddp-adasum":
            net.register_comm_hook(AdasumState(), adasum_hook)
        optimizer = make_optimizer(net.parameters())
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)

    def step() -> None:
        optimizer.zero_grad(set_to_none=variant != "list-kept")
        with autocast:
            out = net(x)
        loss_fn(out, y).backward()
        if variant.startswith("list"):
            adasum.all_reduce([p.grad for p in net.parameters() if p.grad is not None])
        optimizer.step()

    return step


def time_model(name: str, args, device: torch.device, rank: int) -> dict[str, list[float]]:
    """Every variant of one model, built side by side and stepped in turn (one step of each, round after
    round), so that a drift of the machine's speed reaches every variant alike; per variant, the slowest
    rank's time of each step."""
    steps = {variant: build_variant(name, variant, args, device, rank) for variant in args.variants}
    for _ in range(args.warmup):
        for variant, step in steps.items():
            step()
            if args.watchdog and rank == 0:
                print(f"warm-up step of {name} {variant} done", flush=True)
    times: dict[str, list[float]] = {variant: [] for variant in steps}
    for _ in range(args.steps):
        for variant, step in steps.items():
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            step()
            _sync(device)
            times[variant].append(time.perf_counter() - start)
    out = {}
    for variant, values in times.items():
        slowest = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[variant] = slowest.tolist()
    steps.clear()  # free before the next model
    gc.collect()
    if device.type == "cuda":
        # not adasum.release(): it is for teardown; with it here, the next model's first
        # steps hung on 2 x H100 (benchmarks/results/2026-11-26-2xH100-e2e-variants-in-turn.log)
        torch.cuda.empty_cache()
    return out


# -- processes and report -----------------------------------------------------------------------


def init_rank(rank: int, world: int, store_path: str, dry_run: bool) -> torch.device:
    """This rank's process group (gloo on the CPU in a dry run, else NCCL on GPU `rank`) and its device."""
    if dry_run:
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    else:
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=900), device_id=device if backend == "nccl" else None)
    return device


def worker(rank: int, world: int, store_path: str, args) -> None:
    if args.watchdog:  # every rank prints its threads' stacks if the run outlives this
        faulthandler.dump_traceback_later(args.watchdog, exit=False)
    device = init_rank(rank, world, store_path, args.dry_run)
    try:
        rows = []
        for name in args.models:
            for variant, times in time_model(name, args, device, rank).items():
                rows.append(
                    {"model": name, "variant": variant, "step_s": statistics.median(times), "step_times_s": times}
                )
        if rank == 0:
            report(rows, args, world, device)
    finally:
        dist.destroy_process_group()


def report(rows: list[dict], args, world: int, device: torch.device) -> None:
    nccl = None
    if device.type == "cuda":
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    common = {
        "benchmark": "e2e",
        "device": device_name(device),
        "world": world,
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "bf16": args.bf16,
        "dry_run": args.dry_run,
        "warmup": args.warmup,
        "order": "interleaved",  # the variants stepped in turn (`time_model`)
        "hook_batch_mb": adasum.ddp.BATCH_MB,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    base = {r["model"]: r["step_s"] for r in rows if r["variant"] == "ddp"}
    print(
        f"{common['device']} x {world}, torch {common['torch']}, NCCL {nccl}, bf16 {args.bf16}, "
        f"median of {args.steps} steps after {args.warmup}"
    )
    print(f"{'model':<10} {'variant':<12} {'step ms':>10} {'vs ddp':>8}")
    for r in rows:
        ratio = r["step_s"] / base[r["model"]] if r["model"] in base else None
        r["ratio_to_ddp"] = ratio
        shown = f"{ratio:.3f}" if ratio is not None else "-"
        print(f"{r['model']:<10} {r['variant']:<12} {1000 * r['step_s']:>10.2f} {shown:>8}")
    out = args.out if args.out is not None else (None if args.dry_run else str(DEFAULT_OUT))
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            for r in rows:
                f.write(json.dumps({**common, **r}) + "\n")
        print(f"appended {len(rows)} rows to {out}")


def _list(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(items))

    return parse


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=_list(MODELS), default=list(MODELS), help="comma-separated: resnet50,bert")
    p.add_argument(
        "--variants", type=_list(VARIANTS), default=list(DEFAULT_VARIANTS),
        help="comma-separated: ddp,ddp-adasum,delta (default), delta-mean, gradient, list, list-kept"
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--bf16", action="store_true", help="forward pass under bf16 autocast")
    p.add_argument("--world", type=int, default=None, help="processes (default: every GPU; 2 in a dry run)")
    p.add_argument(
        "--dry-run", action="store_true", help="tiny models, 2 CPU processes on gloo, 2 steps (a smoke test)"
    )
    p.add_argument("--watchdog", type=float, default=0, help="seconds after which every rank prints its stacks")
    p.add_argument("--out", default=None, help=f"JSON lines to append to (default {DEFAULT_OUT}; none in a dry run)")
    args = p.parse_args(argv)
    if not args.dry_run and "resnet50" in args.models and torch.cuda.is_available():
        resnet50_builder()  # a clear error before any process starts
    spawn(worker, args, "bench_e2e")


def spawn(worker, args, script: str) -> None:
    """``worker(rank, world, store_path, args)`` in one process per rank: 2 CPU processes on gloo with
    ``args.dry_run`` (at most 2 steps after 1), else one per GPU (``args.world`` of them at most); bad
    arguments exit with a message naming `script` before any process starts."""
    if args.dry_run:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        world = args.world or 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit(f"{script}: no CUDA device; use --dry-run to try the script on CPU")
        world = args.world or torch.cuda.device_count()
        if world > torch.cuda.device_count():
            raise SystemExit(f"{script}: --world {world} but only {torch.cuda.device_count()} GPUs")
    if args.steps < 1 or args.warmup < 0 or world < 1:
        raise SystemExit(f"{script}: --steps must be >= 1, --warmup >= 0, --world >= 1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned processes
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "store"), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
