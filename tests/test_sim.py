"""The simulator against real gloo workers, and its handling of bad input.

The real runs are written out here with plain autograd, `Reducer.all_reduce` and
`slow_momentum_update`, so the simulator is checked against the distributed path step by step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from adasum.diagnostics import all_reduce_orthogonality, orthogonality
from adasum.integrations.slowmo import slow_momentum_update
from adasum.reducers import get_reducer
from adasum.sim import SimulatedWorkers, cross_entropy

import distributed

WORLD = 3  # not a power of two: Adasum's folded tree is exercised too
BATCH = 8
STEPS = 4

# (name, reducer, combine, local_steps, slow_momentum, optimizer)
CASES = [
    ("adasum-grad-sgd", "adasum", "gradient", 1, None, "sgd"),
    ("mean-grad-adam", "mean", "gradient", 1, None, "adam"),
    ("adasum-delta-adam", "adasum", "delta", 1, None, "adam"),
    ("sum-local-sgd", "sum", "delta", 2, None, "sgd"),
    ("slowmo-mean", "mean", "delta", 2, 0.5, "sgd"),
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
        if combine == "gradient":
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


# the harness's methods through `adasum train`'s torchrun path (gradients through the per-tensor
# and the whole-model reducer, every delta method); local_steps=2 with 5 steps an epoch: epoch 1
# ends in the middle of a round (evaluation sees the last combined model), the run ends on a
# combination (rank 0's checkpoint holds the model every rank agrees on)
TRAIN_METHODS = ["adasum", "adacons", "adasum-delta", "localsgd", "adasum-localsgd", "slowmo", "adasum-diloco",
                 "adacons-diloco", "streaming-diloco"]


def train_config(world: int, method: str = "adasum", model: str = "mlp"):
    from adasum.experiments.runner import RunConfig

    # SGD with momentum: per-worker optimizer state in the delta methods. (Adam is checked against
    # the simulator in CASES on random data; on digits its normalised steps amplify the rounding
    # of near-cancelling pixel gradients, batched vs per-rank, beyond any useful tolerance.)
    return RunConfig(
        method=method, workers=world, lr=0.05, epochs=2, batch_size=8, model=model, train_limit=120,
        optimizer="sgd", momentum=0.5, local_steps=2, slow_momentum=0.5, slow_lr=1.5, seed=4,
    )


# the default CNN has dropout (channels after conv2, units after fc1): each rank's masks must be
# its simulated worker's
DROPOUT_METHODS = ["adasum", "localsgd"]


def real_train(rank: int, world: int, out: str) -> dict:
    """`adasum train`'s torchrun path (runner.train with distributed=True) on this rank, for every
    method: each result with rank 0's final model (from its checkpoint) as numpy arrays."""
    from pathlib import Path

    from adasum.experiments.data import load_task
    from adasum.experiments.runner import train

    data = load_task("digits")
    results = {}
    for method in TRAIN_METHODS:
        result = train(train_config(world, method), Path(out) / method, dataset=data, distributed=True)
        if rank == 0:
            state = torch.load(Path(out) / method / "checkpoint.pt", weights_only=True)
            result["final_model"] = {k: v.numpy() for k, v in state["engine"]["model"].items()}
            if method.startswith("streaming"):  # mixing keeps the local weights apart: the synced ones (the anchor)
                anchor = state["engine"]["optimizer"]["anchor"]
                result["final_model"] = {k: a.numpy() for k, a in zip(state["engine"]["model"], anchor)}
        results[method] = result
    for method in DROPOUT_METHODS:
        result = train(train_config(world, method, "cnn"), Path(out) / f"cnn-{method}", dataset=data, distributed=True)
        if rank == 0:
            state = torch.load(Path(out) / f"cnn-{method}" / "checkpoint.pt", weights_only=True)
            result["final_model"] = {k: v.numpy() for k, v in state["engine"]["model"].items()}
        results[f"cnn-{method}"] = result
    try:  # one worker's method on several processes is refused on every rank
        train(train_config(world, "sequential"), dataset=data, distributed=True)
    except ValueError as error:
        results["sequential"] = str(error)
    return results


def gloo_body(rank: int, world: int, out_dir: str) -> dict:
    # numpy arrays, not tensors: tensors would travel through shared memory of exited processes
    out = {case[0]: [p.numpy() for p in real_run(rank, world, case)] for case in CASES}
    # the distributed orthogonality diagnostic on per-rank vectors the parent can recompute
    g = torch.Generator().manual_seed(7)
    vectors = [[torch.randn(3, 2, generator=g), torch.randn(4, generator=g)] for _ in range(world)]
    diag = all_reduce_orthogonality(vectors[rank])
    out["orthogonality"] = (diag.per_tensor.numpy(), diag.model)
    out["train"] = real_train(rank, world, out_dir)
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
def gloo_results(tmp_path_factory) -> list[dict]:
    """One spawned gloo group of WORLD ranks runs every real-worker check of this file."""
    return distributed.run(WORLD, gloo_body, str(tmp_path_factory.mktemp("train")))


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


def test_torchrun_refuses_sequential_on_several_processes(gloo_results):
    for r in gloo_results:
        expected = "method 'sequential' is one worker: launch it with torchrun --nproc-per-node 1"
        assert r["train"]["sequential"] == expected


@pytest.fixture(scope="module")
def digits():
    from adasum.experiments.data import load_task

    return load_task("digits")


@pytest.fixture
def one_thread():
    """The simulator at one thread, as `adasum train` runs it (on a loaded machine far faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("method", TRAIN_METHODS)
def test_torchrun_training_path_matches_the_simulator(gloo_results, method, tmp_path, digits, one_thread):
    from adasum.experiments.models import build_model
    from adasum.experiments.runner import train

    real = [r["train"][method] for r in gloo_results]
    sim = train(train_config(WORLD, method), tmp_path, dataset=digits)
    assert real[0]["distributed"] and real[0]["steps"] == sim["steps"] == 10
    strip = lambda h: {k: v for k, v in h.items() if k != "wall_s"}  # noqa: E731
    for other in real[1:]:  # every rank reports the same history (its test loss from the agreed model)
        assert [strip(h) for h in other["history"]] == [strip(h) for h in real[0]["history"]]
    for r, s in zip(real[0]["history"], sim["history"]):
        assert r["test_loss"] == pytest.approx(s["test_loss"], rel=1e-5)
        assert r["train_loss"] == pytest.approx(s["train_loss"], rel=1e-5)
        assert abs(r["test_accuracy"] - s["test_accuracy"]) <= 0.2
    sim_model = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["engine"]["model"]
    torch.manual_seed(0)  # the runner's initial model
    initial = build_model("mlp", digits.input_shape, digits.classes).state_dict()
    assert sim_model.keys() == real[0]["final_model"].keys()
    for name, value in sim_model.items():
        torch.testing.assert_close(
            torch.from_numpy(real[0]["final_model"][name]), value, rtol=1e-5, atol=1e-6, msg=name
        )
        assert not torch.equal(value, initial[name]), f"{method}: {name} did not move"


@pytest.mark.parametrize("method", DROPOUT_METHODS)
def test_torchrun_and_the_simulator_draw_the_same_dropout(gloo_results, method, tmp_path, digits, one_thread):
    from adasum.experiments.runner import train

    real = gloo_results[0]["train"][f"cnn-{method}"]
    sim = train(train_config(WORLD, method, "cnn"), tmp_path, dataset=digits)
    for r, s in zip(real["history"], sim["history"]):
        assert r["train_loss"] == pytest.approx(s["train_loss"], rel=1e-5)
    sim_model = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["engine"]["model"]
    for name, value in sim_model.items():
        torch.testing.assert_close(
            torch.from_numpy(real["final_model"][name]), value, rtol=1e-5, atol=1e-6, msg=name
        )


def test_keyed_dropout_masks_are_per_key_and_scaled():
    from adasum.sim import KeyedDropout

    layer = KeyedDropout(0.5).train()
    x = torch.ones(4, 1000)
    first = layer(x)
    assert set(first.unique().tolist()) == {0.0, 2.0} and abs((first == 0).float().mean().item() - 0.5) < 0.05
    assert torch.equal(layer(x), first)
    layer.key.fill_(1)
    assert not torch.equal(layer(x), first)  # another key, another mask
    channels = KeyedDropout(0.5, channels=True).train()(torch.ones(8, 6, 5, 5))
    assert all(len(c.unique()) == 1 for c in channels.flatten(2).unbind(0)[0])  # whole channels
    assert torch.equal(layer.eval()(x), x)


def test_methods_differ_so_the_comparison_means_something():
    adasum = simulated(CASES[0], WORLD)
    mean = simulated(("mean-grad-sgd", "mean", "gradient", 1, None, "sgd"), WORLD)
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
        sim = simulated(("one", reducer, "gradient", 1, None, "sgd"), 1)
        for s, p in zip(sim, model.parameters()):
            torch.testing.assert_close(s, p.detach(), rtol=1e-5, atol=1e-6)


def test_64_workers_chunked_equals_unchunked():
    case = ("mean-delta", "mean", "delta", 1, None, "adam")
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
        return SimulatedWorkers(
            make_model(), 3, make_optimizer("sgd"), reducer="mean", combine="delta", local_steps=2, slow_momentum=0.5
        )

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
    # SlowMo's rules and messages (adasum.integrations.slowmo.check_slow_options), and options that need others
    op = "adasum.SimulatedWorkers: "
    delta = {"combine": "delta", "local_steps": 2}
    for workers, kwargs, error, message in [
        (True, {}, TypeError, "workers must be an integer >= 1, got True; pass workers= a whole number"),
        (2.0, {}, TypeError, "workers must be an integer >= 1, got 2.0; pass workers= a whole number"),
        (2, {"combine": "delta", "local_steps": 1.5}, TypeError, "local_steps must be an integer >= 1, got 1.5; pass "
                                                                 "local_steps= a whole number"),
        (2, {"combine": "delta", "local_steps": 0}, ValueError, "local_steps must be an integer >= 1, got 0; pass "
                                                                "local_steps=1 or more"),
        (2, {**delta, "slow_momentum": 1.5}, ValueError, "slow_momentum must be a number in [0, 1), got 1.5; pass "
                                                         "slow_momentum= a number in [0, 1)"),
        (2, {**delta, "slow_momentum": 0.5, "slow_lr": -1}, ValueError,
         "slow_lr must be a finite number > 0, got -1; pass slow_lr= a finite number > 0"),
        (2, {**delta, "slow_momentum": 0.0, "slow_lr": 0.0}, ValueError,
         "slow_lr must be a finite number > 0, got 0.0; pass slow_lr= a finite number > 0"),
        (2, {**delta, "slow_momentum": 0.5, "slow_lr": float("nan")}, ValueError,
         "slow_lr must be a finite number > 0, got nan; pass slow_lr= a finite number > 0"),
        (2, {**delta, "slow_lr": 0.5}, ValueError,
         "slow_lr=0.5 needs slow_momentum (SlowMo's outer step, combine='delta'); without it every worker restarts "
         "from the combined model, as slow_lr=1.0 with slow_momentum=0.0 does; pass slow_momentum= too (0.0 for none) "
         "or leave slow_lr out"),
        (2, {"chunk_size": 0}, ValueError, "chunk_size must be an integer >= 1, got 0; pass chunk_size=1 or more"),
        (2, {"chunk_size": 2.5}, TypeError, "chunk_size must be an integer >= 1, got 2.5; pass chunk_size= a whole "
                                            "number"),
    ]:
        with pytest.raises(error) as info:
            SimulatedWorkers(model, workers, sgd, **kwargs)
        assert str(info.value) == op + message, (kwargs, str(info.value))
    SimulatedWorkers(model, 2, sgd, **delta, slow_lr=1.0)  # slow_lr's default: the combined model, as without it
    SimulatedWorkers(model, 2, sgd, **delta, slow_momentum=0.0, slow_lr=0.5)
    with pytest.raises(ValueError, match="combine must be"):
        SimulatedWorkers(model, 2, sgd, combine="weights")
    with pytest.raises(ValueError, match="need combine=.delta."):
        SimulatedWorkers(model, 2, sgd, local_steps=3)
    with pytest.raises(ValueError, match="unknown reducer"):
        SimulatedWorkers(model, 2, sgd, reducer="median")
    with pytest.raises(ValueError, match="BatchNorm"):
        SimulatedWorkers(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), 2, sgd)
    from pytorch_optimizer import Lamb

    with pytest.raises(ValueError, match="not elementwise"):
        SimulatedWorkers(model, 2, lambda ps: Lamb(ps), combine="delta")
    SimulatedWorkers(model, 2, lambda ps: Lamb(ps))  # fine on the one combined model
    sim = SimulatedWorkers(model, 2, sgd)
    x, y = make_data(3)
    with pytest.raises(ValueError, match="worker index first"):
        sim.step(x[0], y[0])


def test_a_state_of_other_settings_is_refused_before_anything_loads():
    x, y = make_data(3)

    def sim(workers=3, **options):
        return SimulatedWorkers(make_model(), workers, make_optimizer("sgd"), **options)

    slowmo = {"reducer": "mean", "combine": "delta", "local_steps": 2, "slow_momentum": 0.5}
    saved = sim(**slowmo)
    for step in range(STEPS):
        saved.step(x[step], y[step])
    state = saved.state_dict()
    op = "adasum.SimulatedWorkers.load_state_dict: the state was saved with "
    for options, was, has in [
        ({**slowmo, "slow_momentum": None}, "slow_momentum=0.5", "slow_momentum=None"),  # local SGD: no slow momentum
        ({**slowmo, "local_steps": 3}, "local_steps=2", "local_steps=3"),
        ({"reducer": "mean"}, "combine='delta', local_steps=2, slow_momentum=0.5",
         "combine='gradient', local_steps=1, slow_momentum=None"),
        ({**slowmo, "reducer": "adasum"}, "reducer='Mean()'", "reducer='Adasum(per_tensor=True)'"),
    ]:
        target = sim(**options)
        before = [p.clone() for p in target.module.parameters()]
        with pytest.raises(ValueError) as info:
            target.load_state_dict(state)
        assert str(info.value) == (
            f"{op}{was}, but this simulator has {has}; build it with the settings the state was saved with"
        ), options
        assert all(torch.equal(a, b) for a, b in zip(before, target.module.parameters())) and target.steps == 0
    with pytest.raises(ValueError) as info:
        sim(workers=4, **slowmo).load_state_dict(state)
    assert str(info.value) == (
        f"{op}workers=3, but this simulator has workers=4; build it with the settings the state was saved with"
    )
    same = sim(**slowmo)
    same.load_state_dict(state)
    assert same.steps == STEPS
