"""The optional extras: a module that needs one says which to install, in one ImportError."""

from __future__ import annotations

import importlib


def require(*packages: str, extra: str, user: str) -> None:
    """Import each of `packages`; raise ImportError naming `extra` if any of them fails to import.

    >>> require("torch", extra="test", user="adasum.example")
    >>> require("no_such_package", extra="jax", user="adasum.example")
    Traceback (most recent call last):
    ...
    ImportError: adasum.example needs no_such_package: pip install 'adasum[jax]' (from a checkout: pip install '.[jax]')
    """
    missing, first_error = [], None
    for name in packages:
        try:
            importlib.import_module(name)
        except ImportError as error:
            missing.append(name)
            first_error = first_error or error
    if missing:
        raise ImportError(
            f"{user} needs {', '.join(missing)}: "
            f"pip install 'adasum[{extra}]' (from a checkout: pip install '.[{extra}]')",
            name=missing[0],
        ) from first_error
