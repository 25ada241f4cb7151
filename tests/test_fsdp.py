"""adasum.fsdp on gloo (or NCCL, ADASUM_TEST_BACKEND=nccl): FSDP2 sharded on mesh['shard'], gradients
combined across mesh['replicate'].

Each rank also computes, with a plain unsharded copy of the model, the full gradient of every rank's
batch; the expected gradient of a parameter is the NumPy reference (tests/reference*.py) over the
replicas' shard means, per parameter (Adasum) or per unit (AdaCons). Ranks of a replica group
(same shard, other replica) must hold bitwise-identical shards.
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import adasum
import adasum.fsdp
from adasum.integrations.fsdp import fill_unused_grads, unit_view
from adasum.settings import current, override

import distributed
from reference import tree as reference_tree
from reference_adacons import AdaConsReference

pytestmark = pytest.mark.nccl

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if distributed.BACKEND == "nccl" else "cpu"  # the mesh's device type
U32, U16 = 2.0**-24, 2.0**-8  # unit roundoff of float32 and bfloat16


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Odd first dims, so that shards are padded; `extra` and `spare` are used on some ranks only, so ranks
    have different unused parameters in the same step (`uses`)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 5)
        self.blocks = nn.ModuleList([Block(5, 7), Block(5, 3)])
        self.extra = nn.Linear(5, 5)
        self.spare = nn.Linear(5, 5, bias=False)
        self.out = nn.Linear(5, 3)

    def forward(self, x, use_extra=False, use_spare=False):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        if use_extra:
            x = x + self.extra(x)
        if use_spare:
            x = x + self.spare(x)
        return self.out(x)


def uses(rank):
    """Rank 0 uses `extra` only, rank 1 `spare` only, rank 2 both, rank 3 neither."""
    return {"use_extra": rank % 2 == 0, "use_spare": rank % 3 == 1}


def unit_of(name):
    return ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "<root>"


def batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def loss_of(model, x, y, rank, dtype):
    device = next(model.parameters()).device  # the CPU, or this rank's GPU on NCCL (the sharded model)
    x, y = x.to(device), y.to(device)
    out = model(x.to(dtype), **uses(rank))
    return ((out.float() - y) ** 2).mean()


def sharded(mesh, dtype=torch.float32, reduce_dtype=None, reducer="adasum", seed=0, include_unused=True):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = Net()
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"], mp_policy=policy)
    fully_shard(model, mesh=mesh["shard"], mp_policy=policy)
    return model, adasum.fsdp.enable(model, mesh, reducer, include_unused=include_unused)


def full_params(model):
    return {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}


def worker_grads(model, world, step, dtype, micros=1):
    """Every rank's full gradients from a plain copy of `model`'s current parameters, on the same device (the
    same kernels as the sharded model's)."""
    plain = Net()
    plain.load_state_dict(full_params(model))
    plain = plain.to(device=next(model.parameters()).device, dtype=dtype)
    out = []
    for r in range(world):
        plain.zero_grad()
        for m in range(micros):
            loss_of(plain, *batch(step, r, m), r, dtype).backward()
        # an unused parameter reduces as zeros (set_reduce_scatter_unused_params)
        out.append({n: (torch.zeros_like(p) if p.grad is None else p.grad).double().cpu().numpy().copy()
                    for n, p in plain.named_parameters()})
    return out


def replica_means(per_rank, replicas, shards):
    return [{n: np.mean([per_rank[k * shards + s][n] for s in range(shards)], axis=0) for n in per_rank[0]}
            for k in range(replicas)]


def pair_bound(a, b, ea, eb, u):
    """(adasum(a, b), first-order bound on its error) for inputs a, b known within ea, eb (norms), the
    coefficients from float64 sums of the perturbed inputs, the result computed and rounded in a format of
    unit roundoff u: |ca| ea + |cb| eb (the inputs' errors) + (3 ea |b| + eb |a|) / 2|a| + (3 eb |a| + ea |b|) / 2|b|
    (the coefficients' errors, |<a,b>| <= |a||b|) + 2u (|ca a| + |cb b|) + u |result| (the rounding).
    An exactly zero side (a parameter no rank of its subtree used) is exact: coefficient 1, no error."""
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    dot = float(a.reshape(-1) @ b.reshape(-1))
    ca = 1.0 if na == 0 else 1 - dot / (2 * na * na)
    cb = 1.0 if nb == 0 else 1 - dot / (2 * nb * nb)
    out = ca * a + cb * b
    coefficients = (0 if na == 0 else (3 * ea * nb + eb * na) / (2 * na)) + (
        0 if nb == 0 else (3 * eb * na + ea * nb) / (2 * nb))
    rounding = 2 * u * (abs(ca) * na + abs(cb) * nb) + u * np.linalg.norm(out)
    return out, abs(ca) * ea + abs(cb) * eb + coefficients + rounding


def adasum_bound(vectors, u):
    """First-order bound on |result - tree(vectors)| (a power of two of them, Horovod's tree) when each
    input carries two roundings (the shard mean): `pair_bound` level by level."""
    level = [(v, 2 * u * np.linalg.norm(v)) for v in vectors]
    while len(level) > 1:
        level = [pair_bound(a, b, ea, eb, u) for (a, ea), (b, eb) in zip(level[::2], level[1::2])]
    return level[0][1]


def backward(model, rank, step, dtype, micros=1):
    for m in range(micros):
        model.set_requires_gradient_sync(m == micros - 1)
        loss_of(model, *batch(step, rank, m), rank, dtype).backward()


def check_adasum_step(model, rank, world, shards, step, dtype=torch.float32, u=U32, micros=1):
    expected_by = replica_means(worker_grads(model, world, step, dtype, micros), world // shards, shards)
    got = {n: p.grad.full_tensor().double().cpu().numpy() for n, p in model.named_parameters()}
    for n in got:
        vectors = [m[n].reshape(-1) for m in expected_by]
        expected = reference_tree(vectors).reshape(got[n].shape)
        err = np.linalg.norm(got[n] - expected)
        assert err <= adasum_bound(vectors, u), (step, n, err, adasum_bound(vectors, u))
    return b"".join(p.grad.to_local().detach().float().cpu().numpy().tobytes() for _, p in model.named_parameters())


def sgd(model, lr=0.1):
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


def without_setter(make):
    """`make()` on a torch without FSDPModule.set_reduce_scatter_unused_params (as torch 2.11)."""
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        return make()
    setter = FSDPModule.set_reduce_scatter_unused_params
    del FSDPModule.set_reduce_scatter_unused_params
    try:
        return make()
    finally:
        FSDPModule.set_reduce_scatter_unused_params = setter


def adasum_steps(mesh, rank, world, shards, out):
    """Adasum, several units, different unused parameters on different ranks, two steps: with FSDP's setter,
    and without it (adasum.fsdp gives the unused parameters zero gradients itself). One blocking agreement
    (at enable) either way: the forward's probes find the same layouts."""
    from torch.distributed.fsdp import FSDPModule

    variants = [("no setter", lambda: without_setter(lambda: sharded(mesh)))]
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):  # torch >= 2.12 (2.11 has the no-setter path only)
        variants.append(("adasum", lambda: sharded(mesh)))
    for name, make in variants:
        model, state = make()
        assert state.fills_unused == (name == "no setter")
        assert unit_view(model).include_unused != state.fills_unused
        for step in range(2):
            backward(model, rank, step, torch.float32)
            out[(name, step)] = check_adasum_step(model, rank, world, shards, step)
            sgd(model)
        assert state.reductions == 6 and state.agreements == 1, state  # 3 units x 2 steps


def hsdp_body(rank, world, shards, tmp):
    from torch.distributed.device_mesh import init_device_mesh

    replicas = world // shards
    mesh = init_device_mesh(DEVICE, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    out = {}
    adasum_steps(mesh, rank, world, shards, out)

    # gradient accumulation: 2 micro-batches, synchronised on the last
    model, _ = sharded(mesh, seed=1)
    backward(model, rank, 5, torch.float32, micros=2)
    out["accumulate"] = check_adasum_step(model, rank, world, shards, 5, micros=2)

    # mixed precision: bf16 parameters, float32 or bf16 reduction
    for reduce_dtype, u in [(torch.float32, U32), (torch.bfloat16, U16)]:
        model, _ = sharded(mesh, torch.bfloat16, reduce_dtype, seed=2)
        backward(model, rank, 7, torch.bfloat16)
        out[("mixed", str(reduce_dtype))] = check_adasum_step(model, rank, world, shards, 7, torch.bfloat16, u)

    # AdaCons with momentum, whole-unit coefficients over the shards, two steps
    model, _ = sharded(mesh, reducer=adasum.AdaCons(momentum=0.5), seed=3)
    reference = {}
    for step in range(2):
        backward(model, rank, step, torch.float32)
        means = replica_means(worker_grads(model, world, step, torch.float32), replicas, shards)
        got = {n: p.grad.full_tensor().double().cpu().numpy() for n, p in model.named_parameters()}
        for unit in sorted({unit_of(n) for n in got}):
            names = [n for n in got if unit_of(n) == unit]
            ref = reference.setdefault(unit, AdaConsReference(beta=0.5))([[m[n] for n in names] for m in means])
            err = np.sqrt(sum(np.sum((got[n] - r) ** 2) for n, r in zip(names, ref)))
            mean_norm = np.sqrt(sum(np.sum(np.mean([m[n] for m in means], axis=0) ** 2) for n in names))
            # |d| terms sum to |m| (weights c_i >= 0 summing to 1): a few float32 roundings of |m| each
            assert err <= 16 * U32 * mean_norm, (step, unit, err, mean_norm)
        out[("adacons", step)] = b"".join(p.grad.to_local().cpu().numpy().tobytes() for p in model.parameters())
        sgd(model)

    if shards == 2:
        mean_and_refusal(mesh, rank, world, shards, out)
        out["resume"] = resume_check(mesh, rank, tmp)
    return out


class Whole(adasum.Reducer):
    """A reducer with coefficients of its own and no sharded form."""

    def _all_reduce_flat(self, buffer, sizes, group=None):
        raise AssertionError("not reached: refused by enable")


def mean_and_refusal(mesh, rank, world, shards, out):
    """Mean runs on the shards directly (element-wise); a reducer without a sharded form is refused."""
    model, _ = sharded(mesh, reducer="mean", seed=9)
    backward(model, rank, 3, torch.float32)
    means = replica_means(worker_grads(model, world, 3, torch.float32), world // shards, shards)
    for n, p in model.named_parameters():
        got = p.grad.full_tensor().double().cpu().numpy()
        expected = np.mean([m[n] for m in means], axis=0)
        # two roundings of each shard mean, one of the sum over the replicas (the division by 2 is exact)
        assert np.linalg.norm(got - expected) <= 4 * U32 * np.mean([np.linalg.norm(m[n]) for m in means]), n
    out["mean"] = b"".join(p.grad.to_local().cpu().numpy().tobytes() for p in model.parameters())
    with pytest.raises(ValueError, match="would see tensor shards"):
        adasum.fsdp.enable(_sharded_plain(mesh), mesh, Whole())


def train(model, opt, rank, steps):
    for step in steps:
        backward(model, rank, step, torch.float32)
        opt.step()
        opt.zero_grad()


def resume_check(mesh, rank, tmp):
    """Adam + AdaCons momentum: 2 steps, DCP save, 2 more == fresh model loaded from DCP, 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, state = sharded(mesh, reducer=adasum.AdaCons(momentum=0.5), seed=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, rank, [0, 1])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "adasum": state}, checkpoint_id=tmp)
    train(model, opt, rank, [2, 3])
    straight = full_params(model)

    model, state = sharded(mesh, reducer=adasum.AdaCons(momentum=0.5), seed=5)  # other initial values
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    msd, osd = get_state_dict(model, opt)
    loaded = {"model": msd, "optim": osd, "adasum": state}
    dcp.load(loaded, checkpoint_id=tmp)
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert state.reductions == 6 and state.reducer.state_dict()["states"], state
    train(model, opt, rank, [2, 3])
    resumed = full_params(model)
    for n in straight:
        assert torch.equal(straight[n], resumed[n]), n
    return True


def check_replica_groups(results, world, shards):
    """Ranks r and r' with the same shard (r % shards) hold bitwise-identical shards of every result."""
    for key in results[0]:
        for r in range(world):
            assert results[r][key] == results[r % shards][key], (key, r)


@pytest.mark.parametrize("world", distributed.world_sizes(4))
def test_hsdp_2_replicas_x_2_shards(tmp_path, world):
    results = distributed.run(world, hsdp_body, 2, str(tmp_path / "ckpt"), timeout_s=150)
    check_replica_groups(results, world, 2)
    assert all(r["resume"] for r in results)


def replicas_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(DEVICE, (world, 1), mesh_dim_names=("replicate", "shard"))
    out = {}
    adasum_steps(mesh, rank, world, 1, out)
    return out


@pytest.mark.parametrize("world", distributed.world_sizes(4))
def test_hsdp_4_replicas_x_1_shard(world):
    results = distributed.run(world, replicas_body, timeout_s=120)
    check_replica_groups(results, world, 1)


def setup_body(rank, world):
    """2 x 1: the reducers, the private-state accessor, and the refusals."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = hsdp_body(rank, world, 1, None)
    mesh = init_device_mesh(DEVICE, (2, 1), mesh_dim_names=("replicate", "shard"))

    # the accessor reads the layout FSDP really uses: padded dim-0 shard sizes, trainable parameters only
    torch.manual_seed(0)
    model = Net()
    model.inp.bias.requires_grad_(False)
    fully_shard(model, mesh=mesh["shard"])
    model(torch.zeros(1, 6, device=distributed.device_for(rank)))  # FSDP names its parameters at the first forward
    view = unit_view(model)
    expected = [(n, p.numel()) for n, p in Net().named_parameters() if n != "inp.bias"]
    assert list(view.names) == [n for n, _ in expected]
    assert list(view.segments) == [n for _, n in expected]  # one shard: padded size = size
    assert view.all_reduce and not view.post_divides

    errors = {}
    fresh = Net()
    fully_shard(fresh, mesh=mesh["shard"])  # parameters are DTensors until the first forward
    flat = init_device_mesh(DEVICE, (2,))
    for what, call in [
        ("1-D mesh", lambda: adasum.fsdp.enable(model, flat)),
        ("hierarchical", lambda: adasum.fsdp.enable(model, mesh, adasum.Adasum(hierarchical=True, local_size=1))),
        ("not sharded", lambda: adasum.fsdp.enable(Net(), mesh)),
        ("native HSDP", lambda: native_hsdp(mesh)),
        ("optimizer", lambda: adasum.DistributedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1))),
        ("slowmo", lambda: adasum.SlowMo(torch.optim.SGD(fresh.parameters(), lr=0.1), local_steps=2)),
    ]:
        try:
            call()
        except (ValueError, TypeError) as e:
            errors[what] = str(e)
        else:
            raise AssertionError(f"{what}: not refused")
    assert "later step" in errors["1-D mesh"] and "replicate" in errors["1-D mesh"]
    assert "hierarchical Adasum does not combine tensor shards" in errors["hierarchical"]
    assert "use Adasum() without hierarchical" in errors["hierarchical"]
    assert "the model has no fully_shard unit" in errors["not sharded"]
    assert "fully_shard(..., mesh=mesh['shard'])" in errors["not sharded"]
    assert "native HSDP" in errors["native HSDP"]
    assert "adasum.DistributedOptimizer" in errors["optimizer"] and "adasum.fsdp.enable" in errors["optimizer"]
    assert "adasum.SlowMo" in errors["slowmo"] and "adasum.fsdp.enable" in errors["slowmo"]

    # a second enable of an enabled model (or of one of its units): refused on every rank before any collective,
    # and the first enable's hooks reduce on, alone
    model, state = sharded(mesh, seed=12)
    with pytest.raises(ValueError) as e:
        adasum.fsdp.enable(model, mesh, "mean")
    errors["twice"] = str(e.value)
    with pytest.raises(ValueError, match="unit '<root>' of the model is enabled already"):
        adasum.fsdp.enable(model.blocks[0], mesh)
    loss_of(model, *batch(0, rank), rank, torch.float32).backward()
    assert state.reductions == 3 and state.agreements == 1, state  # three units, no other probe
    assert isinstance(state.reducer, adasum.Adasum)

    # a layout that changes on one rank after enable: the forward's probe finds it, every rank raises the same error
    model, state = sharded(mesh, seed=8)
    if rank == 1:
        model.out.bias.requires_grad_(False)
    with pytest.raises(ValueError) as e:
        loss_of(model, *batch(0, rank), rank, torch.float32).backward()
    errors["changed"] = str(e.value)
    assert state.reductions == 0 and state.agreements == 2

    # a parameter without gradient on one replica, unused parameters left out: the same error everywhere
    model, _ = sharded(mesh, seed=6, include_unused=False)  # torch 2.11 has no set_reduce_scatter_unused_params
    with pytest.raises(ValueError) as e:
        loss_of(model, *batch(0, rank), rank, torch.float32).backward()
    errors["unused"] = str(e.value)

    # FSDP divides after the hook (fp16 reduce dtype): a reducer whose result does not scale with its inputs is refused
    model, _ = sharded(mesh, reduce_dtype=torch.float16, reducer=adasum.AdaCons(scale="unit"), seed=10)
    with pytest.raises(ValueError) as e:
        loss_of(model, *batch(0, rank), rank, torch.float32).backward()
    errors["not homogeneous"] = str(e.value)

    # the reductions follow the cuda_graphs setting, captured where it is on (docs/integrations.md: streams and graphs)
    seen = []

    class Seeing(adasum.Mean):
        def all_reduce_shards(self, buffer, sizes, groups, *, key=None):
            seen.append(current().cuda_graphs)
            super().all_reduce_shards(buffer, sizes, groups, key=key)

    model, _ = sharded(mesh, reducer=Seeing(), seed=11)
    with override(cuda_graphs=True):
        loss_of(model, *batch(0, rank), rank, torch.float32).backward()
    errors["graphs in the hook"] = seen
    return out, errors


def _sharded_plain(mesh):
    from torch.distributed.fsdp import fully_shard

    model = Net()
    fully_shard(model, mesh=mesh["shard"])
    return model


def native_hsdp(mesh):
    from torch.distributed.fsdp import fully_shard

    model = Net()
    fully_shard(model, mesh=mesh)
    adasum.fsdp.enable(model, mesh)


@pytest.mark.parametrize("world", distributed.world_sizes(2))  # NCCL: one GPU per rank
def test_hsdp_2_replicas_x_1_shard(world):
    results = distributed.run(world, setup_body, timeout_s=120)
    check_replica_groups([r[0] for r in results], 2, 1)
    errors = [r[1] for r in results]
    assert errors[0] == errors[1]
    assert "differ across ranks" in errors[0]["unused"]
    assert errors[0]["twice"] == (
        "adasum.fsdp.enable: unit '<root>' of the model is enabled already (an earlier adasum.fsdp.enable installed "
        "its hooks); a second enable would leave the first one's forward hook posting probes and its FSDPState "
        "unused. Call enable once per model and keep the FSDPState it returns (for another reducer, shard a new "
        "model)"
    ), errors[0]["twice"]
    assert "gradient layouts differ across ranks" in errors[0]["changed"], errors[0]["changed"]
    assert "does not scale with its inputs" in errors[0]["not homogeneous"], errors[0]["not homogeneous"]
    assert errors[0]["graphs in the hook"] == [True] * 3, errors[0]["graphs in the hook"]  # three units


def part_body(rank, world):
    """2 x 1: enable on one unit of a model whose root is a fully_shard unit too; the other units would reduce over
    the shard group only (never across the replicas), so the first reduction raises, the same on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(DEVICE, (2, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = adasum.fsdp.enable(model.blocks[0], mesh)  # accepted: FSDP knows its root at the first forward only
    with pytest.raises(ValueError) as e:
        loss_of(model, *batch(0, rank), rank, torch.float32).backward()
    return str(e.value), state.reductions


def test_enable_on_a_part_of_the_model_is_refused():
    results = distributed.run(2, part_body, timeout_s=120)
    assert results[0] == results[1], results
    message, reductions = results[0]
    assert message == (
        "adasum.fsdp: the fully_shard units ['<root>', 'blocks.1'] of the FSDP model are outside the module given to "
        "adasum.fsdp.enable, so their gradients would not be combined across the replicas; call adasum.fsdp.enable "
        "on the module that FSDP takes as root (the outermost fully_shard module, whose forward runs first)"
    ), message
    assert reductions == 0


def one_replica_body(rank, world):
    """enable on a mesh of 1 replica x 2 shards: what each rank's warning says and the file it names."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(DEVICE, (1, 2), mesh_dim_names=("replicate", "shard"))
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adasum.fsdp.enable(model, mesh)
    return [(str(w.message), w.filename) for w in caught]


def test_enable_warns_on_every_rank_when_there_is_one_replica():
    results = distributed.run(2, one_replica_body, timeout_s=120)
    assert results[0] == results[1], results
    assert [filename for _, filename in results[0]] == [__file__]  # the user's line, not adasum's
    assert results[0][0][0].startswith(
        "adasum.fsdp.enable: the mesh's 'replicate' dim has size 1, so there is one replica and nothing to combine: "
        "training runs as plain FSDP over 2 shard(s)"
    )


def test_enable_refuses_an_include_unused_that_is_not_a_flag():
    # "no" would count as true; refused before anything else (no mesh, no collective)
    for bad in ("no", 0, None):
        with pytest.raises(TypeError) as e:
            adasum.fsdp.enable(nn.Linear(2, 1), None, include_unused=bad)
        assert str(e.value) == f"adasum.fsdp.enable: include_unused must be True or False, got {bad!r}; pass a bool"


def test_unit_view_fails_loudly_on_changed_torch():
    class Unit:  # an FSDP unit whose state lacks what unit_view reads
        def _get_fsdp_state(self):
            return object()

    with pytest.raises(RuntimeError, match="private state"):
        unit_view(Unit())

    class Group:  # a parameter group without what the stand-in for the setter wraps
        fsdp_params = ()

    class Older:
        def _get_fsdp_state(self):
            return type("State", (), {"_fsdp_param_groups": [Group()]})()

    with pytest.raises(RuntimeError, match="Group.post_backward"):
        fill_unused_grads(Older())


@pytest.mark.parametrize("schedule", ["interleaved", "sequential"])
def test_benchmark_dry_run(schedule, tmp_path):
    """The benchmark on CPU/gloo with a tiny model, every variant's steps interleaved (or each variant alone,
    twice, alternated), then the table and the rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    how = ["--sequential", "--repeats", "2"] if schedule == "sequential" else []
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([*command, str(ROOT / "benchmarks" / "bench_fsdp.py"), "--dry-run", *how, "--mesh", "2x1",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    runs = 2 if schedule == "sequential" else 1
    assert [line.split(":")[0] for line in lines if "ms/step" in line] == ["native", "mean", "adasum"] * runs, lines
    assert any(line.startswith("mesh 2 x 1 (replicas x shards) on ") for line in lines), lines
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"variant", "native", "mean", "adasum"}, lines
    assert rows["native"].split("|")[4].strip() == "1.000", rows["native"]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in records] == ["native", "mean", "adasum"] * runs
    assert {r["schedule"] for r in records} == {schedule}
    assert all(len(r["step_times_s"]) == 2 and r["step_s"] > 0 for r in records), records
    if schedule == "interleaved":  # each variant's ratio: the median of its steps over native's, round by round
        native = records[0]["step_times_s"]
        for r in records:
            assert r["ratio"] == pytest.approx(statistics.median(a / b for a, b in zip(r["step_times_s"], native)))
