"""The warning that a combine has nothing to combine: `adasum.all_reduce`, `adasum.DistributedOptimizer` and the DDP
hook's `adasum.ddp.AdasumState` on a process group of one rank leave every value as it is, which is what one
process means, but usually a script started without ``torchrun``. Each warns once per group (until
`adasum.release()`), at the user's line; the framework glue (`adasum.lightning`, `adasum.accelerate`) and
`adasum.fsdp.enable` warn in their own words, the glue's warning counting for the group, and a sequential run of
``adasum train`` is one process on purpose (`quiet_one_rank`).

>>> import torch.distributed as dist
>>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     for _ in range(2):
...         warn_one_rank(None, "adasum.all_reduce")
>>> [str(w.message) for w in caught]  # doctest: +ELLIPSIS
['adasum.all_reduce: the process group has one rank, so there is nothing to combine ...']
>>> dist.destroy_process_group()
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

from adasum.options import user_stacklevel
from adasum.transport.communicator import communicator

LAUNCH = "torchrun --nproc-per-node N script.py"
"""How to start several processes, as the warning says."""


def warn_one_rank(group: dist.ProcessGroup | None, user: str, *through: str) -> None:
    """Warn, once per group, where `group` has one rank: `user` (the entry point) combines nothing. Silent where
    torch.distributed is not initialised, for a group of several ranks, and for a group `quiet_one_rank` was called
    on. The warning names the first caller outside adasum and the packages named in `through`
    (`adasum.options.user_stacklevel`)."""
    if not dist.is_initialized() or dist.get_world_size(group) != 1:
        return
    comm = communicator(group)
    if comm.one_rank_warned:
        return
    comm.one_rank_warned = True
    warnings.warn(
        f"{user}: the process group has one rank, so there is nothing to combine and every value stays as it is "
        f"(training runs as on a single worker); start several processes ({LAUNCH}), or pass a group of several "
        "ranks",
        UserWarning,
        stacklevel=user_stacklevel(*through),
    )


def quiet_one_rank(group: dist.ProcessGroup | None) -> None:
    """No `warn_one_rank` warning for `group` from now on (until `adasum.release()`): one rank is meant (a sequential
    run of ``adasum train``), or was warned for in other words (the integrations' glue). Nothing where
    torch.distributed is not initialised."""
    if dist.is_initialized():
        communicator(group).one_rank_warned = True
