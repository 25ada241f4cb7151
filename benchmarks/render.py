"""Render docs/benchmarks.md from benchmarks/results/*.jsonl: one table per claim, each with its machine
(card, driver, torch, NCCL) and the command that reproduces it, then benchmarks/notes.md (where the time
goes) as it is.

    python benchmarks/render.py

A claim's rows are selected by `Claim.select` (the runs of the code as it is now); older rows stay in the
jsonl files and are not shown. Drivers that a run did not record in its rows are taken from the header
of its log (`LOGGED`).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# machine facts a run printed in its log but did not write into its rows: (card prefix, field) -> value
LOGGED = {
    ("NVIDIA H100", "driver"): "580.159.04",
    ("NVIDIA H200", "driver"): "580.159.04",
    ("NVIDIA H200", "nccl"): "2.28.9",
    ("NVIDIA H200", "torch"): "2.11.0+cu130",
}
CURRENT_STEPS = {2: "2026-11-26T23:00", 4: "2026-11-28T20:20"}
"""Per group size, the first training-step run of the code it runs now (at 2 ranks the hook with batches of buckets
on the push protocol, at 4 the slice-parallel schedule with its copy kernel of two programs per multiprocessor, 8192
elements a step in the runs before 20:34 and 4096 from then on); the steps' table
shows these runs, the earlier ones stay in e2e.jsonl."""


def load(name: str) -> list[dict]:
    path = os.path.join(HERE, "results", name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in (json.loads(line) for line in f if line.strip()) if not r.get("dry_run")]


def cell(value: object, key: str = "") -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}" if "ratio" in key else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    """A markdown table of `rows`; `columns` are (key, heading)."""
    out = ["| " + " | ".join(h for _, h in columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    out += ["| " + " | ".join(cell(r.get(k), k) for k, _ in columns) + " |" for r in rows]
    return out + [""]


def machine(rows: list[dict]) -> str:
    """The card, driver, torch and NCCL (or JAX) versions of `rows`, one line."""
    cards = sorted({r.get("device", "") for r in rows})
    world = sorted({r.get("world_size") or r.get("world") or r.get("devices") or r.get("gpus") or 1 for r in rows})
    parts = [" / ".join(cards) + (f", {'/'.join(map(str, world))} ranks" if world != [1] else ", one device")]
    for key, name in (("driver", "driver"), ("torch", "torch"), ("nccl", "NCCL"), ("triton", "Triton"), ("jax", "JAX")):
        values = sorted({str(r[key]) for r in rows if r.get(key)})
        if not values:
            values = sorted({LOGGED[(c[:11], key)] for c in cards if (c[:11], key) in LOGGED})
        if values:
            parts.append(f"{name} {'/'.join(values)}")
    dates = sorted({str(r.get("date", ""))[:10] for r in rows if r.get("date")})
    return "; ".join(parts) + (f"; measured {', '.join(dates)}" if dates else "")


@dataclass
class Claim:
    title: str
    text: str
    command: str
    file: str
    select: Callable[[list[dict]], list[dict]]
    columns: list[tuple[str, str]]
    rows: list[dict] = field(default_factory=list)

    def render(self) -> list[str]:
        rows = self.select(load(self.file))
        if not rows:
            return [f"## {self.title}", "", "(no rows)", ""]
        return [
            f"## {self.title}", "", self.text, "", f"Machine: {machine(rows)}.", "",
            "```bash", self.command, "```", "", *table(rows, self.columns),
        ]


def ratio_span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"


CURRENT_DEFAULTS = {
    2: ("defaults, folded sum kernels",),
    3: ("defaults, copy kernel of two programs per multiprocessor, 4096 elements a step",),
    4: ("defaults, copy kernel of two programs per multiprocessor, 4096 elements a step",),
}
"""The labels of the collective's rows whose code each group size runs now (the defaults' table): of each case, the
rows of the transport that its latest row names (`current_rows`)."""


def current_rows(rows: list[dict]) -> list[dict]:
    """The defaults' rows of the code each group size runs now: rows of its `CURRENT_DEFAULTS` labels, of each case
    (P, card, layout, dtype) those of the transport its latest such row names (an older label's rows of a case that
    another transport runs now are left out)."""
    def case(r: dict) -> tuple:
        return r["world_size"], r["device"], r["layout"], r["dtype"]

    mine = [r for r in rows if r.get("label") in CURRENT_DEFAULTS.get(r.get("world_size"), ())]
    latest = {case(r): r["transport"] for r in mine}  # the file is in run order
    return [r for r in mine if r["transport"] == latest[case(r)]]


def runs_per_case(rows: list[dict], case: Callable[[dict], tuple]) -> list[dict]:
    """One row per `case`: its last run's times and the ratio's span over all its runs."""
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        runs[case(r)].append(r)
    out = []
    for rs in runs.values():
        last = rs[-1]
        count = f"{len(rs)} runs" if len(rs) > 1 else "1 run"
        out.append({**last, "adasum_ms": last["adasum_s"] * 1e3, "allreduce_ms": last["allreduce_s"] * 1e3,
                    "ratio": last["ratio"], "span": f"{ratio_span([r['ratio'] for r in rs])} ({count})"})
    return out


def current_steps(rows: list[dict]) -> list[dict]:
    """The training-step rows of the code each group size runs now (`CURRENT_STEPS`), without the settings' A/B
    runs (rows with a label)."""
    return [r for r in rows if not r.get("label") and r["world"] in CURRENT_STEPS
            and r["date"] >= CURRENT_STEPS[r["world"]]]


def step_runs(rows: list[dict]) -> list[dict]:
    """One row per (P, card, model, variant) of `current_steps`: the last run's step and ratio to DDP's step of the
    same run, and the ratio's span over the runs."""
    rows = with_ratio(current_steps(rows), lambda r: (r["date"], r["model"]), lambda r: r["variant"] == "ddp")
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["ratio"] is not None:
            runs[(r["world"], r["device"], r["model"], r["variant"])].append(r)
    out = []
    for rs in runs.values():
        count = f"{len(rs)} runs" if len(rs) > 1 else "1 run"
        ratios = [r["ratio"] for r in rs]
        out.append({**rs[-1], "ratios": ratios, "span": f"{ratio_span(ratios)} ({count})"})
    return sorted(out, key=lambda r: (r["world"], r["model"], r["variant"] != "ddp", r["variant"]))


def target(r: dict) -> float | None:
    """The project's target for the ratio of a defaults' row of the collective (P, layout, dtype), or None."""
    world, layout = r["world_size"], r["layout"]
    large = layout.startswith("flat") and r["numel"] * (4 if r["dtype"] == "fp32" else 2) >= 64 * 2**20
    table = {
        2: {"flat-2^20": 1.0, "large": 1.05, "resnet50": 1.15, "bert-large": 1.10},
        3: {"large": 1.20, "bert-large": 1.30},
        4: {"flat-2^20": 1.5, "large": 1.10, "resnet50": 1.30, "bert-large": 1.20},
    }.get(world, {})
    return table.get("large" if large else layout)


def verdict(ratios: list[float], limit: float | None) -> str:
    """Whether every run, none, or some of `ratios` is within `limit`."""
    if limit is None:
        return ""
    within = sum(x <= limit for x in ratios)
    if within == len(ratios):
        return "met"
    return "not met" if within == 0 else f"met in {within} of {len(ratios)} runs"


def standing(collective: list[dict], steps: list[dict]) -> list[dict]:
    """The summary's rows: each defaults' case of the collective with its target and verdict over its runs, then
    the training steps' hook and delta rows against DDP (target 1.03)."""
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for r in current_rows(collective):
        runs[(r["world_size"], r["device"], r["layout"], r["dtype"])].append(r)
    out = []
    for (world, device, layout, dtype), rs in sorted(runs.items(), key=lambda kv: kv[0][0]):
        limit = target(rs[-1])
        ratios = [r["ratio"] for r in rs]
        out.append({"world": world, "device": device, "what": f"all_reduce, {layout} {dtype}",
                    "span": f"{ratio_span(ratios)} ({len(rs)} run{'s' if len(rs) > 1 else ''})",
                    "target": "" if limit is None else f"<= {limit:.2f}", "verdict": verdict(ratios, limit),
                    "kept": max(r.get("kept_mib") or 0 for r in rs)})
    for r in step_runs(steps):
        if r["variant"] in ("ddp-adasum", "delta"):
            out.append({"world": r["world"], "device": r["device"], "span": r["span"], "target": "<= 1.03",
                        "what": f"training step, {r['model']} {r['variant']}", "verdict": verdict(r["ratios"], 1.03),
                        "kept": None})
    return out


def with_ratio(rows: list[dict], run_key: Callable[[dict], tuple], is_base: Callable[[dict], bool]) -> list[dict]:
    """Rows with ``step_ms`` and ``ratio`` to the baseline row of the same run."""
    base = {run_key(r): r["step_s"] for r in rows if is_base(r)}
    return [{**r, "step_ms": r["step_s"] * 1e3, "ratio": r["step_s"] / base[run_key(r)] if run_key(r) in base else None}
            for r in rows]


def per_epoch(history: list[list[float]]) -> str:
    return ", ".join(f"{accuracy:.1f} % / {loss:.3f}" for accuracy, loss in history)


def last_per(rows: list[dict], key: Callable[[dict], tuple]) -> list[dict]:
    latest = {key(r): r for r in rows}
    return list(latest.values())


CLAIMS = [
    Claim(
        "Training step: DDP with `adasum_hook`, `DistributedOptimizer` in delta mode",
        "Median step time over the timed steps after 5 (slowest rank); the variants of a model are built side by\n"
        "side and stepped in turn, so `ratio` (to the `ddp` row of the same run) is measured under the same\n"
        "drift. `ddp`: DDP's own all-reduce; `ddp-adasum`: the hook with `AdasumState()` (batches of 256 MB);\n"
        "`delta`: `DistributedOptimizer(mode=\"delta\")`; `delta-mean` (where listed): the same with\n"
        "`reducer=\"mean\"`, NCCL's all_reduce of the deltas, the bound of delta mode (its deltas exist only after\n"
        "the whole backward pass, so their combination overlaps nothing of it); `gradient` (where listed):\n"
        "`DistributedOptimizer(mode=\"gradient\")`, the gradients combined in `step()`; `list` and `list-kept`\n"
        "(where listed): `adasum.all_reduce([p.grad ...])` after backward, the gradients re-made by `zero_grad()`\n"
        "(`list`) or kept with `zero_grad(set_to_none=False)` (`list-kept`). ResNet-50: batch 64 per\n"
        "GPU, SGD; "
        "the BERT-Large-sized stack (24 layers, hidden 1024, about 335 M parameters): batch 8 x 128 tokens, Adam.\n"
        "Adasum runs on the symmetric-memory transport inside one host: the push protocol at two ranks, the\n"
        "slice-parallel schedule at four. One row per case: the last run's step and ratio, and the ratio's span\n"
        "over the runs of the code each P runs now (DDP's BERT step runs 77 ms on a quiet host and 85-93 ms on a\n"
        "noisy one); earlier runs are in `benchmarks/results/e2e.jsonl`.",
        "python benchmarks/bench_e2e.py --models bert --steps 30 --warmup 5      # one process per GPU\n"
        "python benchmarks/bench_e2e.py --models resnet50 --steps 30 --warmup 5\n"
        "python benchmarks/bench_e2e.py --models bert,resnet50 --variants ddp,ddp-adasum,delta,delta-mean \\\n"
        "    --steps 30 --warmup 5\n"
        "python benchmarks/bench_e2e.py --models bert,resnet50 --variants ddp,gradient --steps 20 --warmup 5\n"
        "python benchmarks/bench_e2e.py --models bert,resnet50 --variants ddp,list,list-kept,ddp-adasum \\\n"
        "    --steps 20 --warmup 5",
        "e2e.jsonl",
        lambda rows: [{**r, "step_ms": r["step_s"] * 1e3, "gpus": f"{r['world']} x {r['device']}"}
                      for r in step_runs(rows)],
        [("gpus", "GPUs"), ("model", "model"), ("variant", "variant"), ("step_ms", "step ms"), ("ratio", "ratio"),
         ("span", "ratio over runs")],
    ),
    Claim(
        "The hook's batches of buckets",
        "`benchmarks/profile_hook.py`: the same step with the hook at several batch sizes (`hook-bN`: `batch_mb=N`,\n"
        "`hook-b0`: bucket by bucket, `hook`: the default 256 MB), a Python hook that only orders a side stream\n"
        "(`nop`) and DDP, stepped in turn. `backward host ms`: host time of `loss.backward()`; `hook host ms`: host\n"
        "time inside the hook per step; `batches`: collectives per step over the step's bucket calls.",
        "python benchmarks/profile_hook.py --model bert --batch-mb 0,64,128,512 --steps 30 --warmup 6\n"
        "python benchmarks/profile_hook.py --model resnet50 --batch-mb 0 --steps 30 --warmup 6",
        "hook.jsonl",
        lambda rows: [{**r, "backward_ms": r["backward_host_s"] * 1e3, "hook_ms": r["hook_host_s"] * 1e3,
                       "batches": int(r["batches"]), "hook_calls": int(r["hook_calls"])}
                      for r in with_ratio(rows, lambda r: (r["date"], r["model"]), lambda r: r["variant"] == "ddp")],
        [("model", "model"), ("variant", "variant"), ("step_ms", "step ms"), ("ratio", "ratio"),
         ("backward_ms", "backward host ms"), ("hook_ms", "hook host ms"), ("batches", "batches"),
         ("hook_calls", "bucket calls")],
    ),
    Claim(
        "The bound: each transport's own time for the bytes of a 2-rank Adasum",
        "Seconds, medians of 9 (CUDA events, slowest rank): NCCL's all_reduce of the whole buffer; one\n"
        "`batch_isend_irecv` of half the buffer each way; `all_gather_into_tensor` of half; a copy of half read\n"
        "from the peer's symmetric memory between two signal-pad barriers (`replayed`: captured into a CUDA graph\n"
        "and replayed, as the collective's repeated calls run; eager in rows without it). Adasum on two ranks moves\n"
        "half the buffer twice (exchange, then gather), so twice the fastest half is its floor.",
        "python benchmarks/bench_collective.py --backend nccl --transports default,p2p,collectives,symmetric \\\n"
        "    --check --probe --dtypes fp32,bf16 --exps 20,26,28 --layouts resnet50,bert-large --repeats 10",
        "bounds.jsonl",
        lambda rows: [r for r in rows if "probe" not in r],
        [("dtype", "dtype"), ("numel", "values"), ("nccl_all_reduce", "NCCL all_reduce s"),
         ("p2p_half", "p2p half s"), ("all_gather_half", "all_gather half s"), ("symm_pull_half", "symmetric half s"),
         ("captured", "replayed")],
    ),
    Claim(
        "The memory budget: the symmetric transport in rounds",
        "`adasum.all_reduce` with defaults (then the symmetric transport at P = 2 and 4) under the default 512 MiB\n"
        "budget, where a layout larger than a round runs in rounds of whole tensors, against the same code with a\n"
        "budget that never binds (`ADASUM_MEMORY_MB=100000`: one run through buffers as large as the layout), in\n"
        "turn on one machine; `kept MiB` is the device memory kept after repeated calls (buffers, workspaces, graphs).",
        "ADASUM_MEMORY_MB=M python benchmarks/bench_collective.py --backend nccl --world P --transports default \\\n"
        "    --dtypes fp32,bf16 --exps 20,26 --layouts resnet50,bert-large --label \"symmetric within memory_mb M\"",
        "collective.jsonl",
        lambda rows: last_per([{**r, "adasum_ms": r["adasum_s"] * 1e3, "allreduce_ms": r["allreduce_s"] * 1e3,
                                "budget": r["label"].rsplit(" ", 1)[-1]}
                               for r in rows if r.get("label", "").startswith("symmetric within memory_mb")],
                              lambda r: (r["world_size"], r["layout"], r["dtype"], r["budget"])),
        [("world_size", "P"), ("budget", "budget MiB"), ("layout", "layout"), ("dtype", "dtype"),
         ("adasum_ms", "adasum ms"), ("allreduce_ms", "all_reduce ms"), ("ratio", "ratio"), ("kept_mib", "kept MiB")],
    ),
    Claim(
        "The defaults within the memory budget, a tensor larger than a round run in place",
        "`adasum.all_reduce(list)` with default arguments, timed with CUDA events between barriers, inputs\n"
        "restored before each call, slowest rank, medians of 5-10 calls, alternated with NCCL's `all_reduce` of\n"
        "the same bytes in the same process group; repeated calls replay one captured CUDA graph. Under the\n"
        "default 512 MiB budget (the movers' buffers take 480 MiB of it: three quarters for rounds, a quarter for\n"
        "the in-place ring) a layout larger than a round runs in rounds of whole tensors, and a single tensor\n"
        "larger than a round runs in place (every rank's copies of a slice land in the owner's own buffer through\n"
        "the fixed ring, and each owner stores its result into its peers' rings), so flat 2^26 fp32 and 2^28 run\n"
        "with no buffer sized to them. `transport`: what the default picks for the case (at 2 ranks the push\n"
        "protocol, one-shot for flat 2^20; above 2 ranks the slice-parallel schedule); `kept MiB`: device memory\n"
        "kept after repeated calls (buffers, graphs), counted from after one call of NCCL's all_reduce of the\n"
        "same bytes. ResNet-50 and BERT-Large are lists of their 161 and 391 parameter tensors. Rows: the runs of\n"
        "the code each P runs now (`CURRENT_DEFAULTS` in `benchmarks/render.py` names their labels; at 3 and 4\n"
        "ranks they predate the folded sum kernels); each run also checked its results against `adasum.reduce`\n"
        "(the correctness table). Times are the last run's; `ratio over runs` spans every run.",
        "python benchmarks/bench_collective.py --backend nccl --world P --transports default --check \\\n"
        "    --dtypes fp32,bf16 --exps 20,24,26,28 --layouts resnet50,bert-large --repeats 10 --label LABEL",
        "collective.jsonl",
        lambda rows: sorted(
            runs_per_case(current_rows(rows), lambda r: (r["world_size"], r["device"], r["layout"], r["dtype"])),
            key=lambda r: r["world_size"]),
        [("world_size", "P"), ("device", "card"), ("transport", "transport"), ("layout", "layout"), ("dtype", "dtype"),
         ("adasum_ms", "adasum ms"), ("allreduce_ms", "all_reduce ms"), ("ratio", "ratio"),
         ("span", "ratio over runs"), ("kept_mib", "kept MiB")],
    ),
    Claim(
        "Lists re-made before every call (gradients after zero_grad)",
        "`adasum.all_reduce(list)` with default arguments where the list's tensors are new objects before every\n"
        "call (`--fresh`: dropped, then re-made in the same order, as `zero_grad()` with its default\n"
        "`set_to_none=True` and the next backward do), against the same objects every call, in one run per card\n"
        "and P, NCCL's all_reduce of the same bytes beside each; `host us`: the call's host time (adasum / NCCL).\n"
        "A repeat replays its graph only where the tensors lie where they lay; here the caching allocator put\n"
        "ResNet-50's re-made tensors elsewhere every call, so each call ran eagerly (the plan look-up and every\n"
        "launch on the host: 6-16 x NCCL), and BERT-Large's settled after some calls (fp32 1.15-1.17 x, bf16 still\n"
        "moving); `2026-11-28-2xH200-lists-remade-addresses-probe.log` follows the addresses call by call. A group\n"
        "warns once when a layout keeps moving (docs/troubleshooting.md); `zero_grad(set_to_none=False)` keeps the\n"
        "tensors where they lie. Where they settle, new objects are checked by their addresses, dtypes, shapes\n"
        "and strides before the replay: BERT-Large fp32 488-623 us of host time against 766-1147 us for the whole\n"
        "local check (label \"list objects: new each call, the whole local check\", the library before this check\n"
        "was narrowed, run from a copy of it).",
        "python benchmarks/bench_collective.py --backend nccl --world P --dtypes fp32,bf16 --exps \"\" \\\n"
        "    --layouts resnet50,bert-large [--fresh] --label \"list objects: ...\"",
        "collective.jsonl",
        lambda rows: [{**r, "host": f"{r['adasum_host_s'] * 1e6:.0f} / {r['allreduce_host_s'] * 1e6:.0f}",
                       "objects": r["label"].removeprefix("list objects: ")}
                      for r in runs_per_case([r for r in rows if r.get("label", "").startswith("list objects: ")],
                                             lambda r: (r["world_size"], r["device"], r["label"], r["layout"],
                                                        r["dtype"]))],
        [("world_size", "P"), ("device", "card"), ("objects", "objects"), ("layout", "layout"), ("dtype", "dtype"),
         ("adasum_ms", "adasum ms"), ("allreduce_ms", "all_reduce ms"), ("ratio", "ratio"),
         ("span", "ratio over runs"), ("host", "host us")],
    ),
    Claim(
        "The bound of the slice-parallel schedule: its moves alone",
        "The symmetric mover's scatter and gather of every round exactly as the schedule drives them (the same\n"
        "rounds within the memory budget, rows, signal-pad barriers, one copy kernel for every peer's moves of a\n"
        "step, the in-place mover's copy engines for a tensor larger than a round), with no Adasum math, against\n"
        "NCCL's all_reduce of the same bytes in the same run (medians, CUDA events, slowest rank; the last run per\n"
        "case). `replayed`: the moves captured into a CUDA graph and replayed, one host launch a call, as the\n"
        "collective's repeated calls run; rows without it ran eagerly, so small and list cases were host-bound\n"
        "there. `ratio` is the floor of the schedule's ratio in the\n"
        "defaults' table; what the schedule adds beyond it is the tree on each rank's slice (two float64 passes\n"
        "per level and one small all-reduce), which runs between the two moves.",
        "python benchmarks/bench_collective.py --backend nccl --world P --transports slices --probe \\\n"
        "    --dtypes fp32,bf16 --exps 20,26,28 --layouts resnet50,bert-large      # P = 4, 3",
        "bounds.jsonl",
        lambda rows: [{**r, "moves_ms": r["moves_s"] * 1e3, "all_reduce_ms": r["all_reduce_s"] * 1e3}
                      for r in last_per([r for r in rows if r.get("probe") == "slice moves"],
                                        lambda r: (r["world_size"], r["layout"], r["dtype"]))],
        [("world_size", "P"), ("layout", "layout"), ("dtype", "dtype"), ("rounds", "rounds"),
         ("moves_ms", "moves ms"), ("all_reduce_ms", "all_reduce ms"), ("ratio", "ratio"),
         ("captured", "replayed")],
    ),
    Claim(
        "Correctness per transport",
        "`--check`: 4 calls on the same tensors (graphs replayed) against `adasum.reduce` in float64; the last\n"
        "check of each transport and dtype. Relative error 0 means bitwise equal to the single-process result.",
        "python benchmarks/bench_collective.py --backend nccl --transports default,p2p,collectives,symmetric \\\n"
        "    --check --dtypes fp32,bf16 --exps 20 --layouts resnet50",
        "checks.jsonl",
        lambda rows: last_per(rows, lambda r: (r["transport"], r["dtype"])),
        [("transport", "transport"), ("dtype", "dtype"), ("rel_err", "relative error"),
         ("ranks_equal", "ranks bitwise equal"), ("ok", "ok")],
    ),
    Claim(
        "The collective on the CPU (gloo)",
        "As above, on 2 processes of a 2-core VM over loopback, one thread each (a machine shared with other\n"
        "jobs: the small sizes are noisy); `flat` is the same collective on one buffer already holding the\n"
        "layout (a DDP bucket).",
        "python benchmarks/bench_collective.py      # make bench",
        "collective.jsonl",
        lambda rows: [{**r, "adasum_ms": r["adasum_s"] * 1e3, "allreduce_ms": r["allreduce_s"] * 1e3,
                       "flat_ratio": r["adasum_flat_s"] / r["allreduce_s"] if r.get("adasum_flat_s") else None}
                      for r in rows if r["backend"] == "gloo"],
        [("layout", "layout"), ("dtype", "dtype"), ("numel", "values"), ("adasum_ms", "adasum ms"),
         ("allreduce_ms", "all_reduce ms"), ("ratio", "ratio"), ("flat_ratio", "flat ratio")],
    ),
    Claim(
        "Host time per repeated call of each entry point (gloo)",
        "The wall time of a repeated call on 2 processes, one thread each, for a list shaped like ResNet-50's\n"
        "gradients (161 tensors, 21,776 float32 values: the data's share is small), median of `calls` calls after 10\n"
        "(after 5 for the short runs);\n"
        "on gloo the exchanges are host work too. The machine was shared with other jobs: the medians moved by up\n"
        "to 2x between runs (`adasum.all_reduce` 20-47 ms over three runs), so a row is a baseline to compare a\n"
        "change against in one run. Rows labelled \"before\" are of each door at its own replay depth (the whole\n"
        "call for `adasum.all_reduce`, the schedule for the reducers and the optimizer); rows labelled \"after\" of\n"
        "every door through one plan and one run (`Communicator.plan`, `Communicator.run`), with\n"
        "\"before, alternated\" rows of the code before it measured alternately beside them. On gloo nothing is\n"
        "captured: every call runs\n"
        "its plan eagerly, so these rows measure the checks, the plan's look-up and the schedule's host work; the\n"
        "replay's own path (the same two files from every door) is what `tests/test_plan.py` checks. There\n"
        "before and after agree within the spread of three alternated pairs (`Adasum.all_reduce_flat`\n"
        "10.8-15.6 ms before, 12.8-13.3 ms after; `DistributedOptimizer.step` 15.8-18.1 ms before, 15.2-18.8 ms\n"
        "after); a repeated call makes fewer Python calls after (`adasum.all_reduce(list)` 1,111 against 1,537,\n"
        "`Adasum.all_reduce(list)` 1,119 against 1,319).\n"
        "AdaCons on the slice movers took 1.5-1.7x the time of\n"
        "its two all-reduces in each of three runs at this size (gloo's all-reduce is one call, the movers'\n"
        "scatter and gather point-to-point batches): on gloo AdaCons keeps its two all-reduces; inside one NVLink\n"
        "host it runs on the movers (one all-reduce's bytes), not measured yet.",
        'python benchmarks/bench_doors.py --world 2 --out benchmarks/results/doors.jsonl --label "..."',
        "doors.jsonl",
        lambda rows: [{**r, "host_ms": r["host_us_median"] / 1e3,
                       "when": r["label"].split(":")[0] if ":" in r["label"] else "before"} for r in rows],
        [("when", "rows"), ("door", "door"), ("tensors", "tensors"), ("elements", "values"), ("repeats", "calls"),
         ("host_ms", "host ms per call")],
    ),
    Claim(
        "FSDP2 across replicas (`adasum.fsdp.enable`) against FSDP's own replica averaging",
        "Step time (slowest rank) of a 1.04 B-parameter decoder under FSDP2 (replicas x shards), bf16 parameters,\n"
        "the reduction in bf16, AdamW; `native` is FSDP's 2-D HSDP averaging, `mean` the same hook route as Adasum\n"
        "doing a mean. Every variant's model is resident and the variants take one step each in turn (the order\n"
        "rotated each round), `steps` rounds after 4 warm-up steps each; `step ms` is the median of a variant's\n"
        "steps and `ratio` the median over rounds of its step over native's step of the same round. `peak GiB`:\n"
        "the largest growth of `max_memory_allocated` over what was allocated before the variant's model was\n"
        "built (its own footprint), any rank; `kept MiB`: the device memory outside the caching allocator that\n"
        "it took (symmetric-memory buffers within the 512 MiB budget, captured graphs; native's is NCCL's). Rows\n"
        "of one model at a time (`--sequential`, repeats alternated) are in `benchmarks/results/fsdp.jsonl`: their\n"
        "repeats' medians spread by up to 20 % on this machine, which the interleaved rounds cancel.\n"
        "`adasum.fsdp` agrees on the layouts at `enable`, probes them without waiting at each forward and gives\n"
        "unused parameters zero gradients (torch 2.11 has no reduce-scatter setter): no host round trip in the\n"
        "reduction path; the reductions run on a stream of their own. The rows of 2026-11-28 are of the code now\n"
        "(the slice-parallel schedule with its tree from the Gram matrices at 4 replicas).",
        "torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --mesh 2x1 --steps 100 --reduce-dtype bfloat16\n"
        "torchrun --nproc-per-node 4 benchmarks/bench_fsdp.py --mesh 4x1 --steps 150 --reduce-dtype bfloat16\n"
        "torchrun --nproc-per-node 4 benchmarks/bench_fsdp.py --mesh 2x2 --steps 150 --reduce-dtype bfloat16",
        "fsdp.jsonl",
        lambda rows: [{**r, "step_ms": r["step_s"] * 1e3, "steps": len(r["step_times_s"]),
                       "when": str(r.get("date", ""))[:16].replace("T", " ")}
                      for r in rows if r.get("schedule") == "interleaved" and not r.get("dry_run")],
        [("when", "date"), ("mesh", "mesh"), ("params", "parameters"), ("variant", "variant"), ("steps", "steps"),
         ("step_ms", "step ms"), ("ratio", "ratio"), ("peak_gib", "peak GiB"), ("kept_mib", "kept MiB")],
    ),
    Claim(
        "JAX: `adasum.jax.all_reduce` against `jax.lax.psum` of the same tree",
        "Seconds, medians of alternating calls after warm-up; `comm floor` is the schedule's communication\n"
        "alone (no math).",
        "python benchmarks/bench_jax.py --layouts flat-2^26,bert-large",
        "jax.jsonl",
        lambda rows: [{**r, "ratio": r["adasum_s"] / r["psum_s"]} for r in rows if r.get("label", "").startswith("v2")],
        [("layout", "layout"), ("dtype", "dtype"), ("adasum_s", "adasum s"), ("psum_s", "psum s"),
         ("ratio", "ratio"), ("comm_floor_s", "comm floor s")],
    ),
    Claim(
        "The simulator",
        "`adasum.SimulatedWorkers`: 64 workers of the MNIST CNN, 32 examples each, one device.",
        "python benchmarks/bench_sim.py --device cuda",
        "sim.jsonl",
        lambda rows: rows,
        [("method", "method"), ("workers", "workers"), ("batch_per_worker", "batch per worker"),
         ("steps_per_s", "steps/s")],
    ),
    Claim(
        "The single-process tree (`adasum.reduce` over stacked workers)",
        "64 workers' copies of the ResNet-50 layout; `moved` counts the bytes the tree reads and writes,\n"
        "`effective` each input once; both as fractions of the card's copy bandwidth.",
        "python benchmarks/bench_tree.py --device cuda --workers 64 --layout resnet50",
        "tree.jsonl",
        lambda rows: rows,
        [("workers", "workers"), ("layout", "layout"), ("numel", "values"), ("tree_s", "tree s"),
         ("moved_fraction_of_copy", "moved / copy"), ("effective_fraction_of_copy", "effective / copy")],
    ),
    Claim(
        "Four ranks: flat Adasum and hierarchical mode",
        "4 GPUs of one host; hierarchical mode with 2 emulated nodes of 2 GPUs (mean inside a node, Adasum\n"
        "across). Seconds, medians; `rel. err.` compares hierarchical mode with its single-process definition\n"
        "(`reduce_hierarchical`).",
        "python benchmarks/bench_hierarchical.py --world 4 --local-size 2",
        "hierarchical.jsonl",
        lambda rows: rows,
        [("layout", "layout"), ("numel", "values"), ("flat_adasum_s", "flat adasum s"),
         ("hierarchical_adasum_s", "hierarchical s"), ("allreduce_s", "NCCL all_reduce s"),
         ("hierarchical_vs_definition_rel_err", "rel. err.")],
    ),
    Claim(
        "Streaming DiLoCo: inner steps over a slow link",
        "`adasum.SlowMo` (outer Nesterov SGD) on 2 gloo ranks, a 4-layer MLP of width 256; each combination first\n"
        "sleeps the latency (the link). Inner-step times in ms (a step with its backward): blocking DiLoCo waits\n"
        "once a round, streaming combines its fragments on a background thread while the inner steps go on.",
        "python benchmarks/bench_streaming.py --latency-ms 20 --local-steps 16 --fragments 2 --delay 7 --steps 96",
        "streaming.jsonl",
        lambda rows: rows[-3:],
        [("config", "configuration"), ("latency_ms", "latency ms"), ("median_step_ms", "median step ms"),
         ("max_step_ms", "largest step ms"), ("total_ms", "96 steps ms")],
    ),
    Claim(
        "Real multi-GPU training against the simulator (same seeds and data split)",
        "Test accuracy and train loss after each epoch of `adasum train` on 4 GPUs and of `--simulate 4`.",
        "torchrun --nproc-per-node 4 -m adasum train --method M --task digits --model cnn --epochs 3 --lr 0.05 \\\n"
        "    --batch-size 32\n"
        "python -m adasum train --method M --simulate 4 --device cuda --task digits --model cnn --epochs 3 \\\n"
        "    --lr 0.05 --batch-size 32",
        "convergence-4gpu.jsonl",
        lambda rows: [{**r, **{k: per_epoch(r[k]) for k in ("real", "simulated")}} for r in rows],
        [("method", "method"), ("lr", "lr"), ("real", "real, per epoch"), ("simulated", "simulated, per epoch")],
    ),
]


def render() -> str:
    """The text of docs/benchmarks.md."""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/render.py` from `benchmarks/results/*.jsonl`; one table per claim of",
        "the README, each with its machine and the command that reproduces it (`bash benchmarks/gpu.sh STEP`",
        "runs them on a GPU host). Adasum and its baseline run alternately in one process group, so their",
        "ratio is measured in the same run; compare ratios, not absolute times, across tables. NVLink",
        "multicast (NVLS) was off in every GPU run. Raw logs: `benchmarks/results/*.log`, named by date and",
        "machine.",
        "",
    ]
    collective, steps = load("collective.jsonl"), load("e2e.jsonl")
    lines += [
        "## Where it stands",
        "",
        "The project's targets against the runs of the code each group size runs now, inside one NVLink host:",
        "`adasum.all_reduce(list)` with default arguments against NCCL's all_reduce of the same bytes in the same",
        "run (the defaults' table below), and the training step against DDP's (the first table below). `ratio over",
        "runs` spans every such run; `kept MiB` is the most device memory a case kept after repeated calls (budget",
        "512 MiB). Flat buffers of 64 MiB and more share a target; a case without one has none. At 3 and 4 ranks",
        "the rows predate the folded sum kernels (at 2 ranks 1-5 % faster on flat buffers and within 1 % on lists,",
        "`2026-11-29-2xH200-nccl-suite-and-folded-kernels-ab.log`).",
        "",
        f"Machine: {machine(current_rows(collective) + current_steps(steps))}.",
        "",
        *table(standing(collective, steps), [("world", "P"), ("device", "card"), ("what", "case"),
                                             ("span", "ratio over runs"), ("target", "target"),
                                             ("verdict", "verdict"), ("kept", "kept MiB")]),
    ]
    for claim in CLAIMS:
        lines += claim.render()
    notes = os.path.join(HERE, "notes.md")
    if os.path.exists(notes):
        with open(notes) as f:
            lines.append(f.read().rstrip())
    return "\n".join(lines) + "\n"


def main() -> None:
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), "w") as f:
        f.write(render())


if __name__ == "__main__":
    main()
