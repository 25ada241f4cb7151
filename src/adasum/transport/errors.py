"""The named failures of a collective's steps: `CollectiveError`, and `failures_named`, which turns a transport's
error inside a step into one that says which step, level and peer failed, and after how long.

On gloo a wait on a dead peer fails at once ("Connection closed by peer") and a wait on a stalled
peer fails when the group's timeout runs out; both point-to-point ``work.wait()`` and collectives
use the group's timeout. `failures_named` turns those transport errors into a `CollectiveError`
that says which step, level and peer failed, and after how long; any other error (a local one:
autograd, out of memory, a bad argument) passes through as itself (`is_transport_error`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from adasum.transport.groups import group_timeout


class CollectiveError(RuntimeError):
    """A collective step failed: a peer died, stalled past the group's timeout, or the link broke.

    The message names the operation, the step, the level and peer, and the timeout; the
    transport's own error is chained as ``__cause__``. The process group is unusable afterwards:
    destroy it (or exit) and restart, e.g. under torchrun's restarts.
    """


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

    On one process (a group of one rank), with the error gloo raises when a peer's connection closes:

    >>> import textwrap
    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    >>> try:
    ...     with failures_named("adasum.all_reduce", "the exchange at level 1", None):
    ...         raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    ... except adasum.CollectiveError as error:
    ...     print(textwrap.fill(str(error), 100))
    adasum.all_reduce on rank 0 of 1: the exchange at level 1 failed (group timeout 60 s): a peer died,
    stalled past the timeout or the connection broke; Connection closed by peer. Read the peer's own log
    for its error; if it was only slow, pass a longer timeout= to dist.init_process_group (or
    dist.new_group)
    >>> with failures_named("adasum.all_reduce", "the exchange at level 1", None):   # a local error: as itself
    ...     raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    Traceback (most recent call last):
    RuntimeError: a leaf Variable that requires grad is being used in an in-place operation.
    >>> dist.destroy_process_group()
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
            f"the connection broke; {cause}. Read the peer's own log for its error; if it was only slow, "
            "pass a longer timeout= to dist.init_process_group (or dist.new_group)"
        ) from error
