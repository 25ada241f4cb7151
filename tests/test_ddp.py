"""The DDP communication hook on real gloo process groups: against a manual per-parameter
``adasum.reduce`` of every rank's local gradients, with DDP's bucket rebuild, no_sync, join,
static graphs, gradient-as-bucket-view, fp16/bf16 compression and hierarchical mode, and with
bitwise-identical parameters on every rank."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_wrapper, fp16_compress_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

import adasum
from adasum.collectives.hierarchical import reduce_hierarchical
from adasum.ddp import AdasumState, adasum_hook

import distributed

BUCKET_CAP_MB = 0.001  # about 1 KB: after the rebuild, buckets of several parameters each


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )


def batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def local_grads(model, rank, step, micros=(0,)):
    """The gradients rank `rank` computes alone (summed over micro-batches), from `model`'s weights."""
    model.zero_grad()
    for micro in micros:
        x, y = batch(rank, step, micro)
        torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def record(state, bucket: dist.GradBucket):
    """adasum_hook, also recording how many parameters each bucket held."""
    state.bucket_params.append(len(bucket.gradients()))
    return adasum_hook(state, bucket)


def bf16_adasum(state, bucket: dist.GradBucket):
    # DDP refuses hooks *named* bf16_compress_wrapper_hook without NCCL; the wrapper itself runs on gloo
    return bf16_compress_wrapper(adasum_hook)(state, bucket)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_steps(rank, world, ddp, plain, combine, steps, micros=(0,), tol=1e-5, opt_lr=0.1):
    """Run `steps` iterations; after each backward compare DDP's gradients with `combine` of every
    rank's local gradients (computed here by `plain`, a non-distributed copy); return param bytes."""
    opt = torch.optim.SGD(ddp.parameters(), lr=opt_lr)
    for step in range(steps):
        plain.load_state_dict(ddp.module.state_dict())
        per_rank = [local_grads(plain, r, step, micros) for r in range(world)]
        expected = [combine([per_rank[r][i] for r in range(world)]) for i in range(len(per_rank[0]))]
        opt.zero_grad()
        for micro in micros[:-1]:
            with ddp.no_sync():
                x, y = batch(rank, step, micro)
                torch.nn.functional.mse_loss(ddp(x), y).backward()
        x, y = batch(rank, step, micros[-1])
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        for i, p in enumerate(ddp.parameters()):
            assert rel(p.grad, expected[i]) < tol, (step, i, rel(p.grad, expected[i]))
        opt.step()
    return b"".join(p.detach().numpy().tobytes() for p in ddp.parameters())


def ddp_body(rank, world):
    out = {}
    plain = make_model()

    # plain hook, tiny buckets; the buckets are rebuilt after the first iteration
    state = AdasumState()
    state.bucket_params = []
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(state, record)
    out["basic"] = check_steps(rank, world, ddp, plain, adasum.reduce, steps=4)
    assert max(state.bucket_params) >= 3, state.bucket_params
    assert state.iteration == 4

    # static graph with gradients as bucket views
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB, static_graph=True, gradient_as_bucket_view=True)
    ddp.register_comm_hook(AdasumState(), adasum_hook)
    out["static"] = check_steps(rank, world, ddp, plain, adasum.reduce, steps=3)

    # no_sync accumulation over three micro-batches: Adasum of the accumulated local gradients
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(AdasumState(), adasum_hook)
    out["no_sync"] = check_steps(rank, world, ddp, plain, adasum.reduce, steps=3, micros=(0, 1, 2))

    # torch's compression wrappers: Adasum of the half-precision gradients
    for name, wrapped, dtype, tol in [
        ("fp16", fp16_compress_wrapper(adasum_hook), torch.float16, 2e-3),
        ("bf16", bf16_adasum, torch.bfloat16, 2e-2),
    ]:
        ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
        ddp.register_comm_hook(AdasumState(), wrapped)

        def half(grads, dtype=dtype):
            return adasum.reduce([g.to(dtype) for g in grads]).float()

        out[name] = check_steps(rank, world, ddp, plain, half, steps=3, tol=tol)

    # the mean reducer is DDP's own average
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(AdasumState(reducer="mean"), adasum_hook)
    out["mean"] = check_steps(rank, world, ddp, plain, lambda gs: torch.stack(gs).mean(0), steps=2)

    if world == 4:  # 2 emulated nodes of 2 ranks
        ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
        ddp.register_comm_hook(AdasumState(hierarchical=True, local_size=2), adasum_hook)
        out["hierarchical"] = check_steps(
            rank, world, ddp, plain, lambda gs: reduce_hierarchical(gs, 2), steps=3
        )

    # join with uneven inputs: rank r has 2 + r batches; finished ranks contribute zero buckets
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(AdasumState(), adasum_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for step in range(2 + rank):
            plain.load_state_dict(ddp.module.state_dict())
            per_rank = [
                local_grads(plain, r, step) if step < 2 + r else [torch.zeros_like(p) for p in plain.parameters()]
                for r in range(world)
            ]
            opt.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            for i, p in enumerate(ddp.parameters()):
                expected = adasum.reduce([per_rank[r][i] for r in range(world)])
                assert torch.isfinite(p.grad).all()
                assert rel(p.grad, expected) < 1e-5, (step, i)
            opt.step()
    params = list(ddp.parameters())
    assert all(torch.isfinite(p).all() for p in params)
    out["join"] = b"".join(p.detach().numpy().tobytes() for p in params)

    # the state pickles without its process group
    state = AdasumState(dist.new_group(list(range(world))), reducer=adasum.Adasum(hierarchical=False))
    state.iteration = 7
    restored = pickle.loads(pickle.dumps(state))
    assert restored.process_group is None and restored.iteration == 7
    assert isinstance(restored.reducer, adasum.Adasum)
    copy.deepcopy(AdasumState(hierarchical=True, local_size=1))
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_hook_matches_per_parameter_adasum(world):
    results = distributed.run(world, ddp_body)
    distributed.assert_ranks_agree(results)


def test_state_options():
    with pytest.raises(ValueError, match="hierarchical=True goes with reducer='adasum'"):
        AdasumState(reducer="mean", hierarchical=True)
    with pytest.raises(ValueError, match="local_size needs hierarchical=True"):
        AdasumState(local_size=2)
    with pytest.raises(ValueError, match="unknown reducer"):
        AdasumState(reducer="median")
    assert isinstance(AdasumState(reducer=adasum.Sum()).reducer, adasum.Sum)
