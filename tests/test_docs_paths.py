"""Every repository path and every ``adasum.<name>`` that README.md and docs/*.md name exists (a doc names the
code as it is)."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP = ("src/", "docs/", "benchmarks/", "tests/", "examples/")
# a path in backticks or a markdown link: starts at a top-level folder, no spaces
NAMED = re.compile(r"(?<![\w/.-])((?:src|docs|benchmarks|tests|examples)/[\w./*{},-]*[\w*}])")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
OWN = re.compile(r"^https://github\.com/adasum/adasum/(?:blob|tree)/main/(.+)$")  # this repository's own files


def expand(path: str) -> list[str]:
    """`a/{b,c}.log` -> `a/b.log`, `a/c.log`."""
    brace = re.search(r"\{([^}]*)\}", path)
    if not brace:
        return [path]
    return [x for alt in brace.group(1).split(",") for x in expand(path[: brace.start()] + alt + path[brace.end():])]


def named_paths(doc: Path) -> set[str]:
    text = doc.read_text()
    paths = {m.group(1).rstrip(".,") for m in NAMED.finditer(text)}
    for m in LINK.finditer(text):
        target = m.group(1)
        own = OWN.match(target)
        if own:
            paths.add(own.group(1))
        elif "://" not in target and not target.startswith("mailto:"):
            paths.add(str((doc.parent / target).resolve().relative_to(ROOT)))
    return {p for path in paths for p in expand(path)}


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def test_the_check_finds_paths():
    readme = named_paths(ROOT / "README.md")
    assert "docs/benchmarks.md" in readme and any(p.startswith("src/adasum/") for p in readme)
    assert OWN.match("https://github.com/adasum/adasum/blob/main/docs/x.md").group(1) == "docs/x.md"
    assert expand("a/{b,c}.log") == ["a/b.log", "a/c.log"]
    assert not exists("src/adasum/collectives.py") and exists("src/adasum/collectives/*.py")


def test_every_path_named_in_the_docs_exists():
    missing = [f"{doc.relative_to(ROOT)}: {p}" for doc in DOCS for p in sorted(named_paths(doc)) if not exists(p)]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_benchmarks_page_is_rendered_from_the_rows(monkeypatch):
    spec = importlib.util.spec_from_file_location("benchmarks_render", ROOT / "benchmarks" / "render.py")
    render = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "benchmarks_render", render)  # dataclasses look their module up
    spec.loader.exec_module(render)
    assert (ROOT / "docs" / "benchmarks.md").read_text() == render.render(), "run python benchmarks/render.py"


def test_nothing_speaks_of_how_the_work_was_done():
    """Docs, code and benchmark files describe what is, not the work periods or tickets that made it."""
    process = re.compile(r"\bsessions?\b|device calls?\b|\bissue ?#?\d+|\bcall\d|\bsession\d", re.I)
    found = []
    for top in ("README.md", "docs", "src", "benchmarks", "examples"):
        for path in [ROOT / top] if top.endswith(".md") else sorted((ROOT / top).rglob("*")):
            if process.search(str(path.relative_to(ROOT))):
                found.append(f"{path.relative_to(ROOT)} (its name)")
            if path.is_file() and path.suffix in {".md", ".py", ".sh", ".log", ".jsonl", ".txt"}:
                found += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in process.finditer(path.read_text())]
    assert not found, "\n".join(found)


# ``adasum.a.b``: a module, then attributes; a placeholder (``adasum.X needs Y``) is not a name
DOTTED = re.compile(r"(?<![\w/.-])adasum(?:\.[A-Za-z_]\w*)+")
PLACEHOLDERS = {"adasum.X"}
RESOLVE = """
import importlib, json, sys
missing = {}
for name in json.load(sys.stdin):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError as error:
            if not (error.name or "").startswith("adasum"):  # a missing optional framework: not the doc's fault
                obj = None
                break
        except ImportError:  # `adasum.extras.require`: the extra is missing
            obj = None
            break
    if obj is None:
        continue
    try:
        for part in parts[i:]:
            obj = getattr(obj, part)
    except AttributeError as error:
        missing[name] = str(error)
json.dump(missing, sys.stdout)
"""


def named_objects(doc: Path) -> set[str]:
    return {m.group(0) for m in DOTTED.finditer(doc.read_text())} - PLACEHOLDERS


def test_every_adasum_name_in_the_docs_exists():
    """Each ``adasum.module.attribute`` a doc names imports and resolves (in a fresh process: the optional
    frameworks stay out of the test process; a name under an extra that is not installed is left out)."""
    names = {name: doc for doc in DOCS for name in named_objects(doc)}
    assert "adasum.all_reduce" in names and "adasum.X" not in names
    done = subprocess.run([sys.executable, "-c", RESOLVE], input=json.dumps(sorted(names)), capture_output=True,
                          text=True, check=True, cwd=ROOT)
    missing = json.loads(done.stdout)
    assert not missing, "names in the docs that the code lacks:\n" + "\n".join(
        f"{names[n].relative_to(ROOT)}: {n} ({why})" for n, why in sorted(missing.items()))
