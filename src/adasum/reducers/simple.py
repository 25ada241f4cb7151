"""The plain reducers: sum and mean (what DDP does)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from adasum.reducers.base import Reducer, check_workers
from adasum.transport.groups import failures_named, uses_nccl


class Sum(Reducer):
    """The plain sum over workers."""

    name = "sum"
    per_tensor = True
    capturable = True
    elementwise = True

    def reduce(self, per_worker):
        """The sum of the workers' copies, tensor by tensor."""
        count = check_workers(per_worker, f"adasum.{type(self).__name__}.reduce")
        return [torch.stack([w[i] for w in per_worker]).sum(0) for i in range(count)]

    def _all_reduce_flat(self, buffer, sizes, group=None):
        with failures_named("adasum.Sum.all_reduce", "the sum all-reduce", group):
            dist.all_reduce(buffer, group=group)


class Mean(Reducer):
    """The average over workers (Horovod's and DDP's default)."""

    name = "mean"
    per_tensor = True
    exact_average = True
    capturable = True
    elementwise = True

    def reduce(self, per_worker):
        """The mean of the workers' copies, tensor by tensor."""
        count = check_workers(per_worker, f"adasum.{type(self).__name__}.reduce")
        return [torch.stack([w[i] for w in per_worker]).sum(0) / len(per_worker) for i in range(count)]

    def _all_reduce_flat(self, buffer, sizes, group=None):
        if uses_nccl(group):  # NCCL averages in its own pass (gloo has no AVG)
            with failures_named("adasum.Mean.all_reduce", "the average all-reduce", group):
                dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=group)
            return
        with failures_named("adasum.Mean.all_reduce", "the sum all-reduce", group):
            dist.all_reduce(buffer, group=group)
        buffer.div_(dist.get_world_size(group))
