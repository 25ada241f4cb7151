"""Time adasum.all_reduce as a user calls it against one dist.all_reduce of the same bytes, in the same run.

    python benchmarks/bench_collective.py                       # gloo, 2 local CPU processes
    python benchmarks/bench_collective.py --backend nccl        # NCCL, one process per GPU
    python benchmarks/bench_collective.py --backend nccl --transports default,p2p,collectives,symmetric \\
        --check --probe

For each case and transport, ``adasum.all_reduce(list_of_tensors)`` (default arguments, or
``transport=``) and NCCL's ``all_reduce`` of a buffer of the same bytes run alternately (after
warm-up) `--repeats` times. The inputs are restored before each call (outside the timed region);
each call is timed between barriers, with CUDA events on GPUs (host clock on CPU); a repeat's time
is the slowest rank's; medians are written as JSON lines to benchmarks/results/collective.jsonl
with the card, driver, torch and NCCL versions, the host launches of one call (a profiled call
after the timed ones: kernel, memcpy and graph launches through the CUDA runtime and driver), and
each side's median host time per call (``adasum_host_s``, ``allreduce_host_s``: how long the call
took to return, the slowest rank's; on a GPU the idle device waits for the part before the first
launch, which for a list includes the replay's per-tensor checks). ``--fresh``: the inputs are restored into
new tensor objects before each call, the old ones dropped first (gradients re-made by a training loop's
``zero_grad()``, ``set_to_none=True`` by default): where the caching allocator puts them back where the old ones
lay, a repeated call checks them as new objects at those addresses, elsewhere it runs eagerly; rows carry
``"fresh": true``.

``--check`` first checks every transport against ``adasum.reduce`` of the ranks' inputs (float64
rounding bound) with ranks bitwise equal, over repeated calls (so replayed graphs are checked too).
``--probe`` times what each transport's bytes cost alone for the same sizes (the physical bound):
NCCL all_reduce, one ``batch_isend_irecv`` of half the buffer each way, ``all_gather_into_tensor``
of half, and a copy of half from the peer's symmetric memory (2 ranks), and at any world size the
slice-parallel schedule's moves with no Adasum math (`slice_moves_probe`); rows go to
benchmarks/results/bounds.jsonl. `python benchmarks/render.py` turns the rows into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import adasum  # noqa: E402
from adasum.collectives.api import list_transport  # noqa: E402

from layouts import LAYOUTS  # noqa: E402
from machine import device_name, free_memory  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


class Timer:
    """Wall time of one call: CUDA events on GPUs (the device's time between two points of the
    stream, host launch gaps included), the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = 0.0  # the last call's host time: how long `fn` took to return (its launches, on a GPU)

    def __call__(self, fn) -> float:
        cuda = self.device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        self.host = time.perf_counter() - t0
        if not cuda:
            return self.host
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def time_pair(
    fns, restore, device, repeats: int, warmup: int, host: list[float] | None = None
) -> tuple[list[float], list[list[float]]]:
    """Each of `fns` alternately, `repeats` times after `warmup`; `restore()` before each call.
    Returns the medians and all times, each repeat the slowest rank's; `host`, where given, gets each fn's median
    host time, the slowest rank's (how long the call took to return; on a GPU at most what the idle device waited
    for before the call's first launch, and at least the host's share of a list call's checks)."""
    timer = Timer(device)
    for _ in range(warmup):
        for fn in fns:
            restore()
            fn()
    times: list[list[float]] = [[] for _ in fns]
    hosts: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out, spent in zip(fns, times, hosts):
            restore()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            out.append(timer(fn))
            spent.append(timer.host)
    t = torch.tensor([times, hosts], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    rows, host_rows = t.tolist()
    if host is not None:
        host.extend(statistics.median(r) for r in host_rows)
    return [statistics.median(r) for r in rows], rows


def kept_memory(before: int | None, device: torch.device) -> float | None:
    """MiB of device memory taken since `before` (`free_memory`, read after one call of the baseline, so that what
    NCCL keeps for the same bytes is not counted) and still held: what adasum keeps beyond the user's tensors
    after repeated calls (buffers, workspaces, captured graphs, the caching allocator's share), the largest over
    ranks."""
    if before is None:
        return None
    taken = torch.tensor([(before - free_memory(device)) / (1 << 20)], device=device)
    dist.all_reduce(taken, op=dist.ReduceOp.MAX)
    return float(taken)


def host_launches(fn, device: torch.device) -> int | None:
    """Launches through the CUDA runtime/driver during one call of `fn` (kernels, copies, graphs)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    names = [e.name for e in prof.events()]
    return sum(1 for n in names if ("Launch" in n or "Memcpy" in n or "Memset" in n) and n.startswith("cu"))


def cases(args) -> list[tuple[str, list[tuple[int, ...]]]]:
    out = []
    for e in args.exps:
        out.append((f"flat-2^{e}", [(1 << e,)]))
    for name in args.layouts:
        if name:
            out.append((name, LAYOUTS[name]()))
    return out


def versions(backend: str) -> dict:
    return {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None,
        "driver": _driver() if backend == "nccl" else None,
        "triton": _triton_version(),
    }


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def check_transports(rank, world, device, transports, log) -> list[dict]:
    """Every transport against adasum.reduce of the ranks' inputs, ranks bitwise equal, 4 calls each. The
    slice-parallel schedule above two ranks rounds once (the Gram form, `adasum.collectives.slices.by_gram`), so
    it is checked against the float64 tree (`reduce` of float64 copies); the level forms round every level to the
    dtype as `reduce` does, and are checked against it in the dtype."""
    rows = []
    shapes = [(1,), (0,), (7,), (33, 5), (1000,), (3,), (70000,), (129, 17), (40000,), (5,), (300000,)]
    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)):
        for name in transports:
            worst, equal = 0.0, True
            mine = None
            for call in range(4):
                g = torch.Generator().manual_seed(1000 * call + 7)
                every = [[torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
                         for _ in range(world)]
                if mine is None:
                    mine = [t.clone().to(device) for t in every[rank]]
                else:  # the same tensors again (graph replay), new values
                    for t, src in zip(mine, every[rank]):
                        t.copy_(src)
                adasum.all_reduce(mine, transport=None if name == "default" else name)
                nbytes = sum(math.prod(s) for s in shapes) * mine[0].element_size()
                chosen = list_transport(None, None if name == "default" else name, nbytes).name
                once = world > 2 and dtype != torch.float64 and chosen in ("slices", "one-shot")
                for i, got in enumerate(mine):
                    ref = adasum.reduce([every[r][i].double() if once else every[r][i] for r in range(world)])
                    if ref.numel():
                        err = float((got.double().cpu() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))
                        worst = max(worst, err)
                flat = torch.cat([t.reshape(-1).double() for t in mine])
                gathered = [torch.empty_like(flat) for _ in range(world)]
                dist.all_gather(gathered, flat)
                equal = equal and all(torch.equal(gathered[0], x) for x in gathered[1:])
            ok = worst < bound and equal
            rows.append({"transport": name, "dtype": str(dtype), "rel_err": worst, "ranks_equal": equal, "ok": ok})
            log(f"check {name:12s} {str(dtype):15s} rel_err {worst:.2e} ranks_equal {equal} {'ok' if ok else 'FAIL'}")
    return rows


def probe(rank, world, device, exps, dtypes, log) -> list[dict]:
    """Each transport's own time for the bytes of a 2-rank Adasum (half the buffer each way)."""
    rows = []
    peer = 1 - rank
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for e in exps:
            n = 1 << e
            x = torch.randn(n, device=device).to(dtype)
            half = n // 2
            recv = torch.empty(half, device=device, dtype=dtype)
            out = torch.empty(n, device=device, dtype=dtype)

            def p2p():
                ops = [dist.P2POp(dist.isend, x[half * peer : half * peer + half], peer),
                       dist.P2POp(dist.irecv, recv, peer)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

            captured = False  # the symmetric pull's graph (the other moves run eagerly)
            fns = {"nccl_all_reduce": lambda: dist.all_reduce(x), "p2p_half": p2p,
                   "all_gather_half": lambda: dist.all_gather_into_tensor(out, x[:half] if rank == 0 else x[half:])}
            try:
                from adasum.transport import symmetric

                if symmetric.supported(None):
                    shared, handle = symmetric.pool(None).staging(n, x)
                    remote = handle.get_buffer(peer, (n,), dtype, 0)

                    def pull():
                        handle.barrier(channel=0)
                        recv.copy_(remote[half * rank : half * rank + half])
                        handle.barrier(channel=0)

                    fns["symm_pull_half"], captured = replayed(pull, device)
            except Exception as error:  # noqa: BLE001 - recorded, not fatal
                log(f"probe: symmetric memory unavailable: {error!r}")
            medians, _ = time_pair(list(fns.values()), lambda: None, device, 9, 2)
            row = {"dtype": dtype_name, "numel": n, **{k: v for k, v in zip(fns, medians)}, "captured": captured}
            rows.append(row)
            log("probe " + " ".join(f"{k}={v * 1e3:.3f}ms" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in row.items()))
    return rows


def slice_moves_probe(rank, world, device, args, log) -> list[dict]:
    """The slice-parallel schedule's bytes alone, any world size: the symmetric mover's scatter and gather of
    every round exactly as `adasum.collectives.slices.adasum_slices_` drives them (same rounds, rows, barriers,
    copy kernels), with no Adasum math (each rank's own row is copied to the peer's slot that the last pass
    would store into), against NCCL all_reduce of the same bytes in the same run."""
    from adasum.collectives.slices import round_tensor, slice_rounds
    from adasum.core.layout import Layout, Scattered
    from adasum.transport.symmetric import SymmetricSlices, supported

    if world < 2:  # nothing moves between ranks
        return []
    if not supported(None):
        log("probe: symmetric memory unavailable")
        return []
    mover = SymmetricSlices(None)
    rows_out = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for name, shapes in cases(args):
            tensors = [torch.randn(s, device=device).to(dtype) for s in shapes]
            numel = sum(t.numel() for t in tensors)
            flat = torch.randn(numel, device=device).to(dtype)
            buffer = tensors[0].view(-1) if len(tensors) == 1 else Scattered(tensors)
            layout = Layout((numel,)) if len(tensors) == 1 else buffer.layout
            cut, _ = slice_rounds(layout, mover, buffer, 1)  # one round at a time: the moves alone, nothing beside

            def moves():
                for first, end, lo, hi, bounds in cut:
                    mv, buf = mover, buffer
                    if bounds is None:  # one tensor larger than a round: the in-place mover
                        mv = mover.in_place
                        buf = round_tensor(buffer, first, end, lo, hi)
                        bounds = mv.cut(buf.numel())
                    parts = mv.rows(buf, bounds)
                    mv.scatter(buf, bounds, lambda p0, p1: None)

                    def finish(p0, p1, outs, parts=parts):
                        for start, rows in parts:
                            if start <= p0 < start + rows[rank].numel():
                                for out in outs[1:]:
                                    out.copy_(rows[rank][p0 - start : p1 - start])

                    mv.gather(buf, bounds, finish)

            run, captured = replayed(moves, device)
            (m, a), _ = time_pair([run, lambda: dist.all_reduce(flat)], lambda: None, device, args.repeats,
                                  args.warmup)
            row = {"probe": "slice moves", "dtype": dtype_name, "layout": name, "numel": numel, "rounds": len(cut),
                   "moves_s": m, "all_reduce_s": a, "ratio": m / a, "captured": captured}
            rows_out.append(row)
            log(f"probe {dtype_name:5s} {name:16s} slice moves {m * 1e3:7.3f} ms  all_reduce {a * 1e3:7.3f} ms  "
                f"ratio {m / a:5.2f}  rounds {len(cut)}  {'replayed' if captured else 'eager'}")
    return rows_out


def replayed(fn, device) -> tuple:
    """`fn`'s launches as the collective runs repeated calls: run twice (its caches warm), captured into a CUDA graph
    the way `adasum.transport.graphs` captures a call, and replayed; so a probe times the device's work with one
    host launch per call, as the collective's rows are. Returns the function to time and whether it was captured
    (where capture fails, `fn` itself)."""
    from adasum.transport.graphs import CudaCapture

    fn()
    fn()
    try:
        graph = CudaCapture().capture(fn, device)
    except Exception:  # noqa: BLE001 - timed eagerly instead, and the row says so
        return fn, False
    return graph.replay, True


def worker(rank: int, world: int, store_path: str, args) -> None:
    torch.set_num_threads(1 if args.backend == "gloo" else torch.get_num_threads())
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        args.backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
        timeout=timedelta(seconds=600), device_id=device if device.type == "cuda" else None,
    )
    if device.type == "cuda":  # NCCL's own buffers exist before any kept memory is measured
        dist.all_reduce(torch.ones(1, device=device))

    def log(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    common = {
        "date": datetime.date.today().isoformat(), "device": device_name(device), "backend": args.backend,
        "world_size": world, **versions(args.backend), "label": args.label,
    }
    default = None
    if args.backend == "nccl":
        from adasum.collectives.vhdd import transport_for

        default = transport_for(None, None, world & (world - 1) == 0).name
    else:
        default = "p2p"
    log(f"{common['device']} x {world}: torch {common['torch']}, NCCL {common['nccl']}, driver {common['driver']}, "
        f"triton {common['triton']}; default transport {default}")
    transports = [t for t in args.transports if args.backend == "nccl" or t in ("default", "p2p")]
    if args.check:
        rows = check_transports(rank, world, device, transports, log)
        _write(rank, args.check_out, [{**common, **r} for r in rows])
    if args.probe and args.backend == "nccl":
        rows = probe(rank, world, device, args.exps, args.dtypes, log) if world == 2 else []
        rows += slice_moves_probe(rank, world, device, args, log)
        _write(rank, args.probe_out, [{**common, **r} for r in rows])
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for layout, shapes in cases(args):
            numel = sum(math.prod(s) for s in shapes)
            g = torch.Generator(device=device).manual_seed(rank)
            tensors = [torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype) for s in shapes]
            saved = [t.clone() for t in tensors]
            flat = torch.randn(numel, generator=g, device=device, dtype=torch.float32).to(dtype)
            repeats = args.repeats if numel < (1 << 24) else max(5, args.repeats // 2)

            def restore():
                if args.fresh:  # drop every tensor, then make new ones in the same order (module doc)
                    tensors[:] = [None] * len(tensors)
                    tensors[:] = [torch.empty_like(t) for t in saved]
                torch._foreach_copy_(tensors, saved)

            for name in transports:
                chosen = None if name == "default" else name

                def run_adasum():
                    adasum.all_reduce(tensors, transport=chosen)

                dist.all_reduce(flat)  # the baseline's first call: what NCCL keeps for these bytes is not adasum's
                before = free_memory(device)
                host: list[float] = []
                (a_s, r_s), (a_all, r_all) = time_pair(
                    [run_adasum, lambda: dist.all_reduce(flat)], restore, device, repeats, args.warmup, host
                )
                kept = kept_memory(before, device)
                restore()
                launches = host_launches(run_adasum, device)
                row = {
                    **common, "layout": layout, "tensors": len(shapes), "dtype": dtype_name, "numel": numel,
                    "transport": list_transport(None, chosen, numel * flat.element_size()).name,
                    "default": name == "default",
                    "adasum_s": a_s, "allreduce_s": r_s, "ratio": a_s / r_s, "host_launches": launches,
                    "timer": "cuda-events" if device.type == "cuda" else "host", "repeats": repeats,
                    "adasum_all_s": a_all, "allreduce_all_s": r_all, "kept_mib": kept, "kept_after_baseline": True,
                    "adasum_host_s": host[0], "allreduce_host_s": host[1], "fresh": args.fresh,
                }
                rows.append(row)
                star = "*" if name == "default" else " "
                log(f"{dtype_name:5s} {layout:14s} {numel:>11d} {row['transport']:12s}{star} "
                    f"adasum {a_s * 1e3:8.3f} ms  all_reduce {r_s * 1e3:8.3f} ms  ratio {a_s / r_s:5.2f}  "
                    f"launches {launches}  host {host[0] * 1e6:.0f}/{host[1] * 1e6:.0f} us  "
                    f"kept {kept if kept is None else round(kept)} MiB")
                if device.type == "cuda":  # each transport's kept memory on its own
                    adasum.release()
                    torch.cuda.empty_cache()
            tensors = saved = flat = None  # free before the next case
            if device.type == "cuda":
                adasum.release()
                torch.cuda.empty_cache()
    _write(rank, args.out, rows)
    dist.barrier()
    dist.destroy_process_group()


def _write(rank: int, path: str, rows: list[dict]) -> None:
    if rank == 0 and rows:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def _driver() -> str | None:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return None


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp32"])
    p.add_argument("--exps", type=lambda s: [int(x) for x in s.split(",") if x], default=[10, 14, 18, 20, 22, 24, 26])
    p.add_argument("--layouts", type=lambda s: [x for x in s.split(",") if x], default=["resnet50"])
    p.add_argument("--transports", type=lambda s: [x for x in s.split(",") if x], default=["default"],
                   help="default (what adasum.all_reduce picks), p2p, collectives, symmetric")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--check", action="store_true", help="check every transport against adasum.reduce first")
    p.add_argument("--probe", action="store_true",
                   help="time each transport's bytes alone (NCCL; the slice moves at any world size)")
    p.add_argument("--fresh", action="store_true", help="new tensor objects before each call (module doc)")
    p.add_argument("--label", default="")
    p.add_argument("--out", default=os.path.join(here, "results", "collective.jsonl"))
    p.add_argument("--probe-out", default=os.path.join(here, "results", "bounds.jsonl"))
    p.add_argument("--check-out", default=os.path.join(here, "results", "checks.jsonl"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.world, os.path.join(tmp, "store"), args), nprocs=args.world,
                           start_method="spawn")


if __name__ == "__main__":
    main()
