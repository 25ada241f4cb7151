"""The combine rule as an op: a rule other than Adasum's (`CombineOp` with `pair_coefficients` only) runs through
the VHDD schedule on gloo processes, on every transport a CPU group can run it on (point-to-point in whole halves
and in pieces that cut tensors, the NCCL-collectives transport's all-gather, which gloo also has) and on the
slice-parallel movers (the Gram form the op gets from its pair rule), and through the hierarchical forms; each
against an independent float64 reference (the mean, the sum), within a first-order bound, ranks bitwise equal."""

import pytest
import torch

from adasum.collectives.hierarchical import adasum_hierarchical_flat_, build_hierarchy
from adasum.collectives.slices import CombineOp
from adasum.collectives.vhdd import adasum_flat_
from adasum.transport import select
from adasum.transport.c10d import Collectives, post
from adasum.transport.groups import group_timeout

import distributed

SIZES = [5, 0, 130, 1, 77, 301, 2, 0, 64]
EPS = {torch.float64: 2.0**-53, torch.float32: 2.0**-24}
"""Unit roundoffs."""


class Mean(CombineOp):
    """Each pair weighted by the workers each side stands for: the tree's root is the mean of the P copies."""

    def pair_coefficients(self, sums, workers_a, workers_b):
        total = workers_a + workers_b
        rows = torch.tensor([[workers_a / total], [workers_b / total]], dtype=torch.float64, device=sums.device)
        return rows.expand(2, sums.shape[1])


class Sum(CombineOp):
    """Coefficients 1 and 1: the root is the sum of the copies."""

    def pair_coefficients(self, sums, workers_a, workers_b):
        return torch.ones(2, sums.shape[1], dtype=torch.float64, device=sums.device)


class GramOnly(CombineOp):
    """A rule with a Gram form only: the VHDD schedule cannot run it pair by pair."""

    def weights(self, gram, first):
        return torch.full(gram.shape[1:], 1.0 / gram.shape[0], dtype=torch.float64)


class Coupled(Mean):
    coupled = True


def levels_of(world: int) -> int:
    """The tree's depth over `world` workers: the fold where P is not a power of two, then log2 of the rest."""
    groups = 1 << (world.bit_length() - 1)
    return (groups.bit_length() - 1) + (world > groups)


def check(got: torch.Tensor, every: list[torch.Tensor], rule: str, levels: int, what) -> None:
    """`got` against the rule's float64 result of the ranks' copies, tensor by tensor. Bound, first order: each
    level's combination ``c_a a + c_b b`` is computed in float64 from coefficients rounded once (the mean's), so it
    adds at most 3 u64 of ``|c_a a| + |c_b b|`` and, stored in a narrower dtype, its unit roundoff of that; over
    ``L`` levels at most ``L (3 u64 + u) sum_j w_j |x_j|``, w_j the copies' weights in the root (1 or 1/P); twice
    that."""
    stacked = torch.stack([x.double() for x in every])
    weight = 1.0 if rule == "sum" else 1.0 / len(every)
    want = stacked.sum(0) * weight
    bound = 2 * levels * (3 * EPS[torch.float64] + EPS[got.dtype]) * (stacked.abs().sum(0) * weight)
    error = (got.double() - want).abs()
    assert (error <= bound).all(), (what, float((error - bound).max()))


def body(rank, world):
    ops = {"mean": Mean(), "sum": Sum()}
    g = torch.Generator().manual_seed(world)
    every = [torch.randn(sum(SIZES), generator=g, dtype=torch.float64) for _ in range(world)]
    movers = {
        "p2p": lambda: select(None, "p2p"),
        "p2p pieces": lambda: select(None, "p2p", piece_elements=(200, 200)),  # pieces that cut tensors
        "slices": lambda: select(None, "slices"),
        "one-shot": lambda: select(None, "one-shot"),
    }
    if world & (world - 1) == 0:  # the all-gather: every rank a leader of the tree
        movers["collectives"] = lambda: Collectives(None, 100 * 8, group_timeout(), post)
    out = {}
    for rule, op in ops.items():
        for name, mover in movers.items():
            for dtype in (torch.float64, torch.float32) if name == "p2p" else (torch.float64,):
                mine = every[rank].to(dtype, copy=True)
                adasum_flat_(mine, SIZES, transport=mover(), op=op)
                check(mine, [x.to(dtype) for x in every], rule, levels_of(world), (rule, name, dtype))
                out[rule, name, str(dtype)] = mine.numpy().tobytes()
    # the test tells the rules apart: Adasum's tree (no op) is not the mean of these copies
    adasum = every[rank].clone()
    adasum_flat_(adasum, SIZES, transport=select(None, "p2p"))
    with pytest.raises(AssertionError):
        check(adasum, every, "mean", levels_of(world), "adasum")
    if world == 4:  # two nodes of two: the node means' tree across nodes, and the two tiers
        for exact in (False, True):
            hierarchy = build_hierarchy(local_size=2, exact=exact)
            for rule, op in ops.items():
                mine = every[rank].clone()
                adasum_hierarchical_flat_(mine, SIZES, hierarchy, op)
                if exact:  # the flat tree of the rule over every rank
                    check(mine, every, rule, levels_of(world), (rule, "two tiers"))
                else:  # the rule across the node means
                    means = [(every[n] + every[n + 1]) / 2 for n in (0, 2)]
                    check(mine, means, rule, levels_of(2) + 1, (rule, "hierarchical"))
                out[rule, "hierarchical", exact] = mine.numpy().tobytes()
    refusals = []
    for op in (GramOnly(), Coupled()):
        with pytest.raises(ValueError) as caught:
            adasum_flat_(every[rank].clone(), SIZES, transport=select(None, "p2p"), op=op)
        refusals.append(str(caught.value))
    out["refusals"] = refusals
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_rule_other_than_adasums_runs_on_the_vhdd_schedule(world):
    results = distributed.run(world, body)
    distributed.assert_ranks_agree(results)
    gram_only, coupled = results[0]["refusals"]
    assert "combines pair by pair: GramOnly has no level form" in gram_only
    assert "Coupled couples tensors" in coupled


def test_the_ops_level_form_and_its_gram_form_agree_in_one_process():
    """`CombineOp.pair` applies `pair_coefficients` per segment; the Gram form it gets is the tree's root weights
    from the same rule: the mean's are 1/P for every P, the sum's 1."""
    from adasum.core.tree import Tree

    a, b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor([5.0, 7.0, 11.0], dtype=torch.float64)
    out = torch.empty(3, dtype=torch.float64)
    Mean().pair(a, b, torch.zeros(3, 2, dtype=torch.float64), 2, 1, [1, 2], out)
    assert torch.allclose(out, (2 * a + b) / 3, rtol=4 * EPS[torch.float64], atol=0)
    for workers in (2, 3, 5, 8):
        gram = torch.randn(workers, workers, 4, dtype=torch.float64)
        assert torch.allclose(Mean().weights(gram, 0), torch.full((workers, 4), 1 / workers, dtype=torch.float64))
        assert torch.equal(Sum().weights(gram, 0), torch.ones(workers, 4, dtype=torch.float64))
        assert Mean().pairwise and not GramOnly().pairwise and Tree(workers).workers == workers
    with pytest.raises(NotImplementedError, match="GramOnly has no level form"):
        GramOnly().pair(a, b, torch.zeros(3, 1, dtype=torch.float64), 1, 1, [3], out)

    class Wrong(CombineOp):
        def pair_coefficients(self, sums, workers_a, workers_b):
            return torch.ones(3, sums.shape[1])

    with pytest.raises(ValueError, match=r"not float64 \(2, 1\)"):
        Wrong().pair(a, b, torch.zeros(3, 1, dtype=torch.float64), 1, 1, [3], out)
