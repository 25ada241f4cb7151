import math
import sys

import numpy as np
import pytest
import torch

import adasum
from adasum.core.tree import Tree

from reference import STORE_U, U64, gamma, pair, tree_with_bound
from reference import tree as reference_tree


def rel_err(x: torch.Tensor, ref) -> float:
    ref = torch.as_tensor(np.asarray(ref), dtype=torch.float64)
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def orthogonal_columns(n: int, p: int, seed: int) -> list[torch.Tensor]:
    q, _ = torch.linalg.qr(torch.randn(n, p, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return [q[:, i].clone() for i in range(p)]


def test_combine_orthogonal_gives_sum_and_parallel_gives_mean():
    a, b = orthogonal_columns(50, 2, 0)
    assert torch.allclose(adasum.combine(a, b), a + b, atol=1e-14)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(37, dtype=torch.float64, generator=g)
    for ca, cb in [(3.0, -2.0), (-0.5, -7.0), (1e-3, 1e3)]:
        out = adasum.combine(ca * v, cb * v)
        assert torch.allclose(out, (ca + cb) / 2 * v, rtol=1e-12, atol=1e-12)


def test_combine_zero_guard_never_nan():
    b = torch.randn(10)
    z = torch.zeros(10)
    assert torch.equal(adasum.combine(z, z), z)
    assert torch.equal(adasum.combine(z, b), b)
    assert torch.equal(adasum.combine(b, z), b)
    tiny = torch.full((4,), 1e-160, dtype=torch.float64)
    assert torch.isfinite(adasum.combine(tiny, tiny)).all()


def test_combine_matches_formula_and_keeps_shape_dtype():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    out = adasum.combine(a, b)
    assert out.shape == a.shape and out.dtype == a.dtype
    dot = (a.double() * b.double()).sum()
    ref = (1 - dot / (2 * a.double().square().sum())) * a.double() + (
        1 - dot / (2 * b.double().square().sum())
    ) * b.double()
    assert rel_err(out, ref) < 1e-7


def test_combine_is_homogeneous_and_symmetric():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(100, dtype=torch.float64, generator=g), torch.randn(100, dtype=torch.float64, generator=g)
    assert torch.allclose(adasum.combine(4.0 * a, 4.0 * b), 4.0 * adasum.combine(a, b), rtol=1e-12)
    assert torch.allclose(adasum.combine(a, b), adasum.combine(b, a), rtol=1e-12)


@pytest.mark.parametrize("bad", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_non_floating_dtypes_raise_type_error(bad):
    x = torch.ones(3, dtype=bad)
    with pytest.raises(TypeError):
        adasum.combine(x, x)
    with pytest.raises(TypeError):
        adasum.reduce([x, x])


def test_mismatched_inputs_raise():
    with pytest.raises(ValueError):
        adasum.combine(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError):
        adasum.reduce([torch.ones(3), torch.ones(3, dtype=torch.float64)])
    with pytest.raises(ValueError):
        adasum.reduce([])
    # per-worker lists (the reducers' form) are named, not failed on inside ('list' object has no attribute 'dtype')
    x = torch.ones(3)
    with pytest.raises(TypeError, match=r"adasum.reduce takes one tensor per worker, got a list for worker 0; "
                                        r"for a list of tensors per worker use adasum.Adasum\(\).reduce"):
        adasum.reduce([[x], [x]])
    with pytest.raises(TypeError, match=r"adasum.combine takes two tensors, got list and list"):
        adasum.combine([x], [x])


@pytest.mark.parametrize("workers", list(range(1, 10)) + [16, 17, 31])
def test_reduce_limits_for_any_worker_count(workers):
    g = torch.Generator().manual_seed(workers)
    ortho = orthogonal_columns(max(40, workers + 3), workers, workers)
    assert torch.allclose(adasum.reduce(ortho), sum(ortho), atol=1e-12)
    v = torch.randn(29, dtype=torch.float64, generator=g)
    scales = torch.randn(workers, dtype=torch.float64, generator=g) * 3
    parallel = [s * v for s in scales]
    assert torch.allclose(adasum.reduce(parallel), scales.mean() * v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5, 6, 7, 8, 11])
def test_reduce_matches_independent_tree(workers):
    g = torch.Generator().manual_seed(100 + workers)
    xs = [torch.randn(257, dtype=torch.float64, generator=g) for _ in range(workers)]
    ref = reference_tree([x.numpy() for x in xs])
    assert rel_err(adasum.reduce(xs), ref) < 1e-12


def test_power_of_two_tree_is_horovods():
    g = torch.Generator().manual_seed(7)
    x = [torch.randn(64, dtype=torch.float64, generator=g) for _ in range(4)]
    c = adasum.combine
    horovod = c(c(x[0], x[1]), c(x[2], x[3]))
    assert torch.allclose(adasum.reduce(x), horovod, rtol=1e-13, atol=1e-14)


def spacing(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The gap between neighbouring `dtype` values at each of `values` (float64; subnormals included)."""
    info = torch.finfo(dtype)
    digits = 1 - round(math.log2(info.eps))  # significand bits: 24, 11, 8
    lowest = math.frexp(info.tiny)[1]  # frexp's exponent of the smallest normal
    _, exponent = np.frexp(np.abs(values))
    exponent = np.where(values == 0, lowest, np.maximum(exponent, lowest))
    return np.ldexp(1.0, exponent - digits)


def rounded_tree(vectors: list[np.ndarray], dtype: torch.dtype) -> tuple[np.ndarray, float]:
    """`reference.tree` with each pair's result rounded to `dtype`, as `adasum.reduce` documents (every level
    computed in float64, its result stored in the dtype); and the least margin, over every element of every pair,
    by which its float64 value lies farther from a rounding midpoint of `dtype` than twice the float64 error bound
    of that element (`reference`'s module doc, ``u = U64``: that of the reference and that of the library). Where the
    margin is positive, a library that computes each level from the same inputs in float64 and rounds to nearest
    stores the same values, level after level: its result is bitwise this one."""
    p = len(vectors)
    q = 1 << (p.bit_length() - 1)
    r = p - q
    n = vectors[0].size
    margins = []

    def node(x, y):
        (a, na), (b, nb) = x, y
        big_a, big_b = np.linalg.norm(a), np.linalg.norm(b)
        wa, wb = na / (na + nb), nb / (na + nb)
        exact = pair(a, b, na, nb)
        dot = float(a @ b)
        ca, cb = 1 - wa * dot / big_a**2, 1 - wb * dot / big_b**2
        # element by element: each coefficient off by w (2 g_n + 3u) times the other norm over its own, then the
        # products and the sum
        coefficient = 2 * gamma(n, U64) + 3 * U64
        arithmetic = (wa * coefficient * big_b / big_a * np.abs(a) + wb * coefficient * big_a / big_b * np.abs(b)
                      + gamma(2, U64) * (abs(ca) * np.abs(a) + abs(cb) * np.abs(b)))
        stored = torch.from_numpy(exact).to(dtype).double().numpy()  # round to nearest, ties to even
        gap = spacing(np.minimum(np.abs(exact), np.abs(stored)), dtype)
        margins.append(float(np.min(gap / 2 - np.abs(exact - stored) - 2 * arithmetic)))
        return stored, na + nb

    groups = [node((vectors[2 * i], 1), (vectors[2 * i + 1], 1)) for i in range(r)]
    groups += [(v.astype(np.float64), 1) for v in vectors[2 * r:]]

    def combine(lo: int, hi: int):
        if hi - lo == 1:
            return groups[lo]
        mid = (lo + hi) // 2
        return node(combine(lo, mid), combine(mid, hi))

    return combine(0, q)[0], min(margins)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("workers", [4, 5])
def test_reduce_low_precision_within_dtype_precision(dtype, workers):
    """adasum.reduce of float32 / bfloat16 / float16 tensors: bitwise the reference tree with each level rounded to
    the dtype (`rounded_tree`, whose margin shows that float64 arithmetic cannot change a rounding), and within
    `tree_with_bound` (float64 arithmetic, stored in the dtype) of the unrounded reference tree."""
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(1000, generator=g) for _ in range(workers)]
    low = [x.to(dtype) for x in xs]
    out = adasum.reduce(low)
    assert out.dtype == dtype
    vectors = [x.double().numpy() for x in low]
    expected, margin = rounded_tree(vectors, dtype)
    assert margin > 0, margin
    mismatched = int((out != torch.from_numpy(expected).to(dtype)).sum())
    assert mismatched == 0, f"{mismatched} of {out.numel()} elements differ from the rounded reference"
    ref, bound = tree_with_bound(vectors, U64, STORE_U[str(dtype).removeprefix("torch.")])
    err = float(np.linalg.norm(out.double().numpy() - ref))
    assert err <= bound, (err, bound)


@pytest.mark.parametrize(
    "dtype,exponents",
    [
        (torch.float32, range(-126, 128, 9)),
        (torch.float16, range(-14, 16, 3)),
        (torch.bfloat16, range(-126, 128, 9)),
        (torch.float64, range(-250, 250, 25)),
    ],
)
def test_stability_parallel_vectors_across_the_representable_range(dtype, exponents):
    # Horovod's stability cases: parallel vectors whose scales span the dtype's range.
    base = torch.tensor([0.5, -0.25, 0.75, 1.0], dtype=torch.float64)
    for e in exponents:
        for f in exponents:
            a = (base * 2.0**e).to(dtype)
            b = (base * 2.0**f).to(dtype)
            out = adasum.combine(a, b)
            expected = ((a.double() + b.double()) / 2).to(dtype)
            assert torch.isfinite(out).all(), (e, f)
            assert torch.allclose(out.double(), expected.double(), rtol=2 * torch.finfo(dtype).eps, atol=0), (e, f)


def test_tree_counts():
    t = Tree(5)
    assert (t.groups, t.folded) == (4, 1)
    assert [t.leader(g) for g in range(4)] == [0, 2, 3, 4]
    assert t.follower(0) == 1 and t.follower(1) is None
    assert t.count(0, 2) == 3 and t.count(2, 2) == 2 and t.count(0, 4) == 5
    assert [t.group_of(r) for r in range(5)] == [0, 0, 1, 2, 3]
    assert Tree(8).levels() == [1, 2, 4] and Tree(1).levels() == []
    with pytest.raises(ValueError):
        Tree(0)
    # adasum.core.operator's definition: squared norms below sqrt(the smallest normal float64) count as zero
    assert adasum.core.operator.ZERO_NORM == math.sqrt(sys.float_info.min)


def test_batched_device_kernels_match_cpu_kernels():
    # the GPU path's batched kernels run on the CPU too: both must compute the same per-segment math
    from adasum import kernels as ops
    from adasum.core.operator import coefficients
    from adasum.kernels import torch_ops

    g = torch.Generator().manual_seed(12)
    lengths = [5, 0, 70000, 1, 0, 300, 131072 + 7]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        a = torch.randn(sum(lengths), generator=g).to(dtype)
        b = torch.randn(sum(lengths), generator=g).to(dtype)
        blocked = ops.dot_and_norms(a, b, lengths)
        batched = torch_ops.dot_and_norms(a, b, lengths)
        assert batched.shape == blocked.shape == (3, len(lengths))
        # each against the exactly rounded sums (math.fsum of the float64 products, exact for float32 and bfloat16
        # inputs, within u of each for float64 ones): a float64 sum of n products in any order is off by at most
        # gamma_n sum |x_i y_i|, the reference by U64 sum |x_i y_i| (products) plus U64 of its value
        a64, b64 = a.double().numpy(), b.double().numpy()
        start = 0
        for i, n in enumerate(lengths):
            x, y = a64[start:start + n], b64[start:start + n]
            start += n
            for j, (u, v) in enumerate([(x, y), (x, x), (y, y)]):
                exact = math.fsum((u * v).tolist())
                bound = (gamma(n, U64) + U64) * float(np.abs(u * v).sum()) + U64 * abs(exact)
                for name, sums in (("blocked", blocked), ("batched", batched)):
                    err = abs(float(sums[j, i]) - exact)
                    assert err <= bound, (dtype, name, i, j, err, bound)
        ca, cb = coefficients(blocked, 0.5, 0.5)
        out1, out2 = torch.empty_like(a), torch.empty_like(a)
        ops.scale_add(a, b, ca, cb, lengths, out1)
        torch_ops.scale_add(a, b, ca, cb, lengths, out2)
        # a rounding or two apart at most (an FMA in the BLAS path), relative to the terms' size
        eps = torch.finfo(dtype).eps
        scale = ca.abs().max() * a.double().abs() + cb.abs().max() * b.double().abs()
        assert ((out1.double() - out2.double()).abs() <= 2 * eps * scale).all()


def test_flatten_into_a_buffer_matches_cat_and_round_trips():
    """`flatten(tensors, out)` (one cat on the CPU, batched copies into views of `out` on GPUs) equals
    torch.cat of the flattened tensors, non-contiguous and empty tensors included, and `unflatten_into`
    restores them."""
    from adasum.core.layout import copy_into, flatten, unflatten_into

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(4, 6, generator=g).t(), torch.randn(0), torch.randn(7, generator=g),
               torch.randn(3, 8, generator=g)[:, ::2], torch.randn(2, 3, 5, generator=g)]
    expected = torch.cat([t.reshape(-1) for t in tensors])
    out = torch.full((expected.numel() + 5,), float("nan"))
    flat = flatten(tensors, out)
    assert flat.data_ptr() == out.data_ptr() and flat.numel() == expected.numel()
    assert torch.equal(flat, expected)
    batched = torch.full_like(expected, float("nan"))
    copy_into(tensors, batched)  # the GPU path's batched copies, run here on the CPU
    assert torch.equal(batched, expected)
    copies = [torch.zeros_like(t) for t in tensors]
    unflatten_into(flat, copies)
    assert all(torch.equal(a, b) for a, b in zip(copies, tensors))
