"""Facts about a torch.distributed process group that the collectives need: the device its backend works on
(`group_device`, `uses_nccl`, `accepts`), the timeout it was created with (`group_timeout`), and the refusal of
what is not a group (`check_group`). The communicator each group gets (`adasum.transport.communicator`) and the
errors its steps raise (`adasum.transport.errors`) stand on these.

Exit: a process that ran gloo collectives can abort at interpreter exit ("terminate called without
an active exception", SIGABRT), and torchrun then reports a finished job as failed. Seen under gdb:
a gloo worker thread ("pt_gloo_runloop") is still releasing the work of the last all-reduce (its
tensors, whose Python objects only C++ still holds) when the main thread is already finalising the
interpreter; releasing them needs the GIL, which a finalising interpreter no longer hands out, and
the thread is torn down inside a destructor. The window is the few microseconds after a collective
completes, so it shows when a process exits right after its last collective (a bare
``dist.all_reduce`` then exit; never with ``destroy_process_group`` a moment later). So the
first time adasum works on a process group it registers an exit handler that, while the
interpreter is still whole, gives gloo's threads a moment (with the GIL released) to
finish releasing their last work, then destroys the process groups if they use gloo only (NCCL
groups are left to their owner: destroying them at exit can wait on peers that are gone).

The first half of that handler is the communicators' (`adasum.transport.communicator`: the guards stopped, the
control groups let go), registered after this one so that it runs first (``atexit`` runs the last registered
first).
"""

from __future__ import annotations

import atexit
import functools
import time
from datetime import timedelta

import torch
import torch.distributed as dist

EXIT_DRAIN_S = 0.05
"""How long the exit handler lets gloo's threads release their last work (microseconds suffice)."""


def check_group(group: object, operation: str) -> None:
    """`operation`'s TypeError unless `group` is a torch.distributed process group or None (the default group)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{operation}: group must be a torch.distributed ProcessGroup or None, got {group!r}; pass "
                        "dist.new_group(...) or None")


def _drain_and_destroy() -> None:
    """At interpreter exit (module doc): let gloo's threads finish, then destroy gloo-only groups."""
    time.sleep(EXIT_DRAIN_S)  # releases the GIL: a thread releasing its last work can take it
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


@functools.cache
def register_exit_handler() -> None:
    """Register the exit handler of the module doc, once per process."""
    atexit.register(_drain_and_destroy)


def uses_nccl(group: dist.ProcessGroup | None = None) -> bool:
    """Whether the group's CUDA tensors go through NCCL: a group of backend ``"nccl"``, or one of several backends
    whose CUDA backend is NCCL (``init_process_group()`` with no backend on a GPU host makes ``"cpu:gloo,cuda:nccl"``,
    which ``get_backend`` reports as ``"undefined"``; or that string given)."""
    name = dist.get_backend(group)
    if name in ("nccl", "gloo"):
        return name == "nccl"
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except RuntimeError:  # no CUDA backend
        return False
    return type(backend).__name__ == "ProcessGroupNCCL"


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device the group's collectives take tensors on: the current GPU where NCCL serves them (`uses_nccl`),
    else the CPU.

    Every collective path of adasum asks this or `group_timeout` first, so these register the exit
    handler of the module doc."""
    register_exit_handler()
    if uses_nccl(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def accepts(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether `group`'s collectives take tensors on `device`'s type: the CPU on gloo; the current
    GPU's type on NCCL, and the CPU too where torch gave the NCCL group a CPU backend."""
    home = group_device(group)
    if device.type == home.type:
        return True
    if home.type == "cuda" and device.type == "cpu":
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return torch.device("cpu") in getattr(pg, "_device_types", ())
    return False


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta:
    """The timeout `group` was created with (``init_process_group``/``new_group``), or torch's default.
    A `group` that is not a process group (nor None) raises TypeError.

    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    >>> adasum.group_timeout()
    datetime.timedelta(seconds=60)
    >>> dist.destroy_process_group()
    """
    check_group(group, "adasum.group_timeout")
    register_exit_handler()
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        timeout = pg._get_backend(group_device(group)).options._timeout
    except (AttributeError, RuntimeError):
        timeout = None
    return timeout if isinstance(timeout, timedelta) else dist.constants.default_pg_timeout
