r"""Tables, verdicts and plots from a sweep's results (the dicts that `runner.train` returns), over seeds.

Selection and reporting are kept apart: for each method and worker count the learning rate is
picked on the mean **validation** accuracy over seeds (a diverged run scores 0); only then is the
**test** accuracy of that learning rate reported.

A run **failed** when it diverged, ended at chance (the runner's flag), or its validation accuracy ended
below the midpoint between chance and the best run of its cell (method, workers, learning rate), or its
test accuracy below a threshold the caller sets instead (`fail_below`). Rows say "k/n failed"; their
mean, 95% Student-t interval (clipped to [0, 100]) and range are over the runs that did not fail.

Two methods are compared **seed by seed** (runs of one seed share data order and initialisation):
the mean paired difference over the seeds where neither run failed, its 95% t-interval, and a
p-value that `stats.holm` adjusts over every comparison the report makes. "better" / "worse" only
where the adjusted p-value is below 0.05; verdicts on fewer than 5 seeds say so.

``report.md``: the summary with its footnote and conclusion, the learning-rate robustness table
(when more than one rate was run), every cell, every run.
``accuracy.png`` / ``loss.png``: test accuracy / loss against epoch (mean over seeds, a band from the
lowest to the highest seed), one line per method at its picked learning rate, one panel per worker count,
sequential dashed.
``orthogonality.png``: the orthogonality diagnostic over training (first seed), same layout.
``lr.png`` (more than one rate): validation accuracy against learning rate (log x, mean and min-max
over seeds), one panel per worker count.
``curves.png`` and ``steps-to-target.png`` (runs made with ``--evals-per-epoch``): validation accuracy
against epochs with a band over seeds and failed runs apart, and steps to a target against the global
batch (`adasum.experiments.figures`). Every figure at 150 dpi.

>>> results = load_results(["runs/a/results.jsonl", "runs/b/results.jsonl.gz"])  # doctest: +SKIP
>>> write_report(results, Path("runs/report"))  # doctest: +SKIP

Four short simulated runs on a toy task (two methods, two seeds) as one sweep's ``results.jsonl`` in a
temporary folder, read back and reported:

>>> import tempfile
>>> from adasum.experiments.data import Dataset
>>> from adasum.experiments.runner import RunConfig, train
>>> x = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
>>> toy = Dataset("toy", x[:160], (x[:160, 0] > 0).long(), x[160:], (x[160:, 0] > 0).long(), 2, "mlp")
>>> runs = [train(RunConfig(task="toy", method=m, workers=w, lr=0.1, epochs=1, batch_size=8, seed=s), dataset=toy)
...         for m, w in [("sequential", 1), ("adasum", 4)] for s in (0, 1)]
>>> folder = tempfile.TemporaryDirectory()
>>> _ = Path(folder.name, "results.jsonl").write_text("".join(json.dumps(run) + "\n" for run in runs))
>>> results = load_results([folder.name])             # a sweep folder: its results.jsonl
>>> [(r["method"], r["workers"], r["seed"]) for r in results]
[('sequential', 1, 0), ('sequential', 1, 1), ('adasum', 4, 0), ('adasum', 4, 1)]
>>> report = write_report(results, Path(folder.name))
>>> [line for line in report.read_text().splitlines() if line.startswith("## ")]
['## Summary', '## Every cell', '## Every run']
>>> folder.cleanup()
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, TextIO

from adasum.experiments.io import read_jsonl, write_text_atomic
from adasum.experiments.methods import METHODS
from adasum.experiments.runner import differences
from adasum.experiments.stats import ALPHA, FEW_SEEDS, Paired, Stat, failure_p, holm

Result = dict[str, Any]
Key = tuple[str, int]  # (method, workers)
DPI = 150  # every figure

# --- reading: one-line messages for malformed rows, one setting per report ---------------------

_NUMBER = (int, float)
_FIELDS: Mapping[str, tuple[type, ...]] = MappingProxyType({
    "method": (str,), "workers": (int,), "lr": _NUMBER, "effective_lr": _NUMBER, "seed": (int,),
    "val_accuracy": _NUMBER + (type(None),), "test_accuracy": _NUMBER, "test_loss": _NUMBER,
    "diverged": (bool,), "collapsed": (bool,), "steps": (int,), "wall_s": _NUMBER, "epochs": (int,),
    "history": (list,), "orthogonality_trace": (list,), "config": (dict,),
})
"""The fields every row of `adasum compare` has, and their JSON types (a NaN loss is a float)."""
_EPOCH_FIELDS = ("epoch", "test_accuracy", "test_loss")
_METHOD_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
"""What a method name may hold (every name `adasum compare` writes): nothing a markdown table would take apart."""
MOST = MappingProxyType({"workers": 64, "method": 64, "lr": 64})
"""The most distinct worker counts, methods and learning rates a report takes (each is a panel, a row or a line of
its figures): a hostile file with thousands of them is refused in one line rather than drawn for minutes."""
_AXES = MappingProxyType({"method": None, "workers": None, "lr": None, "seed": None})  # what varies within one sweep


def check_row(row: Any, where: str) -> None:
    """ValueError, in one line naming `where`, unless `row` has every field of a run and their types."""
    if not isinstance(row, dict):
        raise ValueError(
            f"{where}: not a JSON object but {type(row).__name__}; pass results files as adasum compare wrote them"
        )
    missing = [k for k in _FIELDS if k not in row]
    if missing:
        raise ValueError(
            f"{where}: lacks {', '.join(missing)} (not a row of `adasum compare`, or an older one); leave that file "
            "out, or run the sweep again with this adasum compare"
        )
    for key, types in _FIELDS.items():
        value = row[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(
                f"{where}: {key} is {_short(value)}, not {' or '.join(t.__name__ for t in types)}; "
                "pass results files as adasum compare wrote them"
            )
    if not _METHOD_NAME.fullmatch(row["method"]):
        raise ValueError(
            f"{where}: method is {_short(row['method'])}, not a method name (letters, digits, _ . + -); "
            "pass results files as adasum compare wrote them"
        )
    for epoch in row["history"]:
        if not isinstance(epoch, dict) or any(k not in epoch for k in _EPOCH_FIELDS):
            raise ValueError(
                f"{where}: an epoch of its history lacks one of {', '.join(_EPOCH_FIELDS)}; "
                "pass results files as adasum compare wrote them"
            )


def _short(value: Any) -> str:
    """`value`'s repr, cut to 60 characters (one line whatever a hostile file holds)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def setting_differences(a: Result, b: Result) -> list[str]:
    """``"key a -> b"`` for every field but method, workers, lr and seed in which the two runs' settings
    differ (the check `compare --resume` makes, plus the number of epochs)."""
    diff = differences({**a["config"], **_AXES}, {**b["config"], **_AXES})
    if a.get("epochs") != b.get("epochs"):
        diff.append(f"epochs {a.get('epochs')!r} -> {b.get('epochs')!r}")
    return diff


def check_one_setting(results: Sequence[Result], sources: Sequence[str] | None = None) -> None:
    """ValueError naming the differences if the runs were made with more than one setting (task, data,
    batch size, optimizer, epochs, ...): their comparisons would not mean anything."""
    for i, row in enumerate(results):
        diff = setting_differences(results[0], row)
        if diff:
            first, other = (sources[0], sources[i]) if sources else ("the first run", f"run {i + 1}")
            raise ValueError(
                f"{other} was made with another setting than {first} ({', '.join(diff)}); "
                "report each setting on its own"
            )


def _read(paths: Sequence[str | Path]) -> tuple[list[Result], list[str]]:
    rows: list[Result] = []
    where: list[str] = []
    for name in paths:
        path = Path(name) / "results.jsonl" if Path(name).is_dir() else Path(name)
        if not path.is_file():
            raise ValueError(
                f"no results file {str(path)!r}; pass a results.jsonl or the --out folder of adasum compare"
            )
        for number, row in enumerate(read_jsonl(path), 1):
            check_row(row, f"{path}: row {number}")
            rows.append(row)
            where.append(f"{path}: row {number}")
    if not rows:
        raise ValueError("the results files hold no runs; run adasum compare first, or pass the files it wrote")
    return rows, where


def read_rows(paths: Sequence[str | Path]) -> list[Result]:
    """Every row of the ``results.jsonl[.gz]`` files (or sweep folders) in `paths`, each checked as
    `load_results` checks it (a one-line ValueError), but of any settings and not deduplicated: the rows
    of a study's pilot and confirmation, say."""
    return _read(paths)[0]


def load_results(paths: Sequence[str | Path]) -> list[Result]:
    """The runs of the ``results.jsonl[.gz]`` files (or sweep folders) in `paths`, a run found twice
    counted once. A malformed row, runs of different settings (checked over every row, before a run found twice is
    counted once: two sweeps that differ in their epochs are refused, not merged), or more distinct worker counts,
    methods or learning rates than a report takes (`MOST`) end in a one-line ValueError."""
    rows, where = _read(paths)
    check_one_setting(rows, where)
    for field, most in MOST.items():
        distinct = {row[field] for row in rows}
        if len(distinct) > most:
            raise ValueError(f"the results hold {len(distinct)} distinct values of {field}; a report takes at most "
                             f"{most} (one panel, row or line each): report fewer at a time")
    results: dict[str, Result] = {}
    for row in rows:
        key = json.dumps([row["method"], row["workers"], row["lr"], row["seed"], row["epochs"], row["config"]],
                         sort_keys=True)
        results.setdefault(key, row)
    return list(results.values())


# --- cells, selection, failures ---------------------------------------------------------------


def _method_order(name: str) -> int:
    names = list(METHODS)
    return names.index(name) if name in names else len(names)


def _ordered(keys):
    return sorted(keys, key=lambda k: (k[1], _method_order(k[0]), k[0]) + tuple(k[2:]))


def _score(r: Result) -> float:
    """Validation accuracy for selection; a diverged run scores 0."""
    return 0.0 if r["diverged"] or r.get("val_accuracy") is None else float(r["val_accuracy"])


def cells(results: Sequence[Result]) -> dict[tuple[str, int, float], list[Result]]:
    """Runs by (method, workers, lr), seeds together."""
    out: dict[tuple[str, int, float], list[Result]] = {}
    for r in results:
        out.setdefault((r["method"], r["workers"], r["lr"]), []).append(r)
    return out


def picked(results: Sequence[Result]) -> dict[Key, list[Result]]:
    """Per (method, workers): the runs (one per seed) of the learning rate with the highest mean
    validation accuracy over seeds (ties: the smaller learning rate)."""
    best: dict[Key, tuple[float, float, list[Result]]] = {}
    for (method, workers, lr), runs in cells(results).items():
        score = sum(_score(r) for r in runs) / len(runs)
        key = (method, workers)
        if key not in best or (score, -lr) > (best[key][0], -best[key][1]):
            best[key] = (score, lr, runs)
    return {key: runs for key, (_, _, runs) in best.items()}


def _several_rates(results: Sequence[Result]) -> bool:
    """More than one learning rate for some method and worker count (else no robustness views)."""
    return len(cells(results)) > len({(r["method"], r["workers"]) for r in results})


def failures(results: Sequence[Result], fail_below: float | None = None) -> dict[int, str]:
    """Why each failed run failed, by ``id(run)``: "diverged", "at chance" (the runner's flags), or
    "near chance": **validation** accuracy below the midpoint between chance (the validation set's
    majority share) and the best run of its cell (test accuracy below `fail_below` percent instead, where
    given: a threshold the caller fixed beforehand). Judged on validation, the failures a report counts
    are not picked with the test set it reports."""
    out = {}

    def val(r: Result) -> float:
        v = r.get("val_accuracy")
        return float(v) if v is not None else float(r["test_accuracy"])

    for runs in cells(results).values():
        finite = [val(r) for r in runs if not r["diverged"] and math.isfinite(val(r))]
        best = max(finite, default=math.nan)
        for r in runs:
            chance = r.get("chance_accuracy")
            if r["diverged"] or not math.isfinite(r["test_accuracy"]):
                out[id(r)] = "diverged"
            elif r["collapsed"]:
                out[id(r)] = chance_reason(r)
            elif fail_below is not None and r["test_accuracy"] < fail_below:
                out[id(r)] = f"below {fail_below:g}%"
            elif fail_below is None and chance is not None and val(r) < (chance + best) / 2:
                out[id(r)] = "near chance"
    return out


LEARNING = 0.1
"""A run the runner flags as at chance but whose test accuracy is this fraction of the way from chance to 100 %
is "not learnt yet", not "at chance"."""


def plural(count: int, word: str) -> str:
    """``"1 epoch"``, ``"3 epochs"``.

    >>> plural(1, "epoch"), plural(2, "run")
    ('1 epoch', '2 runs')
    """
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def chance_reason(r: Result) -> str:
    """Why a run the runner flagged as at chance (``collapsed``) failed: "not learnt yet" where its test accuracy
    is clearly above chance (a `LEARNING` part of the way from chance to 100 %: the flag came from a training loss
    that had not yet fallen below guessing's over a run too short, not from a collapse), else "at chance".

    >>> row = {"chance_accuracy": 11.4, "test_accuracy": 21.8}
    >>> chance_reason(row), chance_reason({**row, "test_accuracy": 11.0})
    ('not learnt yet', 'at chance')
    """
    chance = r.get("chance_accuracy")
    if chance is not None and r.get("test_accuracy") is not None and (
            r["test_accuracy"] >= chance + LEARNING * (100.0 - chance)):
        return "not learnt yet"
    return "at chance"


def _failed_text(runs: Sequence[Result], failed: dict[int, str]) -> str:
    reasons = [failed[id(r)] for r in runs if id(r) in failed]
    text = f"{len(reasons)}/{len(runs)} failed"
    if reasons:
        text += " (" + ", ".join(f"{reasons.count(w)} {w}" for w in sorted(set(reasons))) + ")"
    return text


def _good(runs: Sequence[Result], failed: dict[int, str]) -> list[Result]:
    return [r for r in runs if id(r) not in failed]


def _stat_text(runs: Sequence[Result], failed: dict[int, str]) -> tuple[str, str]:
    """The test accuracy over the runs that did not fail: mean [95% interval], and min-max."""
    good = _good(runs, failed)
    if not good:
        return "-", "-"
    stat = Stat.of([r["test_accuracy"] for r in good])
    if stat.n < FEW_SEEDS:  # a t-interval over so few says little: the range and the count say more
        return f"{stat.mean:.2f} ({plural(stat.n, 'run')})", f"{stat.min:.1f}-{stat.max:.1f}"
    return str(stat), f"{stat.min:.1f}-{stat.max:.1f}"


# --- paired comparisons ------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """`method` against `against` at `workers` workers, seed by seed, over the seeds where neither
    run failed; `p_holm` is the p-value adjusted over the comparisons of one report."""

    method: str
    workers: int
    against: str
    diff: Paired
    failed: tuple[int, int]  # (failed, runs) of method
    against_failed: tuple[int, int]
    p_holm: float = math.nan
    failures_p: float = math.nan  # the exact sign test of the failure counts over the seeds both ran (unadjusted)

    @property
    def verdict(self) -> str:
        """"better", "worse", "no detectable difference" (Holm-corrected) or "no test"."""
        if math.isnan(self.p_holm):
            return "no test"
        if self.p_holm >= ALPHA:
            return "no detectable difference"
        return "better" if self.diff.mean > 0 else "worse"

    def cell(self) -> str:
        """The table cell: difference, verdict, interval, adjusted p, seeds, failures."""
        d = self.diff
        if d.n == 0:
            text = "-: no test (no seed where neither run failed)"
        elif math.isnan(self.p_holm):
            text = f"{d.mean:+.2f}: no test (1 seed where neither run failed)"
        elif d.n < FEW_SEEDS:  # the seeds themselves: a t-interval over so few says little
            text = (f"{d.mean:+.2f}: {self.verdict} (higher on {d.higher} of {d.n} seeds, {d.min:+.1f} to "
                    f"{d.max:+.1f}, Holm p {self.p_holm:.3g})")
        else:
            text = f"{d.mean:+.2f}: {self.verdict} ([{d.lo:+.1f}, {d.hi:+.1f}], Holm p {self.p_holm:.3g})"
        if self.failed[0] or self.against_failed[0]:
            text += f"; failed {self.failed[0]}/{self.failed[1]} vs {self.against_failed[0]}/{self.against_failed[1]}"
            if not math.isnan(self.failures_p):
                text += f" (exact sign test p {self.failures_p:.3g}, unadjusted)"
        return text

    def claim(self) -> str:
        """The comparison in words, for the conclusion."""
        d = self.diff
        where = f" at {self.workers} workers" if self.workers > 1 else ""
        spread = (f"(higher on {d.higher} of {d.n} seeds)" if d.n < FEW_SEEDS else
                  f"[{d.lo:+.1f}, {d.hi:+.1f}] on {d.n} seeds")
        return (f"{self.method}{where} {'above' if d.mean > 0 else 'below'} {_name(self.against)} by "
                f"{abs(d.mean):.2f} points {spread}")


def _name(method: str) -> str:
    return "sequential training" if method == "sequential" else method


def baseline(results: Sequence[Result]) -> str | None:
    """The averaging method every other is compared against: Horovod's scaled mean, else the mean."""
    methods = {r["method"] for r in results}
    return next((m for m in ("mean-scaled", "mean") if m in methods), None)


def _references(key: Key, best: dict[Key, list[Result]], base: str | None) -> list[Key]:
    method, workers = key
    refs = []
    if method != "sequential" and ("sequential", 1) in best:
        refs.append(("sequential", 1))
    if base is not None and method not in (base, "sequential") and (base, workers) in best:
        refs.append((base, workers))
    return refs


def _compare(key: Key, runs: list[Result], ref: Key, ref_runs: list[Result], failed: dict[int, str]) -> Comparison:
    by_seed = {r["seed"]: r for r in ref_runs}
    pairs = [(r, by_seed[r["seed"]]) for r in runs
             if r["seed"] in by_seed and id(r) not in failed and id(by_seed[r["seed"]]) not in failed]
    diff = Paired.of([a["test_accuracy"] for a, _ in pairs], [b["test_accuracy"] for _, b in pairs])
    count = lambda rs: (sum(id(r) in failed for r in rs), len(rs))  # noqa: E731
    both = [(r, by_seed[r["seed"]]) for r in runs if r["seed"] in by_seed]
    failures_p = failure_p([id(a) in failed for a, _ in both], [id(b) in failed for _, b in both]) if both else math.nan
    return Comparison(key[0], key[1], ref[0], diff, count(runs), count(ref_runs), failures_p=failures_p)


def comparisons(results: Sequence[Result], fail_below: float | None = None) -> list[Comparison]:
    """Every comparison of the summary, in its order (each method against sequential training and
    against the averaging baseline at its worker count), with Holm's correction over them."""
    best = picked(results)
    failed = failures(results, fail_below)
    base = baseline(results)
    found = [_compare(key, best[key], ref, best[ref], failed)
             for key in _ordered(best) for ref in _references(key, best, base)]
    return adjust(found)


def pair(results: Sequence[Result], key: Key, against: Key, fail_below: float | None = None) -> Comparison:
    """One comparison the summary does not make (say SlowMo against local SGD), not yet adjusted:
    pass it to `adjust` with the others of its family."""
    best = picked(results)
    return _compare(key, best[key], against, best[against], failures(results, fail_below))


def adjust(found: Sequence[Comparison]) -> list[Comparison]:
    """The comparisons with their p-values adjusted together (Holm): one family, however many reports."""
    return [replace(c, p_holm=p) for c, p in zip(found, holm([c.diff.p for c in found]))]


# --- tables ------------------------------------------------------------------------------------


def _lookup(found: Sequence[Comparison]) -> dict[tuple[str, int, str], Comparison]:
    return {(c.method, c.workers, c.against): c for c in found}


def summary_rows(results: Sequence[Result], found: Sequence[Comparison], fail_below: float | None = None) -> str:
    """The summary table alone: per method and worker count, the learning rate picked on validation,
    its test accuracy over the runs that did not fail, and the paired comparisons `found`."""
    best = picked(results)
    failed = failures(results, fail_below)
    base = baseline(results)
    by_key = _lookup(found)
    lr_head = "lr (picked on val.)" if _several_rates(results) else "lr"
    rows = [
        f"| method | workers | {lr_head} | seeds | val. acc. | test acc. [95% interval] | min-max | failed "
        f"| vs sequential | vs {base or 'averaging'} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for key in _ordered(best):
        runs = best[key]
        acc, span = _stat_text(runs, failed)
        val = sum(_score(r) for r in runs) / len(runs)
        vs = [by_key.get((*key, ref)) for ref in ("sequential", base)]
        rows.append(
            f"| {key[0]} | {key[1]} | {runs[0]['lr']:g} | {len(runs)} | {val:.2f} | {acc} | {span} | "
            f"{_failed_text(runs, failed)} | {vs[0].cell() if vs[0] else '-'} | {vs[1].cell() if vs[1] else '-'} |"
        )
    return "\n".join(rows)


def footnote(results: Sequence[Result], found: Sequence[Comparison], fail_below: float | None = None) -> str:
    """What each column of the summary means, and the rules behind its verdicts."""
    rule = (f"its test accuracy was below {fail_below:g}%" if fail_below is not None else
            "its validation accuracy was below the midpoint between chance and the best run of its cell")
    tested = sum(not math.isnan(c.p_holm) for c in found)
    lr = ("the base learning rate, picked per method and worker count on the mean validation accuracy "
          "over seeds (a diverged run scores 0)") if _several_rates(results) else "the base learning rate"
    base = baseline(results) or "averaging"
    return "\n".join([
        "Columns:",
        "- *method*: how the workers' updates are combined (sequential: one worker; mean-scaled: Horovod's "
        "mean with lr x P); *workers*: simulated workers P; *seeds*: runs of the cell, one per seed",
        f"- *lr*: {lr}",
        "- *val. acc.*: mean validation accuracy (%) over all its runs",
        "- *test acc.*: mean test accuracy (%) over the runs that did not fail, with its 95% Student-t "
        f"interval over them, clipped to [0, 100] (over fewer than {FEW_SEEDS} runs no interval, which would say "
        "little: the count of runs); *min-max*: their range",
        "- *failed*: runs that diverged (a NaN/Inf loss, or one far above guessing's), ended at chance (the "
        "accuracy of always predicting the most frequent class, or a training loss that never fell below "
        "guessing's), were not learnt yet (flagged at chance, but a tenth of the way from chance to 100 % or more: "
        f"still learning when they stopped), or ended near chance ({rule})",
        f"- *vs sequential*, *vs {base}*: the mean paired difference in test accuracy points, seed by seed over "
        "the seeds where neither run failed; the verdict; the difference's 95% t-interval (clipped to "
        f"[-100, +100]; over fewer than {FEW_SEEDS} seeds instead the seeds on which the method is higher and "
        "the range of the differences; the interval is not adjusted, so a verdict of no detectable difference "
        "can stand beside an interval that excludes 0); its p-value (the exact sign-flip test up to 20 seeds, "
        "which never gives 0; the t-test beyond) after "
        f"Holm's correction over the {plural(tested, 'tested comparison')} of this table. "
        f"'better' / 'worse' only where that p-value is below {ALPHA:g} (with fewer than {FEW_SEEDS} seeds a "
        "real difference is often missed)",
    ])


def _tested_part(found: Sequence[Comparison]) -> str:
    tested = [c for c in found if not math.isnan(c.p_holm)]
    held = [c for c in tested if c.p_holm < ALPHA]
    if held:
        claims = "; ".join(c.claim() for c in held[:8]) + (f"; and {len(held) - 8} more" if len(held) > 8 else "")
        which = f"{len(held)} of the {len(tested)} paired comparisons show a difference" if len(tested) > 1 \
            else "the one paired comparison shows a difference"
        return f"{which} after Holm's correction: {claims}"
    if not tested:
        return "no comparison can be tested (fewer than 2 seeds where neither run failed)"
    top = max(tested, key=lambda c: abs(c.diff.mean))
    if len(tested) > 1:
        which, top_text = f"none of the {len(tested)} paired comparisons shows", f"the largest: {top.claim()}"
    else:
        which, top_text = "the one paired comparison shows no", top.claim()
    return f"{which} detectable difference after Holm's correction ({top_text}, adjusted p {top.p_holm:.3g})"


def _failed_part(results: Sequence[Result], fail_below: float | None) -> str:
    best = picked(results)
    failed = failures(results, fail_below)
    counts = [(key, sum(id(r) in failed for r in best[key]), len(best[key])) for key in _ordered(best)]
    bad = [f"{m}{f' at {w} workers' if w > 1 else ''} failed in {k} of {n} runs" for (m, w), k, n in counts if k]
    if not bad:
        picked_ids = {id(r) for runs in best.values() for r in runs}
        elsewhere = [r for r in results if id(r) not in picked_ids]
        others = sum(id(r) in failed for r in elsewhere)
        if others:
            return (f"no run at the picked learning rates failed ({others} of the {len(elsewhere)} runs at other "
                    "rates did)")
        return "no run failed"
    return ", ".join(bad) + (" and every other row in none" if len(bad) < len(counts) else "")


def conclusion(results: Sequence[Result], found: Sequence[Comparison], fail_below: float | None = None) -> str:
    """The summary's finding in one sentence, from its numbers: failures first, then what the paired
    comparisons of the runs that did not fail show after Holm's correction."""
    seeds = len({r["seed"] for r in results})
    lead = f"With {plural(seeds, 'seed')}" + (
        f" (fewer than {FEW_SEEDS}: read it as a pilot)" if seeds < FEW_SEEDS else "")
    failed = _failed_part(results, fail_below)
    among = "; among the runs that did not fail, " if failed != "no run failed" else ", and "
    return f"{lead}: {failed}{among}{_tested_part(found)}."


def summary_table(results: Sequence[Result], fail_below: float | None = None) -> str:
    """The summary (`summary_rows`), its footnote and its conclusion, with Holm's correction over the
    comparisons of this summary."""
    found = comparisons(results, fail_below)
    return "\n\n".join([summary_rows(results, found, fail_below), footnote(results, found, fail_below),
                        "**Conclusion.** " + conclusion(results, found, fail_below)])


@dataclass(frozen=True)
class Robustness:
    """How a method's validation accuracy depends on the learning rate (means over seeds), measured against the
    best method's best at its worker count (`reference`): a method equally bad at every rate has no rate near it,
    so a flat curve far below the best does not pass for a robust one."""

    at_sequential_lr: float | None  # at the learning rate picked for sequential training
    best: float
    best_lr: float
    reference: float  # the best validation accuracy of any method at this worker count
    range_lo: float | None  # the smallest and largest grid learning rate within 1 point of `reference` (None: none)
    range_hi: float | None
    grid: tuple[float, ...]

    @property
    def width(self) -> float | None:
        """range_hi / range_lo (1: one grid point is within 1 point of the reference; None: none is)."""
        if self.range_lo is None or self.range_hi is None:
            return None
        return self.range_hi / self.range_lo

    @property
    def at_edge(self) -> bool:
        """The best learning rate is the smallest or largest of the grid (the grid may be too narrow)."""
        return len(self.grid) > 1 and self.best_lr in (self.grid[0], self.grid[-1])


def robustness(results: Sequence[Result]) -> dict[Key, Robustness]:
    """Per (method, workers) cell: how its validation accuracy depends on the learning rate, against the best
    method's best at the same worker count."""
    by_cell = cells(results)
    seq_runs = picked(results).get(("sequential", 1))
    seq_lr = seq_runs[0]["lr"] if seq_runs else None
    means = {}
    for key in {(m, w) for (m, w, _) in by_cell}:
        means[key] = {lr: sum(_score(r) for r in runs) / len(runs)
                      for (m, w, lr), runs in by_cell.items() if (m, w) == key}
    reference = {w: max(max(rates.values()) for (_, w2), rates in means.items() if w2 == w) for (_, w) in means}
    out = {}
    for key, rates in means.items():
        grid = tuple(sorted(rates))
        best_lr = max(grid, key=lambda lr: (rates[lr], -lr))
        near = [lr for lr in grid if rates[lr] >= reference[key[1]] - 1.0]
        out[key] = Robustness(rates.get(seq_lr) if seq_lr is not None else None, rates[best_lr], best_lr,
                              reference[key[1]], min(near, default=None), max(near, default=None), grid)
    return out


def robustness_table(results: Sequence[Result]) -> str:
    """Per method and worker count: validation accuracy at the sequential learning rate, the best, the best of
    any method at that worker count, and the learning-rate range within 1 point of that (ratio of its ends;
    grid points only; "none" where no rate comes within 1 point)."""
    rob = robustness(results)
    seq_runs = picked(results).get(("sequential", 1))
    seq_lr = f"{seq_runs[0]['lr']:g}" if seq_runs else "-"
    rows = [
        f"| method | workers | val. acc. at sequential's lr ({seq_lr}) | best val. acc. | at lr "
        "| best of any method at these workers | lr range within 1 point of it | width (x) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in _ordered(rob):
        r = rob[key]
        at_seq = "-" if r.at_sequential_lr is None else f"{r.at_sequential_lr:.2f}"
        edge = " (grid edge)" if r.at_edge else ""
        span = "none" if r.width is None else f"{r.range_lo:g}" if r.width == 1 else f"{r.range_lo:g}-{r.range_hi:g}"
        width = "-" if r.width is None else f"{r.width:g}"
        rows.append(
            f"| {key[0]} | {key[1]} | {at_seq} | {r.best:.2f} | {r.best_lr:g}{edge} | {r.reference:.2f} | "
            f"{span} | {width} |"
        )
    return "\n".join(rows)


def cells_table(results: Sequence[Result], fail_below: float | None = None) -> str:
    """Every (method, workers, lr) cell over its seeds (test accuracy over the runs that did not fail)."""
    failed = failures(results, fail_below)
    rows = [
        "| method | workers | lr | lr used | seeds | val. acc. | test acc. [95% interval] | min-max | failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    by_cell = cells(results)
    for key in _ordered(by_cell):
        runs = by_cell[key]
        acc, span = _stat_text(runs, failed)
        val = sum(_score(r) for r in runs) / len(runs)
        rows.append(
            f"| {key[0]} | {key[1]} | {key[2]:g} | {runs[0]['effective_lr']:g} | {len(runs)} | {val:.2f} | {acc} | "
            f"{span} | {_failed_text(runs, failed)} |"
        )
    return "\n".join(rows)


def table(results: Sequence[Result], fail_below: float | None = None) -> str:
    """A markdown table of every run (one row per seed)."""
    failed = failures(results, fail_below)
    rows = [
        "| method | workers | lr | seed | val. acc. | test acc. | test loss | orthogonality | steps | time (s) "
        "| failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in sorted(results, key=lambda r: (r["workers"], _method_order(r["method"]), r["lr"], r["seed"])):
        last_o = r["history"][-1].get("orthogonality") if r["history"] else None
        o = "-" if last_o is None else f"{last_o:.3f}"
        val = "-" if r["val_accuracy"] is None else f"{r['val_accuracy']:.2f}"
        rows.append(
            f"| {r['method']} | {r['workers']} | {r['lr']:g} | {r['seed']} | {val} | "
            f"{r['test_accuracy']:.2f} | {r['test_loss']:.4f} | {o} | {r['steps']} | {r['wall_s']:.1f} | "
            f"{failed.get(id(r), '')} |"
        )
    return "\n".join(rows)


def scores_table(results: Sequence[Result]) -> str:
    """A markdown table of the task's own scores (a row's ``scores``, e.g. english-word2vec's word similarity and
    analogy scores of the test metric) of every run that has them, one row per seed; empty when none has.

    >>> row = {"method": "adasum", "workers": 4, "lr": 0.003, "seed": 0, "scores": {"wordsim353": 51.25}}
    >>> print(scores_table([row]))
    | method | workers | lr | seed | wordsim353 |
    | --- | ---: | ---: | ---: | ---: |
    | adasum | 4 | 0.003 | 0 | 51.25 |
    """
    scored = [r for r in results if r.get("scores")]
    if not scored:
        return ""
    names = list(dict.fromkeys(name for r in scored for name in r["scores"]))
    rows = ["| method | workers | lr | seed | " + " | ".join(names) + " |",
            "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " |"]
    for r in sorted(scored, key=lambda r: (r["workers"], _method_order(r["method"]), r["lr"], r["seed"])):
        values = [r["scores"].get(name) for name in names]
        rows.append(f"| {r['method']} | {r['workers']} | {r['lr']:g} | {r['seed']} | "
                    + " | ".join("-" if v is None else f"{v:.2f}" for v in values) + " |")
    return "\n".join(rows)


def setting_line(results: Sequence[Result]) -> str:
    """The report's paragraph on the runs' setting (task, model, optimizer, batch, epochs, seeds) and how it reads
    them, from the first run's record and every run's seed."""
    first = results[0] if results else {}
    seeds = sorted({r["seed"] for r in results})
    few = f" ({len(seeds)}, fewer than {FEW_SEEDS}: verdicts say so)" if len(seeds) < FEW_SEEDS else ""
    momentum = first.get("momentum")  # None where the optimizer takes none (Adam, LAMB)
    momentum_note = f" (momentum {momentum})" if momentum is not None else ""
    return (
        f"Task `{first.get('task')}`, model `{first.get('model')}`, optimizer `{first.get('optimizer')}`"
        f"{momentum_note}, {first.get('batch_size')} examples per worker per step, "
        f"{plural(int(first.get('epochs') or 0), 'epoch')}, seeds {', '.join(map(str, seeds))}{few}. Accuracy in "
        "percent after the last epoch. Test accuracy is reported for the picked learning rate only; failed "
        "runs are counted apart and left out of the intervals; methods are compared seed by seed, with "
        "Holm's correction over the comparisons of the summary (see its footnote). 'lr' is the base "
        "learning rate, 'lr used' what the optimizer got (x P for mean-scaled and adacons)."
    )


def to_terminal(markdown: str, file: TextIO | None = None, terminal: bool | None = None) -> None:
    """Print `markdown` (a summary): on a terminal rendered by rich, its tables as tables that wrap inside their
    cells at the terminal's width; elsewhere (a pipe, a file, CI) as it is, the markdown of ``report.md``.
    `terminal` (default: whether `file` is one) decides."""
    out = file if file is not None else sys.stdout
    if terminal is None:
        terminal = bool(getattr(out, "isatty", lambda: False)())
    if not terminal:
        print(markdown, file=out)
        return
    from rich.console import Console
    from rich.markdown import Markdown

    Console(file=out, force_terminal=True).print(Markdown(markdown))


def write_report(results: Sequence[Result], out: Path, title: str = "Comparison",
                 fail_below: float | None = None) -> Path:
    """Write ``out/report.md`` (the tables and the plots) and return its path. Runs of more than one
    setting are refused (`check_one_setting`)."""
    check_one_setting(results)
    several = _several_rates(results)
    text = [f"# {title}", "", setting_line(results), "", "## Summary", "", summary_table(results, fail_below), ""]
    if several:
        text += ["## Learning-rate robustness (validation accuracy, mean over seeds)", "",
                 robustness_table(results), "",
                 "*lr range within 1 point of it*: the grid's learning rates at which the method comes within 1 "
                 "point of the best validation accuracy any method reaches at its worker count (none: at no rate; "
                 "a method equally poor at every rate has no range); *width*: the ratio of the range's ends.", ""]
    text += [
        "## Every cell", "", cells_table(results, fail_below), "",
        "## Every run", "", table(results, fail_below), "",
        "*orthogonality*: sum_i |g_i|² / |sum_i g_i|² of the workers' gradients at the last step: 1 when they "
        "are orthogonal (Adasum adds them), 1/P when they are identical (Adasum averages them). "
        "*failed*: why the run counts as failed (see the summary's footnote).", "",
    ]
    scores = scores_table(results)
    if scores:
        text += ["## Scores", "", scores, "",
                 "The task's own test metrics after the last epoch (english-word2vec: Spearman x 100 of the "
                 "embeddings' cosine similarities with the human scores of WordSim-353 and SimLex-999, and the "
                 "Google analogy accuracy in percent, over the items in the vocabulary).", ""]
    names: tuple[str, ...] = ("lr.png", "accuracy.png", "loss.png", "orthogonality.png") if several else (
        "accuracy.png", "loss.png", "orthogonality.png")
    names += ("curves.png", "steps-to-target.png")
    plots = [p for p in names if (out / p).exists()]
    if plots:
        text += ["## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots] + [""]
    path = out / "report.md"
    write_text_atomic(path, "\n".join(text))
    return path


def plot(results: Sequence[Result], out: Path) -> list[Path]:
    """Write the PNG plots into `out` (``lr.png`` only when more than one rate was run); their paths."""
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
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        written.append(path)

    def mean_curve(runs: list[Result], key: str) -> tuple[list[int], list[float]]:
        length = min(len(r["history"]) for r in runs)
        epochs = [runs[0]["history"][i]["epoch"] for i in range(length)]
        return epochs, [sum(r["history"][i][key] for r in runs) / len(runs) for i in range(length)]

    def band(ax, runs: list[Result], key: str, **style) -> None:
        length = min(len(r["history"]) for r in runs)
        epochs = [runs[0]["history"][i]["epoch"] for i in range(length)]
        values = [[r["history"][i][key] for r in runs] for i in range(length)]
        ax.fill_between(epochs, [min(v) for v in values], [max(v) for v in values], alpha=0.15, lw=0, **style)

    def history_lines(key: str):
        def draw(ax, workers):
            if ref is not None:
                ax.plot(*mean_curve(ref, key), "k--", label=f"sequential (lr {ref[0]['lr']:g})")
                band(ax, ref, key, color="k")
            for m in names:
                runs = best.get((m, workers))
                if runs is not None:
                    ax.plot(*mean_curve(runs, key), marker=".", color=colors[m], label=f"{m} (lr {runs[0]['lr']:g})")
                    band(ax, runs, key, color=colors[m])

        return draw

    panels("test accuracy (%), mean and min-max over seeds", "accuracy.png", history_lines("test_accuracy"))
    panels("test loss, mean and min-max over seeds", "loss.png", history_lines("test_loss"))

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

    if _several_rates(results):  # one rate: nothing to show against it
        panels("val. accuracy (%), min-max", "lr.png", draw_lr, xlabel="base learning rate", logx=True)
    written += _curve_figures(results, out)
    return written


def _curve_figures(results: Sequence[Result], out: Path) -> list[Path]:
    """``curves.png`` and ``steps-to-target.png`` (`adasum.experiments.figures`) for runs with learning curves
    (``--evals-per-epoch``), at each cell's picked rate; the target: sequential training's mean validation
    accuracy after one epoch, rounded down to a half point."""
    from adasum.experiments import figures

    best = {key: runs for key, runs in picked(results).items() if all(r.get("curve") for r in runs)}
    if not best:
        return []
    failed = failures(results)
    written = [figures.curves(best, out, lambda r: id(r) in failed)]
    first_epoch = [h["val_accuracy"] for r in best.get(("sequential", 1), []) for h in r["history"][:1]]
    target = figures.target_below(first_epoch)
    if target is not None:
        written.append(figures.steps_to_target(best, target, out))
    return [p for p in written if p is not None]
