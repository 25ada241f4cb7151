"""SlowMo against hand-written references: tau = 1 with SGD(lr=1) is momentum SGD on the reduced
gradient (mean and Adasum, Adasum by the independent reference of tests/reference.py); tau = 3 with momentum
SGD is SlowMo done by hand; local SGD is periodic averaging; DDP-synchronised base steps; buffers policies;
lr = 0; checkpoints resumed mid-period are bitwise equal to an uninterrupted run; one worker (Lookahead) with
and without a process group."""

import copy
import io

import pytest
import torch
import torch.distributed as dist

import adasum

import distributed
from reference import combine_with_bound

# No NCCL mark: these references run float64 models on the CPU (gloo); SlowMo's combinations go through the same
# `adasum.all_reduce` that test_collectives and test_optim run on NCCL.


def make_model(seed=0, dtype=torch.float64, batchnorm=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(4, 6)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(6))
    layers += [torch.nn.Tanh(), torch.nn.Linear(6, 2)]
    return torch.nn.Sequential(*layers).to(dtype)


def batch(worker, step, dtype=torch.float64):
    g = torch.Generator().manual_seed(7919 * step + 31 * worker + 1)
    return torch.randn(16, 4, generator=g, dtype=dtype), torch.randn(16, 2, generator=g, dtype=dtype)


def backward(model, worker, step):
    x, y = batch(worker, step, next(model.parameters()).dtype)
    torch.nn.functional.mse_loss(model(x), y).backward()


def grads_at(params, worker, step):
    """The gradient of worker's loss at `params` (a list of tensors), on a scratch model."""
    model = make_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    backward(model, worker, step)
    return [p.grad.clone() for p in model.parameters()]


def hand_slowmo(world, steps, local_steps, lr, momentum, slow_lr, slow_momentum, combine):
    """SlowMo written out: every worker's momentum SGD (buffers local), then every `local_steps`
    steps x_bar = combine(models, anchor), u = beta u + (anchor - x_bar)/lr, anchor -= alpha lr u."""
    init = [p.detach().clone() for p in make_model().parameters()]
    xs = [[p.clone() for p in init] for _ in range(world)]
    bufs = [None] * world
    anchor, u = [p.clone() for p in init], [torch.zeros_like(p) for p in init]
    for step in range(steps):
        for j in range(world):
            g = grads_at(xs[j], j, step)
            bufs[j] = g if bufs[j] is None else [momentum * b + gi for b, gi in zip(bufs[j], g)]
            xs[j] = [x - lr * b for x, b in zip(xs[j], bufs[j])]
        if (step + 1) % local_steps == 0:
            x_bar = combine(xs, anchor)
            u = [slow_momentum * uk + (a - xb) / lr for uk, a, xb in zip(u, anchor, x_bar)]
            anchor = [a - slow_lr * lr * uk for a, uk in zip(anchor, u)]
            xs = [[a.clone() for a in anchor] for _ in range(world)]
    return xs


def mean_models(xs, anchor):
    return [sum(x[k] for x in xs) / len(xs) for k in range(len(anchor))]


def adasum_deltas(xs, anchor):
    """The anchor plus the independent reference's Adasum (tests/reference.py) of the workers' deltas."""
    return [a + combine_with_bound([x[k] - a for x in xs])[0] for k, a in enumerate(anchor)]


def reference_reduce(name, per_worker):
    """The workers' tensors combined one by one, here rather than by the package: their mean, or Adasum by the
    independent reference."""
    combine = {"mean": lambda ts: sum(ts) / len(ts), "adasum": lambda ts: combine_with_bound(ts)[0]}[name]
    return [combine([w[k] for w in per_worker]) for k in range(len(per_worker[0]))]


def run_slowmo(rank, steps, local_steps, lr, momentum, **kwargs):
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    opt = adasum.SlowMo(base, local_steps=local_steps, **kwargs)
    for step in range(steps):
        opt.zero_grad()
        backward(model, rank, step)
        opt.step()
    return model, opt


def close(params, expected, tol=1e-10):
    return all(torch.allclose(p.detach(), e, rtol=tol, atol=tol) for p, e in zip(params, expected))


def model_bytes(model):
    return b"".join(t.detach().cpu().numpy().tobytes() for t in model.state_dict().values())


def checks(rank, world):
    out = {}

    # tau = 1, base SGD(lr=1): SGD(lr=alpha, momentum=beta) on the reduced gradient
    for name in ("mean", "adasum"):
        model, _ = run_slowmo(rank, 4, 1, 1.0, 0.0, slow_lr=0.5, slow_momentum=0.7, reducer=name)
        ref = make_model()
        sgd = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.7)
        for step in range(4):
            params = [p.detach() for p in ref.parameters()]
            reduced = reference_reduce(name, [grads_at(params, j, step) for j in range(world)])
            for p, g in zip(ref.parameters(), reduced):
                p.grad = g
            sgd.step()
        assert close(model.parameters(), [p.detach() for p in ref.parameters()]), name
        out[f"tau1-{name}"] = model_bytes(model)

    # tau = 3, momentum SGD as the base, 7 steps (ends mid-period): SlowMo by hand
    for name, combine in (("mean", mean_models), ("adasum", adasum_deltas)):
        model, _ = run_slowmo(rank, 7, 3, 0.1, 0.9, slow_lr=0.8, slow_momentum=0.5, reducer=name)
        expected = hand_slowmo(world, 7, 3, 0.1, 0.9, 0.8, 0.5, combine)
        assert close(model.parameters(), expected[rank]), name
        model, _ = run_slowmo(rank, 6, 3, 0.1, 0.9, slow_lr=0.8, slow_momentum=0.5, reducer=name)
        out[f"tau3-{name}"] = model_bytes(model)  # right after a sync: identical on every rank

    # local SGD (slow_lr=1, slow_momentum=0) is periodic averaging
    model, _ = run_slowmo(rank, 5, 2, 0.1, 0.9)
    init = [p.detach().clone() for p in make_model().parameters()]
    xs, bufs = [[p.clone() for p in init] for _ in range(world)], [None] * world
    for step in range(5):
        for j in range(world):
            g = grads_at(xs[j], j, step)
            bufs[j] = g if bufs[j] is None else [0.9 * b + gi for b, gi in zip(bufs[j], g)]
            xs[j] = [x - 0.1 * b for x, b in zip(xs[j], bufs[j])]
        if step % 2 == 1:
            avg = mean_models(xs, init)
            xs = [[a.clone() for a in avg] for _ in range(world)]
    assert close(model.parameters(), xs[rank], 1e-12)

    # buffers: "average" averages the base optimizer's state, module= averages BatchNorm buffers
    model = make_model(batchnorm=True)
    opt = adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), local_steps=100,
                        buffers="average", module=model)
    for step in range(3):
        opt.zero_grad()
        backward(model, rank, step)
        opt.step()
    local_bufs = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    local_stats = [model[1].running_mean.clone(), model[1].running_var.clone()]
    local_count = model[1].num_batches_tracked.clone()
    everyone = [None] * world
    dist.all_gather_object(everyone, (local_bufs, local_stats))
    opt.sync()
    for k, p in enumerate(model.parameters()):
        assert torch.allclose(opt.state[p]["momentum_buffer"], sum(e[0][k] for e in everyone) / world, rtol=1e-12)
    assert torch.allclose(model[1].running_mean, sum(e[1][0] for e in everyone) / world, rtol=1e-12)
    assert torch.allclose(model[1].running_var, sum(e[1][1] for e in everyone) / world, rtol=1e-12)
    assert torch.equal(model[1].num_batches_tracked, local_count)
    out["average"] = b"".join(opt.state[p]["momentum_buffer"].numpy().tobytes() for p in model.parameters())
    out["batchnorm"] = model_bytes(model)
    # "local" keeps them per worker, "reset" clears them
    for policy in ("local", "reset"):
        _, opt = run_slowmo(rank, 3, 3, 0.1, 0.9, buffers=policy)
        assert len(opt.state) == (0 if policy == "reset" else 4), policy
        if policy == "local" and world > 1:
            bufs = [None] * world
            dist.all_gather_object(bufs, [opt.state[p]["momentum_buffer"] for p in opt.param_groups[0]["params"]])
            assert not torch.equal(bufs[0][0], bufs[1][0])

    # lr = 0 at the sync (per group): no division, the group's anchor moves to the average
    model = make_model()
    groups = [{"params": list(model[0].parameters()), "lr": 0.1}, {"params": list(model[2].parameters()), "lr": 0.2}]
    opt = adasum.SlowMo(torch.optim.SGD(groups, momentum=0.5), local_steps=2, slow_momentum=0.5, slow_lr=0.7)
    for step in range(2):
        opt.zero_grad()
        backward(model, rank, step)
        if step == 1:
            opt.param_groups[1]["lr"] = 0.0
            opt.optimizer.step()
            before = [p.detach().clone() for p in model[2].parameters()]
            opt.param_groups[1]["lr"] = 0.0
            opt.sync()
        else:
            opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    everyone = [None] * world
    dist.all_gather_object(everyone, before)
    assert close(model[2].parameters(), [sum(e[k] for e in everyone) / world for k in range(2)], 1e-12)
    assert all(torch.isfinite(m).all() for m in opt.state_dict()["momentum"])

    # the base algorithm DDP-synchronised: Lookahead-like slow steps on mean-gradient SGD
    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = adasum.SlowMo(torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), local_steps=2,
                        slow_lr=0.6, slow_momentum=0.5, module=ddp)
    for step in range(5):
        opt.zero_grad()
        backward(ddp, rank, step)
        opt.step()
    x = [p.detach().clone() for p in make_model().parameters()]
    anchor, u, buf = [p.clone() for p in x], [torch.zeros_like(p) for p in x], None
    for step in range(5):
        g = [sum(gs) / world for gs in zip(*(grads_at(x, j, step) for j in range(world)))]
        buf = g if buf is None else [0.9 * b + gi for b, gi in zip(buf, g)]
        x = [xi - 0.1 * b for xi, b in zip(x, buf)]
        if step % 2 == 1:
            u = [0.5 * uk + (a - xi) / 0.1 for uk, a, xi in zip(u, anchor, x)]
            anchor = [a - 0.6 * 0.1 * uk for a, uk in zip(anchor, u)]
            x = [a.clone() for a in anchor]
    assert close(ddp.parameters(), x)
    out["ddp"] = model_bytes(ddp)

    out["resume"] = resume_check(rank, world)
    return out


def train(model, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        backward(model, rank, step)
        opt.step()


def make_run(seed=0):
    model = make_model(seed, torch.float32, batchnorm=True)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    opt = adasum.SlowMo(base, local_steps=3, slow_lr=0.9, slow_momentum=0.5,
                        reducer=adasum.AdaCons(momentum=0.9), module=model)
    return model, opt


def resume_check(rank, world):
    """Stop at step 4 (mid-period), save, rebuild from other weights, load, go on: bitwise equal."""
    model, opt = make_run()
    train(model, opt, rank, 6)
    after_sync = model_bytes(model)
    train(model, opt, rank, 3, start=6)
    straight = model_bytes(model)

    model, opt = make_run()
    train(model, opt, rank, 4)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    del model, opt
    buf.seek(0)
    checkpoint = torch.load(buf)
    model, opt = make_run(seed=123)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    train(model, opt, rank, 5, start=4)
    assert model_bytes(model) == straight
    return after_sync


@pytest.mark.parametrize("world", [2, 3])
def test_slowmo_against_hand_references(world):
    results = distributed.run(world, checks)
    distributed.assert_ranks_agree(results)


def lookahead_steps(slow_momentum, steps=7):
    return hand_slowmo(1, steps, 3, 0.1, 0.0, 0.5, slow_momentum, mean_models)[0]


def test_one_worker_without_a_process_group_is_lookahead():
    assert not dist.is_initialized()
    for beta in (0.0, 0.6):
        model, _ = run_slowmo(0, 7, 3, 0.1, 0.0, slow_lr=0.5, slow_momentum=beta, reducer="adasum")
        assert close(model.parameters(), lookahead_steps(beta), 1e-12)
    # checkpoint mid-period, one worker, bitwise
    model, opt = make_run()
    train(model, opt, 0, 8)
    straight = model_bytes(model)
    model, opt = make_run()
    train(model, opt, 0, 5)
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    state = torch.load(buf)
    model, opt = make_run(seed=9)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    train(model, opt, 0, 3, start=5)
    assert model_bytes(model) == straight


def _one_rank(rank, world):
    model, _ = run_slowmo(rank, 7, 3, 0.1, 0.0, slow_lr=0.5, slow_momentum=0.6, reducer="adacons")
    return model_bytes(model)


def test_one_worker_in_a_process_group_equals_no_group():
    model, _ = run_slowmo(0, 7, 3, 0.1, 0.0, slow_lr=0.5, slow_momentum=0.6, reducer="adacons")
    assert distributed.run(1, _one_rank) == [model_bytes(model)]
    assert close(model.parameters(), lookahead_steps(0.6), 1e-12)


def test_pass_through_and_bad_input():
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = adasum.SlowMo(base, local_steps=2)
    assert opt.param_groups is base.param_groups
    backward(model, 0, 0)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert opt.step(lambda: torch.tensor(3.0)) == torch.tensor(3.0)
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)  # `base` is wrapped already (below)
    for kwargs, error, message in [
        ({"local_steps": 0}, ValueError, "adasum.SlowMo: local_steps must be an integer >= 1, got 0; pass "
                                         "local_steps=1 or more"),
        ({"local_steps": 1.5}, TypeError, "adasum.SlowMo: local_steps must be an integer >= 1, got 1.5; pass "
                                          "local_steps= a whole number"),
        ({"local_steps": True}, TypeError, "adasum.SlowMo: local_steps must be an integer >= 1, got True; pass "
                                           "local_steps= a whole number"),
        ({"local_steps": 1, "slow_momentum": 1.0}, ValueError,
         "adasum.SlowMo: slow_momentum must be a number in [0, 1), got 1.0; pass slow_momentum= a number in [0, 1)"),
        ({"local_steps": 1, "slow_momentum": float("nan")}, ValueError,
         "adasum.SlowMo: slow_momentum must be a number in [0, 1), got nan; pass slow_momentum= a number in [0, 1)"),
        ({"local_steps": 1, "slow_momentum": "0.5"}, TypeError,
         "adasum.SlowMo: slow_momentum must be a number in [0, 1), got '0.5'; pass a number"),
        ({"local_steps": 1, "slow_lr": -1.0}, ValueError,
         "adasum.SlowMo: slow_lr must be a finite number > 0, got -1.0; pass slow_lr= a finite number > 0"),
        ({"local_steps": 2, "slow_lr": 0.0}, ValueError,
         "adasum.SlowMo: slow_lr must be a finite number > 0, got 0.0; pass slow_lr= a finite number > 0"),
        ({"local_steps": 2, "slow_lr": float("nan")}, ValueError,
         "adasum.SlowMo: slow_lr must be a finite number > 0, got nan; pass slow_lr= a finite number > 0"),
        ({"local_steps": 2, "slow_lr": float("inf")}, ValueError,
         "adasum.SlowMo: slow_lr must be a finite number > 0, got inf; pass slow_lr= a finite number > 0"),
        ({"local_steps": 2, "slow_lr": None}, TypeError,
         "adasum.SlowMo: slow_lr must be a finite number > 0, got None; pass a number"),
        ({"local_steps": 1, "check": "no"}, TypeError, "adasum.SlowMo: check must be True or False, got 'no'; pass a "
                                                       "bool"),
        ({"local_steps": 1, "buffers": "keep"}, ValueError,
         "buffers must be one of ['local', 'reset', 'average'], got 'keep'; pass one of them"),
        ({"local_steps": 1, "reducer": "median"}, ValueError, None),
        ({"local_steps": 1, "module": 3}, TypeError,
         "module must be a torch.nn.Module, got int; pass the model or leave module= out"),
    ]:
        with pytest.raises(error) as info:
            adasum.SlowMo(fresh, **kwargs)
        assert message is None or str(info.value) == message, (kwargs, str(info.value))
    with pytest.raises(TypeError):
        adasum.SlowMo(model, local_steps=1)
    # no wrapper of a wrapper
    with pytest.raises(TypeError) as info:
        adasum.SlowMo(opt, local_steps=2)
    assert str(info.value) == (
        "adasum.SlowMo: the optimizer is an adasum.SlowMo already, which combines across ranks itself: wrapping "
        "it again would combine every step twice. Wrap the torch optimizer once (its .optimizer)"
    )
    with pytest.raises(ValueError, match="anchor"):
        adasum.SlowMo(torch.optim.SGD(make_model().parameters(), lr=0.1), local_steps=2).load_state_dict(
            {**opt.state_dict(), "anchor": opt.state_dict()["anchor"][:2]}
        )


def test_a_state_loads_only_with_its_settings():
    """A state saved at step 3 of rounds of 4 would, under local_steps=2, sync at step 4 (a round boundary no
    worker of the saved run reached); other slow momentum, buffers or reducer: momentum and reducer state of other
    settings. Refused naming what differs, and nothing changes; the same settings load."""
    model = make_model()
    saved_opt = adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=4, slow_momentum=0.5)
    train(model, saved_opt, 0, 3)
    saved = saved_opt.state_dict()
    for kwargs, message in [
        ({"local_steps": 2, "slow_momentum": 0.5}, "local_steps=4, but this SlowMo has local_steps=2"),
        ({"local_steps": 4}, "slow_momentum=0.5, but this SlowMo has slow_momentum=0.0"),
        (
            {"local_steps": 2, "slow_momentum": 0.5, "slow_lr": 0.5, "buffers": "reset", "reducer": "adasum"},
            "local_steps=4, slow_lr=1.0, buffers='local', reducer='Mean()', but this SlowMo has local_steps=2, "
            "slow_lr=0.5, buffers='reset', reducer='Adasum(per_tensor=True)'",
        ),
    ]:
        other = make_model(seed=1)
        opt = adasum.SlowMo(torch.optim.SGD(other.parameters(), lr=0.1), **kwargs)
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(ValueError) as info:
            opt.load_state_dict(saved)
        assert str(info.value) == (
            f"adasum.SlowMo.load_state_dict: the state was saved with {message}; build it with the settings "
            "the state was saved with"
        ), str(info.value)
        after = opt.state_dict()
        assert after["step"] == 0 and after["optimizer"] == before["optimizer"]
        assert all(torch.equal(a, b) for a, b in zip(after["anchor"], before["anchor"]))
    opt = adasum.SlowMo(torch.optim.SGD(make_model(seed=1).parameters(), lr=0.1), local_steps=4, slow_momentum=0.5)
    opt.load_state_dict(saved)
    assert opt.state_dict()["step"] == 3
    # a state saved before the settings were recorded loads as it is
    opt = adasum.SlowMo(torch.optim.SGD(make_model(seed=1).parameters(), lr=0.1), local_steps=2)
    opt.load_state_dict({k: v for k, v in saved.items() if k != "settings"})
    assert opt.state_dict()["step"] == 3


def test_parameters_converted_after_wrapping():
    """``model.double()`` after construction keeps the parameters and changes their dtype: the anchor and the slow
    momentum follow at the next sync (before, in the middle of a round or at its end), so a float64 model stays
    float64; they were kept in float32 and every sync copied the float32 anchor into the parameters. One worker
    with ``slow_lr=1`` and no slow momentum is the base optimizer itself."""
    for convert_after in (0, 1, 2):
        model, plain = make_model(dtype=torch.float32), make_model(dtype=torch.float32)
        opt = adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=2, slow_lr=1.0)
        reference = torch.optim.SGD(plain.parameters(), lr=0.1)
        for step in range(5):
            if step == convert_after:
                for m in (model, plain):
                    m.double()
                with torch.no_grad():  # from the same weights; below float32's resolution: lost if rounded to it
                    for p, q in zip(model.parameters(), plain.parameters()):
                        p.add_(1e-12)
                        q.copy_(p)
            for m, o in ((model, opt), (plain, reference)):
                o.zero_grad()
                backward(m, 0, step)
                o.step()
        for p, q in zip(model.parameters(), plain.parameters()):
            assert p.dtype == torch.float64 and (p - q).abs().max() < 1e-14, convert_after
        assert all(a.dtype == torch.float64 for a in opt.state_dict()["anchor"] + opt.state_dict()["momentum"])
