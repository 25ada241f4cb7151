"""AdaCons against its paper (arXiv 2411.03742; docs/methods.md) on toy gradients: the direction is
the paper's ``d = sum_i c_i g_i / |g_i|`` with ``c_i = a_i / sum_j a_j``, ``a_i = <g_i, m> / |g_i|``
(recomputed here in numpy, as the authors' sample code does); the library's default scale
multiplies it by ``|m|``; and the CLI's learning-rate rule for ``adacons`` (lr x P, the mean's
recipe) makes its step equal to ``mean-scaled``'s when the workers agree, and at most sqrt(P)
times shorter when their gradients are orthogonal."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adasum.experiments.methods import get_method
from adasum.reducers.adacons import AdaCons

EPS = np.finfo(np.float64).eps


def paper_direction(grads: np.ndarray) -> np.ndarray:
    """The paper's aggregate for N workers' flattened gradients [N, D] (momentum 0, all a_i > 0)."""
    m = grads.mean(0)
    norms = np.linalg.norm(grads, axis=1)
    a = grads @ m / norms
    assert (a > 0).all()
    c = a / a.sum()
    return (c[:, None] * grads / norms[:, None]).sum(0)


def reduce(grads: np.ndarray, scale: str) -> np.ndarray:
    per_worker = [[torch.from_numpy(g.reshape(3, -1).copy())] for g in grads]
    return AdaCons(scale=scale).reduce(per_worker)[0].reshape(-1).numpy()


def bound(grads: np.ndarray) -> float:
    """A float64 rounding bound for the aggregate: a few hundred roundings of values of size max|g|/min|g|."""
    n, d = grads.shape
    norms = np.linalg.norm(grads, axis=1)
    return 8 * (n + d) * EPS * (np.abs(grads).max() / norms.min() + 1) * max(1.0, np.linalg.norm(grads.mean(0)))


@pytest.mark.parametrize("workers", [2, 5, 16])
def test_unit_scale_is_the_papers_direction_and_the_default_is_it_times_the_mean_norm(workers):
    rng = np.random.default_rng(workers)
    signal = rng.normal(size=12)
    grads = signal + 0.7 * rng.normal(size=(workers, 12))  # noisy copies of one gradient: all a_i > 0
    d = paper_direction(grads)
    assert np.linalg.norm(d) <= 1 + 1e-12  # the paper's |d| <= 1: lr is the step's length bound
    np.testing.assert_allclose(reduce(grads, "unit"), d, rtol=0, atol=bound(grads))
    m = grads.mean(0)
    np.testing.assert_allclose(reduce(grads, "mean_norm"), np.linalg.norm(m) * d, rtol=0, atol=bound(grads))


def test_identical_gradients_step_exactly_as_mean_scaled_under_the_cli_rule():
    workers, lr = 8, 0.01
    g = np.random.default_rng(0).normal(size=12)
    grads = np.stack([g] * workers)
    unit = reduce(grads, "unit")
    np.testing.assert_allclose(unit, g / np.linalg.norm(g), rtol=0, atol=bound(grads))  # length 1
    default = reduce(grads, "mean_norm")
    np.testing.assert_allclose(default, g, rtol=0, atol=bound(grads))  # the mean itself
    adacons, mean_scaled = get_method("adacons"), get_method("mean-scaled")
    assert adacons.learning_rate(lr, workers) == mean_scaled.learning_rate(lr, workers) == pytest.approx(lr * workers)
    step_adacons = adacons.learning_rate(lr, workers) * default
    step_mean_scaled = mean_scaled.learning_rate(lr, workers) * grads.mean(0)
    np.testing.assert_allclose(step_adacons, step_mean_scaled, rtol=0, atol=lr * workers * bound(grads))


@pytest.mark.parametrize("workers", [4, 16])
def test_orthogonal_gradients_give_a_step_sqrt_p_shorter_than_the_means(workers):
    r = 3.0
    grads = r * np.eye(workers, 24)[:workers]  # orthogonal, equal norms
    default = reduce(grads, "mean_norm")
    mean = grads.mean(0)
    assert np.linalg.norm(mean) == pytest.approx(r / math.sqrt(workers), rel=1e-14)
    # c_i = 1/P, d = (1/P) sum e_i, |d| = 1/sqrt(P); times |m| = r/sqrt(P): length r/P
    assert np.linalg.norm(default) == pytest.approx(r / workers, rel=1e-12)
    assert np.linalg.norm(default) / np.linalg.norm(mean) == pytest.approx(1 / math.sqrt(workers), rel=1e-12)
