"""A sweep over methods x worker counts x learning rates x seeds, with its results file, report and plots."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from adasum.experiments.data import load_task
from adasum.experiments.io import read_jsonl, write_text_atomic
from adasum.experiments.methods import Method, method_reducer
from adasum.experiments.report import plot, write_report
from adasum.experiments.runner import ProgressBar, RunConfig, differences, identity, train

log = logging.getLogger("adasum")


def run_name(method: str, workers: int, lr: float, seed: int = 0) -> str:
    """The folder name of one run of a sweep."""
    return f"{method}-P{workers}-lr{lr:g}-seed{seed}"


def sweep_cells(
    methods: Sequence[Method], workers: Sequence[int], lrs: Sequence[float], seeds: Sequence[int], base: RunConfig
) -> list[RunConfig]:
    """Every run of the sweep, in report order (single-worker methods once per lr and seed)."""
    cells = []
    for m in methods:
        for w in sorted({m.workers(w) for w in workers}):
            for lr in lrs:
                for seed in seeds:
                    cells.append(replace(base, method=m.name, workers=w, lr=lr, seed=seed))
    return cells


def _finished(path: Path, cells: list[RunConfig]) -> dict[str, dict[str, Any]]:
    """Rows of `path` by run name, for `--resume`. A row of a cell of this sweep whose configuration
    differs in anything but the resumable fields (epochs, device, ...) is another sweep's: refused,
    naming the differences."""
    wanted = {run_name(c.method, c.workers, c.lr, c.seed): c for c in cells}
    done = {}
    for row in read_jsonl(path):
        name = run_name(row["method"], row["workers"], row["lr"], row.get("seed", 0))
        if name not in wanted:
            continue
        saved = row.get("config")
        if saved is None:
            raise ValueError(f"{path}: run {name} has no recorded configuration (an older adasum); "
                             "drop --resume or use another --out")
        diff = differences(saved, asdict(wanted[name]))
        if diff:
            raise ValueError(f"{path}: run {name} was made with another configuration ({', '.join(diff)}); "
                             "drop --resume or use another --out")
        done[name] = row
    return done


def compare(
    methods: Sequence[Method],
    workers: Sequence[int],
    lrs: Sequence[float],
    base: RunConfig,
    out: str | Path,
    *,
    seeds: Sequence[int] | None = None,
    resume: bool = False,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Run every (method, workers, lr, seed) cell, simulated, and write into `out`: ``results.jsonl``
    (one JSON object per run, appended as runs finish), ``report.md``, ``accuracy.png``,
    ``loss.png``, ``orthogonality.png``, ``lr.png``, and ``runs/NAME/`` per run (metrics, checkpoint).
    Single-worker methods (sequential) run once per learning rate and seed. `seeds` defaults to
    ``[base.seed]``.

    With `resume`, a finished run is taken from ``results.jsonl`` only when its whole configuration
    matches (task, model, data, batch size, seed, optimizer, method options, learning rate, ...):
    a run of this sweep made with another configuration is refused with the differences named. A
    run that ended with fewer epochs, or was interrupted, continues from its checkpoint.

    >>> methods = parse_methods("sequential,adasum")  # doctest: +SKIP
    >>> compare(methods, [16], [0.01], RunConfig(epochs=2), "runs/x", seeds=[0, 1, 2])  # doctest: +SKIP
    """
    out = Path(out)
    for m in methods:
        method_reducer(m)  # fail before any run starts when a reducer is missing
    cells = sweep_cells(methods, workers, lrs, seeds if seeds is not None else [base.seed], base)
    for config in cells:
        config.validate()
    dataset = load_task(base.task, base.data_dir)

    results_path = out / "results.jsonl"
    done = _finished(results_path, cells) if resume and results_path.exists() else {}
    if not (resume and results_path.exists()):
        write_text_atomic(results_path, "")
    results = []
    with ProgressBar(progress) as bar:
        for config in cells:
            name = run_name(config.method, config.workers, config.lr, config.seed)
            row = done.get(name)
            if row is not None and row["config"] == identity(asdict(config)) and row["epochs"] == config.epochs:
                results.append(row)
                continue
            result = train(config, out / "runs" / name, resume=resume, dataset=dataset, progress=bar)
            results.append(result)
            with open(results_path, "a") as f:
                f.write(json.dumps(result) + "\n")
    # rewrite in cell order, without runs of other cells left over from a resumed sweep
    dropped = len(read_jsonl(results_path)) - len(results) if resume else 0
    write_text_atomic(results_path, "".join(json.dumps(r) + "\n" for r in results))
    if dropped > 0:
        log.info("%s: kept the %d runs of this sweep, dropped %d rows of others", results_path, len(results), dropped)
    plot(results, out)
    write_report(results, out, title=f"Comparison on {dataset.name}")
    return results
