"""Facts about a torch.distributed process group that the collectives need: the device its
backend works on, the timeout it was created with, and clear errors when one of its steps fails.

On gloo a wait on a dead peer fails at once ("Connection closed by peer") and a wait on a stalled
peer fails when the group's timeout runs out; both point-to-point ``work.wait()`` and collectives
use the group's timeout. `failures_named` turns those transport errors into a `CollectiveError`
that says which step, level and peer failed, and after how long; any other error (a local one:
autograd, out of memory, a bad argument) passes through as itself (`is_transport_error`).

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
"""

from __future__ import annotations

import atexit
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective step failed: a peer died, stalled past the group's timeout, or the link broke.

    The message names the operation, the step, the level and peer, and the timeout; the
    transport's own error is chained as ``__cause__``. The process group is unusable afterwards:
    destroy it (or exit) and restart, e.g. under torchrun's restarts.
    """


_exit_handler_registered = False


EXIT_DRAIN_S = 0.05
"""How long the exit handler lets gloo's threads release their last work (microseconds suffice)."""


def _destroy_gloo_groups() -> None:
    """At interpreter exit (module doc): let gloo's threads finish, then destroy gloo-only groups."""
    time.sleep(EXIT_DRAIN_S)  # releases the GIL: a thread releasing its last work can take it
    _control_groups.clear()  # no reference of ours keeps a group (and its threads) alive
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def _register_exit_handler() -> None:
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_destroy_gloo_groups)
        _exit_handler_registered = True


_side_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """One CUDA stream per device and `purpose`, made on first use: "comm" for collectives that overlap the
    compute stream (the DDP hook, `DistributedOptimizer`), "copies" for the symmetric transport's staging
    copies (which overlap its own kernels, on whatever stream those run)."""
    key = (torch.device(device), purpose)
    stream = _side_streams.get(key)
    if stream is None:
        stream = _side_streams[key] = torch.cuda.Stream(key[0])
    return stream


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device the group's collectives take tensors on: the current GPU on NCCL, else the CPU.

    Every collective path of adasum asks this or `group_timeout` first, so these register the exit
    handler of the module doc."""
    _register_exit_handler()
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_control_groups: dict = {}


def control_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The group the small cross-rank checks (layouts, parameter checksums) run on: for the default
    group, a gloo group over all ranks, created on first use (every rank checks there, so every rank
    creates it at the same point) and kept; for any other group, that group itself.

    The checks never share the default group with the data they guard: when ranks' control flow
    diverges (one rank checks a new parameter group while its peer already combines gradients), a
    check paired with a data collective of another size aborts the process inside gloo (SIGABRT);
    on their own group both simply wait, and fail within the timeout with a `CollectiveError`.
    Sub-groups keep their checks on themselves: a group made lazily by some ranks only
    (``use_local_synchronization``) deadlocked when ranks had made different numbers of groups.
    """
    if group is not None and group is not dist.GroupMember.WORLD:
        return group
    pg = dist.distributed_c10d._get_default_group()
    control = _control_groups.get(pg)
    if control is None:
        control = dist.new_group(timeout=group_timeout(None), backend="gloo")
        _control_groups[pg] = control
    return control


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

    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    >>> adasum.group_timeout()
    datetime.timedelta(seconds=60)
    >>> dist.destroy_process_group()
    """
    _register_exit_handler()
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        timeout = pg._get_backend(group_device(group)).options._timeout
    except (AttributeError, RuntimeError):
        timeout = None
    return timeout if isinstance(timeout, timedelta) else dist.constants.default_pg_timeout


_TRANSPORT_PATTERNS = re.compile(
    r"gloo|nccl|timed out|timeout|connection (closed|reset|refused)|broken pipe|read error|write error|"
    r"socket|peer|watchdog|communicator|aborted",
    re.IGNORECASE,
)


def is_transport_error(error: BaseException) -> bool:
    """Whether `error` is a failure of the transport (a peer died or stalled, a link broke) rather
    than a local error. torch raises `torch.distributed.DistError` subclasses on NCCL and for store
    and network errors; gloo raises plain RuntimeError whose text names gloo's source file
    (``[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer``) or a timeout.

    >>> is_transport_error(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    True
    >>> is_transport_error(RuntimeError("a leaf Variable that requires grad is being used in an in-place operation."))
    False
    """
    if isinstance(error, dist.DistError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return bool(_TRANSPORT_PATTERNS.search(first))


@contextmanager
def failures_named(
    operation: str, step: str, group: dist.ProcessGroup | None, timeout: timedelta | None = None
) -> Iterator[None]:
    """Re-raise a transport failure inside the block as a `CollectiveError` naming `step`; any other
    error (`is_transport_error` false) is raised as itself. Keep only communication in the block.

    >>> with failures_named("adasum.all_reduce", "the exchange at level 1 of 2 with rank 3", group):  # doctest: +SKIP
    ...     work.wait()
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:  # gloo raises RuntimeError (DistBackendError is one)
        if not is_transport_error(error):
            raise
        timeout = timeout if timeout is not None else group_timeout(group)
        lines = str(error).strip().splitlines()
        # gloo prefixes its source location: "[/path/gloo/transport/tcp/pair.cc:553] Connection closed ..."
        cause = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else type(error).__name__
        raise CollectiveError(
            f"{operation} on rank {dist.get_rank(group)} of {dist.get_world_size(group)}: {step} failed "
            f"(group timeout {timeout.total_seconds():g} s): a peer died, stalled past the timeout or "
            f"the connection broke; {cause}"
        ) from error
