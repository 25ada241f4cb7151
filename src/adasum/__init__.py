"""adasum: adaptive aggregation of data-parallel gradients for PyTorch.

Adasum (Maleki et al., MLSys 2021) on torch.distributed, with the pairwise operator, its tree
over any number of workers, and a bandwidth-optimal collective.
"""

from adasum.collectives import all_reduce, all_reduce_async
from adasum.ops import combine, reduce

__all__ = ["all_reduce", "all_reduce_async", "combine", "reduce"]
__version__ = "0.1.0"
