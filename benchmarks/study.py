"""Run the pre-registered study (docs/protocol.md, `adasum.experiments.study`) on one machine, many runs at once.

    python benchmarks/study.py pilot   --design fashion-mnist-cnn --rows ROWS.jsonl --budget-s 400 --procs 12
    python benchmarks/study.py confirm --design fashion-mnist-cnn --rows ROWS.jsonl --budget-s 520 --procs 12

`--procs` processes share the device (each loads the data once and trains one run after another, simulated
workers on the GPU); finished runs are appended to ROWS (one JSON object per run, as `adasum compare` writes)
and, with `--copy-to DIR`, copied there gzipped after every run. A run whose row is in ROWS is not run again,
so a phase cut by `--budget-s` (no new run starts after it) continues in the next call. The pilot adds the
extensions of picks on a grid's edge (`study.extensions`) until none is left; the confirmation runs the picks
of the pilot rows in ROWS, primary cells first.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from adasum.experiments.io import read_jsonl, write_atomic  # noqa: E402
from adasum.experiments.runner import RunConfig, identity  # noqa: E402
from adasum.experiments.study import DESIGNS, confirm_runs, extensions, picks, pilot_runs  # noqa: E402

_DATA: dict = {}


def _train(config_dict: dict) -> dict:
    import torch

    from adasum.experiments.data import load_task
    from adasum.experiments.runner import train

    torch.set_num_threads(1)
    config = RunConfig(**config_dict)
    key = (config.task, config.data_dir)
    if key not in _DATA:
        _DATA[key] = load_task(config.task, config.data_dir)
    return train(config, dataset=_DATA[key])


def _key(config: dict) -> str:
    return json.dumps(identity(config) | {"epochs": config["epochs"]}, sort_keys=True)


def _load(path: Path) -> list[dict]:
    return read_jsonl(path) if path.exists() else []  # gzip-compressed where the name ends in .gz


def _save(rows: list[dict], path: Path, copy_to: Path | None) -> None:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    write_atomic(path, lambda f: f.write(gzip.compress(data) if path.suffix == ".gz" else data))
    if copy_to is not None:
        shutil.copy(path, copy_to / path.name)


def run_all(configs: list[RunConfig], rows: list[dict], path: Path, procs: int, deadline: float,
            device: str, copy_to: Path | None) -> int:
    """Train every config whose row is not in `rows`, `procs` at a time, until `deadline`; rows saved as they
    arrive. Returns the number of runs left undone."""
    done = {_key(r["config"] | {"epochs": r["epochs"]}) for r in rows}
    todo = [asdict(c) | {"device": device} for c in configs]
    todo = [c for c in todo if _key(c) not in done]
    if not todo:
        return 0
    ctx = mp.get_context("spawn")
    left = len(todo)
    with ctx.Pool(procs, maxtasksperchild=None) as pool:
        pending = []
        queue = list(todo)
        while queue or pending:
            # at most `procs` submitted, so every pending run has started and the hard deadline stops only
            # runs that began before the deadline, never queued ones
            while queue and len(pending) < procs and time.time() < deadline:
                pending.append(pool.apply_async(_train, (queue.pop(0),)))
            if time.time() >= deadline:
                queue.clear()
            finished = [p for p in pending if p.ready()]
            for p in finished:
                pending.remove(p)
                try:
                    row = p.get()
                except Exception as error:  # a run that raised: reported, not a row
                    print(f"run failed: {error}", flush=True)
                    continue
                rows.append(row)
                left -= 1
                _save(rows, path, copy_to)
            if pending and time.time() > deadline + 90:  # runs started before the deadline that outlive it
                print(f"{len(pending)} runs still going at the hard deadline: stopped", flush=True)
                pool.terminate()
                break
            time.sleep(0.5)
    print(f"{len(todo) - left} runs done, {left} left", flush=True)
    return left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["pilot", "confirm", "plan"])
    parser.add_argument("--design", required=True, choices=list(DESIGNS))
    parser.add_argument("--rows", required=True, type=Path)
    parser.add_argument("--budget-s", type=float, default=400.0, help="no run starts after this many seconds")
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--copy-to", type=Path, default=None)
    args = parser.parse_args()
    design = DESIGNS[args.design]
    if args.data_dir is not None:
        from dataclasses import replace

        design = replace(design, data_dir=args.data_dir)
    deadline = time.time() + args.budget_s
    rows = _load(args.rows)
    if args.phase == "plan":
        print(f"pilot: {len(pilot_runs(design))} runs; picks so far: {picks(rows, design)}")
        print(f"confirm: {len(confirm_runs(design, picks(rows, design)))} runs")
        return
    if args.phase == "pilot":
        configs = pilot_runs(design)
        while configs and time.time() < deadline:
            run_all(configs, rows, args.rows, args.procs, deadline, args.device, args.copy_to)
            more = extensions(rows, design)
            print(f"extensions: {more}", flush=True)
            configs = pilot_runs(design, more) if more else []
        return
    chosen = picks(rows, design)
    configs = confirm_runs(design, chosen)
    primary = {(h.method, h.workers) for h in design.primary} | {(h.against, h.workers) for h in design.primary}
    configs.sort(key=lambda c: ((c.method, c.workers) not in primary and c.method != "sequential", c.seed))
    run_all(configs, rows, args.rows, args.procs, deadline, args.device, args.copy_to)


if __name__ == "__main__":
    main()
