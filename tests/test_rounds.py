"""The VHDD schedule in rounds of whole tensors (`adasum.collectives.vhdd.adasum_flat_`), where the transport's
buffers must stay within the memory budget (`Transport.round_elements`; symmetric memory on NCCL): each round
an Adasum of its own tensors, so the result is the tree of every tensor, against the independent NumPy
reference, with ranks bitwise equal. The group's VHDD transport (gloo: point-to-point; NCCL with
ADASUM_TEST_BACKEND=nccl: symmetric memory, "symmetric") is wrapped to ask for rounds of a few hundred elements."""

import copy

import pytest
import torch
import torch.distributed as dist

import adasum
from adasum.collectives.api import list_transport
from adasum.collectives.slices import rounds, runs_in_place
from adasum.core.tree import Tree
from test_slices import BOUNDS, SIZES, _data, _worst_error

import distributed

CAPACITY = 300  # elements per round: the layout's larger tensors make rounds of their own, the small ones share


def with_rounds(transport, capacity: int):
    """The same transport, asking for rounds of `capacity` elements and counting the levels it runs (a wrapping
    subclass: nothing patched)."""

    class Rounds(type(transport)):
        levels_run = 0

        def round_elements(self, element_size: int) -> int:
            return capacity

        def exchange_and_dot(self, level) -> None:
            type(self).levels_run += 1
            super().exchange_and_dot(level)

    wrapped = copy.copy(transport)
    wrapped.__class__ = Rounds
    return wrapped


def in_rounds(rank, world):
    dev = distributed.device_for(rank)
    # the VHDD transport of the group (the default at two ranks; named, since "slices" is the default at more)
    transport = with_rounds(list_transport(None, "symmetric" if distributed.BACKEND == "nccl" else None), CAPACITY)
    out = {}
    for dtype, bound in BOUNDS.items():
        data = _data(200 + world, world, dtype)
        mine = [t.clone().to(dev) for t in data[rank]]
        for call in range(3):  # repeated calls on the same tensors: captured and replayed graphs on GPUs
            for t, src in zip(mine, data[rank]):
                t.copy_(src)
            before = type(transport).levels_run
            adasum.all_reduce(mine, transport=transport)
            if call == 0 and rank == 0:  # rank 0 leads every level of every round (the first call runs eagerly)
                # but of a tensor larger than a round where the transport runs one in place (symmetric memory)
                scheduled = [(lo, hi) for _, _, lo, hi in rounds(SIZES, CAPACITY)
                             if hi > lo and not runs_in_place(transport.in_place, CAPACITY, lo, hi)]
                assert scheduled
                assert type(transport).levels_run - before == len(Tree(world).levels()) * len(scheduled)
        worst = _worst_error(mine, data)
        assert worst < bound, (dtype, worst)
        flat = torch.cat([t.reshape(-1) for t in mine])
        out[str(dtype)] = flat.cpu().view(torch.uint8).numpy().tobytes()
        assert dist.get_world_size() == world
    return out


@pytest.mark.nccl
@pytest.mark.parametrize("world", distributed.world_sizes(2, 4) if distributed.BACKEND == "nccl" else [2, 3])
def test_vhdd_in_rounds_matches_reference_and_ranks_agree(world):
    env = {"ADASUM_MEMORY_MB": "0.002"} if distributed.BACKEND == "nccl" else None
    distributed.assert_ranks_agree(distributed.run(world, in_rounds, env=env))

