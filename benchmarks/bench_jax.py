"""Time adasum.jax.all_reduce against jax.lax.psum of the same tree, in the same run.

    python benchmarks/bench_jax.py                  # every visible GPU (2 for the targets)
    python benchmarks/bench_jax.py --dry-run        # 2 fake CPU devices, small layouts (the tests run this)

Layouts: one flat 2^26 fp32 array, ResNet-50's and BERT-Large's parameter shapes (benchmarks/layouts.py).
Per layout, jitted shard_map programs over one mesh axis run alternately `--reps` times after
`--warmup` calls, each call timed to `block_until_ready`: Adasum (once per `--pieces` value; the
first is the row's ``adasum_s``), psum of the same tree, the Adasum schedule's communication alone
(ppermute of half the elements and all_gather of half, the same bytes: the floor of this schedule
with no arithmetic) and a psum of one flat array of the same size. Medians go to
benchmarks/results/jax.jsonl, one JSON line per layout, with the device, driver and JAX version.
Device 0's result is also checked against the NumPy reference (tests/reference.py), relative error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="2 fake CPU devices and small layouts")
    p.add_argument("--layouts", default=None, help="comma-separated: flat-2^K, resnet50, bert-large, small-resnet")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--reps", type=int, default=None, help="timed calls of each program (default 30, dry run 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the NumPy reference")
    p.add_argument("--check-leaves", type=int, default=12, help="compare at most this many leaves (evenly spaced, "
                   "the largest always) with the reference")
    p.add_argument("--pieces", default="1", help="comma-separated values of all_reduce(pieces=...) to time")
    p.add_argument("--dump-hlo", default=None, help="folder for the compiled HLO of each layout's first Adasum program")
    p.add_argument("--label", default="")
    p.add_argument("--out", default=str(HERE / "results" / "jax.jsonl"))
    return p.parse_args(argv)


def shapes_of(name: str) -> list[tuple[int, ...]]:
    sys.path.insert(0, str(HERE))
    from layouts import LAYOUTS

    if name.startswith("flat-2^"):
        return [(1 << int(name.split("^")[1]),)]
    if name == "small-resnet":  # the first 12 tensors of ResNet-50: a mixed layout for the dry run
        return LAYOUTS["resnet50"]()[:12]
    return LAYOUTS[name]()


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:  # before JAX starts its backend
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import adasum.jax as aj

    sys.path.insert(0, str(HERE.parent / "tests"))
    from reference import tree as reference_tree

    devices = jax.devices()[:2] if args.dry_run else jax.devices()
    workers = len(devices)
    mesh = Mesh(np.array(devices), ("data",))
    sharded = NamedSharding(mesh, P("data"))
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
    layouts = args.layouts.split(",") if args.layouts else (
        ["flat-2^12", "small-resnet"] if args.dry_run else ["flat-2^26", "resnet50", "bert-large"])
    reps = args.reps or (5 if args.dry_run else 30)

    def mapped(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P("data")))

    pieces = [int(v) for v in args.pieces.split(",")]

    def adasum_program(k: int):
        return mapped(lambda leaves: [x[None] for x in aj.all_reduce([x[0] for x in leaves], "data", pieces=k)])

    adasum_fns = {k: adasum_program(k) for k in pieces}
    psum_fn = mapped(lambda leaves: [x[None] for x in jax.lax.psum([x[0] for x in leaves], "data")])

    def comm(flat):  # the schedule's bytes with no arithmetic: send half, gather half
        half = flat.shape[1] // 2
        got = jax.lax.ppermute(flat[0, :half], "data", [(i, i ^ 1) for i in range(workers)])
        return jax.lax.all_gather(got, "data", tiled=True)[None]

    comm_fn = mapped(comm)
    psum_flat_fn = mapped(lambda flat: jax.lax.psum(flat, "data"))  # the same bytes as one flat array

    for name in layouts:
        shapes = shapes_of(name)
        numel = sum(math.prod(s) for s in shapes)

        @jax.jit
        def make(key):
            keys = jax.random.split(key, len(shapes))
            return [jax.lax.with_sharding_constraint(jax.random.normal(k, (workers, *s), dtype), sharded)
                    for k, s in zip(keys, shapes)]

        leaves = make(jax.random.key(0))
        if args.dump_hlo:
            Path(args.dump_hlo).mkdir(parents=True, exist_ok=True)
            text = adasum_fns[pieces[0]].lower(leaves).compile().as_text()
            (Path(args.dump_hlo) / f"hlo_{name.replace('^', '')}.txt").write_text(text)
        flat = jax.device_put(jnp.zeros((workers, numel + numel % 2), dtype), sharded)
        programs = {f"adasum{k}": (lambda f=f: f(leaves)) for k, f in adasum_fns.items()}
        programs.update(psum=lambda: psum_fn(leaves), comm=lambda: comm_fn(flat), psum_flat=lambda: psum_flat_fn(flat))
        first_call: dict[str, float] = {}
        for key, run in programs.items():  # the first call compiles
            start = time.perf_counter()
            jax.block_until_ready(run())
            first_call[key] = time.perf_counter() - start
        print(f"{name}: first calls (compile) " + " ".join(f"{k} {t:.1f} s" for k, t in first_call.items()), flush=True)
        for _ in range(args.warmup - 1):
            for run in programs.values():
                jax.block_until_ready(run())
        times: dict[str, list[float]] = {k: [] for k in programs}
        for _ in range(reps):
            for key, run in programs.items():
                start = time.perf_counter()
                jax.block_until_ready(run())
                times[key].append(time.perf_counter() - start)
        row = {
            "benchmark": "jax",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": devices[0].device_kind if devices[0].platform == "gpu" else f"cpu ({os.cpu_count()} cores)",
            "platform": devices[0].platform,
            "devices": workers,
            "driver": driver_version() if devices[0].platform == "gpu" else "",
            "jax": jax.__version__,
            "layout": name,
            "dtype": args.dtype,
            "tensors": len(shapes),
            "numel": numel,
            "adasum_s": statistics.median(times[f"adasum{pieces[0]}"]),
            "pieces": pieces[0],
            "adasum_by_pieces_s": {k: statistics.median(times[f"adasum{k}"]) for k in pieces},
            "psum_s": statistics.median(times["psum"]),
            "comm_floor_s": statistics.median(times["comm"]),
            "psum_flat_s": statistics.median(times["psum_flat"]),
            "first_call_s": first_call,
            "reps": reps,
            "warmup": args.warmup,
            "dry_run": args.dry_run,
            "label": args.label,
            "adasum_all_s": times[f"adasum{pieces[0]}"],
            "psum_all_s": times["psum"],
        }
        row["ratio"] = row["adasum_s"] / row["psum_s"]
        out = adasum_fns[pieces[0]](leaves)
        row["identical_on_devices"] = all(
            bool(jnp.all(o[w] == o[0])) for o in out for w in range(1, workers))
        if not args.no_check:
            err = 0.0
            sizes = [math.prod(sh) for sh in shapes]
            picked = set(np.linspace(0, len(shapes) - 1, min(args.check_leaves, len(shapes))).astype(int).tolist())
            picked.add(int(np.argmax(sizes)))
            for x, o in (pair for i, pair in enumerate(zip(leaves, out)) if i in picked):
                host = np.asarray(x.astype(jnp.float32))
                ref = reference_tree([host[w].reshape(-1) for w in range(workers)])
                got = np.asarray(o[0].astype(jnp.float32), dtype=np.float64).reshape(-1)
                err = max(err, float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)))
            row["max_abs_err_vs_reference"] = err  # relative to the largest reference value
            row["checked_leaves"] = len(picked)
        programs = out = leaves = flat = None  # free the device memory before the next layout
        print(f"{name:>14} {args.dtype} {numel:>11,} values: adasum {row['adasum_s'] * 1e3:8.3f} ms  "
              f"psum {row['psum_s'] * 1e3:8.3f} ms  ratio {row['ratio']:.2f}  "
              f"comm floor {row['comm_floor_s'] * 1e3:8.3f} ms  flat psum {row['psum_flat_s'] * 1e3:8.3f} ms  "
              f"rel err {row.get('max_abs_err_vs_reference', float('nan')):.2g}  by pieces (ms) "
              + " ".join(f"{k}:{t * 1e3:.3f}" for k, t in row["adasum_by_pieces_s"].items()), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
