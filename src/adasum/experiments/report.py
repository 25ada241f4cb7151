"""Tables and plots from a sweep's results (the dicts that `runner.train` returns), over seeds.

Selection and reporting are kept apart: for each method and worker count the learning rate is
picked on the mean **validation** accuracy over seeds (a diverged run scores 0); only then is the
**test** accuracy of that learning rate reported, as the mean over seeds with its 95% interval
(Student's t over the seeds) and the min-max range. A difference is called better or worse only
when the two 95% intervals do not overlap; otherwise it is "within spread".

``report.md``: the validated summary, the learning-rate robustness table, every cell.
``accuracy.png`` / ``loss.png``: test accuracy / loss against epoch (mean over seeds), one line
per method at its picked learning rate, one panel per worker count, sequential dashed.
``orthogonality.png``: the orthogonality diagnostic over training (first seed), same layout.
``lr.png``: validation accuracy against learning rate (log x, mean and min-max over seeds), one
panel per worker count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adasum.experiments.io import write_text_atomic
from adasum.experiments.methods import METHODS

Result = dict[str, Any]

# two-sided 95% quantiles of Student's t by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (the table's next smaller df)."""
    if df >= 60:
        return 1.96 + 2.4 / df
    return _T95[max(k for k in _T95 if k <= df)]


@dataclass(frozen=True)
class Stat:
    """Mean of n values with its 95% interval (t over the values) and their range."""

    mean: float
    lo: float
    hi: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        """The statistics of `values` (class doc)."""
        values = [float(v) for v in values]
        n = len(values)
        mean = sum(values) / n
        if n < 2:
            return cls(mean, mean, mean, mean, mean, n)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        half = t95(n - 1) * sd / math.sqrt(n)
        return cls(mean, mean - half, mean + half, min(values), max(values), n)

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:.2f} (1 seed)"
        return f"{self.mean:.2f} [{self.lo:.1f}, {self.hi:.1f}]"


def separation(a: Stat, b: Stat) -> str:
    """"better" / "worse" when a's 95% interval lies above / below b's, else "within spread"."""
    if a.n < 2 or b.n < 2:
        return "one seed: no call"
    if a.lo > b.hi:
        return "better"
    if a.hi < b.lo:
        return "worse"
    return "within spread"


def _method_order(name: str) -> int:
    names = list(METHODS)
    return names.index(name) if name in names else len(names)


def _score(r: Result) -> float:
    """Validation accuracy for selection; a diverged run scores 0."""
    return 0.0 if r["diverged"] or r.get("val_accuracy") is None else float(r["val_accuracy"])


def cells(results: Sequence[Result]) -> dict[tuple[str, int, float], list[Result]]:
    """Runs by (method, workers, lr), seeds together."""
    out: dict[tuple[str, int, float], list[Result]] = {}
    for r in results:
        out.setdefault((r["method"], r["workers"], r["lr"]), []).append(r)
    return out


def picked(results: Sequence[Result]) -> dict[tuple[str, int], list[Result]]:
    """Per (method, workers): the runs (one per seed) of the learning rate with the highest mean
    validation accuracy over seeds (ties: the smaller learning rate)."""
    best: dict[tuple[str, int], tuple[float, float, list[Result]]] = {}
    for (method, workers, lr), runs in cells(results).items():
        score = sum(_score(r) for r in runs) / len(runs)
        key = (method, workers)
        if key not in best or (score, -lr) > (best[key][0], -best[key][1]):
            best[key] = (score, lr, runs)
    return {key: runs for key, (_, _, runs) in best.items()}


def test_stat(runs: Sequence[Result]) -> Stat:
    """The test-accuracy statistics of `runs`."""
    return Stat.of([r["test_accuracy"] for r in runs])


def _flags(runs: Sequence[Result]) -> str:
    n = len(runs)
    parts = []
    for key, word in (("diverged", "diverged"), ("collapsed", "at chance")):
        k = sum(bool(r.get(key)) for r in runs)
        if k:
            parts.append(f"{k}/{n} {word}")
    return ", ".join(parts)


def _ordered(keys):
    return sorted(keys, key=lambda k: (k[1], _method_order(k[0])) + tuple(k[2:]))


def summary_table(results: Sequence[Result]) -> str:
    """Per method and worker count: the learning rate picked on validation and its test accuracy
    over seeds, against sequential training and Horovod's scaled mean at the same worker count."""
    best = picked(results)
    seq = best.get(("sequential", 1))
    seq_stat = test_stat(seq) if seq else None
    rows = [
        "| method | workers | lr (picked on val.) | seeds | val. acc. | test acc. [95% interval] | min-max "
        "| vs sequential | vs mean-scaled | flags |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for key in _ordered(best):
        runs = best[key]
        stat = test_stat(runs)
        val = sum(r["val_accuracy"] for r in runs) / len(runs)
        vs_seq = "-" if seq_stat is None or key[0] == "sequential" else (
            f"{stat.mean - seq_stat.mean:+.2f}: {separation(stat, seq_stat)}")
        ms = best.get(("mean-scaled", key[1]))
        vs_ms = "-" if ms is None or key[0] in ("mean-scaled", "sequential") else (
            f"{stat.mean - test_stat(ms).mean:+.2f}: {separation(stat, test_stat(ms))}")
        rows.append(
            f"| {key[0]} | {key[1]} | {runs[0]['lr']:g} | {len(runs)} | {val:.2f} | {stat} | "
            f"{stat.min:.1f}-{stat.max:.1f} | {vs_seq} | {vs_ms} | {_flags(runs)} |"
        )
    return "\n".join(rows)


best_table = summary_table  # the name the CLI printed before seeds


@dataclass(frozen=True)
class Robustness:
    """How a method's validation accuracy depends on the learning rate (means over seeds)."""

    at_sequential_lr: float | None  # at the learning rate picked for sequential training
    best: float
    best_lr: float
    range_lo: float  # the smallest and largest grid learning rate within 1 point of the best
    range_hi: float
    grid: tuple[float, ...]

    @property
    def width(self) -> float:
        """range_hi / range_lo (1: only the best grid point is within 1 point)."""
        return self.range_hi / self.range_lo

    @property
    def at_edge(self) -> bool:
        """The best learning rate is the smallest or largest of the grid (the grid may be too narrow)."""
        return len(self.grid) > 1 and self.best_lr in (self.grid[0], self.grid[-1])


def robustness(results: Sequence[Result]) -> dict[tuple[str, int], Robustness]:
    """Per (method, workers) cell: how its validation accuracy depends on the learning rate."""
    by_cell = cells(results)
    seq_runs = picked(results).get(("sequential", 1))
    seq_lr = seq_runs[0]["lr"] if seq_runs else None
    out = {}
    for key in {(m, w) for (m, w, _) in by_cell}:
        means = {lr: sum(_score(r) for r in runs) / len(runs) for (m, w, lr), runs in by_cell.items() if (m, w) == key}
        grid = tuple(sorted(means))
        best_lr = max(grid, key=lambda lr: (means[lr], -lr))
        near = [lr for lr in grid if means[lr] >= means[best_lr] - 1.0]
        out[key] = Robustness(means.get(seq_lr) if seq_lr is not None else None, means[best_lr], best_lr,
                              min(near), max(near), grid)
    return out


def robustness_table(results: Sequence[Result]) -> str:
    """Per method and worker count: validation accuracy at the sequential learning rate, the best,
    and the learning-rate range within 1 point of the best (ratio of its ends; grid points only)."""
    rob = robustness(results)
    seq_runs = picked(results).get(("sequential", 1))
    seq_lr = f"{seq_runs[0]['lr']:g}" if seq_runs else "-"
    rows = [
        f"| method | workers | val. acc. at sequential's lr ({seq_lr}) | best val. acc. | at lr "
        "| lr range within 1 point | width (x) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in _ordered(rob):
        r = rob[key]
        at_seq = "-" if r.at_sequential_lr is None else f"{r.at_sequential_lr:.2f}"
        edge = " (grid edge)" if r.at_edge else ""
        rows.append(
            f"| {key[0]} | {key[1]} | {at_seq} | {r.best:.2f} | {r.best_lr:g}{edge} | "
            f"{r.range_lo:g}-{r.range_hi:g} | {r.width:g} |"
        )
    return "\n".join(rows)


def cells_table(results: Sequence[Result]) -> str:
    """Every (method, workers, lr) cell over its seeds."""
    rows = [
        "| method | workers | lr | lr used | seeds | val. acc. | test acc. [95% interval] | min-max | flags |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    by_cell = cells(results)
    for key in _ordered(by_cell):
        runs = by_cell[key]
        stat = test_stat(runs)
        val = sum(r["val_accuracy"] for r in runs) / len(runs)
        rows.append(
            f"| {key[0]} | {key[1]} | {key[2]:g} | {runs[0]['effective_lr']:g} | {len(runs)} | {val:.2f} | {stat} | "
            f"{stat.min:.1f}-{stat.max:.1f} | {_flags(runs)} |"
        )
    return "\n".join(rows)


def table(results: Sequence[Result]) -> str:
    """A markdown table of every run (one row per seed)."""
    rows = [
        "| method | workers | lr | seed | val. acc. | test acc. | test loss | orthogonality | steps | time (s) "
        "| flags |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in sorted(results, key=lambda r: (r["workers"], _method_order(r["method"]), r["lr"], r["seed"])):
        last_o = r["history"][-1].get("orthogonality") if r["history"] else None
        o = "-" if last_o is None else f"{last_o:.3f}"
        rows.append(
            f"| {r['method']} | {r['workers']} | {r['lr']:g} | {r['seed']} | {r['val_accuracy']:.2f} | "
            f"{r['test_accuracy']:.2f} | {r['test_loss']:.4f} | {o} | {r['steps']} | {r['wall_s']:.1f} | "
            f"{_flags([r])} |"
        )
    return "\n".join(rows)


def write_report(results: Sequence[Result], out: Path, title: str = "Comparison") -> Path:
    """Write ``out/report.md`` (the tables and the plots) and return its path."""
    first = results[0] if results else {}
    seeds = sorted({r["seed"] for r in results})
    setting = (
        f"Task `{first.get('task')}`, model `{first.get('model')}`, optimizer `{first.get('optimizer')}` "
        f"(momentum {first.get('momentum')}), {first.get('batch_size')} examples per worker per step, "
        f"{first.get('epochs')} epochs, seeds {', '.join(map(str, seeds))}. Accuracy in percent after the last "
        "epoch. The learning rate of each method and worker count is picked on the mean validation accuracy "
        "(a split held out of the training data); test accuracy is reported for that learning rate only: "
        "mean over seeds [95% interval]. 'better'/'worse' only where the 95% intervals do not overlap. "
        "'lr' is the base learning rate, 'lr used' what the optimizer got (x P for mean-scaled and adacons); "
        "'at chance' marks runs that ended at the accuracy of always predicting the most frequent class, "
        "or whose training loss never fell below that of predicting the class frequencies."
    )
    text = [
        f"# {title}", "", setting, "",
        "## Validated summary", "", summary_table(results), "",
        "## Learning-rate robustness (validation accuracy, mean over seeds)", "", robustness_table(results), "",
        "## Every cell", "", cells_table(results), "",
        "## Every run", "", table(results), "",
    ]
    plots = [p for p in ("lr.png", "accuracy.png", "loss.png", "orthogonality.png") if (out / p).exists()]
    if plots:
        text += ["## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots] + [""]
    path = out / "report.md"
    write_text_atomic(path, "\n".join(text))
    return path


def plot(results: Sequence[Result], out: Path) -> list[Path]:
    """Write the four PNG plots into `out` and return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = picked(results)
    by_cell = cells(results)
    ref = best.get(("sequential", 1))
    counts = sorted({w for (_, w) in best if w > 1}) or [1]
    names = sorted({m for (m, _) in best if m != "sequential"}, key=_method_order)
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(names)}
    written = []

    def panels(ylabel: str, filename: str, draw, xlabel: str = "epoch", logx: bool = False) -> None:
        fig, axes = plt.subplots(1, len(counts), figsize=(4.2 * len(counts), 3.4), squeeze=False, sharey=True)
        for ax, workers in zip(axes[0], counts):
            draw(ax, workers)
            ax.set_title(f"{workers} workers")
            ax.set_xlabel(xlabel)
            if logx:
                ax.set_xscale("log")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        legend: dict = {}  # every method of any panel (a panel may lack some: an unfinished sweep)
        for ax in axes[0]:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        if legend:
            axes[0][-1].legend(list(legend.values()), list(legend), fontsize=7, loc="best")
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)

    def mean_curve(runs: list[Result], key: str) -> tuple[list[int], list[float]]:
        length = min(len(r["history"]) for r in runs)
        epochs = [runs[0]["history"][i]["epoch"] for i in range(length)]
        return epochs, [sum(r["history"][i][key] for r in runs) / len(runs) for i in range(length)]

    def history_lines(key: str):
        def draw(ax, workers):
            if ref is not None:
                ax.plot(*mean_curve(ref, key), "k--", label=f"sequential (lr {ref[0]['lr']:g})")
            for m in names:
                runs = best.get((m, workers))
                if runs is not None:
                    ax.plot(*mean_curve(runs, key), marker=".", color=colors[m], label=f"{m} (lr {runs[0]['lr']:g})")

        return draw

    panels("test accuracy (%), mean over seeds", "accuracy.png", history_lines("test_accuracy"))
    panels("test loss, mean over seeds", "loss.png", history_lines("test_loss"))

    def draw_orthogonality(ax, workers):
        for m in names:
            runs = best.get((m, workers))
            if runs is not None and runs[0]["orthogonality_trace"]:
                xs, ys = zip(*runs[0]["orthogonality_trace"])
                ax.plot(xs, ys, color=colors[m], lw=0.8, label=m)
        ax.axhline(1.0, color="grey", ls=":", lw=0.8)
        ax.axhline(1.0 / workers, color="grey", ls=":", lw=0.8)
        ax.set_yscale("log")

    panels("orthogonality  sum|g_i|² / |sum g_i|²", "orthogonality.png", draw_orthogonality)

    def lr_line(ax, method: str, workers: int, **style) -> None:
        lrs = sorted(lr for (m, w, lr) in by_cell if (m, w) == (method, workers))
        if not lrs:
            return
        scores = [[_score(r) for r in by_cell[(method, workers, lr)]] for lr in lrs]
        means = [sum(s) / len(s) for s in scores]
        errs = [[m - min(s) for m, s in zip(means, scores)], [max(s) - m for m, s in zip(means, scores)]]
        ax.errorbar(lrs, means, yerr=errs, capsize=2, marker=".", **style)

    def draw_lr(ax, workers):
        lr_line(ax, "sequential", 1, color="k", ls="--", label="sequential")
        for m in names:
            lr_line(ax, m, workers, color=colors[m], label=m)

    panels("val. accuracy (%), min-max", "lr.png", draw_lr, xlabel="base learning rate",
           logx=True)
    return written
