"""Collectives across ranks: the VHDD Adasum schedule (`vhdd`), the user-facing `all_reduce`
(`api`), the hierarchical mode (`hierarchical`), the cross-rank layout check (`agreement`), the per-layout
plan (`plan`) and the thread that compares deferred checks (`guard`), and the cross-rank non-finite check
(`nonfinite`)."""

from adasum.collectives.api import all_reduce, all_reduce_async, fused_per_dtype
from adasum.collectives.vhdd import Placement, adasum_flat_

__all__ = ["Placement", "adasum_flat_", "all_reduce", "all_reduce_async", "fused_per_dtype"]
