"""adasum: adaptive aggregation of data-parallel gradients for PyTorch.

Adasum (Maleki et al., MLSys 2021) on torch.distributed, with the pairwise operator, its tree
over any number of workers, and a bandwidth-optimal collective; AdaCons (adaptive consensus
aggregation) and SlowMo (slow momentum over periodically combined models) on the same reducer
interface.
"""

import importlib as _importlib
from types import ModuleType as _ModuleType

from adasum import ddp
from adasum.checks.nonfinite import NonFinite, NonFiniteError, check_finite, find_nonfinite
from adasum.collectives import all_reduce, all_reduce_async, hierarchical
from adasum.diagnostics import Orthogonality, all_reduce_orthogonality, orthogonality, orthogonality_stacked
from adasum.integrations.broadcast import broadcast_optimizer_state, broadcast_parameters
from adasum.integrations.optim import DistributedOptimizer
from adasum.integrations.slowmo import SlowMo, diloco_outer
from adasum.kernels.reduce import combine, reduce
from adasum.reducers import AdaCons, Adasum, Mean, Reducer, Sum, get_reducer
from adasum.sim import SimulatedWorkers
from adasum.transport.communicator import release
from adasum.transport.errors import CollectiveError
from adasum.transport.groups import group_timeout

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
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "check_finite",
    "combine",
    "ddp",
    "diloco_outer",
    "find_nonfinite",
    "get_reducer",
    "group_timeout",
    "hierarchical",
    "orthogonality",
    "orthogonality_stacked",
    "reduce",
    "release",
]
ON_ACCESS = ("accelerate", "fsdp", "jax", "lightning", "loggers")
"""Public modules that ``import adasum`` leaves out and the first ``adasum.<name>`` loads (their frameworks are
optional extras: a missing one raises the ImportError that names it, `adasum.extras.require`)."""


def __getattr__(name: str) -> _ModuleType:
    if name in ON_ACCESS:
        return _importlib.import_module(f"adasum.{name}")
    raise AttributeError(f"module 'adasum' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, the subpackages and the modules loaded on access (not the loader's own names)."""
    loaded = [k for k, v in globals().items() if isinstance(v, _ModuleType) and not k.startswith("_")]
    return sorted({*__all__, *ON_ACCESS, *loaded, "__version__"})


__version__ = "0.1.0"  # the one place the version is written: pyproject.toml reads it from here
