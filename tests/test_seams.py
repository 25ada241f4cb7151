"""The tests reach the library through its public seams: at most `LIMIT` distinct private names of adasum's own
are touched by the files under tests/, and each one left is listed in `LEFT` with why.

What counts, read from each tests/*.py with `ast` (no import):

- ``from adasum.<module> import _name``;
- an attribute ``<expr>._name`` whose name the library's source defines (a function, class, method, module-level
  name, field or ``self._name`` it assigns), unless ``<expr>`` starts from a module the test file imports from
  outside adasum (``torch._dynamo``, ``os._exit``, ``dist.distributed_c10d._world``: those are the other
  library's business) or is ``self`` inside a class of the test file that gives itself that name;
- a name given as a string to ``getattr``, ``setattr``, ``hasattr``, ``delattr``, ``monkeypatch.setattr`` /
  ``delattr`` or ``patch`` / ``patch.object`` (``(obj, "_name")`` or ``"adasum.module._name"``), with the same
  test of definition: patching a private is touching it.

Dunder names (``__init__``, ``__all__``) are Python's protocol and do not count. A private name of a third-party
class that adasum overrides is still adasum's name here (a test calls adasum's code through it)."""

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "adasum"
TESTS = ROOT / "tests"

LIMIT = 10

LEFT: dict[str, str] = {
    "_close_batch": (
        "test_plan's profile of each door's repeat: the DDP hook's batch is closed inside torch's autograd, and the "
        "profile needs the function that is the door to tell its frames from the ones below it"
    ),
}
"""The private names the tests still touch, each with the reason no public seam serves it."""

STRING_TARGETS = {"getattr", "setattr", "hasattr", "delattr", "patch", "object"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_in_source() -> set[str]:
    """Every private name the library's source gives to something."""
    names = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
    return {name for name in names if _private(name)}


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _foreign_modules(tree: ast.Module) -> set[str]:
    """The names a test file binds to modules (or their objects) from outside adasum."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("adasum"))
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("adasum") and not node.level:
            names.update(a.asname or a.name for a in node.names)
    return names


def _own_names(cls: ast.ClassDef) -> set[str]:
    """The names a test file's class gives itself: its methods and the ``self.<name>`` it assigns."""
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _root(node) == "self":
            names.add(node.attr)
    return names


def _string_target(call: ast.Call) -> str | None:
    func = call.func
    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if called not in STRING_TARGETS and not (isinstance(func, ast.Attribute) and func.attr in ("setattr", "delattr")):
        return None
    for arg in call.args[:2]:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            text = arg.value
            if "." in text and not text.startswith("adasum."):
                continue
            last = text.rsplit(".", 1)[-1]
            if _private(last):
                return last
    return None


@functools.cache
def touches() -> dict[str, list[str]]:
    """Each private name of adasum's the tests touch, with where (``file:line``)."""
    defined = _defined_in_source()
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(TESTS.glob("*.py")):
        tree = ast.parse(path.read_text())
        foreign = _foreign_modules(tree)
        own: dict[int, set[str]] = {}
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef):
                names = _own_names(cls)
                for node in ast.walk(cls):
                    own.setdefault(id(node), set()).update(names)
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("adasum"):
                for alias in node.names:
                    if _private(alias.name):
                        found[alias.name].append(where)
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in defined:
                root = _root(node.value)
                if root in foreign or (root == "self" and node.attr in own.get(id(node), set())):
                    continue
                found[node.attr].append(where)
            elif isinstance(node, ast.Call):
                name = _string_target(node)
                if name is not None and name in defined:
                    found[name].append(where)
    return dict(found)


def _listing(found: dict[str, list[str]]) -> str:
    return "\n".join(f"  {name}: {', '.join(sorted(set(where)))}" for name, where in sorted(found.items()))


def test_tests_touch_few_private_names():
    found = touches()
    assert len(found) <= LIMIT, (
        f"{len(found)} private names of adasum touched by tests (at most {LIMIT}); reach these through a public "
        f"property, method or function, or assert on what the call does:\n{_listing(found)}"
    )
    unexplained = sorted(set(found) - set(LEFT))
    assert unexplained == [], f"private names touched without a reason in LEFT: {unexplained}\n{_listing(found)}"


def test_every_name_left_is_still_touched():
    stale = sorted(set(LEFT) - set(touches()))
    assert stale == [], f"LEFT gives reasons for private names no test touches any more (drop them): {stale}"
