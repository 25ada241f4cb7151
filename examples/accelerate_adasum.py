"""Adasum with Hugging Face Accelerate (optional extra: pip install 'adasum[accelerate]').

    torchrun --nproc-per-node 4 examples/accelerate_adasum.py
    accelerate launch --multi_gpu --num_processes 4 examples/accelerate_adasum.py    # on GPUs

``accelerator.prepare`` wraps the model in DistributedDataParallel when there are several
processes; ``adasum.accelerate.enable(model)`` registers the Adasum hook on the prepared model,
before the first backward pass. On CPU launch with torchrun: ``accelerate launch --cpu`` starts
one process whatever ``--num_processes`` says (``enable`` then warns that Adasum has nothing to
combine).
"""

import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator

import adasum.accelerate


def synthetic_data(steps: int, world: int, batch: int = 32, features: int = 20) -> torch.utils.data.DataLoader:
    """A regression task; the prepared data loader gives each process its own examples."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(features, 1, generator=g)
    x = torch.randn(steps * batch * world, features, generator=g)
    y = x @ teacher + 0.1 * torch.randn(len(x), 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = synthetic_data(args.steps, accelerator.num_processes)
    model, opt, data = accelerator.prepare(model, opt, data)
    state = adasum.accelerate.enable(model)  # None (with a warning) on one process

    for step, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        if accelerator.is_main_process and step % 20 == 0:
            print(f"step {step}: loss {loss.item():.4f}")

    mine = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    if accelerator.num_processes > 1:
        first = mine.clone()
        dist.broadcast(first, src=0)
        same = torch.tensor([float(torch.equal(mine, first))], device=mine.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
    else:
        same = torch.tensor([1.0])
    if accelerator.is_main_process:
        print(f"parameters identical on {accelerator.num_processes} ranks: {bool(same.item())}")
        if state is not None:
            print(f"Adasum combined the gradients of {state.iteration} iterations")
    accelerator.end_training()


if __name__ == "__main__":
    main()
