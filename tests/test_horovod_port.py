"""Horovod's Adasum training script (its PyTorch MNIST example with ``op=hvd.Adasum``) ported line by line
to adasum (examples/horovod_port.py, docs/migrating-from-horovod.md) and trained on 2 gloo ranks, against a
single-process simulation of both ranks; and the two broadcast helpers on their own, with Horovod's and
torch's names of the root."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import adasum

import distributed
from reference import tree

ROUNDS, PASSES = 8, 2  # optimizer steps; backward passes accumulated per step


def example():
    """examples/horovod_port.py as a module (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location("horovod_port", Path(__file__).parent.parent / "examples" /
                                                  "horovod_port.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


port = example()
Net, FEATURES, shard = port.Net, port.FEATURES, port.batch


def make_optimizer(params):
    return port.make_optimizer(params, 0.05)


def warm_up(model, optimizer):
    """Rank 0 has already taken one step (so there is momentum state to broadcast); the others have none."""
    data, target = shard(99, 0, 0)
    F.nll_loss(model(data), target).backward()
    optimizer.step()
    optimizer.zero_grad()


def horovod_body(rank, world):
    params, losses = port.train(rank, steps=ROUNDS, passes=PASSES, lr=0.05,
                                before_broadcast=warm_up if rank == 0 else None)
    return [p.numpy().copy() for p in params], losses


def simulate(world):
    """Both ranks in one process: rank 0's warmed-up start everywhere, per rank PASSES accumulated passes and a
    local SGD step, the deltas combined by the NumPy reference tree, applied to the common start."""
    torch.manual_seed(0)
    start = Net()
    start_opt = make_optimizer(start.parameters())
    warm_up(start, start_opt)
    models = [Net() for _ in range(world)]
    opts = [make_optimizer(m.parameters()) for m in models]
    for m, o in zip(models, opts):
        m.load_state_dict(start.state_dict())
        o.load_state_dict(copy.deepcopy(start_opt.state_dict()))  # torch would share the momentum buffers
    for step in range(ROUNDS):
        x0 = [p.detach().clone() for p in models[0].parameters()]
        for r, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            for micro in range(PASSES):
                data, target = shard(r, step, micro)
                F.nll_loss(m(data), target).backward()
            o.step()
        with torch.no_grad():
            for i, base in enumerate(x0):
                deltas = [(list(m.parameters())[i] - base).double().reshape(-1).numpy() for m in models]
                combined = torch.from_numpy(tree(deltas)).to(base.dtype).reshape(base.shape)
                for m in models:
                    list(m.parameters())[i].copy_(base + combined)
    return [p.detach() for p in models[0].parameters()]


def test_horovod_adasum_example_trains_as_the_reference():
    world = 2
    results = distributed.run(world, horovod_body)
    expected = simulate(world)
    for params, _ in results:
        for p, e in zip(params, expected):
            assert float((torch.from_numpy(p) - e).norm() / e.norm()) < 1e-5
    assert all((a == b).all() for a, b in zip(results[0][0], results[1][0]))
    losses = results[0][1]
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), losses  # it learns


def broadcast_body(rank, world):
    """broadcast_parameters: a state dict with buffers (integer ones too) and tied weights, named_parameters()
    pairs, bare parameters; broadcast_optimizer_state: Adam state onto a rank without any (``step`` stays a CPU
    tensor), and into a DistributedOptimizer; a layout that differs across ranks is refused on every rank.
    Returns each rank's values before and after every broadcast."""

    def copies(tensors):
        return [t.detach().numpy().copy() for t in tensors]

    torch.manual_seed(rank)
    model = Net()
    tied = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False))
    tied[1].weight = tied[0].weight
    model.bn.num_batches_tracked.fill_(7 * (rank + 1))
    out = {"state_before": copies(model.state_dict().values()), "tied_before": copies([tied[0].weight])}
    adasum.broadcast_parameters(model.state_dict(), root=1)
    adasum.broadcast_parameters(tied.state_dict(), root=1)  # lists the tied weight twice
    out["state"] = copies(model.state_dict().values())
    out["tied"] = copies([tied[0].weight])
    out["still_tied"] = tied[1].weight is tied[0].weight
    assert int(model.bn.num_batches_tracked) == 14
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank + 1)  # the ranks differ again, so that the next broadcast has something to move
    out["bare_before"] = copies(model.parameters())
    adasum.broadcast_parameters(model.parameters(), root=0)  # bare tensors (a generator)
    out["bare"] = copies(model.parameters())

    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    if rank == 0:
        F.nll_loss(model(torch.randn(4, FEATURES)), torch.tensor([0, 1, 2, 0])).backward()
        adam.step()
    out["adam_before"] = [t.numpy().copy() for s in adam.state_dict()["state"].values() for t in s.values()]
    adasum.broadcast_optimizer_state(adam, root=0)
    state = adam.state_dict()["state"]
    assert len(state) == 6 and all(s["step"].device.type == "cpu" for s in state.values())
    out["adam"] = [t.numpy().copy() for s in state.values() for t in s.values()]

    out["moved_before"] = copies(model.parameters())
    adasum.broadcast_parameters(model.parameters(), root=0)  # Adam moved rank 0's
    out["moved"] = copies(model.parameters())
    wrapped = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), local_steps=2)
    if rank == 1:  # loaded mid-round on one rank: the broadcast gives rank 0's counters
        start = [p.detach().clone() for p in model.parameters()]
        mid_round = {**wrapped.state_dict(), "round_step": 1, "anchor": start}
        wrapped.load_state_dict(mid_round)
        assert wrapped.state_dict()["round_step"] == 1
    adasum.broadcast_optimizer_state(wrapped, root=0)
    assert wrapped.state_dict()["round_step"] == 0

    bad = torch.zeros(3 if rank == 0 else 4)
    with pytest.raises(ValueError) as info:
        adasum.broadcast_parameters([bad], root=0)
    out["error"] = str(info.value)
    # roots that differ across ranks, and a root that is not a rank: refused on every rank before data moves
    kept = copies(model.parameters())
    for name, call in {
        "roots differ": lambda: adasum.broadcast_parameters(model.parameters(), root=rank),
        "root not a rank": lambda: adasum.broadcast_parameters(model.parameters(), root=world),
        "state roots differ": lambda: adasum.broadcast_optimizer_state(adam, root=1 - rank),
        "state root not a rank": lambda: adasum.broadcast_optimizer_state(adam, root=-1),
    }.items():
        with pytest.raises(ValueError) as info:
            call()
        out[name] = str(info.value)
    out["unchanged"] = all((a == b).all() for a, b in zip(kept, copies(model.parameters())))
    return out


def test_broadcasts():
    """Every broadcast gives every rank exactly the root's values from before it (root 1 for the state dict and
    the tied weights, root 0 for the rest), where the ranks held different values (or, for Adam, none)."""
    results = distributed.run(2, broadcast_body)
    for key, root in (("state", 1), ("tied", 1), ("bare", 0), ("adam", 0), ("moved", 0)):
        before = results[root][key + "_before"]
        other = results[1 - root][key + "_before"]
        assert len(other) != len(before) or any((a != b).any() for a, b in zip(before, other)), key
        for rank in range(2):
            after = results[rank][key]
            assert len(after) == len(before), (key, rank)
            for i, (a, b) in enumerate(zip(after, before)):
                assert a.dtype == b.dtype and (a == b).all(), (key, rank, i)
    assert results[0]["adam_before"] and not results[1]["adam_before"]  # rank 1 had no Adam state before
    assert results[0]["still_tied"] and results[1]["still_tied"]
    assert results[0]["error"] == results[1]["error"]
    assert "adasum.broadcast_parameters: tensors differ across ranks at index 0" in results[0]["error"]
    expected = {
        "roots differ": "adasum.broadcast_parameters: the configuration differs across ranks: rank 0 has root=0, "
                        "rank 1 has root=1",
        "root not a rank": "adasum.broadcast_parameters: root=2 is not a rank of the group (0 to 1)",
        "state roots differ": "adasum.broadcast_optimizer_state: the configuration differs across ranks: rank 0 has "
                              "root=1, rank 1 has root=0",
        "state root not a rank": "adasum.broadcast_optimizer_state: root=-1 is not a rank of the group (0 to 1)",
    }
    for name, message in expected.items():
        assert results[0][name] == results[1][name], name
        assert results[0][name].startswith(message), (name, results[0][name])
    assert results[0]["unchanged"] and results[1]["unchanged"]


def test_broadcast_on_one_process_changes_nothing():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = Net()
        before = [t.clone() for t in model.state_dict().values()]
        adasum.broadcast_parameters(model.state_dict())
        adasum.broadcast_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1))
        assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
        with pytest.raises(ValueError, match=r"broadcast_parameters: root=1 is not a rank of the group \(0 to 0\)"):
            adasum.broadcast_parameters(model.state_dict(), root=1)  # not a peer that died: a bad argument
        with pytest.raises(ValueError, match=r"broadcast_optimizer_state: root=True is not a rank"):
            adasum.broadcast_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1), root=True)
        # the wrong object: named, not failed on inside ('Linear' object is not iterable, no attribute 'data_ptr')
        with pytest.raises(TypeError, match=r"broadcast_parameters takes model.state_dict\(\), model.parameters\(\) "
                                            r"or model.named_parameters\(\), not the Net itself"):
            adasum.broadcast_parameters(model)
        with pytest.raises(TypeError, match=r"broadcast_parameters: item 0 is a dict, not a tensor or a \(name, "):
            adasum.broadcast_parameters(torch.optim.SGD(model.parameters(), lr=0.1).state_dict().values())
        with pytest.raises(TypeError, match=r"broadcast_parameters takes a dict or an iterable .*, got int"):
            adasum.broadcast_parameters(3)
        with pytest.raises(TypeError, match=r"broadcast_optimizer_state takes an optimizer .*, got Net"):
            adasum.broadcast_optimizer_state(model)
    finally:
        dist.destroy_process_group()


def root_names_body(rank, world):
    """On 3 ranks: the root named as Horovod (root_rank=) and torch (src=, a global rank; group_src=, a rank in
    the group) name it, over the world and over the group of global ranks 1 and 2; each rank's value is its
    rank, so the value received names the root. Then the refusals, each caught on every rank it concerns."""
    out = {}

    def received(group=None, **root):
        t = torch.tensor([float(rank)])
        adasum.broadcast_parameters([t], group=group, **root)
        return float(t)

    def state_received(group=None, **root):
        opt = torch.optim.SGD([torch.zeros(1)], lr=float(rank + 1))
        adasum.broadcast_optimizer_state(opt, group=group, **root)
        return opt.param_groups[0]["lr"] - 1

    out["root_rank"] = received(root_rank=2)
    out["src"] = received(src=2)
    out["group_src"] = received(group_src=1)
    out["state_root_rank"] = state_received(root_rank=1)
    pair = dist.new_group([1, 2])
    if rank in (1, 2):
        out["pair_src"] = received(pair, src=2)  # torch's global rank 2: rank 1 of the pair
        out["pair_group_src"] = received(pair, group_src=0)  # rank 0 of the pair: global rank 1
        out["pair_state_src"] = state_received(pair, src=2)
        for name, call in {
            "src not in group": lambda: received(pair, src=0),
            "two names": lambda: received(pair, root=1, src=2),
            "root_rank and src": lambda: state_received(pair, root_rank=0, src=1),
        }.items():
            with pytest.raises(ValueError) as info:
                call()
            out[name] = str(info.value)
    return out


def test_broadcast_root_names():
    results = distributed.run(3, root_names_body)
    for r in results:
        assert (r["root_rank"], r["src"], r["group_src"], r["state_root_rank"]) == (2.0, 2.0, 1.0, 1.0), r
    for r in results[1:]:
        assert (r["pair_src"], r["pair_group_src"], r["pair_state_src"]) == (2.0, 1.0, 2.0), r
    assert results[1]["src not in group"] == results[2]["src not in group"] == (
        "adasum.broadcast_parameters: src=0 (a global rank) is not in the group, whose ranks are [1, 2]; "
        "pass src= one of them, or group_src= or root= the rank in the group"
    )
    assert results[1]["two names"] == (
        "adasum.broadcast_parameters: name the root once (root=, Horovod's root_rank=, torch's src= or group_src=), "
        "got root=1, src=2"
    )
    assert results[1]["root_rank and src"].startswith(
        "adasum.broadcast_optimizer_state: name the root once"
    )
