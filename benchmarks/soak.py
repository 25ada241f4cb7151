"""Soak test of adasum.all_reduce: thousands of steps over local gloo ranks with random layouts.

Every step draws, from a seed shared by all ranks, a process group (a random subset of at least two
ranks, so world sizes and rank placements vary), a random bucket layout (1 to 24 tensors of random
shapes, zero-size ones included, and dtypes float32/float64/bfloat16/float16) and a regime for each
tensor (Gaussian at a random scale, zeros, parallel across ranks, one rank large). Each member
rank builds its own tensors from (seed, step, its group rank); any rank can rebuild every member's.

Checked at every step: the results are bitwise identical on every member (an all-gather of a hash
of the result bytes). Every `--check-every` steps: they agree with the single-process
``adasum.reduce`` of the members' tensors. About 3% of steps inject a NaN or Inf on one member
and check that ``nonfinite="raise"`` names the same tensor and rank on every member; another 3%
let it propagate and check bitwise identity with it. Any failure raises (the run exits non-zero).

    python benchmarks/soak.py                          # 4 ranks, 5000 steps
    python benchmarks/soak.py --world 3 --steps 20000 --seed 7
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import adasum

DTYPES = [torch.float32, torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16]
SCALE_EXPONENTS = {torch.float64: 60, torch.float32: 30, torch.bfloat16: 30, torch.float16: 2}  # fp16 tops at 65504
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def draw_step(seed: int, step: int, world: int) -> dict:
    """Everything about a step that every rank must agree on, from (seed, step) alone."""
    rng = random.Random(seed * 1_000_003 + step)
    size = rng.randint(2, world)
    members = sorted(rng.sample(range(world), size))
    tensors = []
    for _ in range(rng.randint(1, 24)):
        dtype = rng.choice(DTYPES)
        if rng.random() < 0.1:
            shape = (rng.randint(1000, 5000),)
        else:
            shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3)))
        regime = rng.choices(["gaussian", "zero", "parallel", "one-large"], weights=[6, 1, 2, 1])[0]
        tensors.append((shape, dtype, regime, rng.randint(-SCALE_EXPONENTS[dtype], SCALE_EXPONENTS[dtype])))
    fault = rng.choices([None, "raise", "propagate"], weights=[94, 3, 3])[0]
    poisoned = None
    if fault is not None:
        sizable = [i for i, (shape, *_rest) in enumerate(tensors) if torch.Size(shape).numel() > 0]
        if sizable:
            value = rng.choice([float("nan"), float("inf"), -float("inf")])
            poisoned = (rng.choice(sizable), rng.randrange(size), value)
        else:
            fault = None
    return {
        "members": members,
        "tensors": tensors,
        "check_layout": rng.random() < 0.8,
        "fault": fault,
        "poisoned": poisoned,
    }


def member_tensors(seed: int, step: int, plan: dict, group_rank: int) -> list[torch.Tensor]:
    """The tensors group rank `group_rank` holds at `step`."""
    shared = torch.Generator().manual_seed(seed * 7919 + step)
    own = torch.Generator().manual_seed((seed * 7919 + step) * 64 + group_rank + 1)
    out = []
    for shape, dtype, regime, exponent in plan["tensors"]:
        direction = torch.randn(shape, generator=shared, dtype=torch.float64)
        scale = 2.0**exponent
        if regime == "zero":
            t = torch.zeros(shape, dtype=torch.float64)
        elif regime == "parallel":  # same direction, a positive factor per rank
            t = direction * scale * (0.5 + torch.rand((), generator=own, dtype=torch.float64))
        elif regime == "one-large":
            t = torch.randn(shape, generator=own, dtype=torch.float64) * scale * (2.0**6 if group_rank == 0 else 1.0)
        else:
            t = torch.randn(shape, generator=own, dtype=torch.float64) * scale
        out.append(t.to(dtype))
    if plan["poisoned"] is not None:
        index, bad_rank, value = plan["poisoned"]
        if group_rank == bad_rank:
            out[index].view(-1)[0] = value
    return out


def digest(tensors: list[torch.Tensor]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def check_bitwise(tensors: list[torch.Tensor], group: dist.ProcessGroup, step: int) -> None:
    mine = torch.tensor([digest(tensors)], dtype=torch.int64)
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if len({int(x) for x in everyone}) != 1:
        raise AssertionError(f"step {step}: results differ across ranks: {[int(x) for x in everyone]}")


def check_same_message(message: str, group: dist.ProcessGroup, step: int) -> None:
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, message, group=group)
    if len(set(everyone)) != 1:
        raise AssertionError(f"step {step}: the ranks raised different errors: {everyone}")


def check_reference(result: list[torch.Tensor], inputs: list[list[torch.Tensor]], step: int) -> None:
    for i, t in enumerate(result):
        if t.numel() == 0:
            continue
        ref = adasum.reduce([w[i] for w in inputs]).double()
        scale = sum(float(w[i].double().norm()) for w in inputs) or 1.0
        err = float((t.double() - ref).abs().max()) / scale
        if not err <= TOLERANCE[t.dtype]:
            raise AssertionError(
                f"step {step}: tensor {i} ({t.dtype}, {tuple(t.shape)}) is off adasum.reduce by {err:.3g}"
            )


def soak(rank: int, world: int, args: argparse.Namespace, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    groups = {
        members: dist.new_group(list(members))
        for size in range(2, world + 1)
        for members in itertools.combinations(range(world), size)
    }
    counts = {"steps": 0, "reference_checks": 0, "raised": 0, "propagated": 0}  # those this rank took part in
    start = time.monotonic()
    for step in range(args.steps):
        plan = draw_step(args.seed, step, world)
        members = plan["members"]
        if rank not in members:
            continue
        group = groups[tuple(members)]
        me = members.index(rank)
        tensors = member_tensors(args.seed, step, plan, me)
        inputs = [t.clone() for t in tensors]
        if plan["fault"] == "raise":
            index, bad_rank, value = plan["poisoned"]
            kind = "NaN" if value != value else "Inf"
            try:
                adasum.all_reduce(tensors, group=group, nonfinite="raise")
                raise AssertionError(f"step {step}: no NonFiniteError for {kind} in tensor {index} on rank {bad_rank}")
            except adasum.NonFiniteError as error:
                raised = error
            if (raised.found.index, raised.found.rank, raised.found.kind) != (index, bad_rank, kind):
                raise AssertionError(f"step {step}: expected tensor {index} rank {bad_rank} {kind}, got {raised}")
            if digest(tensors) != digest(inputs):
                raise AssertionError(f"step {step}: nonfinite='raise' changed the tensors")
            check_same_message(str(raised), group, step)
            counts["raised"] += 1
            continue
        adasum.all_reduce(tensors, group=group, check_layout=plan["check_layout"])
        check_bitwise(tensors, group, step)
        counts["steps"] += 1
        if plan["fault"] == "propagate":
            counts["propagated"] += 1
            if torch.isfinite(tensors[plan["poisoned"][0]]).all():
                raise AssertionError(f"step {step}: a non-finite input came out finite")
        elif step % args.check_every == 0:
            everyone = [member_tensors(args.seed, step, plan, r) for r in range(len(members))]
            check_reference(tensors, everyone, step)
            counts["reference_checks"] += 1
    if rank == 0:
        summary = {"world": world, "seed": args.seed, "steps_drawn": args.steps}
        summary.update({f"rank0_{k}": v for k, v in counts.items()}, seconds=round(time.monotonic() - start, 1))
        print(json.dumps(summary), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4, help="gloo ranks to spawn (2 to 4 is the target)")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=25, help="compare with adasum.reduce every N steps")
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error("--world must be at least 2")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(soak, args=(args.world, args, os.path.join(tmp, "store")), nprocs=args.world, join=True)


if __name__ == "__main__":
    sys.exit(main())
