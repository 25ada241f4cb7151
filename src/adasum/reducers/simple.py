"""The plain reducers: sum and mean (what DDP does)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from adasum.reducers.base import Reducer, check_workers, is_float8, widened
from adasum.transport.errors import failures_named
from adasum.transport.groups import uses_nccl


def _summed(copies: list[torch.Tensor], divisor: int = 1) -> torch.Tensor:
    """The sum of `copies` (divided by `divisor` if not 1); 8-bit floats summed in float32 and rounded once."""
    dtype = copies[0].dtype
    if is_float8(dtype):
        return (_summed([c.float() for c in copies], divisor)).to(dtype)
    total = torch.stack(copies).sum(0)
    return total if divisor == 1 else total / divisor


class Sum(Reducer):
    """The plain sum over workers."""

    name = "sum"
    per_tensor = True
    capturable = True
    elementwise = True

    def reduce(self, per_worker):
        """The sum of the workers' copies, tensor by tensor."""
        count = check_workers(per_worker, f"adasum.{type(self).__name__}.reduce")
        return [_summed([w[i] for w in per_worker]) for i in range(count)]

    def _all_reduce_flat(self, buffer, sizes, group=None):
        with widened(buffer) as work, failures_named("adasum.Sum.all_reduce", "the sum all-reduce", group):
            dist.all_reduce(work, group=group)


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
        return [_summed([w[i] for w in per_worker], len(per_worker)) for i in range(count)]

    def _all_reduce_flat(self, buffer, sizes, group=None):
        with widened(buffer) as work:
            if uses_nccl(group):  # NCCL averages in its own pass (gloo has no AVG)
                with failures_named("adasum.Mean.all_reduce", "the average all-reduce", group):
                    dist.all_reduce(work, op=dist.ReduceOp.AVG, group=group)
                return
            with failures_named("adasum.Mean.all_reduce", "the sum all-reduce", group):
                dist.all_reduce(work, group=group)
            work.div_(dist.get_world_size(group))
