"""Doctests of src/ run with `torch` and `adasum` in their namespace (pytest --doctest-modules); a test (or
doctest) that needs an optional extra which is not installed is skipped with the extra's name."""

import doctest
import importlib.util

import pytest
import torch

import adasum

# not collected (paths relative to this file): adasum.jax where jax or optax is not installed
# (`pip install 'adasum[jax]'`; `make install` installs them, so `make test` runs these examples)
collect_ignore = []
if importlib.util.find_spec("jax") is None or importlib.util.find_spec("optax") is None:
    collect_ignore.append("src/adasum/jax")
for extra in ("lightning", "accelerate"):  # likewise the framework integrations without their extras
    if importlib.util.find_spec(extra) is None:
        collect_ignore += [f"src/adasum/{extra}.py", f"src/adasum/integrations/{extra}.py"]


EXTRAS = {
    "mlflow": "mlflow", "sqlalchemy": "mlflow", "alembic": "mlflow", "tensorboard": "tensorboard",
    "lightning": "lightning", "pytorch_lightning": "lightning", "accelerate": "accelerate", "jax": "jax",
    "optax": "jax", "wandb": "wandb", "mkdocs": "docs", "mkdocstrings": "docs", "build": "test", "twine": "test",
    **dict.fromkeys(["matplotlib", "rich", "mlxtend", "mnist1d", "pytorch_optimizer", "sklearn", "scipy"],
                    "experiments"),
}
"""The optional packages by the extra of pyproject.toml that installs them."""


def missing_extra(error: ImportError) -> str | None:
    """The extra whose package `error` failed to import, where that package is not installed (else None: a real
    error, not a missing extra)."""
    top = (error.name or "").split(".")[0]
    if top not in EXTRAS:
        return None
    try:
        installed = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        installed = False
    return None if installed else EXTRAS[top]


def _import_error(error: BaseException) -> ImportError | None:
    """The ImportError `error` is, or the one a doctest example raised (doctest wraps it)."""
    if isinstance(error, ImportError):
        return error
    if isinstance(error, doctest.UnexpectedException) and isinstance(error.exc_info[1], ImportError):
        return error.exc_info[1]
    return None


def _skip_without_extras():
    try:
        return (yield)
    except (ImportError, doctest.UnexpectedException) as raised:
        error = _import_error(raised)
        extra = missing_extra(error) if error is not None else None
        if error is None or extra is None:
            raise
        package = (error.name or "").split(".")[0]
        pytest.skip(f"needs the {extra} extra ({package} is not installed): pip install '.[{extra}]'")


def _missing(extra: str) -> list[str]:
    """The packages of `extra` (`EXTRAS`) that are not installed."""
    return sorted(p for p, e in EXTRAS.items() if e == extra and importlib.util.find_spec(p) is None)


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked ``extra(name)`` (whose failure without the extra would not be an ImportError: the
    CLI turns one into its one-line message) where a package of the extra is missing."""
    for item in items:
        for mark in item.iter_markers("extra"):
            missing = _missing(mark.args[0])
            if missing:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs the {mark.args[0]} extra ({', '.join(missing)} not installed): "
                           f"pip install '.[{mark.args[0]}]'"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _skip_without_extras())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _skip_without_extras())


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(torch=torch, adasum=adasum)
