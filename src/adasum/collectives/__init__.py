"""Collectives across ranks: the VHDD Adasum schedule (`vhdd`), the slice-parallel schedule (`slices`), the
user-facing `all_reduce` (`api`) and the hierarchical mode (`hierarchical`). The checks they pass before data
moves stand on the floor below (`adasum.checks`)."""

from adasum.collectives.api import all_reduce, all_reduce_async, fused_per_dtype
from adasum.collectives.vhdd import Placement, adasum_flat_

__all__ = ["Placement", "adasum_flat_", "all_reduce", "all_reduce_async", "fused_per_dtype"]
