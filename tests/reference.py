"""An independent float64 NumPy reference of Adasum for the tests: the operator written from the
paper's formula and the tree written recursively, sharing no code with the package."""

from __future__ import annotations

import numpy as np


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
