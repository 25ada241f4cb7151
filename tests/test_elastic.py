"""Elastic restarts (SPEC 3.2, docs/faults.md): a 3-rank gloo job stops in the middle of a round, rank 0's
checkpoint resumes on 2 ranks (and a 2-rank one on 3), for DiLoCo (SlowMo with an outer optimizer), SlowMo and
DistributedOptimizer in both modes; the resumed run equals a fresh run at the new size from the checkpoint's
agreed state (the written-out references of tests/test_diloco.py), the rules named in one warning on every
rank, and what cannot be resized (passes accumulated toward a step) refused on every rank."""

import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import adasum
from test_diloco import LR, OUTER_LR, OUTER_MOMENTUM, H, data, grads, reference, start

import distributed

SAVED_STEPS = 7  # two rounds of H = 3 and one step of the third: a round in flight


def make(kind):
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p, v in zip(model.parameters(), start()):
            p.copy_(torch.from_numpy(v))
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    if kind == "diloco":
        opt = adasum.SlowMo(sgd, local_steps=H, reducer="mean", outer_optimizer=adasum.diloco_outer(OUTER_LR,
                                                                                                 OUTER_MOMENTUM))
    elif kind == "adacons-diloco":
        opt = adasum.SlowMo(sgd, local_steps=H, reducer="adacons", outer_optimizer=adasum.diloco_outer())
    elif kind == "delta":
        opt = adasum.DistributedOptimizer(sgd, reducer="mean", local_steps=H)
    else:
        opt = adasum.DistributedOptimizer(sgd, reducer="mean", mode="gradient")
    return model, opt


def train(model, opt, rank, steps):
    x, y = (torch.from_numpy(a).float() for a in data(rank))
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * (model(x) - y).pow(2).sum(1).mean()).backward()
        opt.step()


KINDS = ["diloco", "adacons-diloco", "delta", "gradient"]


def save_body(rank, world, folder):
    for kind in KINDS:
        model, opt = make(kind)
        train(model, opt, rank, SAVED_STEPS)
        if rank == 0:  # as `adasum train` does: rank 0 writes the job's checkpoint
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{folder}/{kind}.pt")
        dist.barrier()
    return None


def resume_body(rank, world, folder, saved_world):
    out = {}
    for kind in KINDS:
        model, opt = make(kind)
        checkpoint = torch.load(f"{folder}/{kind}.pt", weights_only=False)
        state = checkpoint["opt"]  # what the references start from (read first: the optimizers step these tensors)
        anchor = [a.double().numpy() for a in state["anchor"]] if state.get("anchor") is not None else None
        outer = state.get("outer")
        buf = [outer["state"][i]["momentum_buffer"].double().numpy() for i in range(2)] if outer else None
        model.load_state_dict(checkpoint["model"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.load_state_dict(checkpoint["opt"])
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1 and f"saved on {saved_world} ranks and loads on {world}" in messages[0], messages
        train(model, opt, rank, 2 * H)
        out[kind] = ([p.detach().numpy().copy() for p in model.parameters()], messages[0], anchor, buf)
    return out


def gradient_reference(world, x, steps):
    for _ in range(steps):
        g = [sum(grads(x, j)[k] for j in range(world)) / world for k in range(2)]
        x = [np.float32(p - LR * gk) for p, gk in zip(x, g)]
    return x


def delta_reference(world, x0, rounds):
    for _ in range(rounds):
        deltas = []
        for j in range(world):
            x = [p.copy() for p in x0]
            for _ in range(H):
                x = [np.float32(p - LR * g) for p, g in zip(x, grads(x, j))]
            deltas.append([p - a for p, a in zip(x, x0)])
        x0 = [np.float32(a + sum(d[k] for d in deltas) / world) for k, a in enumerate(x0)]
    return x0


@pytest.mark.parametrize("saved_world, world", [(3, 2), (2, 3)])
def test_a_job_resumes_on_another_world_size(tmp_path, saved_world, world):
    distributed.run(saved_world, save_body, str(tmp_path))
    results = distributed.run(world, resume_body, str(tmp_path), saved_world)
    for kind in KINDS:
        params = [r[kind][0] for r in results]
        for other in params[1:]:  # bitwise equal ranks
            assert all(np.array_equal(a, b) for a, b in zip(params[0], other)), kind
        assert len({r[kind][1] for r in results}) == 1, kind  # the same warning on every rank
        anchor, buf = results[0][kind][2], results[0][kind][3]
        if kind == "diloco":  # from the round's start weights and the outer momentum, 2 rounds at the new size
            expected = reference(world, "mean", x0=anchor, buf=buf, rounds=2)
            assert "restarts from its start" in results[0][kind][1]
        elif kind == "delta":
            expected = delta_reference(world, anchor, 2)
            assert "restarts from its start" in results[0][kind][1]
        elif kind == "gradient":
            continue  # against its reference in test_gradient_mode_resumes_on_another_world_size
        else:
            assert "AdaCons's state (one entry per rank) starts afresh" in results[0][kind][1]
            continue
        for p, e in zip(params[0], expected):
            assert np.allclose(p, e, rtol=2e-4, atol=2e-5), kind


def accumulating_body(rank, world, folder, save):
    model = torch.nn.Linear(4, 3)
    opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), backward_passes_per_step=2)
    if save:
        train(model, opt, rank, 3)  # one pass toward the second step
        if rank == 0:
            torch.save(opt.state_dict(), f"{folder}/accumulating.pt")
        dist.barrier()
        return None
    with pytest.raises(ValueError, match="cannot take the gradients accumulated toward that step") as caught:
        opt.load_state_dict(torch.load(f"{folder}/accumulating.pt", weights_only=False))
    return str(caught.value)


def test_what_cannot_be_resized_is_refused_on_every_rank(tmp_path):
    distributed.run(2, accumulating_body, str(tmp_path), True)
    messages = distributed.run(3, accumulating_body, str(tmp_path), False)
    assert len(set(messages)) == 1


def gradient_body(rank, world, folder, save):
    model, opt = make("gradient")
    if save:
        train(model, opt, rank, 4)
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{folder}/gradient.pt")
        dist.barrier()
        return None
    checkpoint = torch.load(f"{folder}/gradient.pt", weights_only=False)
    model.load_state_dict(checkpoint["model"])
    with pytest.warns(UserWarning, match="loads as saved"):
        opt.load_state_dict(checkpoint["opt"])
    train(model, opt, rank, 3)
    start_params = [v.double().numpy() for v in checkpoint["model"].values()]
    expected = gradient_reference(world, start_params, 3)
    for p, e in zip(model.parameters(), expected):
        assert np.allclose(p.detach().numpy(), e, rtol=1e-5, atol=1e-6)
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


def test_gradient_mode_resumes_on_another_world_size(tmp_path):
    distributed.run(3, gradient_body, str(tmp_path), True)
    results = distributed.run(2, gradient_body, str(tmp_path), False)
    distributed.assert_ranks_agree(results)


def ddp_body(rank, world, folder, save):
    """The DDP hook's state (AdaCons with momentum: one entry per rank) pickled on one world size and run on
    another: the momentum starts afresh (a warning on every rank), so the gradients equal a fresh state's."""
    import pickle

    from torch.nn.parallel import DistributedDataParallel as DDP

    from adasum.ddp import AdasumState, adasum_hook

    x, y = (torch.from_numpy(a).float() for a in data(rank))

    def gradients(state, passes=1):
        model = torch.nn.Linear(4, 3)
        with torch.no_grad():
            for p, v in zip(model.parameters(), start()):
                p.copy_(torch.from_numpy(v))
        ddp = DDP(model)
        ddp.register_comm_hook(state, adasum_hook)
        for _ in range(passes):
            model.zero_grad()
            (0.5 * (ddp(x) - y).pow(2).sum(1).mean()).backward()
        return [p.grad.numpy().copy() for p in model.parameters()]

    if save:
        state = AdasumState(reducer=adasum.AdaCons(momentum=0.5))
        gradients(state, passes=2)
        if rank == 0:
            with open(f"{folder}/hook.pkl", "wb") as f:
                pickle.dump(state, f)
        dist.barrier()
        return None
    with open(f"{folder}/hook.pkl", "rb") as f:
        state = pickle.load(f)
    with pytest.warns(UserWarning, match=f"pickled on 2 ranks and runs on {world}: .*AdaCons's state"):
        resumed = gradients(state)
    fresh = gradients(AdasumState(reducer=adasum.AdaCons(momentum=0.5)))
    assert all(np.array_equal(a, b) for a, b in zip(resumed, fresh))
    return [g.tobytes() for g in resumed]


def test_the_ddp_hook_state_resumes_on_another_world_size(tmp_path):
    distributed.run(2, ddp_body, str(tmp_path), True)
    results = distributed.run(3, ddp_body, str(tmp_path), False)
    distributed.assert_ranks_agree(results)
