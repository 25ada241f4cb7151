"""Adasum in PyTorch Lightning (optional extra: pip install 'adasum[lightning]').

    torchrun --nproc-per-node 4 examples/lightning_adasum.py            # Adasum of the gradients (SGD)
    torchrun --nproc-per-node 4 examples/lightning_adasum.py --delta    # Adasum of Adam's steps

``import adasum.lightning`` registers two strategy names: ``"ddp_adasum"`` (DDP with Adasum's hook,
on CPU and GPU) and ``"ddp_adasum_delta"`` (no DDP wrapper; each optimizer runs locally and
adasum.DistributedOptimizer combines its steps). With a strategy of your own,
``callbacks=[adasum.lightning.AdasumCallback()]`` registers the hook instead.
"""

import argparse
import os

import lightning as L
import torch
import torch.distributed as dist

import adasum.lightning  # noqa: F401  (registers "ddp_adasum" and "ddp_adasum_delta")


class Regression(L.LightningModule):
    def __init__(self, lr: float, adam: bool) -> None:
        super().__init__()
        self.lr = lr
        self.adam = adam
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_rank == 0 and batch_idx % 20 == 0:
            print(f"step {batch_idx}: loss {loss.item():.4f}")
        return loss

    def configure_optimizers(self):
        if self.adam:
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def synthetic_data(steps: int, batch: int = 32, features: int = 20) -> torch.utils.data.DataLoader:
    """A regression task; the DistributedSampler Lightning adds gives each rank its own examples."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(features, 1, generator=g)
    world = int(os.environ.get("WORLD_SIZE", 1))
    x = torch.randn(steps * batch * world, features, generator=g)
    y = x @ teacher + 0.1 * torch.randn(len(x), 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--delta", action="store_true", help="Adam, its steps combined (strategy ddp_adasum_delta)")
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    module = Regression(args.lr, adam=args.delta)
    trainer = L.Trainer(
        accelerator="auto",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy="ddp_adasum_delta" if args.delta else "ddp_adasum",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, synthetic_data(args.steps))

    mine = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    first = mine.clone()
    dist.broadcast(first, src=0)
    same = torch.tensor([float(torch.equal(mine, first))], device=mine.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if trainer.global_rank == 0:
        print(f"parameters identical on {trainer.world_size} ranks: {bool(same.item())}")
        if not args.delta:
            print(f"Adasum combined the gradients of {trainer.strategy.adasum_state.iteration} iterations")
    # shut the process group down before exit: a gloo group torn down by the interpreter's exit can
    # abort the process ("terminate called without an active exception") after a good run
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
