"""The optional extras: a module that needs one says which to install, in one ImportError."""

from __future__ import annotations

import importlib.util


def require(*packages: str, extra: str, user: str) -> None:
    """Raise ImportError naming `extra` unless every one of `packages` can be imported.

    >>> require("torch", extra="test", user="adasum.example")
    >>> require("no_such_package", extra="jax", user="adasum.example")
    Traceback (most recent call last):
    ...
    ImportError: adasum.example needs no_such_package: pip install 'adasum[jax]' (from a checkout: pip install '.[jax]')
    """
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"{user} needs {', '.join(missing)}: "
            f"pip install 'adasum[{extra}]' (from a checkout: pip install '.[{extra}]')",
            name=missing[0],
        )
