"""Tables and plots from a sweep's results (the dicts that `runner.train` returns).

``report.md``: one row per run, plus the best learning rate per method and worker count.
``accuracy.png`` / ``loss.png``: test accuracy / loss against epoch, one line per method (its best
learning rate), one panel per worker count, the sequential run dashed in every panel.
``orthogonality.png``: the orthogonality diagnostic over training, same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adasum.experiments.methods import METHODS

Result = dict[str, Any]


def _method_order(name: str) -> int:
    names = list(METHODS)
    return names.index(name) if name in names else len(names)


def best_runs(results: Sequence[Result]) -> dict[tuple[str, int], Result]:
    """The run with the highest final test accuracy per (method, workers); diverged runs last."""
    best: dict[tuple[str, int], Result] = {}
    for r in results:
        key = (r["method"], r["workers"])
        score = (not r["diverged"], r["test_accuracy"])
        if key not in best or score > (not best[key]["diverged"], best[key]["test_accuracy"]):
            best[key] = r
    return best


def sequential_reference(results: Sequence[Result]) -> Result | None:
    """The best sequential run, the reference the others are measured against."""
    return best_runs(results).get(("sequential", 1))


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: Sequence[Result]) -> str:
    """A markdown table of all runs, sorted by workers, method and learning rate."""
    ref = sequential_reference(results)
    rows = [
        "| method | workers | lr | lr used | test acc. (%) | vs sequential | test loss | best acc. (%) "
        "| orthogonality | steps | time (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(results, key=lambda r: (r["workers"], _method_order(r["method"]), r["lr"])):
        delta = "-" if ref is None or r is ref else f"{r['test_accuracy'] - ref['test_accuracy']:+.2f}"
        last_o = r["history"][-1].get("orthogonality") if r["history"] else None
        acc = _fmt(r["test_accuracy"]) + (" (diverged)" if r["diverged"] else "")
        rows.append(
            f"| {r['method']} | {r['workers']} | {r['lr']:g} | {r['effective_lr']:g} | {acc} | {delta} | "
            f"{_fmt(r['test_loss'], 4)} | {_fmt(r['best_test_accuracy'])} | {_fmt(last_o, 3)} | {r['steps']} "
            f"| {r['wall_s']:.1f} |"
        )
    return "\n".join(rows)


def best_table(results: Sequence[Result]) -> str:
    """A markdown table of the best learning rate per method and worker count."""
    ref = sequential_reference(results)
    rows = ["| method | workers | best lr | test acc. (%) | vs sequential |", "| --- | ---: | ---: | ---: | ---: |"]
    for (name, workers), r in sorted(best_runs(results).items(), key=lambda kv: (kv[0][1], _method_order(kv[0][0]))):
        delta = "-" if ref is None or r is ref else f"{r['test_accuracy'] - ref['test_accuracy']:+.2f}"
        acc = _fmt(r["test_accuracy"]) + (" (diverged)" if r["diverged"] else "")
        rows.append(f"| {name} | {workers} | {r['lr']:g} | {acc} | {delta} |")
    return "\n".join(rows)


def write_report(results: Sequence[Result], out: Path, title: str = "Comparison") -> Path:
    """Write ``out/report.md`` (both tables and the plots) and return its path."""
    first = results[0] if results else {}
    setting = (
        f"Task `{first.get('task')}`, model `{first.get('model')}`, optimizer `{first.get('optimizer')}` "
        f"(momentum {first.get('momentum')}), {first.get('batch_size')} examples per worker per step, "
        f"{first.get('epochs')} epochs, seed {first.get('seed')}. Accuracy in percent on the test set after the "
        "last epoch; 'vs sequential' is in points against the best sequential run; 'lr' is the base "
        "learning rate, 'lr used' what the optimizer got (x P for mean-scaled); orthogonality is the "
        "mean over the last epoch's steps of sum_i |g_i|^2 / |sum_i g_i|^2 (1/P parallel, 1 orthogonal)."
    )
    text = [
        f"# {title}",
        "",
        setting,
        "",
        "## Best learning rate per method",
        "",
        best_table(results),
        "",
        "## All runs",
        "",
        table(results),
        "",
    ]
    plots = [p for p in ("accuracy.png", "loss.png", "orthogonality.png") if (out / p).exists()]
    if plots:
        text += ["## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots] + [""]
    path = out / "report.md"
    path.write_text("\n".join(text))
    return path


def plot(results: Sequence[Result], out: Path) -> list[Path]:
    """Write the three PNG plots into `out` and return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_runs(results)
    ref = best.get(("sequential", 1))
    counts = sorted({w for (_, w) in best if w > 1}) or [1]
    names = sorted({m for (m, _) in best if m != "sequential"}, key=_method_order)
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(names)}
    written = []

    def panels(ylabel: str, filename: str, draw) -> None:
        fig, axes = plt.subplots(1, len(counts), figsize=(4.2 * len(counts), 3.4), squeeze=False, sharey=True)
        for ax, workers in zip(axes[0], counts):
            draw(ax, workers)
            ax.set_title(f"{workers} workers")
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)

    def history_lines(key: str):
        def draw(ax, workers):
            if ref is not None:
                h = ref["history"]
                ax.plot([e["epoch"] for e in h], [e[key] for e in h], "k--", label=f"sequential (lr {ref['lr']:g})")
            for m in names:
                r = best.get((m, workers))
                if r is not None:
                    h = r["history"]
                    ax.plot(
                        [e["epoch"] for e in h],
                        [e[key] for e in h],
                        marker=".",
                        color=colors[m],
                        label=f"{m} (lr {r['lr']:g})",
                    )

        return draw

    panels("test accuracy (%)", "accuracy.png", history_lines("test_accuracy"))
    panels("test loss", "loss.png", history_lines("test_loss"))

    def draw_orthogonality(ax, workers):
        for m in names:
            r = best.get((m, workers))
            if r is not None and r["orthogonality_trace"]:
                xs, ys = zip(*r["orthogonality_trace"])
                ax.plot(xs, ys, color=colors[m], lw=0.8, label=m)
        ax.axhline(1.0, color="grey", ls=":", lw=0.8)
        ax.axhline(1.0 / workers, color="grey", ls=":", lw=0.8)
        ax.set_yscale("log")

    panels("orthogonality  sum|g_i|² / |sum g_i|²", "orthogonality.png", draw_orthogonality)
    return written
