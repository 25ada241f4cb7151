"""Adasum of Adam's weight changes with adasum.DistributedOptimizer, launched with torchrun.

    torchrun --nproc-per-node 4 examples/delta_adam.py
    torchrun --nproc-per-node 4 examples/delta_adam.py --reduce mean        # the baseline
    torchrun --nproc-per-node 4 examples/delta_adam.py --local-steps 4      # local SGD-style rounds

No DDP wrapper: each rank runs Adam on its own batch inside ``opt.step()``; the weight changes are
combined with Adasum and applied to the common starting weights. Gradient clipping and AMP's
GradScaler are used the usual way (here: clipping).
"""

import argparse
import os

import torch
import torch.distributed as dist

import adasum


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
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--reduce", default="adasum", help="adasum, mean, sum, ... (any reducer name)")
    parser.add_argument("--local-steps", type=int, default=1)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same starting weights on every rank (checked by the optimizer)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    opt = adasum.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr),
        reducer=args.reduce,
        mode="delta",
        local_steps=args.local_steps,
    )

    for step, (x, y) in enumerate(synthetic_batches(rank, args.steps)):
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if rank == 0 and (step == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}")

    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = mine.clone()
    dist.broadcast(first, src=0)
    same = torch.tensor([float(torch.equal(mine, first))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"parameters identical on {world} ranks: {bool(same.item())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
