"""A sweep over methods x worker counts x learning rates x seeds, with its results file, report and plots."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from adasum.experiments.data import load_task
from adasum.experiments.io import folder_lock, read_results, write_text_atomic, writing
from adasum.experiments.methods import Method, method_reducer
from adasum.experiments.progress import ProgressBar
from adasum.experiments.report import plot, write_report
from adasum.experiments.runner import RunConfig, differences, identity, train

log = logging.getLogger("adasum")


def run_name(method: str, workers: int, lr: float, seed: int = 0) -> str:
    """The folder name of one run of a sweep."""
    return f"{method}-P{workers}-lr{lr:g}-seed{seed}"


def check_distinct(lrs: Sequence[float], seeds: Sequence[int]) -> None:
    """ValueError if two of `lrs` or two of `seeds` would be one run: a value given twice, or two
    learning rates with one name in `run_name` (six significant digits), which would share a folder."""
    for what, values, each in (("learning rates", lrs, "a cell of every method and worker count"),
                               ("seeds", seeds, "a run of every cell")):
        named: dict[str, float] = {}
        for value in values:
            name = f"{value:g}"
            if name in named:
                clash = (f"repeat {name}" if named[name] == value else
                         f"give {named[name]!r} and {value!r} one run name (lr{name})")
                raise ValueError(f"{what} {','.join(map(str, values))} {clash}: each is {each}; give each once")
            named[name] = value


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


def _finished(rows: list[dict[str, Any]], cells: list[RunConfig], path: Path) -> dict[str, dict[str, Any]]:
    """`rows` of this sweep's cells by run name, for `--resume`. A row of a cell of this sweep whose
    configuration differs in anything but the resumable fields (epochs, device, ...) is another
    sweep's: refused, naming the differences."""
    wanted = {run_name(c.method, c.workers, c.lr, c.seed): c for c in cells}
    done = {}
    for row in rows:
        name = _row_name(row)
        if name not in wanted:
            continue
        diff = differences(row["config"], asdict(wanted[name]))
        if diff:
            raise ValueError(f"{path}: run {name} was made with another configuration ({', '.join(diff)}); "
                             "drop --resume or use another --out")
        done[name] = row
    return done


def _row_name(row: dict[str, Any]) -> str:
    return run_name(row["method"], row["workers"], row["lr"], row["seed"])


# the fields that place a run in a sweep; rows that agree on every other identity field are one sweep's
CELL_FIELDS = ("method", "workers", "lr", "seed")


def _same_sweep(row: dict[str, Any], base: RunConfig) -> bool:
    a, b = identity(row["config"]), identity(asdict(base))
    return row["epochs"] == base.epochs and all(a[key] == b[key] for key in a if key not in CELL_FIELDS)


def _previous_rows(path: Path, resume: bool, overwrite: bool) -> list[dict[str, Any]]:
    """The rows already in `path` that this sweep keeps (--resume), or none; ValueError if a fresh
    sweep would empty a results file that holds runs and `overwrite` is not set."""
    if not path.exists():
        return []
    if resume:
        return read_results(path)
    if path.stat().st_size > 0 and not overwrite:
        raise ValueError(
            f"{path} already holds runs; pass --resume to add to them, --overwrite to replace them, or another --out"
        )
    return []


def compare(
    methods: Sequence[Method],
    workers: Sequence[int],
    lrs: Sequence[float],
    base: RunConfig,
    out: str | Path,
    *,
    seeds: Sequence[int] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool | ProgressBar = False,
    train: Callable[..., dict[str, Any]] = train,
    plot: Callable[[list[dict[str, Any]], Path], Any] = plot,
) -> list[dict[str, Any]]:
    """Run every (method, workers, lr, seed) cell, simulated, and write into `out`: ``results.jsonl``
    (one JSON object per run, appended as runs finish), ``report.md``, ``accuracy.png``,
    ``loss.png``, ``orthogonality.png``, ``lr.png``, and ``runs/NAME/`` per run (metrics, checkpoint).
    Single-worker methods (sequential) run once per learning rate and seed. `seeds` defaults to
    ``[base.seed]``. A seed or learning rate given twice is refused before any run (`check_distinct`);
    a worker count given twice is run once.

    Nothing finished is lost: into a folder whose ``results.jsonl`` holds runs, a sweep starts only with
    `resume` or `overwrite` (ValueError otherwise); while a sweep runs it holds the folder
    (`adasum.experiments.io.folder_lock`), and a second sweep into it is refused at once in one line
    (two sweeps rewrote one ``results.jsonl`` and one's finished runs were lost). With `resume`, a
    finished run is taken from ``results.jsonl`` only when its whole configuration matches (task, model,
    data, batch size, seed, optimizer, method options, learning rate, ...): a run of this sweep made
    with another configuration is refused with the differences named. A run that ended with fewer
    epochs, or was interrupted, continues from its checkpoint. Rows of other cells (other seeds,
    methods, worker counts or learning rates) stay in ``results.jsonl``; the report covers those of them
    with this sweep's configuration. The rows returned are those the report covers.

    `train` runs one cell (`adasum.experiments.runner.train`'s signature; tests count or fake runs) and
    `plot` draws the figures (`adasum.experiments.report.plot`).

    >>> methods = parse_methods("sequential,adasum")  # doctest: +SKIP
    >>> compare(methods, [16], [0.01], RunConfig(epochs=2), "runs/x", seeds=[0, 1, 2])  # doctest: +SKIP

    A sweep of two short runs on scikit-learn's bundled digits, into a temporary folder (the figures left out):

    >>> import tempfile
    >>> from adasum.experiments.methods import parse_methods
    >>> folder = tempfile.TemporaryDirectory()
    >>> methods, base = parse_methods("sequential,adasum"), RunConfig(task="sklearn-digits", epochs=1, train_limit=64)
    >>> rows = compare(methods, [2], [0.05], base, folder.name, plot=lambda results, out: [])
    >>> [(row["method"], row["workers"], row["lr"], row["seed"]) for row in rows]
    [('sequential', 1, 0.05, 0), ('adasum', 2, 0.05, 0)]
    >>> sorted(p.name for p in Path(folder.name).iterdir()), sorted(p.name for p in Path(folder.name, "runs").iterdir())
    (['report.md', 'results.jsonl', 'runs'], ['adasum-P2-lr0.05-seed0', 'sequential-P1-lr0.05-seed0'])
    >>> compare(methods, [2], [0.05], base, folder.name, plot=lambda results, out: [])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: .../results.jsonl already holds runs; pass --resume to add to them, --overwrite to replace them, ...
    >>> folder.cleanup()
    """
    out = Path(out)
    seeds = seeds if seeds is not None else [base.seed]
    check_distinct(lrs, seeds)
    for m in methods:
        method_reducer(m)  # fail before any run starts when a reducer is missing
    cells = sweep_cells(methods, workers, lrs, seeds, base)
    for config in cells:
        config.validate()
    with folder_lock(out, "adasum compare"):
        return _sweep(cells, base, out, resume, overwrite, progress, train, plot)


def _sweep(
    cells: list[RunConfig], base: RunConfig, out: Path, resume: bool, overwrite: bool, progress: bool | ProgressBar,
    train: Callable[..., dict[str, Any]], plot: Callable[[list[dict[str, Any]], Path], Any],
) -> list[dict[str, Any]]:
    """`compare`'s runs, results file and report, with the folder held."""
    results_path = out / "results.jsonl"
    previous = _previous_rows(results_path, resume, overwrite)
    done = _finished(previous, cells, results_path)
    dataset = load_task(base.task, base.data_dir)
    names = {run_name(c.method, c.workers, c.lr, c.seed) for c in cells}
    others = [row for row in previous if _row_name(row) not in names]
    if not resume:  # (a file holding runs was refused above unless overwrite)
        write_text_atomic(results_path, "")
    results = []
    bar = progress if isinstance(progress, ProgressBar) else ProgressBar(progress)
    with bar:
        bar.sweep(len(cells))
        for config in cells:
            name = run_name(config.method, config.workers, config.lr, config.seed)
            row = done.get(name)
            same = row is not None and identity(row["config"]) == identity(asdict(config))
            if same and row is not None and row["epochs"] == config.epochs:
                bar.skip()
                result = row
            else:
                result = train(
                    config, out / "runs" / name, resume=resume, overwrite=overwrite, dataset=dataset, progress=bar
                )
                with writing(results_path), open(results_path, "a") as f:  # a later row of a run wins
                    f.write(json.dumps(result) + "\n")
            results.append(result)
    # this sweep's rows in cell order (a run's earlier rows replaced), then every row of other cells
    write_text_atomic(results_path, "".join(json.dumps(r) + "\n" for r in [*results, *others]))
    kept = [row for row in others if _same_sweep(row, base)]
    if others:
        log.info("%s: kept the %d rows of other runs (%d in this report)", results_path, len(others), len(kept))
    reported = results + kept
    with writing(out, f"the figures in {out}"):
        plot(reported, out)
    write_report(reported, out, title=f"Comparison on {dataset.name}")
    return reported
