"""Doctests of src/ run with `torch` and `adasum` in their namespace (pytest --doctest-modules)."""

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


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(torch=torch, adasum=adasum)
