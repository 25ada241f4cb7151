"""A griffe extension for the API reference: the docstrings' ``>>>`` examples (doctests, run by
pytest) become fenced ``pycon`` blocks, without their ``# doctest:`` directives, so that Markdown
renders them as code rather than as quotes and links."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

DIRECTIVE = re.compile(r"\s*# doctest: [+-]\w+.*$")


def fence(text: str) -> str:
    """Wrap each run of doctest lines (from a ``>>>`` line to the next blank line) in a pycon fence."""
    out: list[str] = []
    indent: str | None = None
    for line in text.splitlines():
        stripped = line.lstrip()
        if indent is None and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
        elif indent is not None and not stripped:
            out.append(f"{indent}```")
            indent = None
        out.append(DIRECTIVE.sub("", line) if indent is not None else line)
    if indent is not None:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(Extension):
    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence(obj.docstring.value)
