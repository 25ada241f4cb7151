"""The tree from the Gram matrices (`adasum.core.gram`): its result, ``sum_j w_j x_j``, against the independent
float64 reference tree, and the operator's exact cases (zero sides, parallel and orthogonal inputs)."""

import numpy as np
import pytest
import torch

from adasum.core.gram import consensus_sums, pair_ops, weights
from adasum.core.tree import Tree, level_pairs
from adasum.kernels import combine_from_sums, cpu, dot_and_norms

from reference import tree as reference_tree

EPS = np.finfo(np.float64).eps


def _tree_of(rows: list[torch.Tensor]) -> torch.Tensor:
    gram = cpu.gram(rows, [rows[0].numel()])
    w, _ = weights(gram, Tree(len(rows)))
    return sum(float(w[j, 0]) * rows[j] for j in range(len(rows)))


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_the_gram_form_is_the_reference_tree(world):
    # well-conditioned inputs (64 dimensions, more than the workers): no node nearly cancels, so the float64 error
    # stays a few eps64 per level times the terms (the ratio of the terms' magnitudes to the result, here < 10)
    g = torch.Generator().manual_seed(world)
    rows = [torch.randn(64, generator=g, dtype=torch.float64) for _ in range(world)]
    got = _tree_of(rows).numpy()
    want = reference_tree([r.numpy() for r in rows])
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 100 * world * EPS


def test_pair_ops_are_the_levels_in_order_and_end_at_node_zero():
    for world in range(2, 17):
        ops = pair_ops(Tree(world))
        assert ops == [op for level in level_pairs(Tree(world)) for op in level]
        assert len(ops) == world - 1 and ops[-1][0] == 0 and ops[-1][2] + ops[-1][3] == world


def test_exact_cases_of_the_operator_hold_through_the_weights():
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    e = [torch.eye(4, dtype=torch.float64)[k] for k in range(4)]
    assert torch.allclose(_tree_of([x, 2 * x, -x]), (x + 2 * x - x) / 3, rtol=0, atol=4 * EPS)  # parallel: the mean
    assert torch.allclose(_tree_of(e), torch.ones(4, dtype=torch.float64), rtol=0, atol=4 * EPS)  # orthogonal: the sum
    zero = torch.zeros(3, dtype=torch.float64)
    assert torch.equal(_tree_of([zero, zero, zero, zero]), zero)  # all zero: zero, never NaN
    # an exact cancellation (x and -x fold to zero): the zero guard gives the other side coefficient 1
    got = _tree_of([x, -x, 3 * e[0][:3]])
    assert torch.allclose(got, 3 * e[0][:3], rtol=0, atol=4 * EPS), got


def test_level_sums_are_the_quadratic_forms_of_the_nodes():
    # P = 4: the second level's sums are those of the first level's two results, formed as vectors
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(16, generator=g, dtype=torch.float64) for _ in range(4)]
    w, sums = weights(cpu.gram(rows, [16]), Tree(4))
    nodes = []
    for a, b in ((0, 1), (2, 3)):
        out = torch.empty(16, dtype=torch.float64)
        combine_from_sums(rows[a], rows[b], dot_and_norms(rows[a], rows[b], [16]), 1, 1, [16], out)
        nodes.append(out)
    want = dot_and_norms(nodes[0], nodes[1], [16])
    assert torch.allclose(sums[2], want, rtol=1e-13, atol=0)


def test_a_non_finite_copy_makes_the_whole_tensor_nan():
    # the quadratic forms carry worker 3's NaN into every node's sums (through zero weights): those give NaN
    # coefficients, never the zero guard's 1, so no element of the tensor comes out finite
    rows = [torch.ones(5, dtype=torch.float64) for _ in range(4)]
    rows[3][2] = float("nan")
    assert torch.isnan(_tree_of(rows)).all()
    rows[3][2] = float("inf")
    assert not torch.isfinite(_tree_of(rows)).any()


def test_consensus_sums_are_the_projections_on_the_mean():
    """AdaCons' sums from the Gram matrices equal the direct float64 sums: <x_i, m>, |x_i|^2, |m|^2 per tensor."""
    g = np.random.default_rng(4)
    x = g.standard_normal((5, 3, 11))  # workers, tensors, elements
    gram = torch.from_numpy(np.einsum("itn,jtn->ijt", x, x))
    dots, sq_norms, mean_sq = consensus_sums(gram)
    m = x.mean(0)
    np.testing.assert_allclose(dots.numpy(), np.einsum("itn,tn->ti", x, m), rtol=1e-13)
    np.testing.assert_allclose(sq_norms.numpy(), np.einsum("itn,itn->ti", x, x), rtol=1e-13)
    np.testing.assert_allclose(mean_sq.numpy(), np.einsum("tn,tn->t", m, m), rtol=1e-13)
