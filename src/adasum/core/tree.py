"""The reduction tree of Adasum over P workers, shared by `reduce` and the collective.

P = 2**k + r workers. Ranks (2i, 2i+1) for i < r are first folded pairwise into one group each
(the odd rank hands its vector to the even one); the remaining ranks are groups of one. That
leaves Q = 2**k groups, numbered in rank order, which are combined on Horovod's binary tree:
level d = 1, 2, 4, ... combines the subtree of groups [base, base + d) with [base + d, base + 2d).
Every subtree carries its worker count, so the weighted operator gives exactly the mean for
parallel inputs and exactly the sum for orthogonal ones, whatever P is. For a power of two, r = 0
and this is Horovod's tree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tree:
    """The tree for `workers` ranks: fold pairs, then a power-of-two tree over `groups`."""

    workers: int

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}; pass a count of one or more")

    @property
    def groups(self) -> int:
        """Q: the largest power of two <= workers."""
        return 1 << (self.workers.bit_length() - 1)

    @property
    def folded(self) -> int:
        """r: how many leading rank pairs are folded into one group each."""
        return self.workers - self.groups

    def leader(self, group: int) -> int:
        """The rank that holds `group`'s vector during the power-of-two tree."""
        return 2 * group if group < self.folded else group + self.folded

    def follower(self, group: int) -> int | None:
        """The rank folded into `group`, or None for a group of one."""
        return 2 * group + 1 if group < self.folded else None

    def group_of(self, rank: int) -> int:
        """The group a rank belongs to."""
        return rank // 2 if rank < 2 * self.folded else rank - self.folded

    def is_leader(self, rank: int) -> bool:
        """Whether `rank` leads its group (takes part in the levels after the fold)."""
        return self.leader(self.group_of(rank)) == rank

    def count(self, first_group: int, num_groups: int) -> int:
        """Workers in groups [first_group, first_group + num_groups)."""
        folded_inside = max(0, min(self.folded, first_group + num_groups) - first_group)
        return num_groups + folded_inside

    def levels(self) -> list[int]:
        """Distances d = 1, 2, 4, ... < groups."""
        out, d = [], 1
        while d < self.groups:
            out.append(d)
            d *= 2
        return out


def level_pairs(tree: Tree) -> list[list[tuple[int, int, int, int]]]:
    """The tree's levels as (rank of side a, rank of side b, workers of a, workers of b) per pair: the fold
    (when P is not a power of two), then d = 1, 2, 4, ...; each pair's result replaces side a's vector, so the
    root's ends at rank 0.

    >>> level_pairs(Tree(3))
    [[(0, 1, 1, 1)], [(0, 2, 2, 1)]]
    """
    levels = []
    if tree.folded:
        levels.append([(2 * i, 2 * i + 1, 1, 1) for i in range(tree.folded)])
    for d in tree.levels():
        levels.append([
            (tree.leader(base), tree.leader(base + d), tree.count(base, d), tree.count(base + d, d))
            for base in range(0, tree.groups, 2 * d)
        ])
    return levels
