"""adasum: adaptive aggregation of data-parallel gradients for PyTorch.

Adasum (Maleki et al., MLSys 2021) on torch.distributed, with the pairwise operator, its tree
over any number of workers, and a bandwidth-optimal collective; AdaCons (adaptive consensus
aggregation) and SlowMo (slow momentum over periodically combined models) on the same reducer
interface.
"""

from adasum import ddp, hierarchical
from adasum.collectives import all_reduce, all_reduce_async
from adasum.diagnostics import Orthogonality, all_reduce_orthogonality, orthogonality, orthogonality_stacked
from adasum.groups import CollectiveError, group_timeout
from adasum.nonfinite import NonFinite, NonFiniteError, check_finite, find_nonfinite
from adasum.ops import combine, reduce
from adasum.optim import DistributedOptimizer
from adasum.reducers import Adasum, Mean, Reducer, Sum, get_reducer
from adasum.adacons import AdaCons  # also registers "adacons" with get_reducer
from adasum.sim import SimulatedWorkers
from adasum.slowmo import SlowMo

__all__ = [
    "AdaCons",
    "Adasum",
    "CollectiveError",
    "DistributedOptimizer",
    "Mean",
    "NonFinite",
    "NonFiniteError",
    "Orthogonality",
    "Reducer",
    "SimulatedWorkers",
    "SlowMo",
    "Sum",
    "all_reduce",
    "all_reduce_async",
    "all_reduce_orthogonality",
    "check_finite",
    "combine",
    "find_nonfinite",
    "get_reducer",
    "group_timeout",
    "orthogonality",
    "orthogonality_stacked",
    "reduce",
]
__version__ = "0.1.0"
