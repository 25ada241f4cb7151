"""Errors name the fix: every user-facing raise in src/adasum says what to do.

The scan reads each ``raise SomeError("...")`` and ``warnings.warn("...")`` in src/adasum whose message is a
literal (a str or an f-string; messages built elsewhere are checked where they are built). A message passes if it
holds an imperative hint word (HINTS: "pass", "set", "use", "call", ...) or "internal error; please report", or if
its site is in ALLOWED with a reason. Abstract methods (``raise NotImplementedError`` with no message) and
``__getattr__``'s AttributeError (Python's own wording) are not user errors and are skipped, and so is a message
whose literal parts hold no word (``f"{operation}: {error}"``: it only prefixes a message written elsewhere).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "adasum"

HINTS = (
    "pass", "set", "use", "call", "install", "run", "give", "make", "remove", "choose", "report", "delete",
    "build", "apply", "wrap", "leave", "start", "write", "drop", "load", "name", "launch", "change", "cast", "import",
)
HINT = re.compile(r"\b(" + "|".join(HINTS) + r")\b", re.IGNORECASE)

# (file relative to src/adasum, words the message holds): reason.
ALLOWED: dict[tuple[str, str], str] = {
    ("experiments/data.py", "refused global"): "pickle's find_class refusal; caught and reworded by the loader",
    ("integrations/lightning.py", "is not applied (the strategy"): "the fix is the per-option `hint` beside it",
    ("integrations/glue.py", "the model is a"): "the fix arrives as `not_ddp`, a text each caller writes for its "
                                                "framework",
    ("integrations/optim.py", "the state was saved on"): "a notice of the rules a resized load applied; nothing is "
                                                         "wrong, so there is nothing to fix",
    ("integrations/slowmo.py", "the state was saved on"): "a notice of the rules a resized load applied; nothing is "
                                                          "wrong, so there is nothing to fix",
    ("integrations/ddp.py", "the state was pickled on"): "a notice of the rules a resized load applied; nothing is "
                                                         "wrong, so there is nothing to fix",
}


def _literal(node: ast.expr) -> str | None:
    """The text of a literal message (an f-string's fixed parts joined by spaces), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return " ".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left), _literal(node.right)
        if left is not None or right is not None:
            return f"{left or ''} {right or ''}"
    return None


def sites() -> list[tuple[str, int, str, str]]:
    """(file, line, kind, message) for every raise and warning in src/adasum with a literal message."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            call = None
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                call, kind = node.exc, ast.unparse(node.exc.func)
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
                call, kind = node, "warning"
            if call is None or not call.args:
                continue
            if kind == "AttributeError" and "has no attribute" in ast.unparse(call.args[0]):
                continue
            text = _literal(call.args[0])
            if text is not None and re.search(r"[A-Za-z]", text):
                found.append((rel, node.lineno, kind, text))
    return found


def _allowed(rel: str, text: str) -> bool:
    return any(rel == f and start in text for f, start in ALLOWED)


def test_every_user_facing_message_names_the_fix():
    missing = [
        f"src/adasum/{rel}:{line}: {kind}: {text[:100]!r}"
        for rel, line, kind, text in sites()
        if not HINT.search(text) and "internal error" not in text and not _allowed(rel, text)
    ]
    assert not missing, "these messages say what went wrong but not what to do:\n" + "\n".join(missing)


def test_the_scan_sees_the_messages():
    """The scan is not vacuous: it finds the messages of the known files, and flags a message without a fix."""
    found = sites()
    assert len(found) > 150
    assert {rel for rel, *_ in found} >= {"options.py", "settings.py", "reducers/adasum.py"}
    assert not HINT.search("local_size must be an integer >= 1, got 0")
    assert HINT.search("pass local_size= an integer >= 1")


def test_allowlist_is_live():
    """Every allowlist entry still matches a site."""
    found = sites()
    for f, start in ALLOWED:
        assert any(rel == f and start in text for rel, _, _, text in found), (f, start)


def test_bad_reducer_name_says_the_fix():
    import adasum

    with pytest.raises(ValueError, match=r"(?i)\b(pass|use|choose)\b"):
        adasum.get_reducer("no-such-reducer")


def test_bad_setting_env_var_says_the_fix():
    from adasum.settings import Settings

    with pytest.raises(ValueError, match=r"ADASUM_\w+.*\b(set|use)\b"):
        Settings.from_env({"ADASUM_CUDA_GRAPHS": "maybe"})


def test_bad_reducer_option_says_the_fix():
    import adasum

    with pytest.raises(ValueError, match=r"\bpass\b"):
        adasum.Adasum(hierarchical="sometimes")
    with pytest.raises(ValueError, match=r"\bpass\b"):
        adasum.Adasum(local_size=2)
