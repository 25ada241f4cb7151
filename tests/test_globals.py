"""The library keeps its process-wide mutable state in two registries: the transport layer's
(`adasum.transport.communicator`: communicators by process group, side streams, the movers' table) and the
reducers' names (`adasum.reducers.base`): no other module-level name holds a mutable container or an object of
the package's own classes, so `adasum.release()` can drop everything a process group left behind."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "adasum"

MUTABLE_CONSTRUCTORS = {
    "dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque", "ChainMap",
    "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "array",
}
ALLOWED = {("transport/communicator.py", "_registry"), ("reducers/base.py", "_REDUCERS")}
"""The registries: the transport layer's (communicators, side streams, the movers' table; `adasum.release()` empties
what a process group left behind) and the reducers' names (process-wide, never released)."""
EXPORTS = "__all__"  # a module's export list: read by ``import *`` and tools, never written


def _called_name(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _mutable(value: ast.expr, own_classes: set[str]) -> bool:
    """A container literal or comprehension, a call of a mutable container's constructor, or an object of a
    class the module defines."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        name = _called_name(value)
        return name in MUTABLE_CONSTRUCTORS or name in own_classes
    return False


def _frozen(node: ast.ClassDef) -> bool:
    """A class decorated ``@dataclass(frozen=True)``: its objects cannot be changed (their fields' values are the
    module's business: a dict field would still be mutable, and `test_frozen_designs_hold_no_containers` checks
    the ones the package defines)."""
    for decorator in node.decorator_list:
        if isinstance(decorator, ast.Call) and _called_name(decorator) == "dataclass":
            keywords = decorator.keywords
            if any(k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value for k in keywords):
                return True
    return False


def module_state(source: str) -> list[tuple[int, str]]:
    """(line, name) of each module-level assignment (annotated or not) of mutable state in `source`."""
    tree = ast.parse(source)
    own_classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef) and not _frozen(node)}
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if _mutable(value, own_classes):
            found.extend((node.lineno, ast.unparse(t)) for t in targets if ast.unparse(t) != EXPORTS)
    return found


def test_the_scan_finds_each_form_of_module_state():
    source = """
import collections, weakref
class Cache: ...
@dataclass(frozen=True)
class Point: ...
a = {}
b: dict[str, int] = {}
c = []
d: list = list()
e = set()
f = collections.defaultdict(list)
g = weakref.WeakKeyDictionary()
h = {k: 1 for k in "ab"}
i = Cache()
ok = (1, 2)
fine = frozenset({1})
origin = Point()
__all__ = ["a"]
def f():
    local = {}
"""
    assert [name for _, name in module_state(source)] == list("abcdefghi")


def test_no_module_level_mutable_state_outside_the_registry():
    found, allowed_seen = [], set()
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        for line, name in module_state(path.read_text()):
            if (relative, name) in ALLOWED:
                allowed_seen.add((relative, name))
            else:
                found.append(f"{relative}:{line} {name}")
    assert found == [], found
    assert allowed_seen == ALLOWED  # the registries are where this test says they are


def test_frozen_designs_hold_no_containers():
    """The study's designs are module-level objects of a frozen dataclass: none of their fields may be a mutable
    container (a dict or list there could still be changed)."""
    from dataclasses import fields

    from adasum.experiments.study import DESIGNS

    for design in DESIGNS.values():
        for f in fields(design):
            value = getattr(design, f.name)
            assert not isinstance(value, (dict, list, set)), (design.name, f.name)
            if f.name == "primary":
                assert isinstance(value, tuple)
