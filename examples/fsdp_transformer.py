"""A small transformer trained with FSDP2 + Adasum across replicas (HSDP), under torchrun.

    torchrun --nproc-per-node 4 examples/fsdp_transformer.py              # 2 replicas x 2 shards, CPU/gloo
    torchrun --nproc-per-node 4 examples/fsdp_transformer.py --shards 1   # 4 replicas
    torchrun --nproc-per-node 2 examples/fsdp_transformer.py              # 2 replicas x 1 shard
    torchrun --nproc-per-node 3 examples/fsdp_transformer.py              # 3 replicas (an odd count: 1 shard)

--shards must divide the number of processes (default: 2 where that leaves at least 2 replicas, else 1:
Adasum combines across replicas, so one replica would have nothing to combine).

Parameters are sharded over mesh["shard"] with `fully_shard`; `adasum.fsdp.enable` combines the
gradients across mesh["replicate"] with Adasum, per parameter. Each rank draws its own batches of
a copy task (predict the token seen `lag` positions earlier).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import adasum.fsdp


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab=16, dim=32, layers=2, heads=4, seq=12):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        seq = tokens.shape[1]
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        x = self.embed(tokens) + self.pos[:seq]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=None,
                        help="ranks per replica (default: 2 where that leaves 2 replicas or more, else 1)")
    parser.add_argument("--steps", type=int, default=60, help="training steps")
    parser.add_argument("--lag", type=int, default=2, help="the copy task's lag in tokens")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    shards = args.shards if args.shards is not None else (2 if world % 2 == 0 and world >= 4 else 1)
    if shards < 1 or world % shards:  # checked before the group starts: every rank exits with this line
        parser.error(f"--shards {shards} must divide the {world} processes into replicas of equal size")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)  # the same initial model everywhere
    model = Transformer()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = adasum.fsdp.enable(model, mesh)  # Adasum across the replicas
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    g = torch.Generator().manual_seed(int(os.environ.get("RANK", rank)) + 1)
    for step in range(args.steps):
        tokens = torch.randint(0, 16, (16, 12), generator=g)
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, args.lag:].flatten(0, 1), tokens[:, : -args.lag].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step in (0, args.steps - 1) and rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    full = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(everyone, full)
    if rank == 0:
        print(f"parameters identical on {world} ranks: {all(torch.equal(full, e) for e in everyone)}")
        print(f"Adasum combined {state.reductions} unit gradients across {world // shards} replicas")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
