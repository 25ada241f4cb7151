"""Where ranks stand: one frozen `Topology` for every schedule that runs over more than a flat group.

A process group's ranks, as one rank sees them, form a grid of two tiers:

* the **inner** tier, ranks that hold pieces of the same thing: the ranks of one node (hierarchical mode: each
  holds one shard of its node's mean) or the shard ranks of one replica (FSDP: each holds one shard of every
  tensor); ``inner_size`` of them, this rank the ``inner_rank``-th, over the ``inner`` group (None: one rank);
* the **outer** tier, the ranks that hold the same piece: one per node, or one per replica (``peers``, their ranks
  in the group, in tree order; this rank is ``peers[position]``), over the ``outer`` group where one is built
  (FSDP's replicate group; hierarchical mode runs its trees over ``group`` with `peers` as the placement).

The VHDD tree runs over `peers` on a slice of the layout that starts at ``offset`` (`at`), each level's
per-tensor sums added over the whole group so that every slice of a tensor gets the whole tensor's coefficients
(`adasum.collectives.vhdd.adasum_flat_`). A flat group is the grid of one inner rank per outer one (`flat`).

Hierarchical mode names the tiers nodes (`local_group`, `local_size`, `local_rank`, `nodes`, `node`:
`adasum.hierarchical.build_hierarchy` builds it), FSDP replicas and shards (`replicate`, `shard`, `replicas`,
`shards`: `adasum.fsdp`'s mesh builds it); those names are properties of the one class, and `Hierarchy` and
`ShardGroups` are its constructors from those names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (None: the default group)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def group_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The rank in `group` (None: the default group) of global rank `rank`."""
    return rank if group is None else dist.get_group_rank(group, rank)


@dataclass(frozen=True)
class Topology:
    """This rank's place in a grid of `group` (module doc). Frozen and hashable: schedules key their plans and
    captured graphs by it."""

    group: dist.ProcessGroup | None
    peers: tuple[int, ...]  # the outer tier's ranks in `group`, in tree order (this rank among them)
    offset: int = 0  # where this rank's slice starts in the layout the tree over `peers` runs on
    inner: dist.ProcessGroup | None = None  # the inner tier's group (None: a tier of one rank)
    outer: dist.ProcessGroup | None = None  # the outer tier's group, where one is built
    inner_size: int = 1
    inner_rank: int = 0
    position: int = 0  # this rank's index in `peers`
    exact: bool = False  # hierarchical mode: the flat tree in two tiers, not Adasum over node means

    @classmethod
    def flat(cls, group: dist.ProcessGroup | None = None) -> Topology:
        """Every rank of `group` a worker of one tree (an inner tier of one rank each)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        return cls(group, tuple(range(world)), position=rank)

    @classmethod
    def placement(cls, peers: tuple[int, ...] | list[int], offset: int = 0) -> Topology:
        """A tree over `peers` (group ranks, in tree order) on the slice of the layout at `offset`, inside the
        group the schedule is given."""
        return cls(None, tuple(peers), offset)

    def at(self, offset: int) -> Topology:
        """The same grid, its trees on the slice of the layout that starts at `offset`."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(Topology)}
        return Topology(**{**values, "offset": offset})

    def global_rank(self, rank: int) -> int:
        """The global rank of `rank` of `group`."""
        return global_rank(self.group, rank)

    @property
    def outer_size(self) -> int:
        """The number of outer ranks: nodes, or replicas."""
        return len(self.peers)

    # hierarchical mode's names (`adasum.hierarchical.build_hierarchy`)

    @property
    def local_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's node (`inner`)."""
        return self.inner

    @property
    def local_size(self) -> int:
        """Ranks per node (`inner_size`)."""
        return self.inner_size

    @property
    def local_rank(self) -> int:
        """This rank's index in its node (`inner_rank`)."""
        return self.inner_rank

    @property
    def nodes(self) -> int:
        """The number of nodes (`outer_size`)."""
        return self.outer_size

    @property
    def node(self) -> int:
        """This rank's node (`position`)."""
        return self.position

    # FSDP's names (`adasum.fsdp`'s 2-D mesh)

    @property
    def replicate(self) -> dist.ProcessGroup | None:
        """The ranks holding this rank's shard, one per replica (`outer`)."""
        return self.outer

    @property
    def shard(self) -> dist.ProcessGroup | None:
        """The shard ranks of this rank's replica (`inner`)."""
        return self.inner

    @property
    def replicas(self) -> int:
        """The number of replicas (`outer_size`)."""
        return self.outer_size

    @property
    def shards(self) -> int:
        """Shards per replica (`inner_size`)."""
        return self.inner_size


class Hierarchy(Topology):
    """The nodes of a process group and this rank's place in them (hierarchical mode's name and constructor, as
    `adasum.hierarchical.build_hierarchy` builds it): the inner tier is the node (`local_group`, the intra-node
    sub-group, of `local_size` ranks; this rank its `local_rank`-th), and `peers` are the group ranks that share
    this rank's local rank, one per node, in node order (`nodes` of them; this rank's node is `node`)."""

    def __init__(self, group: dist.ProcessGroup | None, local_group: dist.ProcessGroup | None, local_size: int,
                 nodes: int, node: int, local_rank: int, exact: bool = False) -> None:
        peers = tuple(n * local_size + local_rank for n in range(nodes))
        super().__init__(group, peers, inner=local_group, inner_size=local_size, inner_rank=local_rank,
                         position=node, exact=exact)


class ShardGroups(Topology):
    """A grid of `replicas` x `shards` ranks, as one rank sees it (FSDP's name and constructor, as `adasum.fsdp`
    builds it from its 2-D mesh): each replica holds every tensor, split over the `shards` ranks of its `shard`
    group; `replicate` holds the ranks with this rank's shard, one per replica. `group` holds every rank of the
    grid (None: the default group); `peers` are the `group` ranks of `replicate`, in replica order."""

    def __init__(self, group: dist.ProcessGroup | None, replicate: dist.ProcessGroup, shard: dist.ProcessGroup,
                 peers: tuple[int, ...], replicas: int, shards: int) -> None:
        if len(peers) != replicas:
            raise ValueError(f"ShardGroups: {len(peers)} peers for {replicas} replicas (internal error; please report)")
        super().__init__(group, tuple(peers), inner=shard, outer=replicate, inner_size=int(shards),
                         inner_rank=dist.get_rank(shard), position=dist.get_rank(replicate))
