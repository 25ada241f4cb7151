"""adasum.DistributedOptimizer keeps torch's optimizer contract on gloo ranks: parameters without a
gradient are left alone in gradient mode (and ranks agree on which have one), ``step(closure)``
combines the closure's gradients (LBFGS included), a DDP-wrapped model is refused, the wrapper's
hooks run, a resume with another ``local_steps`` is refused, ``named_parameters=`` names parameters
in errors and ``sparse_as_dense=True`` combines sparse gradients."""

import copy

import pytest
import torch
import torch.distributed as dist

import adasum

import distributed
from reference import combine_with_bound


def reference_combine(grads):
    """Adasum of the ranks' tensors by the independent NumPy reference, in their dtype."""
    return combine_with_bound(grads)[0].to(grads[0].dtype)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def to_bytes(params):
    return b"".join(p.detach().contiguous().numpy().tobytes() for p in params)


def data(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)


class Branches(torch.nn.Module):
    """A frozen stem, a trunk, and a branch that only some ranks use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Linear(5, 5)
        self.trunk = torch.nn.Linear(5, 2)
        self.branch = torch.nn.Linear(5, 2)
        self.stem.requires_grad_(False)

    def forward(self, x, use_branch):
        h = torch.tanh(self.stem(x))
        return self.trunk(h) + (self.branch(h) if use_branch else 0)


def uses_branch(rank, step):
    return rank == 0 and step % 2 == 0  # rank 0 on even steps only; rank 1 never


def frozen_body(rank, world):
    """Gradient mode, 4 steps: the frozen stem stays bitwise where it was (AdamW's weight decay and SGD's
    momentum never touch it); the branch, used on rank 0 at even steps, is combined with rank 1's zeros
    then and keeps no gradient at odd steps; against a simulation of both ranks."""
    out = {}
    for name, make in (
        ("adamw", lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)),
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1)),
    ):
        model = Branches()
        stem = [p.detach().clone() for p in model.stem.parameters()]
        opt = adasum.DistributedOptimizer(make(model.parameters()), mode="gradient")
        sims = [Branches() for _ in range(world)]
        sim_opt = make(sims[0].parameters())
        for step in range(4):
            opt.zero_grad()
            x, y = data(rank, step)
            torch.nn.functional.mse_loss(model(x, uses_branch(rank, step)), y).backward()
            opt.step()
            # the simulation: every rank's gradients, combined where any rank has one, plain step
            for sim in sims:
                sim.load_state_dict(sims[0].state_dict())
                sim.zero_grad()
            for r, sim in enumerate(sims):
                xr, yr = data(r, step)
                torch.nn.functional.mse_loss(sim(xr, uses_branch(r, step)), yr).backward()
            for i, p in enumerate(sims[0].parameters()):
                grads = [list(s.parameters())[i].grad for s in sims]
                if any(g is not None for g in grads):
                    p.grad = reference_combine([g if g is not None else torch.zeros_like(p) for g in grads])
            sim_opt.step()
            branch_has_grad = model.branch.weight.grad is not None
            assert branch_has_grad == any(uses_branch(r, step) for r in range(world)), (name, step)
            for p, e in zip(model.parameters(), sims[0].parameters()):
                assert rel(p, e) < 1e-5, (name, step, rel(p, e))
        assert all(torch.equal(p, s) for p, s in zip(model.stem.parameters(), stem)), name
        assert all(p.grad is None for p in model.stem.parameters())
        assert not any(p in opt.state for p in model.stem.parameters())  # never stepped: no state
        out[name] = to_bytes(model.parameters())
    return out


def test_gradient_mode_leaves_parameters_without_gradient_alone():
    results = distributed.run(2, frozen_body)
    distributed.assert_ranks_agree(results)


def closure_body(rank, world):
    """step(closure) in gradient mode: SGD against the same steps without a closure (the closure's gradients
    are combined); LBFGS with the mean reducer against single-process LBFGS on the mean of the ranks' losses
    (its gradient is the mean of theirs), with the same number of closure evaluations on every rank."""
    out = {}
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    twin = copy.deepcopy(model)
    opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), mode="gradient")
    twin_opt = adasum.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9), mode="gradient")
    losses = []
    for step in range(3):
        x, y = data(rank, step)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        losses.append(float(opt.step(closure)))
        twin_opt.zero_grad()
        torch.nn.functional.mse_loss(twin(x), y).backward()
        twin_opt.step()
        assert to_bytes(model.parameters()) == to_bytes(twin.parameters()), step
    out["sgd"] = (to_bytes(model.parameters()), losses)  # the returned loss is the ranks' mean: equal

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    make = lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=6, history_size=4)  # noqa: E731
    opt = adasum.DistributedOptimizer(make(model.parameters()), mode="gradient", reducer="mean")
    ref_opt = make(reference.parameters())
    calls = [0]
    for step in range(2):
        x, y = data(rank, step)

        def closure():
            calls[0] += 1
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        def ref_closure():
            ref_opt.zero_grad()
            loss = sum(
                torch.nn.functional.mse_loss(reference(xr), yr) for xr, yr in (data(r, step) for r in range(world))
            )
            loss = loss / world
            loss.backward()
            return loss

        opt.step(closure)
        ref_opt.step(ref_closure)
        for p, e in zip(model.parameters(), reference.parameters()):
            assert rel(p, e) < 1e-4, (step, rel(p, e))
    out["lbfgs"] = (to_bytes(model.parameters()), calls[0])

    with pytest.raises(ValueError, match="backward_passes_per_step > 1"):
        adasum.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), mode="gradient", backward_passes_per_step=2
        ).step(lambda: None)
    return out


def test_step_with_closure_combines_the_closure_gradients():
    results = distributed.run(2, closure_body)
    distributed.assert_ranks_agree(results)
    assert results[0]["lbfgs"][1] > 2  # LBFGS evaluated the closure several times, the same on both ranks


def ddp_body(rank, world):
    """A DDP model over the same ranks: refused at construction and, when DDP wraps the model after the
    wrapper was built, at the first step (before anything changes), the same message on every rank. A DDP
    over other ranks (here each rank alone), or with a comm hook of the user's own, is accepted."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    messages = []
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    ddp = DDP(model)
    with pytest.raises(ValueError) as info:
        adasum.DistributedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1))
    messages.append(str(info.value))
    del ddp

    model = torch.nn.Linear(5, 2)
    opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mode="gradient")
    ddp = DDP(model)
    before = to_bytes(model.parameters())
    x, y = data(rank, 0)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    with pytest.raises(ValueError) as info:
        opt.step()
    messages.append(str(info.value))
    assert to_bytes(model.parameters()) == before
    del ddp

    results = []
    alone = [dist.new_group([r]) for r in range(world)][rank]
    for make in (lambda m: DDP(m, process_group=alone), own_hook, lambda m: m):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 2)
        net = make(model)
        opt = adasum.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        results.append(to_bytes(model.parameters()))
    assert results[0] == results[1] == results[2]  # DDP combined nothing: the plain optimizer's result
    return messages, results[0]


def keep_local(state, bucket):
    """A comm hook of the user's own: DDP combines nothing."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def own_hook(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    ddp.register_comm_hook(None, keep_local)
    return ddp


def test_ddp_wrapped_model_is_refused():
    results = distributed.run(2, ddp_body)
    assert results[0][1] == results[1][1]
    for messages, _ in results:
        for message in messages:
            assert message.startswith(
                "adasum.DistributedOptimizer: on rank 0, the parameters belong to a DistributedDataParallel"
            )
            assert message.endswith("adasum.ddp.adasum_hook)"), message  # the advice ends it, no rank after it


def resume_body(rank, world):
    """A state saved at local step 3 of 4 loaded into a wrapper with local_steps=2 (or a state of the
    earlier format, without the length): ValueError, nothing loaded; with local_steps=4 it resumes and the
    ranks combine (their parameters agree again at the round's end)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=4)

    def train(model, opt, steps, first):
        for step in range(first, first + steps):
            opt.zero_grad()
            x, y = data(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    train(model, opt, 3, 0)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert saved[1]["round_step"] == 3 and saved[1]["local_steps"] == 4
    messages = []
    for local_steps, state in ((2, saved[1]), (2, {k: v for k, v in saved[1].items() if k != "local_steps"})):
        other = adasum.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), local_steps=local_steps, check=False
        )
        with pytest.raises(ValueError) as info:
            other.load_state_dict(state)
        assert other.state_dict()["round_step"] == 0
        messages.append(str(info.value))
    resumed = torch.nn.Linear(5, 2)
    opt2 = adasum.DistributedOptimizer(torch.optim.SGD(resumed.parameters(), lr=0.1), local_steps=4)
    resumed.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    train(resumed, opt2, 1, 3)
    assert opt2.last_combined() is None  # the round ended: combined
    return messages, to_bytes(resumed.parameters())


def test_resume_with_another_local_steps_is_refused():
    results = distributed.run(2, resume_body)
    assert results[0][1] == results[1][1]
    messages = results[0][0]
    assert "saved after local step 3 of 4, but this wrapper has local_steps=2" in messages[0], messages[0]
    assert "saved after local step 3, but this wrapper has local_steps=2" in messages[1], messages[1]


def names_body(rank, world):
    """named_parameters= names parameters in the construction check and in gradient mode's sparse refusal;
    sparse_as_dense=True combines an embedding's sparse gradients (against the dense reference)."""
    messages = {}
    torch.manual_seed(rank)  # different weights on each rank
    model = torch.nn.Sequential(torch.nn.Linear(5, 3))
    with pytest.raises(ValueError) as info:
        adasum.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
    messages["values"] = str(info.value)
    with pytest.raises(ValueError, match="names no parameter 1"):
        adasum.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=[("0.weight", model[0].weight)]
        )

    def embedding_run(sparse_as_dense):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 3, sparse=True)
        opt = adasum.DistributedOptimizer(
            torch.optim.SGD(emb.parameters(), lr=0.5),
            mode="gradient",
            named_parameters=emb.named_parameters(),
            sparse_as_dense=sparse_as_dense,
        )
        start = emb.weight.detach().clone()
        ids = [torch.tensor([0, 2, 2]), torch.tensor([2, 5])]
        emb(ids[rank]).sum().backward()
        opt.step()
        grads = []
        for r in range(world):
            dense = torch.zeros(6, 3)
            dense.index_add_(0, ids[r], torch.ones(len(ids[r]), 3))
            grads.append(dense)
        want = start - 0.5 * reference_combine(grads)
        assert rel(emb.weight, want) < 1e-6
        return to_bytes([emb.weight])

    with pytest.raises(TypeError) as info:
        embedding_run(False)
    messages["sparse"] = str(info.value)
    return messages, embedding_run(True)


def test_named_parameters_and_sparse_as_dense():
    results = distributed.run(2, names_body)
    assert results[0][1] == results[1][1]
    for messages, _ in results:
        assert "parameter '0.weight' (shape [3, 5]) differs across ranks" in messages["values"], messages["values"]
        assert "the gradient of parameter 0 ('weight') is sparse" in messages["sparse"], messages["sparse"]
        assert "sparse_as_dense=True" in messages["sparse"]


def test_hooks_registered_on_the_wrapper_run():
    """Step pre/post hooks and state_dict / load_state_dict hooks registered on the wrapper run, with the
    wrapper as their optimizer; a state_dict post hook's return replaces the state."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 1)
        opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2)
        seen = []
        opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o is opt)))
        opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o is opt)))
        opt.register_state_dict_pre_hook(lambda o: seen.append(("sd-pre", o is opt)))
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
        opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(("load-pre", "extra" in sd)))
        opt.register_load_state_dict_post_hook(lambda o: seen.append(("load-post", o is opt)))
        for _ in range(2):
            model(torch.ones(3)).sum().backward()
            opt.step()
        state = opt.state_dict()
        assert state["extra"] == 1
        opt.load_state_dict(state)
        assert seen == [("pre", True), ("post", True)] * 2 + [("sd-pre", True), ("load-pre", True), ("load-post", True)]
    finally:
        dist.destroy_process_group()


def settings_body(rank, world):
    """Settings that decide each step's collectives, different on one rank: the same ValueError on every
    rank at construction, naming the setting (instead of ranks waiting on collectives their peers skip)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    messages = []
    for option in (
        {"local_steps": 1 + rank},
        {"mode": ("delta", "gradient")[rank]},
        {"nonfinite": ("propagate", "raise")[rank]},
    ):
        with pytest.raises(ValueError) as info:
            adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **option)
        messages.append(str(info.value))
    return messages


def test_settings_that_differ_across_ranks_are_refused():
    results = distributed.run(2, settings_body)
    assert results[0] == results[1]
    local_steps, mode, nonfinite = results[0]
    assert local_steps == (
        "adasum.DistributedOptimizer: settings differ across ranks at index 2: rank 0 has local_steps 1, "
        "rank 1 has local_steps 2"
    ), local_steps
    assert "rank 0 has mode delta, rank 1 has mode gradient" in mode, mode
    assert "rank 0 has nonfinite propagate, rank 1 has nonfinite raise" in nonfinite, nonfinite
