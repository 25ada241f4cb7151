"""Hierarchical Adasum on gloo, emulating nodes of consecutive ranks: against the definition
(Adasum over the node means, NumPy reference) within its error bound, with bitwise agreement across
ranks, and the placement errors."""


import pytest
import torch

import adasum
from adasum.collectives import hierarchical
from adasum.collectives.hierarchical import check_placement, reduce_hierarchical
from adasum.settings import override

import distributed
from reference import U64, combine_with_bound, error_of, gamma, hierarchical_with_bound
from reference import tree as reference_tree

# odd sizes so that shards cut through tensors, zero-size tensors, and a total not divisible by 2 or 4
SIZES = [7, 0, 33, 5, 130, 1, 64, 0, 17, 3, 250, 9]

def check_against_reference(got, data, local_size, what):
    """Each non-empty tensor of `got` within `hierarchical_with_bound` of the hierarchical reference of the
    ranks' tensors `data` (one list per rank)."""
    for i, t in enumerate(got):
        assert t.shape == data[0][i].shape, (what, i)
        if t.numel():
            ref, bound = hierarchical_with_bound([d[i] for d in data], local_size)
            assert error_of(t, ref) <= bound, (what, local_size, i, error_of(t, ref), bound)


def hierarchical_body(rank, world, local_sizes):
    """Every tensor within the bound of the reference over the ranks' inputs (`hierarchical_with_bound`), the
    single-process form too."""
    out = {}
    for local_size in local_sizes:
        reducer = adasum.Adasum(hierarchical=True, local_size=local_size)
        reducer.setup()
        for seed, sizes in [(1, SIZES), (2, [3]), (3, [1, 1])]:  # also buffers smaller than a node
            g = torch.Generator().manual_seed(seed * 100 + world)
            data = [[torch.randn(n, generator=g) for n in sizes] for _ in range(world)]
            mine = [t.clone() for t in data[rank]]
            reducer.all_reduce(mine)
            check_against_reference(mine, data, local_size, ("all_reduce", seed))
            # the single-process form is the same definition, within the same bound
            check_against_reference(reducer.reduce(data), data, local_size, ("reduce", seed))
            out[(local_size, seed)] = torch.cat(mine).numpy().tobytes()

        # parallel inputs (exactly: powers of two) give their mean; the hook-style flat call
        v = torch.randn(40, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        inputs = [v * 2.0**r for r in range(world)]
        t = inputs[rank].clone()
        reducer.all_reduce_flat(t, [40])
        check_against_reference([t], [[x] for x in inputs], local_size, "parallel")
        # the exact result is the exact mean (the bound holds the library's distance from it); computing the
        # mean here rounds twice (the factor, the product)
        mean = v * ((2**world - 1) / world)
        ref, bound = hierarchical_with_bound(inputs, local_size)
        assert error_of(t, mean) <= bound + gamma(2, U64) * float(mean.norm()), (error_of(t, mean), bound)
        # whole-model variant: one pair of coefficients for the concatenation
        whole = adasum.Adasum(per_tensor=False, hierarchical=True, local_size=local_size)
        data = [[torch.randn(9, generator=torch.Generator().manual_seed(r)), torch.full((4,), float(r))]
                for r in range(world)]
        mine = [t.clone() for t in data[rank]]
        whole.all_reduce(mine)
        check_against_reference([torch.cat(mine)], [[torch.cat(d)] for d in data], local_size, "whole")

    # gloo's pipelined exchanges (messages shrunk to 37 elements so that shards span several)
    with override(piece_elements=(37, 37)):
        for local_size in local_sizes:
            data = [[torch.randn(n, generator=torch.Generator().manual_seed(50 + r)) for n in SIZES]
                    for r in range(world)]
            mine = [t.clone() for t in data[rank]]
            adasum.Adasum(hierarchical=True, local_size=local_size).all_reduce(mine)
            check_against_reference(mine, data, local_size, "pipelined")
            out[(local_size, "pipelined")] = torch.cat(mine).numpy().tobytes()
    return out


@pytest.mark.parametrize("world, local_sizes", [(4, (2, 4, 1)), (6, (2, 3))])
def test_hierarchical_matches_adasum_of_node_means(world, local_sizes):
    # 4 = 2 nodes x 2 (and 1 x 4, 4 x 1); 6 = 3 nodes x 2 (a folded tree) and 2 x 3
    results = distributed.run(world, hierarchical_body, local_sizes)
    distributed.assert_ranks_agree(results)


def test_reduce_hierarchical_is_adasum_of_node_means():
    """The single-process definition against the reference over float64 node means, within the bound."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(11, generator=g, dtype=torch.float64) for _ in range(6)]
    got = reduce_hierarchical(xs, 3)
    ref, bound = hierarchical_with_bound(xs, 3)
    assert error_of(got, ref) <= bound, (error_of(got, ref), bound)
    expected = reference_tree([(xs[0] + xs[1] + xs[2]).numpy() / 3, (xs[3] + xs[4] + xs[5]).numpy() / 3])
    assert error_of(got, torch.from_numpy(expected)) <= bound, "the node means computed the other way"
    with pytest.raises(ValueError, match="does not divide"):
        reduce_hierarchical(xs, 4)


def test_check_placement_names_the_problem():
    assert check_placement([2] * 4, [0, 1, 0, 1], [5, 5, 9, 9]) == 2
    assert check_placement([2] * 4, [-1] * 4, [-1] * 4) == 2
    with pytest.raises(ValueError, match="local sizes differ across ranks: rank 0 has 2, rank 3 has 4"):
        check_placement([2, 2, 2, 4], [-1] * 4, [-1] * 4)
    with pytest.raises(ValueError, match="local_size 3 does not divide the world size 4"):
        check_placement([3] * 4, [-1] * 4, [-1] * 4)
    with pytest.raises(ValueError, match="rank 1 has local rank 0, expected 1"):
        check_placement([2] * 4, [0, 0, 1, 1], [-1] * 4)
    with pytest.raises(ValueError, match="rank 1 is on node 1, rank 0 on node 0"):
        check_placement([2] * 4, [-1] * 4, [0, 1, 0, 1])
    with pytest.raises(ValueError, match="same node"):
        check_placement([2] * 4, [-1] * 4, [0, 0, 0, 0])


def errors_body(rank, world):
    """Each bad configuration raises the same ValueError on every rank (no hang)."""
    messages = {}
    cases = {
        "differ": dict(local_size=4 if rank == world - 1 else 2),
        "divide": dict(local_size=3),
    }
    for name, kwargs in cases.items():
        with pytest.raises(ValueError) as info:
            adasum.Adasum(hierarchical=True, **kwargs).setup()
        messages[name] = str(info.value)
    # torchrun-style environment with ranks placed round robin over two nodes
    with override(local_world_size=2, local_rank=rank // 2, group_rank=rank % 2), pytest.raises(ValueError) as info:
        adasum.Adasum(hierarchical=True).setup()
    messages["placement"] = str(info.value)
    # the same environment placed node by node works, local size from LOCAL_WORLD_SIZE
    t = torch.full((5,), float(rank))
    with override(local_world_size=2, local_rank=rank % 2, group_rank=rank // 2):
        adasum.Adasum(hierarchical=True).all_reduce([t])
    messages["ok"] = t.tolist()
    return messages


def test_bad_placements_raise_on_every_rank():
    results = distributed.run(4, errors_body)
    for messages in results:
        assert "local sizes differ across ranks: rank 0 has 2, rank 3 has 4" in messages["differ"]
        assert "local_size 3 does not divide the world size 4" in messages["divide"]
        assert "not placed node by node" in messages["placement"]
        # node means 0.5 and 2.5 are parallel: their mean
        assert messages["ok"] == [1.5] * 5


def build_arguments_body(rank, world):
    """build_hierarchy's arguments of the wrong kind: TypeError on every rank, before the placement all-gather."""
    errors = []
    wrong = (dict(local_size=1.5), dict(local_size="2"), dict(local_size=True), dict(group="world", local_size=2),
             dict(local_size=2, exact="no"))  # "no" was true: the two tiers
    for kwargs in wrong:
        with pytest.raises(TypeError) as info:
            hierarchical.build_hierarchy(**kwargs)
        errors.append(str(info.value))
    return errors, hierarchical.build_hierarchy(local_size=2).nodes


def test_build_hierarchy_refuses_local_sizes_and_groups_of_the_wrong_kind():
    results = distributed.run(2, build_arguments_body)
    assert results[0] == results[1]
    errors, nodes = results[0]
    operation = "adasum.hierarchical.build_hierarchy"
    per_node = "; pass the number of ranks per node, or None to read LOCAL_WORLD_SIZE"
    assert errors == [
        f"{operation}: local_size must be an integer >= 1 or None, got 1.5{per_node}",  # was a node of one rank
        f"{operation}: local_size must be an integer >= 1 or None, got '2'{per_node}",
        f"{operation}: local_size must be an integer >= 1 or None, got True{per_node}",
        f"{operation}: group must be a torch.distributed ProcessGroup or None, got 'world'; pass dist.new_group(...) "
        "or None",
        f"{operation}: exact must be True or False, got 'no'; pass a bool",
    ]
    assert nodes == 1


def exact_body(rank, world, local_size):
    """Two tiers (slice-parallel inside each emulated node, VHDD across) against the flat reference tree over every
    rank, within its bound (`adasum_with_bound`); the single-process form too."""
    reducer = adasum.Adasum(hierarchical="exact", local_size=local_size)
    reducer.setup()
    out = {}
    for dtype in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(11 + world)
        data = [[torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in SIZES] for _ in range(world)]
        mine = [t.clone().to(distributed.device_for(rank)) for t in data[rank]]
        reducer.all_reduce(mine)
        mine = [t.cpu() for t in mine]
        single = reducer.reduce(data)  # the single-process form is the flat tree too
        for i, (t, s) in enumerate(zip(mine, single)):
            assert t.shape == s.shape == data[0][i].shape
            if t.numel():
                ref, bound = combine_with_bound([data[r][i] for r in range(world)])
                assert error_of(t, ref) <= bound, (dtype, i, error_of(t, ref), bound)
                assert error_of(s, ref) <= bound, (dtype, i, "reduce", error_of(s, ref), bound)
        out[str(dtype)] = torch.cat(mine).numpy().tobytes()
    return out


TIERS = [(4, 2, {}), (4, 2, {"ADASUM_MEMORY_MB": "0.002"}), (8, 4, {})]
"""(ranks, ranks per node, environment): 2 nodes x 2, also in rounds through a budget of 2 KiB, and 2 nodes x 4
(one node of 4 alone is the schedule, tests/test_slices.py)."""


@pytest.mark.nccl
@pytest.mark.parametrize("world, local_size, env", [t for t in TIERS if distributed.world_sizes(t[0])])
def test_exact_two_tiers_equal_the_flat_tree(world, local_size, env):
    distributed.assert_ranks_agree(distributed.run(world, exact_body, local_size, env=env))


def exact_refused_body(rank, world):
    with pytest.raises(ValueError, match="power of two of ranks per node") as caught:
        adasum.Adasum(hierarchical="exact", local_size=3).setup()
    return str(caught.value)


def test_exact_two_tiers_refuse_other_placements_on_every_rank():
    distributed.assert_ranks_agree(distributed.run(3, exact_refused_body))
    with pytest.raises(ValueError, match="hierarchical must be"):
        adasum.Adasum(hierarchical="yes")


def local_world_size_on_one_rank_body(rank, world):
    """LOCAL_WORLD_SIZE set on rank 0 only (the others have neither it nor local_size)."""
    with override(local_world_size=2 if rank == 0 else None):
        try:
            adasum.Adasum(hierarchical=True).setup()
        except ValueError as error:
            return type(error).__name__, str(error)
    return None


def test_local_world_size_on_one_rank_only_is_the_same_error_on_every_rank():
    results = distributed.run(2, local_world_size_on_one_rank_body, timeout_s=30)
    distributed.assert_ranks_agree(results)
    assert results[0] == ("ValueError", "hierarchical mode needs local_size or LOCAL_WORLD_SIZE (set by torchrun): "
                                        "rank 1 has neither (1 of 2 ranks)"), results[0]


def renumbered_body(rank, world, folder, local_size):
    """One hierarchical reducer, used, then the default group destroyed and made again with the ranks renumbered
    (rank r becomes world - 1 - r): the reducer builds its groups anew and combines the new ranks' tensors."""
    import torch.distributed as dist

    reducer = adasum.Adasum(hierarchical=True, local_size=local_size)
    t = [torch.full((5,), float(rank + 1))]
    reducer.all_reduce(t)
    dist.destroy_process_group()
    new = world - 1 - rank
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/again", world), rank=new, world_size=world)
    data = [torch.arange(5.0) * (r + 1) + r for r in range(world)]
    mine = [data[new].clone()]
    reducer.all_reduce(mine)
    return new, mine[0].tolist(), [d.tolist() for d in data]


@pytest.mark.parametrize("local_size", [2])  # its node groups were the old group's: `tuple.index(x)` failed
def test_a_hierarchical_reducer_after_the_group_is_made_again_with_renumbered_ranks(tmp_path, local_size):
    results = distributed.run(4, renumbered_body, str(tmp_path), local_size)
    got = {new: out for new, out, _ in results}
    data = [torch.tensor(d) for d in results[0][2]]
    want = reduce_hierarchical(data, local_size)
    for new in range(4):
        assert got[new] == got[0], got  # bitwise the same on every rank
    torch.testing.assert_close(torch.tensor(got[0]), want, rtol=1e-5, atol=1e-5)
