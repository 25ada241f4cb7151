"""A toy transport added the way docs/extension.md says: one file and one registration line. It moves the VHDD
schedule's bytes with plain ``isend``/``irecv`` pairs (no batches), through the two primitives of
`adasum.transport.base.PointToPoint`, and counts its posts so a test sees the schedule went through it."""

from __future__ import annotations

import torch.distributed as dist

from adasum.transport import register_transport
from adasum.transport.base import PointToPoint
from adasum.transport.topology import global_rank


class Toy(PointToPoint):
    name = "toy"

    def __init__(self, need) -> None:
        super().__init__(need.group, need.piece_bytes, need.timeout)
        self.posts = 0

    def post(self, sends, recvs, peer):
        self.posts += 1
        to = global_rank(self.group, peer)
        sent = [dist.isend(t, to, self.group) for t in sends if t.numel()]
        return sent, [dist.irecv(t, to, self.group) if t.numel() else None for t in recvs]

    def wait(self, works):
        for work in works:
            if work is not None:
                work.wait(self.timeout)


def register() -> None:
    register_transport("toy", Toy, serves="vhdd")
