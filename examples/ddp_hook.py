"""Adasum in a plain DistributedDataParallel training loop, launched with torchrun.

    torchrun --nproc-per-node 4 examples/ddp_hook.py                  # CPUs (gloo)
    torchrun --nproc-per-node 8 examples/ddp_hook.py --hierarchical   # one node of 8 GPUs (NCCL)

The only Adasum line is ``register_comm_hook``: DDP keeps its buckets, overlap and no_sync; each
bucket is combined with Adasum, every parameter with its own coefficients.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from adasum.ddp import AdasumState, adasum_hook


def synthetic_batches(rank: int, steps: int, batch: int = 32, features: int = 20):
    """A regression task; every rank draws its own examples from the same teacher."""
    teacher = torch.randn(features, 1, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        x = torch.randn(batch, features, generator=g)
        yield x, x @ teacher + 0.1 * torch.randn(batch, 1, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hierarchical", action="store_true", help="mean within each node, Adasum across nodes")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    state = AdasumState(hierarchical=args.hierarchical)
    ddp.register_comm_hook(state, adasum_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    for step, (x, y) in enumerate(synthetic_batches(rank, args.steps)):
        loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}")

    # every rank holds bitwise the same weights
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = mine.clone()
    dist.broadcast(first, src=0)
    same = torch.tensor([float(torch.equal(mine, first))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"parameters identical on {world} ranks: {bool(same.item())}")
        print(f"Adasum combined the gradients of {state.iteration} iterations")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
