"""Render docs/results.md's tables and figures from the study's stored rows in benchmarks/results/ (the prose
around them is written by hand; each table sits between ``<!-- rendered: NAME -->`` and ``<!-- end -->``).

    python benchmarks/render_results.py            # rewrite the tables in docs/results.md and its figures
    python benchmarks/render_results.py --check    # exit 1 if the page's tables are not the rows'

The rows: ``study-DESIGN.jsonl.gz`` (the pilot's and the confirmatory runs of `adasum.experiments.study`'s
design DESIGN, as `benchmarks/study.py` writes them). Everything is computed on the CPU from the rows.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

from adasum.experiments.io import read_jsonl  # noqa: E402
from adasum.experiments.study import DESIGNS, draw, render  # noqa: E402

DOC = ROOT / "docs" / "results.md"
IMAGES = ROOT / "docs" / "img"


def path(design: str) -> Path:
    return HERE / "results" / f"study-{design}.jsonl.gz"


def rows(design: str) -> list[dict]:
    """The stored rows of one design."""
    return read_jsonl(path(design))


def stored() -> dict:
    """The designs whose rows are stored (a design registered before its runs has none yet)."""
    return {name: design for name, design in DESIGNS.items() if path(name).exists()}


def tables() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, design in stored().items():
        out.update(render(rows(name), design))
    return out


def fill(text: str, blocks: dict[str, str]) -> str:
    def one(match: re.Match) -> str:
        name = match.group(1)
        if name not in blocks:
            raise SystemExit(f"docs/results.md names an unknown table {name!r}")
        return f"<!-- rendered: {name} -->\n\n{blocks[name]}\n\n<!-- end -->"  # blank lines: a table apart

    return re.sub(r"<!-- rendered: ([\w -]+?) -->(.*?)<!-- end -->", one, text, flags=re.S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is not what it renders to")
    args = parser.parse_args()
    text = DOC.read_text()
    new = fill(text, tables())
    if args.check:
        sys.exit(0 if new == text else "docs/results.md differs from its stored rows: run benchmarks/render_results.py")
    DOC.write_text(new)
    for name, design in stored().items():
        for written in draw(rows(name), design, IMAGES):
            print(f"wrote {os.path.relpath(written, ROOT)}")


if __name__ == "__main__":
    main()
