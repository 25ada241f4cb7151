"""The import rules that docs/extension.md states, checked on the source: each layer imports only the
layers below it, no module imports itself back through others (no circle), `core` imports nothing
else of adasum, and only `adasum.settings` reads the environment in the library (the modules named in
`READ_THEIR_OWN` aside, as docs/settings.md says; the launchers, `demo` and `experiments`, set up and
read torchrun's environment)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "adasum"

# what each folder (or top-level module) may import of adasum, besides itself
BELOW = {
    "settings": set(),
    "options": set(),
    "extras": set(),
    "core": set(),
    "kernels": {"core", "settings"},
    "transport": {"core", "kernels", "settings", "options"},
    "checks": {"core", "kernels", "transport", "settings", "options"},
    "collectives": {"core", "kernels", "transport", "checks", "settings", "options"},
    "reducers": {"core", "kernels", "transport", "checks", "collectives", "settings", "options"},
    "diagnostics": {"core", "kernels", "transport", "checks", "collectives", "settings", "options"},
    "integrations": {
        "core", "kernels", "transport", "checks", "collectives", "reducers", "settings", "options", "extras",
    },
    "jax": {"core", "options", "extras"},
}

READ_THEIR_OWN: set[str] = set()
"""Library modules that still read their tuning from the environment themselves (docs/settings.md)."""


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        name = ".".join(("adasum", *path.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        yield name, path, ast.parse(path.read_text())


def _imports(tree: ast.AST, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The adasum modules `tree` imports (``from pkg import module`` counts as the module, not the package)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("adasum"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            if module.startswith("adasum"):
                submodules = {f"{module}.{a.name}" for a in node.names} & modules
                found.update(submodules)
                if len(submodules) < len(node.names):
                    found.add(module)
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _graph() -> dict[str, set[str]]:
    names = {name: path for name, path, _ in _modules()}
    graph = {}
    for name, path, tree in _modules():
        found = _imports(tree, name, path.name == "__init__.py", set(names))
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def test_each_layer_imports_only_layers_below_it():
    wrong = []
    for name, targets in _graph().items():
        layer = _layer(name)
        if layer not in BELOW:
            continue
        for target in targets:
            other = _layer(target)
            if other != layer and other not in BELOW[layer]:
                wrong.append(f"{name} imports {target}")
    assert wrong == [], wrong


def test_no_import_circle():
    graph = _graph()
    # a package's __init__ re-exports its modules: an edge into a package means its __init__ only
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue  # a package importing its own modules
            if state.get(nxt) == 1 and not node.startswith(nxt + "."):
                return [*path, node, nxt]
            if nxt not in state:
                found = visit(nxt, [*path, node])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            circle = visit(start, [])
            assert circle is None, " -> ".join(circle)


def test_only_settings_reads_the_environment():
    readers = []
    for name, path, tree in _modules():
        relative = path.relative_to(SRC).as_posix()
        launcher = relative == "demo.py" or relative.startswith("experiments/")  # they set up torchrun-style runs
        if relative == "settings.py" or relative in READ_THEIR_OWN or launcher:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append(f"{relative}:{node.lineno}")
    assert readers == [], readers
