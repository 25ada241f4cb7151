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


def tree_with_bound(vectors: list[np.ndarray], u: float = U64, store_u: float = 0.0) -> tuple[np.ndarray, float]:
    """`tree` of `vectors` (taken as exact) and a first-order bound on the 2-norm error of a result computed with
    unit roundoff `u` and stored with `store_u` (module doc). The library's kernels compute in float64 (``u=U64``)
    and store in the tensors' dtype (``store_u`` its unit roundoff; 0 for float64 kept as it is)."""
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
        carried = spread(ea, 1 + wb + 4 * wa * big_b / big_a if big_a else np.inf)
        carried += spread(eb, 1 + wa + 4 * wb * big_a / big_b if big_b else np.inf)
        return out, na + nb, carried + local

    leaves = [(v.astype(np.float64), 1, 0.0) for v in vectors]
    groups = [node(leaves[2 * i], leaves[2 * i + 1]) for i in range(r)] + leaves[2 * r:]

    def combine(lo: int, hi: int) -> tuple:
        if hi - lo == 1:
            return groups[lo]
        mid = (lo + hi) // 2
        return node(combine(lo, mid), combine(mid, hi))

    value, _, bound = combine(0, q)
    np.testing.assert_array_equal(value, tree(vectors))  # the bound follows the reference's tree
    return value, bound


STORE_U = {"float64": 0.0, "float32": U32, "float16": U16, "bfloat16": UBF16}
"""The unit roundoff of storing a result in each dtype, by its name (`torch.float32` is "float32")."""


def combine_with_bound(tensors) -> tuple:
    """`tree_with_bound` of torch tensors, one per rank: (the reference in float64, shaped like the first, and the
    bound on a result computed in float64 and stored in their dtype)."""
    import torch

    vectors = [t.detach().double().cpu().reshape(-1).numpy() for t in tensors]
    value, bound = tree_with_bound(vectors, U64, STORE_U[str(tensors[0].dtype).removeprefix("torch.")])
    return torch.from_numpy(value).reshape(tensors[0].shape), bound
