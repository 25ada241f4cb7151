"""Figures of learning curves over seeds, for reports and the results page (PNG, 150 dpi).

``curves``: accuracy against examples seen (in epochs), one panel per worker count, one colour per
method: the median over the runs that did not fail, a band from their minimum to their maximum, and every
failed run drawn apart as a thin dotted line, never folded into the median.

``steps_to_target``: the median number of steps to a target validation accuracy against the global batch
(log-log), one line per method. Runs that never reached the target within their budget count as never
(`censored_median`); a cell where some did not says how many did beside its point, a cell where half
or more did not has no median and is drawn as an open marker at the top. The
dashed line is perfect scaling from sequential training (steps x batch constant); a method's **critical
batch** (marked) is its largest global batch whose steps stay within twice that line.

Both take runs grouped by ``(method, workers)`` (one run per seed, at one learning rate), as
`adasum.experiments.report.picked` or the study's confirmatory cells give them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]
Groups = Mapping[tuple[str, int], Sequence[Row]]

DPI = 150
ORDER = ("sequential", "mean", "mean-scaled", "sum", "adasum", "adasum-delta", "adacons", "localsgd",
         "adasum-localsgd", "slowmo")


def method_order(name: str) -> tuple[int, str]:
    """Sort key of a method's label ("adasum", "adasum (rule)"): its place in ORDER, then the label, so that
    the order (and so the colours) never depends on a set's iteration order."""
    base = name.split(" ")[0]
    return (ORDER.index(base) if base in ORDER else len(ORDER), name)


def _colors(methods: Sequence[str]) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    return {m: ("black" if m == "sequential" else cmap(i % 10)) for i, m in enumerate(methods)}


def _setup():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves(groups: Groups, out: Path, failed: Callable[[Row], bool], key: str = "val_accuracy",
           filename: str = "curves.png", title: str | None = None) -> Path | None:
    """Draw `key` of each run's ``curve`` against epochs (module doc) into ``out/filename``; None when no
    run has a curve. `failed(run)` says which runs are drawn apart."""
    plt = _setup()
    with_curves = {k: [r for r in runs if r.get("curve")] for k, runs in groups.items()}
    with_curves = {k: runs for k, runs in with_curves.items() if runs}
    if not with_curves:
        return None
    counts = sorted({w for (m, w) in with_curves if m != "sequential"}) or [1]
    methods = sorted({m for (m, _) in with_curves}, key=method_order)
    colors = _colors(methods)
    cols = min(len(counts), 2)
    rows_n = math.ceil(len(counts) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.6 * cols, 3.6 * rows_n), squeeze=False, sharey=True)
    for ax, workers in zip(axes.flat, counts):
        for method in methods:
            runs = with_curves.get((method, 1 if method == "sequential" else workers))
            if not runs:
                continue
            good = [r for r in runs if not failed(r)]
            bad = [r for r in runs if failed(r)]
            style = {"color": colors[method]}
            if good:
                length = min(len(r["curve"]) for r in good)
                xs = [good[0]["curve"][i]["epoch"] for i in range(length)]
                values = [[r["curve"][i][key] for r in good] for i in range(length)]
                ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], alpha=0.18, lw=0, **style)
                ax.plot(xs, [statistics.median(v) for v in values], lw=1.4,
                        ls="--" if method == "sequential" else "-",
                        label=f"{method} (lr {good[0]['lr']:g}, {len(good)} runs)", **style)
            for r in bad:
                ax.plot([p["epoch"] for p in r["curve"]], [p[key] for p in r["curve"]], lw=0.6, ls=":", **style)
            if bad:
                ax.plot([], [], lw=0.6, ls=":", label=f"{method}: {len(bad)} failed", **style)
        batch = workers * (runs[0]["batch_size"] if runs else 1)
        ax.set_title(f"{workers} workers (global batch {batch:,})", fontsize=9)
        ax.set_xlabel("epochs (examples seen / training set)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="lower right")
    for ax in axes.flat[len(counts):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(key.replace("_", " ") + " (%)", fontsize=8)
    if title:
        if cols == 1 and len(title) > 60:  # one panel: the title on two lines, at its last comma
            head, _, tail = title.rpartition(", ")
            title = f"{head},\n{tail}" if head else title
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out / filename
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def steps_to(row: Row, target: float) -> int | None:
    """The first evaluated step of the run's ``curve`` at which validation accuracy reached `target`; None if it
    never did."""
    for point in row.get("curve", []):
        if point["val_accuracy"] >= target:
            return int(point["step"])
    return None


def target_below(accuracies: Sequence[float]) -> float | None:
    """The target accuracy a study sets from sequential training: the mean of `accuracies`, rounded down to a
    half point (None without any).

    >>> target_below([80.2, 80.6])
    80.0
    """
    return math.floor(2 * statistics.fmean(accuracies)) / 2 if accuracies else None


def censored_median(steps: Sequence[float | None]) -> float | None:
    """The median of steps to target where a run that never reached it counts as more than any that did
    (None: the median itself is such a run, so more than half never reached it).

    >>> censored_median([10, 20, None]), censored_median([10, None, None])
    (20, None)
    """
    values = sorted(math.inf if s is None else s for s in steps)
    if not values:
        return None
    middle = statistics.median(values)
    return None if math.isinf(middle) or math.isnan(middle) else middle


def steps_table(groups: Groups, target: float) -> dict[tuple[str, int], tuple[float | None, int, int]]:
    """Per cell: the median steps to `target` (`censored_median`: runs that never reached it count as
    never), the runs that reached it, and the runs."""
    out = {}
    for cell, runs in groups.items():
        steps = [steps_to(r, target) for r in runs]
        out[cell] = (censored_median(steps), sum(s is not None for s in steps), len(runs))
    return out


def critical_batch(points: Sequence[tuple[int, float | None]], sequential: tuple[int, float]) -> int | None:
    """The largest global batch whose steps stay within twice perfect scaling from `sequential` (batch,
    steps), walking up from the smallest batch and stopping at the first that does not."""
    b0, s0 = sequential
    best = None
    for batch, steps in sorted(points):
        if steps is None or steps > 2 * s0 * b0 / batch:
            break
        best = batch
    return best


def steps_to_target(groups: Groups, target: float, out: Path, filename: str = "steps-to-target.png",
                    title: str | None = None) -> Path | None:
    """Draw the median steps to `target` against the global batch (module doc) into ``out/filename``;
    None without curves or without sequential training's cell."""
    plt = _setup()
    table = steps_table(groups, target)
    seq = table.get(("sequential", 1))
    if seq is None or seq[0] is None:
        return None
    seq_batch = groups[("sequential", 1)][0]["batch_size"]
    methods = sorted({m for (m, _) in table if m != "sequential"}, key=method_order)
    colors = _colors(["sequential", *methods])
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    batches = sorted({w * groups[(m, w)][0]["batch_size"] for (m, w) in table})
    top = max(v[0] for v in table.values() if v[0] is not None) * 2.5
    ax.plot(batches, [seq[0] * seq_batch / b for b in batches], "k--", lw=0.8, label="perfect scaling")
    ax.plot([seq_batch], [seq[0]], "ko", label=f"sequential ({seq[1]}/{seq[2]} reached)")
    for index, method in enumerate(methods):
        cells = sorted((w * groups[(method, w)][0]["batch_size"], table[(method, w)])
                       for (m, w) in table if m == method)
        xs = [b for b, (s, _, _) in cells if s is not None]
        ys = [s for _, (s, _, _) in cells if s is not None]
        style = {"color": colors[method]}
        ax.plot(xs, ys, marker="o", ms=4, lw=1.2, label=method, **style)
        for b, (s, reached, n) in cells:
            if s is None:
                ax.plot([b], [top], marker="o", mfc="none", ms=6, **style)
                ax.annotate(f"{method}: {reached}/{n}", (b, top), fontsize=6, xytext=(-60, -8 - 8 * index),
                            textcoords="offset points", **style)
            elif reached < n:
                ax.annotate(f"{reached}/{n}", (b, s), fontsize=6, xytext=(3, 3), textcoords="offset points", **style)
        critical = critical_batch([(b, s) for b, (s, _, _) in cells], (seq_batch, seq[0]))
        if critical is not None:
            ax.axvline(critical, color=colors[method], ls=":", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global batch (workers x examples per worker)", fontsize=8)
    ax.set_ylabel(f"median steps to {target:g} % validation accuracy", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title(title or "steps to target (open marker at the top: no run reached it; dotted: critical batch)",
                 fontsize=8)
    fig.tight_layout()
    path = out / filename
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
