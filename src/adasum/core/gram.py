r"""The tree's coefficients from the Gram matrix of the workers' vectors (SPEC 1.3), for the slice-parallel
schedule (`adasum.collectives.slices`). Pure math; no communication.

Every node of the tree is a linear combination of the workers' vectors: leaf j is ``x_j``, and a pair gives
``c_a a + c_b b``. Written as weights over the workers (``node = sum_j W[j] x_j``), every level's ``<a,b>``,
``|a|^2``, ``|b|^2`` are quadratic forms of the Gram matrix ``G[i, j] = <x_i, x_j>`` (per tensor)::

    <a,b> = W_a^T G W_b,   |a|^2 = W_a^T G W_a,   |b|^2 = W_b^T G W_b

so one pass over the P vectors (G's partial sums over a slice, in float64), one all-reduce of G, this small
computation per tensor, and one pass (``sum_j w_j x_j`` with the root's weights) give the whole tree; level by
level it takes a pass of sums, an all-reduce and a combination pass per level. The coefficients are those of
`adasum.core.operator.coefficients`, zero guard included, level after level (or another rule's on the same
tree: `weights`' `rule`); the result equals the
level-by-level tree in exact arithmetic. Numerically, the inner nodes are never rounded to the tensor's dtype:
the result is rounded once.

The same Gram sums give AdaCons' per-worker sums (`consensus_sums`): with ``m = (1/P) sum_j x_j``,
``<x_i, m> = (1/P) sum_j G[i, j]``, ``|x_i|^2 = G[i, i]`` and ``|m|^2 = (1/P^2) sum_ij G[i, j]``.

Non-finite values: a pair whose sums are not all finite gets NaN coefficients, so a tensor with a NaN or Inf in
any worker's copy comes out NaN everywhere. (The quadratic forms carry one worker's NaN into every node's sums,
through zero weights: the zero guard, which reads a NaN norm as zero, would otherwise give such nodes
coefficient 1 and a finite result where the level-by-level tree gives a non-finite one.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from adasum.core.operator import pair_coefficients
from adasum.core.tree import Tree, level_pairs


def pair_ops(tree: Tree) -> list[tuple[int, int, int, int]]:
    """The tree's pairs in the order they combine (`level_pairs`, level after level): (node a, node b, workers of
    a, workers of b), node k being the vector that rank k holds (the pair's result replaces node a). P - 1 pairs;
    the root ends as node 0.

    >>> pair_ops(Tree(3))
    [(0, 1, 1, 1), (0, 2, 2, 1)]
    """
    return [pair for level in level_pairs(tree) for pair in level]


def weights(
    gram: torch.Tensor, tree: Tree, rule: Callable[[torch.Tensor, int, int], torch.Tensor] = pair_coefficients
) -> tuple[torch.Tensor, torch.Tensor]:
    """The root's weights over the workers and every pair's sums, from ``gram`` ([P, P, T] float64: per tensor
    the Gram matrix of the P workers' vectors): (weights [P, T], sums [P - 1, 3, T]: ``<a,b>``, ``|a|^2``,
    ``|b|^2`` of each pair of `pair_ops`, in that order). `rule`: each pair's ``[2, T]`` coefficients from its
    ``[3, T]`` sums and worker counts (Adasum's, `adasum.core.operator.pair_coefficients`; another tree rule's,
    `adasum.collectives.slices.CombineOp.pair_coefficients`)."""
    workers, _, width = gram.shape
    if workers != tree.workers:
        raise ValueError(f"a Gram matrix of {workers} workers for a tree of {tree.workers} (internal error; please "
                         "report)")
    nodes = torch.eye(workers, dtype=torch.float64, device=gram.device).unsqueeze(-1).repeat(1, 1, width)
    ops = pair_ops(tree)
    sums = torch.empty(len(ops), 3, width, dtype=torch.float64, device=gram.device)
    for k, (a, b, workers_a, workers_b) in enumerate(ops):
        side_a, side_b = nodes[a], nodes[b]  # [P, T]: weights over the workers
        g_a = torch.einsum("ijt,it->jt", gram, side_a)
        g_b = torch.einsum("ijt,it->jt", gram, side_b)
        sums[k, 0] = (g_a * side_b).sum(0)
        sums[k, 1] = (g_a * side_a).sum(0)
        sums[k, 2] = (g_b * side_b).sum(0)
        coeff_a, coeff_b = rule(sums[k], workers_a, workers_b)
        broken = ~torch.isfinite(sums[k]).all(0)  # module doc: non-finite sums give NaN, never the zero guard's 1
        coeff_a = torch.where(broken, torch.nan, coeff_a)
        coeff_b = torch.where(broken, torch.nan, coeff_b)
        nodes[a] = coeff_a * side_a + coeff_b * side_b
    return nodes[0], sums


def consensus_sums(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdaCons' sums from ``gram`` ([P, P, T] float64, per tensor the Gram matrix of the P workers' vectors, m their
    mean): (``<x_i, m>`` [T, P], ``|x_i|^2`` [T, P], ``|m|^2`` [T]), as `adasum.reducers.adacons.coefficients`
    takes them per segment.

    >>> x = torch.tensor([[3.0, 4.0], [3.0, 4.0]], dtype=torch.float64)   # two equal workers, one tensor
    >>> dots, sq_norms, mean_sq = consensus_sums((x @ x.T).unsqueeze(-1))
    >>> dots.tolist(), sq_norms.tolist(), mean_sq.tolist()
    ([[25.0, 25.0]], [[25.0, 25.0]], [25.0])
    """
    workers = gram.shape[0]
    dots = (gram.sum(1) / workers).T
    sq_norms = torch.diagonal(gram, dim1=0, dim2=1)
    return dots, sq_norms, gram.sum((0, 1)) / workers**2
