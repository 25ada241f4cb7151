"""DiLoCo with adasum.SlowMo: AdamW inner steps on each rank, an outer Nesterov SGD over the combined
pseudo-gradients every H steps, launched with torchrun.

    torchrun --nproc-per-node 4 examples/diloco.py                                  # the mean, as in the paper
    torchrun --nproc-per-node 4 examples/diloco.py --reduce adasum                  # Adasum of the deltas
    torchrun --nproc-per-node 4 examples/diloco.py --communication-dtype bf16 --error-feedback

No DDP wrapper: the ranks train apart for ``--local-steps`` steps, then their weight changes are
combined (any reducer: mean, adasum, adacons), sent in ``--communication-dtype`` if given, and the
outer optimizer steps the common starting weights with them as its gradient.
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
    parser.add_argument("--lr", type=float, default=0.05, help="the inner AdamW's learning rate")
    parser.add_argument("--local-steps", type=int, default=10, help="H: inner steps per round")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--reduce", default="mean", help="mean, adasum, adacons, ... (any reducer name)")
    parser.add_argument("--communication-dtype", default=None, help="bf16, fp16 or fp8 (default: the parameters')")
    parser.add_argument("--error-feedback", action="store_true")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same starting weights on every rank (checked by SlowMo)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    opt = adasum.SlowMo(
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        local_steps=args.local_steps,
        outer_optimizer=adasum.diloco_outer(args.outer_lr, args.outer_momentum),
        reducer=args.reduce,
        communication_dtype=args.communication_dtype,
        error_feedback=args.error_feedback,
    )

    for step, (x, y) in enumerate(synthetic_batches(rank, args.steps)):
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}")

    opt.sync()  # a last round, so that the ranks hold the same model however the steps fell
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = mine.clone()
    dist.broadcast(first, src=0)
    same = torch.tensor([float(torch.equal(mine, first))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"parameters identical on {world} ranks: {bool(same.item())}; {opt.statistics()['step']} rounds")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
