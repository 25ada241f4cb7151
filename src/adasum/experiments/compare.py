"""A sweep over methods x worker counts x learning rates, with its results file, report and plots."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from adasum.experiments.data import load_task
from adasum.experiments.methods import Method, method_reducer
from adasum.experiments.report import plot, write_report
from adasum.experiments.runner import ProgressBar, RunConfig, train

log = logging.getLogger("adasum")


def run_name(method: str, workers: int, lr: float) -> str:
    return f"{method}-P{workers}-lr{lr:g}"


def compare(
    methods: Sequence[Method],
    workers: Sequence[int],
    lrs: Sequence[float],
    base: RunConfig,
    out: str | Path,
    *,
    resume: bool = False,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Run every (method, workers, lr) cell, simulated, and write into `out`: ``results.jsonl``
    (one JSON object per run, appended as runs finish), ``report.md``, ``accuracy.png``,
    ``loss.png``, ``orthogonality.png``, and ``runs/NAME/`` per run (metrics, checkpoint).
    Single-worker methods (sequential) run once per learning rate. With `resume`, finished runs
    are read back from ``results.jsonl`` and an interrupted run continues from its checkpoint.

    >>> compare(parse_methods("sequential,adasum"), [16], [0.01], RunConfig(epochs=2), "runs/x")
    """
    out = Path(out)
    for m in methods:
        method_reducer(m)  # fail before any run starts when a reducer is missing
    cells = []
    for m in methods:
        for w in sorted({m.workers(w) for w in workers}):
            for lr in lrs:
                cells.append(replace(base, method=m.name, workers=w, lr=lr))
    for config in cells:
        config.validate()
    dataset = load_task(base.task, base.data_dir)

    results_path = out / "results.jsonl"
    done: dict[str, dict[str, Any]] = {}
    if resume and results_path.exists():
        for line in results_path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[run_name(r["method"], r["workers"], r["lr"])] = r
    else:
        results_path.write_text("")
    results = []
    with ProgressBar(progress) as bar:
        for config in cells:
            name = run_name(config.method, config.workers, config.lr)
            if name in done and done[name]["epochs"] == config.epochs:
                results.append(done[name])
                continue
            result = train(config, out / "runs" / name, resume=resume, dataset=dataset, progress=bar)
            results.append(result)
            with open(results_path, "a") as f:
                f.write(json.dumps(result) + "\n")
    # rewrite in cell order, without runs of other settings left over from a resumed sweep
    results_path.write_text("".join(json.dumps(r) + "\n" for r in results))
    plot(results, out)
    write_report(results, out, title=f"Comparison on {dataset.name}")
    return results
