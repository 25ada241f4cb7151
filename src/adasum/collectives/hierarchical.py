"""Hierarchical Adasum for multi-GPU nodes (Horovod's GPU mode, made exact and checked).

The group's P ranks form N nodes of L = local_size consecutive ranks each (node n holds ranks
nL .. nL+L-1). For a flat buffer holding tensors end to end:

1. intra-node reduce-scatter (sum) into L shards, divided by L: local rank l holds shard l of its
   node's mean;
2. Adasum across nodes on the shards: the ranks with local rank l (one per node) run the VHDD tree
   of `adasum.collectives` on shard l, while the per-tensor dot products are summed over the whole
   group, so every tensor gets the coefficients of the whole tensor, not of a shard;
3. intra-node all-gather of the shards.

The result, on every rank, is exactly defined as ``adasum.reduce`` (per tensor) over the N node
means: `reduce_hierarchical` is that definition in a single process. Each node's mean is computed
once (by the reduce-scatter) and each element of the result by one rank, so all ranks end
bitwise identical. Bytes per rank: a reduce-scatter and an all-gather within the node plus
Adasum's ``2 (N/L)(N-1)/N``-sized exchanges between nodes.

Horovod's version silently breaks when local sizes differ, L is not a power of two, or ranks are
not placed node by node. Here any L works, and the other two raise ValueError on every rank
(`build_hierarchy` checks LOCAL_WORLD_SIZE, LOCAL_RANK and GROUP_RANK as torchrun sets them).

**Exact two tiers** (``build_hierarchy(..., exact=True)``, `adasum_two_tier_flat_`): the flat tree of
`adasum.reduce` over every rank, not over node means, in two tiers (SPEC 1.4b). With node-contiguous
ranks and powers of two for L and N, the flat tree's levels d < L pair ranks inside a node: each node runs
them with the slice-parallel schedule (`adasum.collectives.slices`: symmetric memory on NVLink, c10d
elsewhere) on its own ranks, leaving local rank l with slice l of its node's subtree; the levels across
nodes run as VHDD over the ranks of local rank l (one per node) on that slice, their per-tensor sums added
over the whole group; then each node gathers its slices. Other placements are refused on every rank.
"""

import numbers
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist

from adasum.collectives.slices import CombineOp, SliceMover, adasum_slices_
from adasum.collectives.vhdd import adasum_flat_, transport_for
from adasum.core.layout import Layout
from adasum.kernels.reduce import reduce
from adasum.options import check_flag
from adasum.settings import current
from adasum.transport.base import Transport
from adasum.transport.c10d import all_gather_single, reduce_scatter_single
from adasum.transport.errors import failures_named
from adasum.transport.groups import check_group, group_device
from adasum.transport.topology import Hierarchy, global_rank


def _known(value: int | None) -> int:
    return -1 if value is None else value


def local_size_from_env() -> int | None:
    """LOCAL_WORLD_SIZE as torchrun sets it (`adasum.settings`), or None."""
    return current().local_world_size


def check_placement(local_sizes: Sequence[int], local_ranks: Sequence[int], node_ids: Sequence[int]) -> int:
    """The common local size, or ValueError naming the first problem; -1 marks an unknown value.

    Rank r must be local rank ``r % L`` of node ``r // L``: the ranks of a node are consecutive
    and every node has the same number L of ranks, which divides the world size.

    >>> check_placement([2, 2, 2, 2], [0, 1, 0, 1], [0, 0, 1, 1])
    2
    """
    world = len(local_sizes)
    size = local_sizes[0]
    for r, s in enumerate(local_sizes):
        if s != size:
            raise ValueError(
                f"local sizes differ across ranks: rank 0 has {size}, rank {r} has {s} "
                "(hierarchical mode needs the same number of ranks on every node); launch as many ranks on every node "
                "(torchrun --nproc-per-node), or pass hierarchical=False"
            )
    if size < 1 or world % size:
        raise ValueError(
            f"local_size {size} does not divide the world size {world}; pass local_size= the number of ranks per "
            "node (it divides the world size)"
        )
    for r in range(world):
        if local_ranks[r] >= 0 and local_ranks[r] != r % size:
            raise ValueError(
                f"ranks are not placed node by node: rank {r} has local rank {local_ranks[r]}, expected "
                f"{r % size} (hierarchical mode needs node n to hold ranks n*{size} .. n*{size}+{size - 1}); launch "
                "the ranks node by node (as torchrun numbers them), or pass hierarchical=False"
            )
        first = r - r % size
        if node_ids[r] >= 0 and node_ids[first] >= 0 and node_ids[r] != node_ids[first]:
            raise ValueError(
                f"ranks are not placed node by node: rank {r} is on node {node_ids[r]}, rank {first} on "
                f"node {node_ids[first]} (hierarchical mode needs consecutive ranks on each node); launch the ranks "
                "node by node (as torchrun numbers them), or pass hierarchical=False"
            )
    leaders = [node_ids[n * size] for n in range(world // size) if node_ids[n * size] >= 0]
    if len(set(leaders)) != len(leaders):
        raise ValueError("ranks are not placed node by node: two blocks of local_size ranks report the same node")
    return size


def build_hierarchy(
    group: dist.ProcessGroup | None = None, local_size: int | None = None, exact: bool = False
) -> Hierarchy:
    """Check the placement and create the intra-node sub-groups; collective over `group`. With `exact`, the
    hierarchy runs the flat tree in two tiers (module doc), which needs powers of two for the local size and
    the number of nodes.

    `local_size` defaults to LOCAL_WORLD_SIZE. Where it equals LOCAL_WORLD_SIZE, the ranks'
    LOCAL_RANK and GROUP_RANK (the node), when set, are checked too. One small all-gather;
    raises ValueError on every rank (see `check_placement`). A `local_size` that is not an integer
    (``1.5``, ``"2"``, ``True``), an `exact` that is not True or False, or a `group` that is not a process group
    raises TypeError before it.

    >>> hierarchy = build_hierarchy(local_size=8)  # doctest: +SKIP
    >>> adasum_hierarchical_flat_(buffer, sizes, hierarchy)  # doctest: +SKIP

    On one process (a group of one rank: one node holding one rank; under torchrun every rank makes the
    same calls):

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> hierarchy = build_hierarchy(local_size=1)
    >>> hierarchy.nodes, hierarchy.local_size, hierarchy.peers
    (1, 1, (0,))
    >>> buffer = torch.tensor([3.0, 4.0, 1.0])                    # two tensors end to end: sizes [2, 1]
    >>> adasum_hierarchical_flat_(buffer, [2, 1], hierarchy)      # one node: its mean is the result
    >>> buffer
    tensor([3., 4., 1.])
    >>> build_hierarchy(local_size=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: local_size 2 does not divide the world size 1; pass local_size= the number of ranks per node ...
    >>> dist.destroy_process_group()
    """
    operation = "adasum.hierarchical.build_hierarchy"
    check_group(group, operation)
    check_flag(operation, "exact", exact)
    if local_size is not None and (isinstance(local_size, bool) or not isinstance(local_size, numbers.Integral)):
        raise TypeError(
            f"{operation}: local_size must be an integer >= 1 or None, got {local_size!r}; pass the number of ranks "
            "per node, or None to read LOCAL_WORLD_SIZE"
        )
    env_size = local_size_from_env()
    size = env_size if local_size is None else int(local_size)
    from_env = size is not None and size == env_size
    settings = current()
    # an unknown size (-2) is gathered too, so that a rank without LOCAL_WORLD_SIZE fails with its peers
    mine = [-2 if size is None else size, _known(settings.local_rank) if from_env else -1,
            _known(settings.group_rank) if from_env else -1]
    world = dist.get_world_size(group)
    device = group_device(group)
    everyone = torch.empty(world * 3, dtype=torch.int64, device=device)
    with failures_named("adasum.hierarchical.build_hierarchy", "the placement all-gather", group):
        all_gather_single(everyone, torch.tensor(mine, dtype=torch.int64, device=device), group=group)
    info = everyone.view(world, 3).tolist()
    unknown = [r for r, i in enumerate(info) if i[0] == -2]
    if unknown:
        raise ValueError(f"hierarchical mode needs local_size or LOCAL_WORLD_SIZE (set by torchrun): rank "
                         f"{unknown[0]} has neither ({len(unknown)} of {world} ranks)")
    size = check_placement([i[0] for i in info], [i[1] for i in info], [i[2] for i in info])
    nodes = world // size
    if exact and size > 1 and (size & (size - 1) or nodes & (nodes - 1)):
        raise ValueError(
            f"exact two-tier Adasum needs a power of two of ranks per node and of nodes, got {nodes} nodes of "
            f"{size} (the flat tree then pairs ranks across nodes; use hierarchical=True or flat Adasum)"
        )
    rank = dist.get_rank(group)
    node, local_rank = divmod(rank, size)
    local_group = None
    if size > 1:
        members = [global_rank(group, node * size + i) for i in range(size)]
        # only the node's own ranks take part, so building it needs no global order of calls
        local_group = dist.new_group(members, use_local_synchronization=True)
    return Hierarchy(group, local_group, size, nodes, node, local_rank, exact)


def adasum_hierarchical_flat_(
    buffer: torch.Tensor, sizes: Sequence[int], hierarchy: Hierarchy, op: CombineOp | None = None, *,
    mover: Transport | None = None, inner: Transport | None = None,
) -> None:
    """Hierarchical Adasum of a flat buffer across the group, in place; `sizes` as in `adasum_flat_`.

    Every rank ends with ``adasum.reduce`` over the node means, per tensor (module doc); with an exact
    hierarchy, over every rank (`adasum_two_tier_flat_`). `op`: the combine rule of the tree across nodes (and, two
    tiers, inside them too; `adasum.collectives.slices.CombineOp`, as `adasum_flat_` takes it; None: Adasum's).
    `mover` runs the tree across nodes (with one rank per node, the group's tree) and `inner` the two tiers' node
    schedule: a call's plan passes the ones it chose (`adasum.collectives.api.Schedule`); left out, each is picked
    as a plan picks it (`_movers`).
    """
    if hierarchy.exact:
        adasum_two_tier_flat_(buffer, sizes, hierarchy, op, mover=mover, inner=inner)
        return
    size, numel = hierarchy.local_size, buffer.numel()
    if size == 1:
        adasum_flat_(buffer, sizes, hierarchy.group, transport=mover, op=op)
        return
    if numel == 0:
        return
    shard_len = -(-numel // size)
    padded = buffer if shard_len * size == numel else torch.cat([buffer, buffer.new_zeros(shard_len * size - numel)])
    shard = buffer.new_empty(shard_len)
    with failures_named("adasum.hierarchical", "the intra-node reduce-scatter", hierarchy.local_group):
        reduce_scatter_single(shard, padded, group=hierarchy.local_group)
    shard.div_(size)
    start = min(hierarchy.local_rank * shard_len, numel)
    owned = min(numel - start, shard_len)  # the last shards may be partly or wholly padding
    adasum_flat_(shard[:owned], sizes, hierarchy.group, hierarchy.at(start),
                 transport=mover if mover is not None else _movers(hierarchy)[0], op=op)
    with failures_named("adasum.hierarchical", "the intra-node all-gather", hierarchy.local_group):
        all_gather_single(padded, shard, group=hierarchy.local_group)
    if padded is not buffer:
        buffer.copy_(padded[:numel])


def adasum_two_tier_flat_(
    buffer: torch.Tensor, sizes: Sequence[int], hierarchy: Hierarchy, op: CombineOp | None = None, *,
    mover: Transport | None = None, inner: Transport | None = None,
) -> None:
    """The flat tree of Adasum over every rank of the group, in place, computed in two tiers (module doc):
    equal to `adasum.reduce` of the ranks' buffers per tensor up to float64 rounding, ranks bitwise equal. `op`:
    the combine rule of both tiers (a `pairwise` `adasum.collectives.slices.CombineOp`, not `coupled`; None:
    Adasum's tree): the node's tree on the slice-parallel schedule, the levels across nodes on VHDD. `mover` and
    `inner` as in `adasum_hierarchical_flat_`."""
    if hierarchy.local_size == 1:
        adasum_flat_(buffer, sizes, hierarchy.group, transport=mover, op=op)
        return
    layout = Layout(tuple(int(n) for n in sizes))
    if layout.numel != buffer.numel():
        raise ValueError(
            f"sizes add up to {layout.numel} elements, the buffer has {buffer.numel()}; pass the sizes of the "
            "tensors the buffer holds, end to end"
        )

    if mover is None or inner is None:
        mover, inner = _movers(hierarchy)

    def across(mine: torch.Tensor, offset: int) -> None:
        if hierarchy.nodes > 1:
            adasum_flat_(mine, layout.sizes, hierarchy.group, hierarchy.at(offset), transport=mover, op=op)

    with failures_named("adasum.hierarchical", "the two-tier schedule", hierarchy.group):
        adasum_slices_(buffer, layout, cast(SliceMover, inner), across, op)


def _movers(hierarchy: Hierarchy) -> tuple[Transport, Transport | None]:
    """The movers of a direct call on a hierarchy of more than one rank per node, picked as a call's plan picks them
    (`adasum.collectives.api.Schedule`): the placed mover of the tree across nodes and, in two tiers, the node
    group's slice-parallel one (each built once per group and kept by its communicator, with its buffers)."""
    outer = transport_for(hierarchy.group, None, whole_group=False, placed=True)
    inner = transport_for(hierarchy.local_group, "slices", whole_group=True) if hierarchy.exact else None
    return outer, inner


def reduce_hierarchical(tensors: Sequence[torch.Tensor], local_size: int) -> torch.Tensor:
    """Single-process hierarchical Adasum: ``adasum.reduce`` over the means of consecutive blocks
    of `local_size` workers (the nodes). The definition the collective computes.

    >>> a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    >>> reduce_hierarchical([a, a, b, b], local_size=2)   # adasum.reduce([a, b]): orthogonal, the sum
    tensor([1., 2.])
    >>> reduce_hierarchical([a, b, a, b], local_size=2)   # both node means are (a + b) / 2
    tensor([0.5000, 1.0000])
    """
    if local_size < 1 or len(tensors) % local_size:
        raise ValueError(
            f"local_size {local_size} does not divide the number of workers {len(tensors)}; pass a local_size that "
            "divides it (the workers per node)"
        )
    means = [
        torch.stack(list(tensors[n : n + local_size])).sum(0).div_(local_size)
        for n in range(0, len(tensors), local_size)
    ]
    return reduce(means)
