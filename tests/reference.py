"""An independent float64 NumPy reference of Adasum for the tests: the operator written from the
paper's formula and the tree written recursively, sharing no code with the package; and a first-order bound on
how far a computed result may lie from it (`tree_with_bound`), which the tests' tolerances come from.

Error bounds (``u`` the unit roundoff of the arithmetic, ``g_n = n u/(1 - n u)``): for one pairwise step on a
vector of ``n`` elements with inputs of norms A, B, the computed dot products are off by at most ``g_n A B`` (any
summation order), so ``|delta c_a| A <= w_a (2 g_n + 3u) B``; the combination adds
``g_2 (|c_a| A + |c_b| B) <= g_2 (A + B + w_a B + w_b A)`` and storing in the output's dtype ``u_store |out|``. An
input error ``e_a`` reaches the output at most multiplied by the operator's Lipschitz bound ``1 + w_b + 4 w_a B/A``
(differentiate the formula). `tree_with_bound` walks the reference tree adding these up (first order).
"""

from __future__ import annotations

import numpy as np

U64, U32, U16, UBF16 = 2.0**-53, 2.0**-24, 2.0**-11, 2.0**-8
"""Unit roundoffs of float64, float32, float16 and bfloat16."""


def pair(a: np.ndarray, b: np.ndarray, na: int = 1, nb: int = 1) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    ca = 1.0 if aa < tiny else 1.0 - na / (na + nb) * dot / aa
    cb = 1.0 if bb < tiny else 1.0 - nb / (na + nb) * dot / bb
    return ca * a + cb * b


def tree(vectors: list[np.ndarray]) -> np.ndarray:
    """Fold ranks (2i, 2i+1) for i < r, then Horovod's tree over the 2**k groups, counts carried."""
    p = len(vectors)
    q = 1 << (p.bit_length() - 1)
    r = p - q
    groups = []
    for i in range(r):
        groups.append((pair(vectors[2 * i], vectors[2 * i + 1]), 2))
    for rank in range(2 * r, p):
        groups.append((vectors[rank].astype(np.float64), 1))

    def combine(lo: int, hi: int):
        if hi - lo == 1:
            return groups[lo]
        mid = (lo + hi) // 2
        (a, na), (b, nb) = combine(lo, mid), combine(mid, hi)
        return pair(a, b, na, nb), na + nb

    return combine(0, q)[0]


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def spread(error: float, lipschitz: float) -> float:
    """An input's error as it reaches the output (none where there is none, whatever the bound)."""
    return lipschitz * error if error else 0.0


def tree_with_bound(
    vectors: list[np.ndarray], u: float = U64, store_u: float = 0.0, leaf_errors=None, node_error=None
) -> tuple[np.ndarray, float]:
    """`tree` of `vectors` and a first-order bound on the 2-norm error of a result computed with unit roundoff `u`
    and stored with `store_u` (module doc), from inputs off by at most ``leaf_errors[i]`` (default: exact) and
    with ``node_error(out)`` more on each pairwise result `out` (a store's underflow, say; none on the result of
    two exact zeros, which is exact). The library's kernels compute in float64 (``u=U64``) and store in the
    tensors' dtype (``store_u`` its unit roundoff; 0 for float64 kept as it is)."""
    p = len(vectors)
    q = 1 << (p.bit_length() - 1)
    r = p - q
    n = vectors[0].size

    def node(a: tuple, b: tuple) -> tuple:
        (va, na, ea), (vb, nb, eb) = a, b
        big_a, big_b = np.linalg.norm(va), np.linalg.norm(vb)
        wa, wb = na / (na + nb), nb / (na + nb)
        out = pair(va, vb, na, nb)
        local = ((2 * gamma(n, u) + 3 * u) * (wa * big_b + wb * big_a)
                 + gamma(2, u) * (big_a + big_b + wa * big_b + wb * big_a) + store_u * np.linalg.norm(out))
        if node_error is not None and (ea or eb or big_a or big_b):
            local += node_error(out)
        carried = spread(ea, 1 + wb + 4 * wa * big_b / big_a if big_a else np.inf)
        carried += spread(eb, 1 + wa + 4 * wb * big_a / big_b if big_b else np.inf)
        return out, na + nb, carried + local

    errors = leaf_errors if leaf_errors is not None else [0.0] * p
    leaves = [(v.astype(np.float64), 1, float(e)) for v, e in zip(vectors, errors)]
    groups = [node(leaves[2 * i], leaves[2 * i + 1]) for i in range(r)] + leaves[2 * r:]

    def combine(lo: int, hi: int) -> tuple:
        if hi - lo == 1:
            return groups[lo]
        mid = (lo + hi) // 2
        return node(combine(lo, mid), combine(mid, hi))

    value, _, bound = combine(0, q)
    np.testing.assert_array_equal(value, tree(vectors))  # the bound follows the reference's tree
    return value, bound


# torch tensors, one per rank: the library's results against the reference, each with the bound on their distance
# (the library's error from the exact result plus the float64 reference's own)

STORE_U = {"float64": 0.0, "float32": U32, "float16": U16, "bfloat16": UBF16}
"""The unit roundoff of storing a float64 result in each dtype, by its name (`torch.float32` is "float32")."""

UNIT = {"float64": U64, "float32": U32, "float16": U16, "bfloat16": UBF16}
"""The unit roundoff of arithmetic in each dtype, by its name."""


def dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def flat64(tensors) -> list[np.ndarray]:
    return [t.detach().double().cpu().reshape(-1).numpy() for t in tensors]


def error_of(got, reference) -> float:
    """``||got - reference||_2`` in float64, on the CPU (tensors or arrays)."""
    got = got.detach().double().cpu().reshape(-1).numpy() if hasattr(got, "detach") else np.asarray(got, np.float64)
    ref = reference.double().cpu().reshape(-1).numpy() if hasattr(reference, "double") else np.asarray(reference)
    return float(np.linalg.norm(got.reshape(-1) - ref.astype(np.float64).reshape(-1)))


def _finfo(dtype):
    import torch

    return torch.finfo(dtype)


def underflow(dtype, n: int) -> float:
    """What storing n values in `dtype` may add to their 2-norm error beyond the relative ``STORE_U`` (gradual
    underflow: a value below the smallest normal number is off by up to half the smallest subnormal, ``u * tiny``,
    not by ``u`` of itself). Nothing for float64, kept as computed."""
    return STORE_U[str(dtype).removeprefix("torch.")] * _finfo(dtype).tiny * np.sqrt(n)


def store_error(dtype, n: int):
    """What storing a float64 result `out` of n elements in `dtype` may add to its 2-norm error beyond
    ``STORE_U[dtype] ||out||``, as a function of `out`: the underflow, and for float16 and bfloat16 a rounding to
    float32 first (torch converts float64 to them through float32: ``1 + 2**-11 + 2**-40`` becomes 1 in float16),
    ``U32 ||out||`` more with float32's own underflow."""
    import torch

    extra = underflow(dtype, n)
    if _finfo(dtype).eps > _finfo(torch.float32).eps:
        return lambda out: extra + U32 * (np.linalg.norm(out) + _finfo(torch.float32).tiny * np.sqrt(n))
    return lambda out: extra


def combine_with_bound(tensors) -> tuple:
    """Adasum of torch tensors, one per rank, by the reference (float64, shaped like the first) and the bound on
    its distance from a library result computed in float64 and stored in their dtype: `tree_with_bound`'s with the
    stores' `store_error`, plus the float64 reference's own rounding (as large as the library's for float64)."""
    import torch

    vectors = flat64(tensors)
    dtype = tensors[0].dtype
    value, bound = tree_with_bound(vectors, U64, STORE_U[dtype_name(tensors[0])],
                                   node_error=store_error(dtype, vectors[0].size))
    return torch.from_numpy(value).reshape(tensors[0].shape), bound + tree_with_bound(vectors, U64)[1]


def half_with_bound(tensors, dtype) -> tuple:
    """Adasum under torch's fp16/bf16 compression wrappers: the library combines the gradients rounded to `dtype`
    (the wrapper's cast, done here alike) and stores in `dtype`; the wrapper's cast back is exact (every half
    value is a float32). So `combine_with_bound` of the rounded gradients."""
    return combine_with_bound([t.to(dtype) for t in tensors])


def node_means_with_errors(tensors, local_size: int) -> tuple:
    """The node means in float64 (NumPy's mean of each node's ranks) and per node a bound on the 2-norm distance
    between the library's node mean and this one. The library sums a node's L tensors in their dtype (the
    intra-node reduce-scatter, any order: ``gamma_{L-1}(u) sum_i |x_i|``), then divides by L in their dtype
    (``u |mean|``, plus underflow); NumPy's float64 mean adds the same with U64. One rank a node: the inputs,
    exact."""
    vectors, name = flat64(tensors), dtype_name(tensors[0])
    u, n = UNIT[name], vectors[0].size
    means, errors = [], []
    for start in range(0, len(vectors), local_size):
        block = vectors[start : start + local_size]
        mean = np.mean(block, axis=0)
        error = 0.0
        if local_size > 1 and any(v.any() for v in block):
            spread_sum = sum(np.linalg.norm(v) for v in block) / local_size  # >= ||sum_i |x_i| / L||
            error = ((gamma(local_size - 1, u) + gamma(local_size - 1, U64)) * spread_sum
                     + (u + U64) * np.linalg.norm(mean) + u * _finfo(tensors[0].dtype).tiny * np.sqrt(n))
        means.append(mean)
        errors.append(error)
    return means, errors


def hierarchical_with_bound(tensors, local_size: int) -> tuple:
    """Hierarchical Adasum (the mean inside nodes of `local_size` consecutive ranks, Adasum across nodes) by the
    reference: `tree_with_bound` of the float64 node means, computed in float64 and stored in the tensors' dtype,
    from the node means' own errors (`node_means_with_errors`), with the stores' (`store_error`), plus the
    reference's own rounding. Returns (the reference shaped like the first tensor, the bound on its distance from
    a library result)."""
    import torch

    means, errors = node_means_with_errors(tensors, local_size)
    value, bound = tree_with_bound(means, U64, STORE_U[dtype_name(tensors[0])], leaf_errors=errors,
                                   node_error=store_error(tensors[0].dtype, means[0].size))
    return torch.from_numpy(value).reshape(tensors[0].shape), bound + tree_with_bound(means, U64)[1]


def mean_with_bound(tensors) -> tuple:
    """The mean of the ranks' tensors in float64 and the bound on a library Mean: a sum all-reduce in their dtype
    (any order: ``gamma_{p-1}(u) sum_i ||x_i||``) then a division by p in their dtype (``u ||mean||``, plus
    underflow), or on NCCL each term multiplied by a rounded 1/p first (two roundings more at most, held by
    ``gamma_{p+1}``); the float64 mean computed here adds the same with U64."""
    import torch

    p, u = len(tensors), UNIT[dtype_name(tensors[0])]
    stacked = torch.stack([t.detach().double().cpu() for t in tensors])
    value = stacked.sum(0) / p
    norms = float(stacked.reshape(p, -1).norm(dim=1).sum())
    bound = ((gamma(p + 1, u) + gamma(p - 1, U64)) * norms / p + (u + U64) * float(value.norm())
             + u * _finfo(tensors[0].dtype).tiny * np.sqrt(value.numel()))
    return value, bound


def sum_with_bound(tensors) -> tuple:
    """The sum of the ranks' tensors in float64 and the bound on a library Sum: a sum all-reduce in their dtype
    (any order: ``gamma_{p-1}(u) sum_i ||x_i||``, no underflow: a sum is exact where it is subnormal); the float64
    sum computed here adds the same with U64."""
    import torch

    p, u = len(tensors), UNIT[dtype_name(tensors[0])]
    stacked = torch.stack([t.detach().double().cpu() for t in tensors])
    norms = float(stacked.reshape(p, -1).norm(dim=1).sum())
    return stacked.sum(0), (gamma(p - 1, u) + gamma(p - 1, U64)) * norms
