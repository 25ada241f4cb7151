"""Property-based tests (hypothesis) of the operator and the tree, single process: homogeneity,
the orthogonal and parallel limits for any P, symmetry, no NaN from finite input, and agreement
with the independent reference of `reference.py`."""

import math

import numpy as np
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import adasum
from adasum.kernels.reduce import combine_weighted

from reference import STORE_U, U64, tree_with_bound
from reference import pair as reference_pair

SETTINGS = settings(max_examples=60, deadline=None)
F32_MAX = float(np.finfo(np.float32).max)

workers = st.integers(1, 17)
lengths = st.integers(1, 24)


def finite(width: int, bound: float | None = None) -> st.SearchStrategy[float]:
    """Any finite float of `width` bits (subnormals, zeros, the extremes), within ±bound if given."""
    return st.floats(
        min_value=None if bound is None else -bound,
        max_value=bound,
        width=width,
        allow_nan=False,
        allow_infinity=False,
        allow_subnormal=True,
    )


def moderate() -> st.SearchStrategy[float]:
    """Zero or a magnitude in [1e-6, 1e6]: nothing a power-of-two scaling could push to the edges."""
    magnitude = st.floats(1e-6, 1e6)
    return st.one_of(st.just(0.0), magnitude, magnitude.map(lambda x: -x))


def arrays(dtype, n: int, elements) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(dtype, n, elements=elements)


def as_tensor(x: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t if dtype is None else t.to(dtype)


def normal_or_zero(t: torch.Tensor) -> bool:
    a = t.abs()
    return bool(((a == 0) | (a >= torch.finfo(t.dtype).tiny)).all() and torch.isfinite(t).all())


# ---- homogeneity: adasum(k a, k b) = k adasum(a, b) for k a power of two -------------------------


@SETTINGS
@given(st.data(), lengths, st.integers(-20, 20))
def test_combine_is_exactly_homogeneous_in_powers_of_two(data, n, exponent):
    k = 2.0**exponent
    for dtype in (np.float32, np.float64):
        a = as_tensor(data.draw(arrays(dtype, n, moderate())))
        b = as_tensor(data.draw(arrays(dtype, n, moderate())))
        out, scaled = adasum.combine(a, b), adasum.combine(k * a, k * b)
        # exact while nothing falls into the subnormal range, where scaling itself rounds
        assume(normal_or_zero(out) and normal_or_zero(scaled))
        assert torch.equal(scaled, k * out), (dtype, (scaled - k * out).abs().max())


@SETTINGS
@given(st.data(), workers, lengths, st.integers(-30, 30))
def test_reduce_is_exactly_homogeneous_in_powers_of_two(data, p, n, exponent):
    k = 2.0**exponent
    gs = [as_tensor(data.draw(arrays(np.float64, n, moderate()))) for _ in range(p)]
    assert torch.equal(adasum.reduce([k * g for g in gs]), k * adasum.reduce(gs))


# ---- the limits for any number of workers ---------------------------------------------------------


def orthonormal(n: int, p: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, p, generator=g, dtype=torch.float64))
    return q


@SETTINGS
@given(st.data(), workers, st.integers(0, 8), st.integers(0, 2**31 - 1))
def test_orthogonal_inputs_give_the_sum_for_any_p(data, p, extra, seed):
    scale = st.one_of(st.just(0.0), st.floats(1e-3, 1e3), st.floats(-1e3, -1e-3))
    scales = data.draw(st.lists(scale, min_size=p, max_size=p))
    q = orthonormal(p + extra, p, seed)
    gs = [scales[i] * q[:, i] for i in range(p)]
    out = adasum.reduce(gs)
    expected = torch.stack(gs).sum(0)
    tol = 1e-12 * max(1.0, max(map(abs, scales)))
    assert torch.allclose(out, expected, rtol=0, atol=tol), (out - expected).abs().max()


def subtree_means(c: list[float]) -> list[float]:
    """The mean of every subtree of the reduction tree (fold pairs, then a power-of-two tree), from
    its description in `adasum.core.tree`, for scalars."""
    p = len(c)
    q = 1 << (p.bit_length() - 1)
    r = p - q
    groups = [((c[2 * i] + c[2 * i + 1]) / 2, 2) for i in range(r)] + [(x, 1) for x in c[2 * r :]]
    means = [m for m, count in groups if count == 2]
    while len(groups) > 1:
        groups = [
            ((ma * na + mb * nb) / (na + nb), na + nb) for (ma, na), (mb, nb) in zip(groups[::2], groups[1::2])
        ]
        means += [m for m, _ in groups]
    return means


@SETTINGS
@given(st.data(), workers, lengths, st.integers(0, 2**31 - 1), st.booleans())
def test_parallel_inputs_give_the_mean_for_any_p(data, p, n, seed, mixed_signs):
    magnitude = st.floats(0.1, 10.0)
    sign = data.draw(st.sampled_from([1.0, -1.0]))
    if mixed_signs:
        c = data.draw(st.lists(st.one_of(magnitude, magnitude.map(lambda x: -x)), min_size=p, max_size=p))
        # a subtree whose workers nearly cancel has no well-defined direction left: out of scope
        assume(all(abs(m) >= 0.05 * max(map(abs, c)) for m in subtree_means(c)))
    else:
        c = [sign * x for x in data.draw(st.lists(magnitude, min_size=p, max_size=p))]
    v = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out = adasum.reduce([ci * v for ci in c])
    expected = (sum(c) / p) * v
    assert torch.allclose(out, expected, rtol=1e-10, atol=1e-10 * max(map(abs, c)) * float(v.abs().max())), (
        out - expected
    ).abs().max()


# ---- symmetry of the two-worker case --------------------------------------------------------------


@SETTINGS
@given(st.data(), lengths, st.integers(1, 9), st.integers(1, 9))
def test_two_worker_case_is_symmetric(data, n, na, nb):
    for dtype, width in ((np.float32, 32), (np.float64, 64)):
        a = as_tensor(data.draw(arrays(dtype, n, finite(width, 2.0**100))))
        b = as_tensor(data.draw(arrays(dtype, n, finite(width, 2.0**100))))
        # not bitwise: `c_a a + c_b b` rounds its two products in the other order (last bits only);
        # each term is at most |a| + |b| in size, so a few ulps of that bound the difference
        tol = 4 * torch.finfo(a.dtype).eps * (a.double().norm() + b.double().norm())
        assert ((adasum.combine(a, b).double() - adasum.combine(b, a).double()).abs() <= tol).all()
        swapped = combine_weighted(a, b, na, nb).double() - combine_weighted(b, a, nb, na).double()
        assert (swapped.abs() <= tol).all()
        assert torch.equal(adasum.reduce([a, b]), adasum.combine(a, b))


# ---- no NaN from finite input ---------------------------------------------------------------------


@SETTINGS
@given(st.data(), lengths)
def test_combine_of_finite_float32_anywhere_in_range_is_never_nan(data, n):
    a = data.draw(arrays(np.float32, n, finite(32)))
    b = data.draw(arrays(np.float32, n, finite(32)))
    out = adasum.combine(as_tensor(a), as_tensor(b))
    assert not torch.isnan(out).any()
    # an Inf only where the exact result lies beyond float32's range (orthogonal parts add up)
    exact = torch.from_numpy(reference_pair(a, b)).abs()
    assert (exact[torch.isinf(out)] >= F32_MAX * (1 - 1e-6)).all()
    assert torch.isinf(out)[exact > F32_MAX * (1 + 1e-6)].all()
    for dtype, lo in ((torch.bfloat16, 3.38e38), (torch.float16, 65504.0)):
        a16 = as_tensor(np.clip(a, -lo, lo), dtype)
        b16 = as_tensor(np.clip(b, -lo, lo), dtype)
        assert not torch.isnan(adasum.combine(a16, b16)).any(), dtype


@SETTINGS
@given(st.data(), st.integers(2, 17), st.integers(1, 16))
def test_reduce_of_finite_float32_is_finite(data, p, n):
    # elements up to 2**100 (1.3e30) and down to subnormals and zero: no level can overflow float32
    gs = [as_tensor(data.draw(arrays(np.float32, n, finite(32, 2.0**100)))) for _ in range(p)]
    assert torch.isfinite(adasum.reduce(gs)).all()


@SETTINGS
@given(st.data(), st.integers(2, 17), st.integers(1, 16))
def test_float64_within_the_documented_safe_range_is_finite(data, p, n):
    # README "Numerics": float64 vector norms below about 1e154 (elements here up to 1e140, with
    # subnormals and zeros; norms below 1e-77 count as zero)
    gs = [as_tensor(data.draw(arrays(np.float64, n, finite(64, 1e140)))) for _ in range(p)]
    assert torch.isfinite(adasum.combine(gs[0], gs[1])).all()
    assert torch.isfinite(adasum.reduce(gs)).all()


# ---- agreement with the independent reference -----------------------------------------------------


@SETTINGS
@given(st.data(), workers, lengths, st.integers(0, 2**31 - 1))
def test_reduce_matches_the_independent_reference(data, p, n, seed):
    """adasum.reduce of P vectors of scales 2**-20 to 2**20 (some zero), in float64 and float32, lies within
    `reference.tree_with_bound` (2-norm, float64 arithmetic, stored in the dtype) of the reference tree."""
    exponents = data.draw(st.lists(st.integers(-20, 20), min_size=p, max_size=p))
    zero = data.draw(st.lists(st.booleans(), min_size=p, max_size=p))
    g = torch.Generator().manual_seed(seed)
    base = [
        torch.randn(n, generator=g, dtype=torch.float64) * 2.0**e * (0 if z else 1) for e, z in zip(exponents, zero)
    ]
    for dtype in (torch.float64, torch.float32):
        gs = [x.to(dtype) for x in base]  # the reference starts from the rounded inputs the library combines
        # the kernels compute in float64 and store each level in the dtype: `tree_with_bound`'s first-order bound
        ref, bound = tree_with_bound([x.double().numpy() for x in gs], U64, STORE_U[str(dtype).removeprefix("torch.")])
        err = float(np.linalg.norm(adasum.reduce(gs).double().numpy() - ref))
        assert err <= bound, (dtype, err, bound)


def test_subtree_means_helper():
    # P = 3: fold (0, 1), then (fold, 2)
    assert subtree_means([1.0, 3.0, 5.0]) == [2.0, 3.0]
    assert subtree_means([2.0]) == []
    assert subtree_means([1.0, 2.0, 3.0, 4.0]) == [1.5, 3.5, 2.5]
    assert math.isclose(subtree_means([1.0] * 17)[-1], 1.0)
