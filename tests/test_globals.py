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


def module_state(source: str) -> list[tuple[int, str]]:
    """(line, name) of each module-level assignment (annotated or not) of mutable state in `source`."""
    tree = ast.parse(source)
    own_classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
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
