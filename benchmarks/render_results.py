"""Render the tables of docs/results.md from the stored sweep rows in benchmarks/results/ (the prose
around them is written by hand; each table sits between ``<!-- rendered: NAME -->`` and
``<!-- end -->``).

    python benchmarks/render_results.py            # rewrite the tables in docs/results.md
    python benchmarks/render_results.py --claims   # also print every comparison, for the prose
    python benchmarks/render_results.py --check    # exit 1 if the page's tables are not the rows'

The paired comparisons of every summary on the page form one family: Holm's correction runs over
all of them together, so a verdict anywhere on the page survives every comparison the page makes
(`--claims` also prints each p-value adjusted within its own table, as `adasum report` gives it).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

from adasum.experiments.report import (  # noqa: E402
    adjust,
    cells_table,
    comparisons,
    load_results,
    pair,
    picked,
    robustness_table,
    summary_rows,
)

STUDIES = {  # name: the results files of one setting
    "cpu-digits": ["sweeps-cpu-digits.jsonl"],
    "gpu-digits": ["sweeps-gpu-digits.jsonl.gz"],
    "gpu-digits-b8": ["sweeps-gpu-digits-b8.jsonl.gz"],
    "mnist1d": ["sweeps-gpu-mnist1d.jsonl", "sweeps-cpu-mnist1d.jsonl", "sweeps-gpu-mnist1d-64-128.jsonl.gz"],
    "text-adam": ["sweeps-gpu-text-adam.jsonl.gz", "sweeps-cpu-text-adam-mean.jsonl.gz"],
    "text-lamb": ["sweeps-gpu-text-lamb.jsonl.gz"],
}
EXTRA = [  # comparisons the page makes beyond each summary's: (study, method, against), at every P of both
    (study, "slowmo", "localsgd") for study in ("cpu-digits", "gpu-digits", "gpu-digits-b8", "mnist1d")
]
DOC = os.path.join(ROOT, "docs", "results.md")


def studies() -> dict[str, list[dict]]:
    return {name: load_results([os.path.join(HERE, "results", f) for f in files]) for name, files in STUDIES.items()}


def extra(rows: dict[str, list[dict]]) -> list:
    out = []
    for study, method, against in EXTRA:
        best = picked(rows[study])
        for workers in sorted({w for (m, w) in best if m == method and (against, w) in best}):
            out.append(pair(rows[study], (method, workers), (against, workers)))
    return out


def page_comparisons(rows: dict[str, list[dict]]) -> tuple[dict[str, list], dict[str, list], list]:
    """Every study's comparisons and the `EXTRA` ones adjusted together, one family for the page;
    and (for `--claims`) each study's adjusted within its own table, as `adasum report` does."""
    alone = {name: comparisons(results) for name, results in rows.items()}
    more = extra(rows)
    flat = adjust([c for cs in alone.values() for c in cs] + more)
    page, start = {}, 0
    for name, cs in alone.items():
        page[name], start = flat[start:start + len(cs)], start + len(cs)
    return page, alone, flat[start:]


def blocks(rows: dict[str, list[dict]], found: dict[str, list]) -> dict[str, str]:
    out = {}
    for name, results in rows.items():
        out[f"{name} summary"] = summary_rows(results, found[name])
        out[f"{name} robustness"] = robustness_table(results)
        out[f"{name} cells"] = cells_table(results)
    return out


def render(text: str, tables: dict[str, str]) -> str:
    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name not in tables:
            raise SystemExit(f"docs/results.md names an unknown table {name!r}")
        return f"<!-- rendered: {name} -->\n\n{tables[name]}\n\n<!-- end -->"  # blank lines: a table apart

    return re.sub(r"<!-- rendered: ([\w -]+?) -->(.*?)<!-- end -->", fill, text, flags=re.S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", action="store_true", help="print every comparison with its adjusted p")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is not what it renders to")
    args = parser.parse_args()
    rows = studies()
    page, alone, more = page_comparisons(rows)
    with open(DOC) as f:
        text = f.read()
    new = render(text, blocks(rows, page))
    if args.check:
        sys.exit(0 if new == text else "docs/results.md differs from its stored rows: run benchmarks/render_results.py")
    with open(DOC, "w") as f:
        f.write(new)
    if args.claims:
        tested = [c for cs in [*page.values(), more] for c in cs if not math.isnan(c.p_holm)]
        print(f"{len(tested)} tested comparisons on the page")
        for name in rows:
            for c, own in zip(page[name], alone[name]):
                print(f"{name:13} {c.method:>12} P{c.workers:<4} vs {c.against:12} {c.cell()}; "
                      f"Holm p within its table {own.p_holm:.2g}")
        for c in more:
            print(f"{'extra':13} {c.method:>12} P{c.workers:<4} vs {c.against:12} {c.cell()}")


if __name__ == "__main__":
    main()
