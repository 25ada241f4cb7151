"""The c10d point-to-point transport: paired sends and receives through ``batch_isend_irecv``
(NCCL pairs a send with its receive only inside one batch), waits bounded by the group's timeout
on gloo and left to the stream on NCCL."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (None: the default group)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def post(
    sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], peer: int, group: dist.ProcessGroup | None
) -> tuple[list, list]:
    """Start sending `sends` to and receiving `recvs` from `peer` (a group rank) as one batch, so
    NCCL pairs them; empty tensors are skipped. Returns the send and the receive works (None for
    a skipped receive)."""
    peer = global_rank(group, peer)
    p2p = [dist.P2POp(dist.isend, t, peer, group) for t in sends if t.numel() > 0]
    p2p += [dist.P2POp(dist.irecv, t, peer, group) for t in recvs if t.numel() > 0]
    works = list(dist.batch_isend_irecv(p2p)) if p2p else []
    if len(works) != len(p2p):
        # NCCL coalesces a batch into one work: every receive then waits for the whole batch
        return works, [works[0] if t.numel() > 0 else None for t in recvs]
    n_send = sum(1 for t in sends if t.numel() > 0)
    send_works, recv_iter = works[:n_send], iter(works[n_send:])
    recv_works = [next(recv_iter) if t.numel() > 0 else None for t in recvs]
    return send_works, recv_works


def wait(works, timeout: timedelta | None = None) -> None:
    """Wait for `works`; with a `timeout` (gloo) each wait gives up after it, None (NCCL) leaves the
    waiting to the stream: an explicit timeout there would block the host until the kernels finish."""
    for work in works:
        if work is not None:
            work.wait() if timeout is None else work.wait(timeout)


def exchange(
    send: torch.Tensor | None,
    recv: torch.Tensor | None,
    peer: int,
    group: dist.ProcessGroup | None,
    timeout: timedelta | None = None,
) -> None:
    """Send `send` to and receive `recv` from `peer` (a group rank), and wait for both."""
    send_works, recv_works = post([] if send is None else [send], [] if recv is None else [recv], peer, group)
    wait(send_works + recv_works, timeout)
