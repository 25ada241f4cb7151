"""The simulator against real gloo workers, and its handling of bad input.

The real runs are written out here with plain autograd, `Reducer.all_reduce` and
`slow_momentum_update`, so the simulator is checked against the distributed path step by step.
"""

from __future__ import annotations

import distributed
import pytest
import torch
from torch import nn

from adasum.diagnostics import all_reduce_orthogonality, orthogonality
from adasum.reducers import get_reducer
from adasum.sim import SimulatedWorkers, cross_entropy
from adasum.slowmo import slow_momentum_update

WORLD = 3  # not a power of two: Adasum's folded tree is exercised too
BATCH = 8
STEPS = 4

# (name, reducer, combine, local_steps, slow_momentum, optimizer)
CASES = [
    ("adasum-grad-sgd", "adasum", "gradients", 1, None, "sgd"),
    ("mean-grad-adam", "mean", "gradients", 1, None, "adam"),
    ("adasum-delta-adam", "adasum", "deltas", 1, None, "adam"),
    ("sum-local-sgd", "sum", "deltas", 2, None, "sgd"),
    ("slowmo-mean", "mean", "deltas", 2, 0.5, "sgd"),
]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))


def make_data(workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, workers, BATCH, 6, generator=g)
    y = torch.randint(0, 4, (STEPS, workers, BATCH), generator=g)
    return x, y


def make_optimizer(kind: str):
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    return lambda ps: torch.optim.Adam(ps, lr=0.01)


def real_run(rank: int, world: int, case: tuple) -> list[torch.Tensor]:
    """One rank of the real data-parallel run of `case`."""
    _, reducer_name, combine, local_steps, slow_momentum, opt = case
    reducer = get_reducer(reducer_name)
    model = make_model()
    params = list(model.parameters())
    optimizer = make_optimizer(opt)(params)
    x, y = make_data(world)
    anchor = [p.detach().clone() for p in params]
    buffers = [torch.zeros_like(p) for p in params]
    for step in range(STEPS):
        optimizer.zero_grad()
        cross_entropy(model(x[step, rank]), y[step, rank]).backward()
        if combine == "gradients":
            reducer.all_reduce([p.grad for p in params])
            optimizer.step()
            continue
        optimizer.step()
        if (step + 1) % local_steps == 0:
            with torch.no_grad():
                deltas = [p - a for p, a in zip(params, anchor)]
                reducer.all_reduce(deltas)
                for p, a, d, u in zip(params, anchor, deltas, buffers):
                    if slow_momentum is None:
                        a.add_(d)
                    else:
                        slow_momentum_update(a, a + d, u, optimizer.param_groups[0]["lr"], 1.0, slow_momentum)
                    p.copy_(a)
    return [p.detach().clone() for p in params]


def real_train(rank: int, world: int) -> dict:
    """`adasum train`'s torchrun path (runner.train with distributed=True) on this rank."""
    from adasum.experiments.data import load_task
    from adasum.experiments.runner import train

    return train(train_config(world), dataset=load_task("digits"), distributed=True)


def train_config(world: int):
    from adasum.experiments.runner import RunConfig

    return RunConfig(method="adasum", workers=world, lr=0.05, epochs=2, batch_size=8, model="mlp", train_limit=240)


def gloo_body(rank: int, world: int) -> dict:
    # numpy arrays, not tensors: tensors would travel through shared memory of exited processes
    out = {case[0]: [p.numpy() for p in real_run(rank, world, case)] for case in CASES}
    # the distributed orthogonality diagnostic on per-rank vectors the parent can recompute
    g = torch.Generator().manual_seed(7)
    vectors = [[torch.randn(3, 2, generator=g), torch.randn(4, generator=g)] for _ in range(world)]
    diag = all_reduce_orthogonality(vectors[rank])
    out["orthogonality"] = (diag.per_tensor.numpy(), diag.model)
    out["train"] = real_train(rank, world)
    return out


def simulated(case: tuple, workers: int, chunk_size: int | None = None) -> list[torch.Tensor]:
    _, reducer_name, combine, local_steps, slow_momentum, opt = case
    model = make_model()
    sim = SimulatedWorkers(
        model,
        workers,
        make_optimizer(opt),
        reducer=reducer_name,
        combine=combine,
        local_steps=local_steps,
        slow_momentum=slow_momentum,
        chunk_size=chunk_size,
    )
    x, y = make_data(workers)
    for step in range(STEPS):
        sim.step(x[step], y[step])
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def gloo_results() -> list[dict]:
    """One spawned gloo group of WORLD ranks runs every real-worker check of this file."""
    return distributed.run(WORLD, gloo_body)


def test_simulated_equals_real_gloo_run(gloo_results):
    results = gloo_results
    for case in CASES:
        name = case[0]
        real = [torch.from_numpy(a) for a in results[0][name]]
        for other in results[1:]:  # data-parallel ranks agree bitwise
            assert all(a.tobytes() == b.tobytes() for a, b in zip(results[0][name], other[name])), name
        sim = simulated(case, WORLD)
        initial = list(make_model().parameters())
        for s, r, p0 in zip(sim, real, initial):
            torch.testing.assert_close(s, r, rtol=1e-5, atol=1e-6, msg=name)
            assert not torch.equal(s, p0.detach()), f"{name}: the parameters did not move"
    g = torch.Generator().manual_seed(7)
    vectors = [[torch.randn(3, 2, generator=g), torch.randn(4, generator=g)] for _ in range(WORLD)]
    expected = orthogonality(vectors)
    per_tensor, model = results[0]["orthogonality"]
    torch.testing.assert_close(torch.from_numpy(per_tensor), expected.per_tensor)
    assert model == pytest.approx(expected.model)


def test_torchrun_training_path_matches_the_simulator(gloo_results):
    from adasum.experiments.data import load_task
    from adasum.experiments.runner import train

    real = [r["train"] for r in gloo_results]
    sim = train(train_config(WORLD), dataset=load_task("digits"))
    assert real[0]["distributed"] and real[0]["steps"] == sim["steps"] == 20
    strip = lambda h: {k: v for k, v in h.items() if k != "wall_s"}  # noqa: E731
    for other in real[1:]:  # every rank reports the same history
        assert [strip(h) for h in other["history"]] == [strip(h) for h in real[0]["history"]]
    for r, s in zip(real[0]["history"], sim["history"]):
        assert r["test_loss"] == pytest.approx(s["test_loss"], rel=1e-4)
        assert r["train_loss"] == pytest.approx(s["train_loss"], rel=1e-4)
        assert abs(r["test_accuracy"] - s["test_accuracy"]) <= 0.2


def test_methods_differ_so_the_comparison_means_something():
    adasum = simulated(CASES[0], WORLD)
    mean = simulated(("mean-grad-sgd", "mean", "gradients", 1, None, "sgd"), WORLD)
    assert not torch.allclose(adasum[0], mean[0])


def test_one_worker_is_plain_training():
    x, y = make_data(1)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        cross_entropy(model(x[step, 0]), y[step, 0]).backward()
        optimizer.step()
    for reducer in ("mean", "adasum"):
        sim = simulated(("one", reducer, "gradients", 1, None, "sgd"), 1)
        for s, p in zip(sim, model.parameters()):
            torch.testing.assert_close(s, p.detach(), rtol=1e-5, atol=1e-6)


def test_64_workers_chunked_equals_unchunked():
    case = ("mean-delta", "mean", "deltas", 1, None, "adam")
    whole = simulated(case, 64)
    chunked = simulated(case, 64, chunk_size=16)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_step_reports_losses_and_orthogonality():
    model = make_model()
    sim = SimulatedWorkers(model, 4, make_optimizer("sgd"), reducer="adasum")
    x, y = make_data(4)
    result = sim.step(x[0], y[0])
    assert result.losses.shape == (4,)
    with torch.no_grad():
        expected = torch.stack([cross_entropy(make_model()(x[0, i]), y[0, i]) for i in range(4)])
    torch.testing.assert_close(result.losses, expected)
    assert result.orthogonality is not None
    assert result.orthogonality.per_tensor.shape == (4,)
    assert 1 / 4 - 1e-9 <= result.orthogonality.model


def test_state_dict_round_trip_continues_identically():
    x, y = make_data(3)

    def fresh():
        return SimulatedWorkers(make_model(), 3, make_optimizer("sgd"), reducer="mean", combine="deltas", local_steps=2, slow_momentum=0.5)

    straight = fresh()
    for step in range(STEPS):
        straight.step(x[step], y[step])
    first = fresh()
    for step in range(3):
        first.step(x[step], y[step])
    second = fresh()
    second.load_state_dict(first.state_dict())
    second.step(x[3], y[3])
    for a, b in zip(straight.module.parameters(), second.module.parameters()):
        assert torch.equal(a, b)


def test_bad_input_is_refused_clearly():
    model = make_model()
    sgd = make_optimizer("sgd")
    with pytest.raises(ValueError, match="workers must be"):
        SimulatedWorkers(model, 0, sgd)
    with pytest.raises(ValueError, match="combine must be"):
        SimulatedWorkers(model, 2, sgd, combine="weights")
    with pytest.raises(ValueError, match="need combine='deltas'"):
        SimulatedWorkers(model, 2, sgd, local_steps=3)
    with pytest.raises(ValueError, match="unknown reducer"):
        SimulatedWorkers(model, 2, sgd, reducer="median")
    with pytest.raises(ValueError, match="BatchNorm"):
        SimulatedWorkers(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), 2, sgd)
    from pytorch_optimizer import Lamb

    with pytest.raises(ValueError, match="not elementwise"):
        SimulatedWorkers(model, 2, lambda ps: Lamb(ps), combine="deltas")
    SimulatedWorkers(model, 2, lambda ps: Lamb(ps))  # fine on the one combined model
    sim = SimulatedWorkers(model, 2, sgd)
    x, y = make_data(3)
    with pytest.raises(ValueError, match="worker index first"):
        sim.step(x[0], y[0])
