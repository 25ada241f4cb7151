"""Doctests of src/ run with `torch` and `adasum` in their namespace (pytest --doctest-modules)."""

import pytest
import torch

import adasum


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(torch=torch, adasum=adasum)
