"""An independent float64 NumPy reference of AdaCons for the tests, written from the formula in
plain loops, sharing no code with the package.

Rules (the package's, stated in adasum/adacons.py): a_i = <g_i, m>/|g_i| (0 for a zero g_i);
sorted momentum s = beta s + (1 - beta) sort(a) (s = sort(a) the first time), the worker at rank
position k (ties by worker index) gets s[k]; negative values clipped to 0; normalised to sum 1,
1/N each if the sum is not positive; d = sum_i c_i g_i/|g_i|, times |m| for scale "mean_norm".
"""

from __future__ import annotations

import math

import numpy as np

TINY = math.sqrt(np.finfo(np.float64).tiny)


def smooth_sorted(a: list[float], state: list[float] | None, beta: float) -> tuple[list[float], list[float]]:
    """The sort momentum, by hand: which worker sits at which rank position, then look it up."""
    n = len(a)
    order = sorted(range(n), key=lambda i: (a[i], i))  # order[k] = worker at rank position k
    ordered = [a[i] for i in order]
    state = ordered if state is None else [beta * state[k] + (1 - beta) * ordered[k] for k in range(n)]
    smoothed = [0.0] * n
    for position, worker in enumerate(order):
        smoothed[worker] = state[position]
    return smoothed, state


def coefficients(a: list[float]) -> list[float]:
    clipped = [max(x, 0.0) for x in a]
    total = sum(clipped)
    if total <= 0:
        return [1.0 / len(a)] * len(a)
    return [x / total for x in clipped]


class AdaConsReference:
    """Call with a list (workers) of lists of arrays; keeps one momentum state per segment layout."""

    def __init__(self, beta: float = 0.0, per_tensor: bool = False, scale: str = "mean_norm") -> None:
        self.beta, self.per_tensor, self.scale = beta, per_tensor, scale
        self.states: dict = {}

    def __call__(self, per_worker: list[list[np.ndarray]]) -> list[np.ndarray]:
        n = len(per_worker)
        count = len(per_worker[0])
        vecs = [[np.asarray(t, dtype=np.float64).reshape(-1) for t in w] for w in per_worker]
        if self.per_tensor:
            segments = [[i] for i in range(count)]
        else:
            segments = [list(range(count))]
        key = tuple(v.size for v in vecs[0])
        states = self.states.setdefault(key, [None] * len(segments))
        out = [np.zeros_like(v) for v in vecs[0]]
        for s, members in enumerate(segments):
            g = [np.concatenate([vecs[j][i] for i in members]) for j in range(n)]
            m = sum(g) / n
            norms = [math.sqrt(float(x @ x)) for x in g]
            a = [float(g[j] @ m) / norms[j] if norms[j] ** 2 >= TINY else 0.0 for j in range(n)]
            smoothed, states[s] = smooth_sorted(a, states[s], self.beta)
            c = coefficients(smoothed)
            scale = math.sqrt(float(m @ m)) if self.scale == "mean_norm" else 1.0
            d = sum(c[j] * g[j] / norms[j] for j in range(n) if norms[j] ** 2 >= TINY) * scale
            d = np.broadcast_to(d, g[0].shape) if np.isscalar(d) else d
            start = 0
            for i in members:
                out[i] = d[start : start + vecs[0][i].size].copy()
                start += vecs[0][i].size
        return [o.reshape(np.shape(t)) for o, t in zip(out, per_worker[0])]
