"""Horovod's PyTorch MNIST example with ``op=hvd.Adasum``, ported to adasum (docs/migrating-from-horovod.md),
launched with torchrun instead of horovodrun.

    torchrun --nproc-per-node 2 examples/horovod_port.py                # CPU, gloo
    torchrun --nproc-per-node 4 examples/horovod_port.py --steps 200

Each ``# hvd:`` comment is the Horovod line that the line below it replaces; the lines without one are
Horovod's as they were. A synthetic three-class task stands in for MNIST's loader (every rank draws its own
batches), so the example runs without a download. The metric average at the end is Horovod's
``metric_average`` (``hvd.allreduce(t, op=hvd.Average)``) in torch's words.
"""

import argparse

import torch
import torch.distributed as dist  # hvd: import horovod.torch as hvd
import torch.nn.functional as F
import torch.optim as optim

import adasum

CLASSES, FEATURES, BATCH = 3, 6, 8


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, 16)
        self.bn = torch.nn.BatchNorm1d(16)  # buffers: broadcast with the state dict
        self.fc2 = torch.nn.Linear(16, CLASSES)

    def forward(self, x):
        return F.log_softmax(self.fc2(torch.relu(self.bn(self.fc1(x)))), dim=1)


def batch(rank, step, micro):
    """Rank `rank`'s batch of backward pass `micro` of step `step`: three Gaussian blobs, a draw of its own."""
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    target = torch.randint(CLASSES, (BATCH,), generator=g)
    centres = torch.eye(CLASSES, FEATURES) * 3.0
    return centres[target] + torch.randn(BATCH, FEATURES, generator=g), target


def make_optimizer(params, lr):
    return optim.SGD(params, lr=lr, momentum=0.9)  # on CPUs Horovod's Adasum example scales lr by nothing


def train(rank, steps=8, passes=2, lr=0.05, before_broadcast=None):
    """The training part of the script on rank `rank` of an initialised group: ([parameters], [losses]).
    `before_broadcast(model, optimizer)`, if given, runs before the broadcasts (a test gives rank 0 a step)."""
    torch.manual_seed(rank)  # different initial weights on every rank: the broadcast makes them agree
    model = Net()
    optimizer = make_optimizer(model.parameters(), lr)
    if before_broadcast is not None:
        before_broadcast(model, optimizer)
    # hvd: hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    adasum.broadcast_parameters(model.state_dict(), root_rank=0)
    # hvd: hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    adasum.broadcast_optimizer_state(optimizer, root_rank=0)
    # hvd: optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
    # hvd:                                      op=hvd.Adasum, backward_passes_per_step=passes)
    optimizer = adasum.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            op="Adasum", backward_passes_per_step=passes)
    losses = []
    for step in range(steps):
        for micro in range(passes):
            data, target = batch(rank, step, micro)
            optimizer.zero_grad()  # a no-op while passes accumulate
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def metric_average(value):
    """The mean of `value` over the ranks (Horovod's ``metric_average``: ``hvd.allreduce(t, op=hvd.Average)``)."""
    tensor = torch.tensor(float(value))  # on NCCL: on the rank's GPU
    dist.all_reduce(tensor)  # a sum: ReduceOp.AVG exists on NCCL only
    return (tensor / dist.get_world_size()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (each of 2 backward passes)")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # hvd: hvd.init()  (torchrun sets the rendezvous; "nccl" on GPUs)
    rank, world = dist.get_rank(), dist.get_world_size()  # hvd: hvd.rank(), hvd.size()
    params, losses = train(rank, steps=args.steps, lr=args.lr)
    first, last = metric_average(losses[0]), metric_average(sum(losses[-4:]) / 4)

    flat = torch.cat([p.reshape(-1) for p in params])
    root = flat.clone()
    dist.broadcast(root, src=0)
    same = torch.tensor([float(torch.equal(flat, root))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"loss averaged over {world} ranks: first {first:.4f}, last {last:.4f}")
        print(f"parameters identical on {world} ranks: {bool(same.item())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
