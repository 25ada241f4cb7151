"""adasum: adaptive aggregation of data-parallel gradients for PyTorch.

Adasum (Maleki et al., MLSys 2021) on torch.distributed, with the pairwise operator, its tree
over any number of workers, and a bandwidth-optimal collective.
"""

from adasum.collectives import all_reduce, all_reduce_async
from adasum.diagnostics import Orthogonality, all_reduce_orthogonality, orthogonality, orthogonality_stacked
from adasum.ops import combine, reduce
from adasum.reducers import Adasum, Mean, Reducer, Sum, get_reducer
from adasum.sim import SimulatedWorkers

__all__ = [
    "Adasum",
    "Mean",
    "Orthogonality",
    "Reducer",
    "SimulatedWorkers",
    "Sum",
    "all_reduce",
    "all_reduce_async",
    "all_reduce_orthogonality",
    "combine",
    "get_reducer",
    "orthogonality",
    "orthogonality_stacked",
    "reduce",
]
__version__ = "0.1.0"
