"""adasum.DistributedOptimizer on real gloo process groups: round by round against a single-process
simulation of every rank's local work from the same weights and optimizer states, combined by the
independent reference (tests/reference.py) within its error bound, with bitwise-identical parameters
on every rank after every step; accumulation, local steps, clipping, GradScaler's found-inf agreement,
checkpoints and the construction checks."""

import copy

import pytest
import torch
import torch.distributed as dist

import adasum
from adasum.integrations.optim import buckets, checksum

import distributed
from reference import (
    U64,
    UNIT,
    combine_with_bound,
    error_of,
    hierarchical_with_bound,
    mean_with_bound,
    sum_with_bound,
)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def loss_of(model, rank, step, micro=0):
    x, y = batch(rank, step, micro)
    return torch.nn.functional.mse_loss(model(x), y)


def backward(model, rank, step, micro=0):
    loss_of(model, rank, step, micro).backward()


def _lamb(params):
    # imported here: the NCCL suite runs where the experiments extra (pytorch-optimizer) is absent
    from pytorch_optimizer import Lamb

    return Lamb(params, lr=0.01)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "lamb": lambda ps: _lamb(ps),
}


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def to_bytes(params):
    return b"".join(p.detach().numpy().tobytes() for p in params)


def reference_combine(tensors):
    """Adasum of the ranks' tensors by the independent reference, in their dtype (`Simulation.round`)."""
    return combine_with_bound(tensors)[0].to(tensors[0].dtype)


class Simulation:
    """Every rank's model and optimizer in one process: the non-distributed copy. `local` recomputes each rank's
    local work of a round from given weights and optimizer states (what the distributed optimizer is checked
    against, round by round); `round` runs whole rounds on its own, combining with the reference (the device
    test, whose GPU optimizer steps round otherwise than these CPU ones). Under `autocast` the forward passes run
    in bfloat16; with a `scale`, the losses are scaled by it and the gradients unscaled, as GradScaler does."""

    def __init__(self, world, make_opt, combine=reference_combine, mode="delta", micros=1, local_steps=1, clip=None,
                 autocast=False):
        self.world, self.make_opt, self.combine, self.mode = world, make_opt, combine, mode
        self.micros, self.local_steps, self.clip, self.autocast = micros, local_steps, clip, autocast
        self.models = [make_model() for _ in range(world)]
        self.opts = [make_opt(m.parameters()) for m in self.models]
        self.step_index = 0

    def _local_grads(self, r, scale=None):
        model = self.models[r]
        model.zero_grad()
        for micro in range(self.micros):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss = loss_of(model, r, self.step_index, micro)
            (loss if scale is None else loss * scale).backward()
        if scale is not None:  # a power of two: exact, as GradScaler's unscaling
            for p in model.parameters():
                p.grad.mul_(1 / scale)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)

    def local(self, start, states, scale=None):
        """Every rank's local work of one round from the weights `start` and its wrapped optimizer's state
        ``states[r]``: in delta mode its weights after its local steps, in gradient mode its local gradients."""
        first, out = self.step_index, []
        for r, model in enumerate(self.models):
            with torch.no_grad():
                for p, x in zip(model.parameters(), start):
                    p.copy_(x)
            self.opts[r] = self.make_opt(model.parameters())
            self.opts[r].load_state_dict(states[r])
            self.step_index = first
            if self.mode == "gradient":
                self._local_grads(r, scale)
                out.append([p.grad.clone() for p in model.parameters()])
                continue
            for _ in range(self.local_steps):
                self._local_grads(r, scale)
                self.opts[r].step()
                self.step_index += 1
            out.append(snapshot(model))
        self.step_index = first + (1 if self.mode == "gradient" else self.local_steps)
        return out

    def round(self):
        """One combination on its own: local_steps local steps per rank (delta) or one step (gradient)."""
        params = [list(m.parameters()) for m in self.models]
        if self.mode == "gradient":
            for r in range(self.world):
                self._local_grads(r)
            for i in range(len(params[0])):
                combined = self.combine([params[r][i].grad for r in range(self.world)])
                for r in range(self.world):
                    params[r][i].grad = combined.clone()
            for opt in self.opts:
                opt.step()
            self.step_index += 1
            return snapshot(self.models[0])
        start = snapshot(self.models[0])
        first = self.step_index
        for r in range(self.world):
            self.step_index = first
            for _ in range(self.local_steps):
                self._local_grads(r)
                self.opts[r].step()
                self.step_index += 1
        with torch.no_grad():
            for i, x0 in enumerate(start):
                combined = self.combine([params[r][i] - x0 for r in range(self.world)])
                for r in range(self.world):
                    params[r][i].copy_(x0 + combined)
        return snapshot(self.models[0])


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def gather_states(optimizer, world):
    """Every rank's wrapped optimizer state (a collective)."""
    states = [None] * world
    dist.all_gather_object(states, optimizer.state_dict())
    return states


def check_deltas(params, start, local, reference):
    """Delta mode: every parameter within ``bound + (u + U64) ||p||`` of its starting weights plus `reference` of
    the ranks' deltas: the bound of the combination, then the rounding of adding it to the starting weights in
    the parameter's dtype (u; U64 for that sum done here). The deltas are taken as the library takes them
    (``torch.sub`` in the parameters' dtype, an exactly rounded operation: the same values)."""
    for i, (p, x0) in enumerate(zip(params, start)):
        ref, bound = reference([weights[i] - x0 for weights in local])
        extra = (UNIT[str(p.dtype).removeprefix("torch.")] + U64) * float(p.detach().double().norm())
        err = error_of(p, x0.double() + ref)
        assert p.dtype == x0.dtype and err <= bound + extra, (i, err, bound, extra)


def check_gradients(model, start, local, reference, make_opt, state):
    """Gradient mode: every combined gradient within the bound of `reference` of the ranks' local gradients, and
    the parameters bitwise those of the wrapped optimizer's step (from the same weights and state) on them."""
    for i, p in enumerate(model.parameters()):
        ref, bound = reference([grads[i] for grads in local])
        assert error_of(p.grad, ref) <= bound, (i, error_of(p.grad, ref), bound)
    twin = make_model()
    with torch.no_grad():
        for q, x0, p in zip(twin.parameters(), start, model.parameters()):
            q.copy_(x0)
            q.grad = p.grad.clone()
    twin_opt = make_opt(twin.parameters())
    twin_opt.load_state_dict(state)
    twin_opt.step()
    assert to_bytes(twin.parameters()) == to_bytes(model.parameters())


def run_and_compare(rank, world, make_opt, rounds=3, reference=combine_with_bound, **kwargs):
    """The distributed optimizer round by round against the simulation's recomputation of every rank's local work
    from the same weights and optimizer states (gathered from the ranks), so that errors do not compound:
    `check_deltas` (delta mode) or `check_gradients`, with `reference` giving the reference combination and its
    bound (tests/reference.py); the parameters' bytes after each round."""
    reducer = kwargs.pop("reducer", "adasum")
    mode = kwargs.get("mode", "delta")
    micros, local_steps, clip = kwargs.pop("micros", 1), kwargs.get("local_steps", 1), kwargs.pop("clip", None)
    sim = Simulation(world, make_opt, mode=mode, micros=micros, local_steps=local_steps, clip=clip)
    model = make_model()
    opt = adasum.DistributedOptimizer(
        make_opt(model.parameters()), reducer=reducer, backward_passes_per_step=micros, **kwargs
    )
    history = []
    step = 0
    for _ in range(rounds):
        start = snapshot(model)
        states = gather_states(opt.optimizer, world)
        local = sim.local(start, states)
        for _ in range(local_steps):
            for micro in range(micros):
                opt.zero_grad()  # a no-op while gradients accumulate
                backward(model, rank, step, micro)
                if clip is not None and micro == micros - 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
            step += 1
        if mode == "gradient":
            check_gradients(model, start, local, reference, make_opt, states[rank])
        else:
            check_deltas(list(model.parameters()), start, local, reference)
        history.append(to_bytes(model.parameters()))
    return history


def optim_body(rank, world):
    out = {}
    full = world < 4  # world 4 runs the main cases (keeps the file fast); hierarchical mode: `hierarchical_body`
    for name in ("sgd", "adam", "adamw", "lamb") if full else ("sgd", "adam"):
        out[f"delta-{name}"] = run_and_compare(rank, world, OPTIMIZERS[name])
    sgd = OPTIMIZERS["sgd"]
    out["gradient-adasum"] = run_and_compare(rank, world, sgd, mode="gradient")
    out["gradient-mean"] = run_and_compare(rank, world, sgd, mode="gradient", reducer="mean", reference=mean_with_bound)
    out["local-steps"] = run_and_compare(rank, world, sgd, local_steps=2)
    if full:
        out["delta-sum"] = run_and_compare(rank, world, sgd, reducer=adasum.Sum(), reference=sum_with_bound)
        out["accumulate"] = run_and_compare(rank, world, OPTIMIZERS["adam"], micros=2)
        out["clip"] = run_and_compare(rank, world, OPTIMIZERS["adam"], clip=0.05)
        out["tiny-buckets"] = run_and_compare(rank, world, sgd, bucket_cap_mb=1e-4)
    # whole-model coefficients: one bucket per dtype, whatever the cap
    model = make_model()
    whole = adasum.DistributedOptimizer(sgd(model.parameters()), reducer=adasum.Adasum(per_tensor=False))
    assert whole.bucket_cap_bytes is None
    out["scaler"] = grad_scaler_checks(rank, world)
    out["checkpoint"] = checkpoint_checks(rank, world)
    out["errors"] = error_checks(rank, world)
    return out


def grad_scaler_checks(rank, world):
    """scaler.step(opt) with an inf injected on the last rank: every rank skips and backs off;
    also after unscale_ and clipping, and under bf16 autocast on the CPU. The steps taken are checked as
    `run_and_compare` checks delta mode, against the simulation's recomputation of every rank's local step
    (scaled by the same power of two and unscaled, clipped alike, under the same autocast)."""
    history = []
    for unscale_first, autocast in ((False, False), (True, False), (False, True)):
        model = make_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
        opt = adasum.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), grad_scaler=scaler)
        sim = Simulation(world, OPTIMIZERS["adam"], clip=10.0 if unscale_first else None, autocast=autocast)
        for step in range(4):
            before = snapshot(model)
            states = gather_states(opt.optimizer, world)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_of(model, rank, sim.step_index)
            scaler.scale(loss).backward()
            inject = step == 1 and rank == world - 1
            if inject:
                next(model.parameters()).grad[0, 0] = float("inf")
            if unscale_first:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if step == 1:  # skipped everywhere, the scale halved everywhere
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
                assert scaler.get_scale() == scale / 2, (scaler.get_scale(), scale)
            else:
                local = sim.local(before, states, scale=scale)
                check_deltas(list(model.parameters()), before, local, combine_with_bound)
                assert scaler.get_scale() == scale * 2
            history.append(to_bytes(model.parameters()) + repr(scaler.get_scale()).encode())
    return history


def checkpoint_checks(rank, world):
    """Save in the middle (also in the middle of a round of local steps), reload into fresh
    objects, continue: bitwise the same as not stopping."""
    out = []
    for local_steps, save_after in ((1, 2), (2, 3)):

        def train(model, opt, steps, first):
            for step in range(first, first + steps):
                opt.zero_grad()
                backward(model, rank, step)
                opt.step()

        model = make_model()
        opt = adasum.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), local_steps=local_steps)
        train(model, opt, save_after, 0)
        saved = copy.deepcopy((model.state_dict(), opt.state_dict()))  # as torch.save would
        train(model, opt, 3, save_after)
        straight = to_bytes(model.parameters())

        # build, then load (mid-round the ranks' weights differ, which the construction check refuses)
        resumed = make_model(seed=1)
        opt2 = adasum.DistributedOptimizer(torch.optim.Adam(resumed.parameters(), lr=0.01), local_steps=local_steps)
        resumed.load_state_dict(saved[0])
        opt2.load_state_dict(saved[1])
        train(resumed, opt2, 3, save_after)
        assert to_bytes(resumed.parameters()) == straight, local_steps
        out.append(straight)

    # an LR scheduler drives the wrapped optimizer's learning rate
    model = make_model()
    opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    backward(model, rank, 0)
    opt.step()
    sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.5
    return out


def error_checks(rank, world):
    messages = {}
    model = make_model(seed=rank if rank == world - 1 else 0)
    with pytest.raises(ValueError) as info:
        adasum.DistributedOptimizer(torch.optim.SGD(model.named_parameters(), lr=0.1))
    messages["values"] = str(info.value)
    model = torch.nn.Linear(6, 4 if rank == world - 1 else 3)
    with pytest.raises(ValueError) as info:
        adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    messages["shapes"] = str(info.value)
    return messages


@pytest.mark.parametrize("world", [2, 3])  # a power of two and a fold; deeper trees: test_collectives
def test_distributed_optimizer_matches_simulation(world):
    results = distributed.run(world, optim_body, timeout_s=240)
    distributed.assert_ranks_agree(results, skip=("errors",))
    for r in range(world):
        errors = results[r]["errors"]
        assert "parameter '0.weight' (shape [10, 6]) differs across ranks" in errors["values"], errors["values"]
        assert "parameters differ across ranks at index 0" in errors["shapes"]


def hierarchical_body(rank, world):
    """2 emulated nodes of 2 ranks: the mean inside each, Adasum across, round by round against the reference."""
    return run_and_compare(
        rank, world, OPTIMIZERS["adam"], reducer=adasum.Adasum(hierarchical=True, local_size=2),
        reference=lambda ts: hierarchical_with_bound(ts, 2),
    )


def test_distributed_optimizer_in_hierarchical_mode_matches_the_reference():
    results = distributed.run(4, hierarchical_body, timeout_s=240)
    distributed.assert_ranks_agree(results)


def test_buckets_and_checksum():
    ts = [torch.zeros(4), torch.zeros(2), torch.zeros(4, dtype=torch.float64), torch.zeros(1)]
    assert buckets(ts, 16) == [[0], [1, 3], [2]]
    assert buckets(ts, None) == [[0, 1, 3], [2]]
    assert torch.equal(checksum(torch.ones(3)), checksum(torch.ones(3)))
    assert not torch.equal(checksum(torch.tensor([1.0, 2.0])), checksum(torch.tensor([2.0, 1.0])))


def test_options_are_checked():
    model = make_model()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        adasum.DistributedOptimizer(model)
    with pytest.raises(ValueError, match="mode must be one of"):
        adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), mode="weights")
    with pytest.raises(ValueError, match="local_steps > 1 needs mode='delta'"):
        adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), mode="gradient", local_steps=2)
    # numbers and flags, checked before anything else happens (no process group needed to refuse them)
    op = "adasum.DistributedOptimizer: "
    for kwargs, error, message in [
        ({"backward_passes_per_step": 1.5}, TypeError, "backward_passes_per_step must be an integer >= 1, got 1.5; "
                                                       "pass backward_passes_per_step= a whole number"),
        ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step must be an integer >= 1, got 0; pass "
                                                      "backward_passes_per_step=1 or more"),
        ({"backward_passes_per_step": True}, TypeError, "backward_passes_per_step must be an integer >= 1, got True; "
                                                        "pass backward_passes_per_step= a whole number"),
        ({"local_steps": 1.5}, TypeError, "local_steps must be an integer >= 1, got 1.5; pass local_steps= a whole "
                                          "number"),
        ({"local_steps": -1}, ValueError, "local_steps must be an integer >= 1, got -1; pass local_steps=1 or more"),
        ({"bucket_cap_mb": -5}, ValueError, "bucket_cap_mb must be a finite number > 0 (MiB), got -5; pass "
                                            "bucket_cap_mb= a finite number > 0 (MiB)"),
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be a finite number > 0 (MiB), got 0; pass "
                                           "bucket_cap_mb= a finite number > 0 (MiB)"),
        ({"bucket_cap_mb": float("nan")}, ValueError, "bucket_cap_mb must be a finite number > 0 (MiB), got nan; pass "
                                                      "bucket_cap_mb= a finite number > 0 (MiB)"),
        ({"bucket_cap_mb": float("inf")}, ValueError, "bucket_cap_mb must be a finite number > 0 (MiB), got inf; pass "
                                                      "bucket_cap_mb= a finite number > 0 (MiB)"),
        ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb must be a finite number > 0 (MiB), got '25'; pass "
                                             "a number"),
        ({"bucket_cap_mb": None}, TypeError, "bucket_cap_mb must be a finite number > 0 (MiB), got None; pass "
                                             "a number"),
        ({"sparse_as_dense": "no"}, TypeError, "sparse_as_dense must be True or False, got 'no'; pass a bool"),
        ({"check": "no"}, TypeError, "check must be True or False, got 'no'; pass a bool"),
        ({"check": 1}, TypeError, "check must be True or False, got 1; pass a bool"),
        (
            {"grad_scaler": "yes"},
            TypeError,
            "grad_scaler must be a torch.amp.GradScaler (the scaler whose step() drives this optimizer) or None, "
            "got str; pass that scaler or leave grad_scaler= out",
        ),
    ]:
        with pytest.raises(error) as info:
            adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), **kwargs)
        assert str(info.value) == op + message, (kwargs, str(info.value))
    # an adasum wrapper is not wrapped again: it would combine every step twice
    with pytest.raises(TypeError) as info:
        adasum.DistributedOptimizer(adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=1), local_steps=2))
    assert str(info.value) == (
        "adasum.DistributedOptimizer: the optimizer is an adasum.SlowMo already, which combines across ranks "
        "itself: wrapping it again would combine every step twice. Wrap the torch optimizer once (its .optimizer)"
    )


def test_an_adasum_wrapper_is_not_wrapped_again():
    """A DistributedOptimizer is not wrapped again, by another or by SlowMo: every step would be combined twice
    (-4 instead of -2 with sums over 2 ranks). A new wrapper of the same torch optimizer (a set-up run again)
    is allowed."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = make_model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        first = adasum.DistributedOptimizer(sgd, reducer="sum", mode="gradient")
        for wrapper, kwargs in [
            (adasum.DistributedOptimizer, {"reducer": "sum", "mode": "gradient"}),
            (adasum.SlowMo, {"local_steps": 1, "reducer": "sum"}),
        ]:
            with pytest.raises(TypeError) as info:
                wrapper(first, **kwargs)
            assert str(info.value) == (
                f"adasum.{wrapper.__name__}: the optimizer is an adasum.DistributedOptimizer already, which combines "
                "across ranks itself: wrapping it again would combine every step twice. Wrap the torch optimizer "
                "once (its .optimizer)"
            )
        model(torch.ones(1, 6)).sum().backward()
        first.step()  # the first wrapper works on, undisturbed
        again = adasum.DistributedOptimizer(sgd, mode="gradient")  # a set-up run again
        assert again.optimizer is sgd
    finally:
        dist.destroy_process_group()


def steps_against(sim, model, opt, steps, rank, dev):
    """`steps` steps of `opt` on `dev` against the simulation's rounds (the parameters read after ``step()``, on
    the compute stream); the parameters' bytes after each step."""
    history = []
    for step in range(steps):
        expected = sim.round()
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev)).backward()
        opt.step()
        for p, e in zip(model.parameters(), expected):
            assert rel(p.cpu(), e) < 1e-5, rel(p.cpu(), e)
        history.append(to_bytes([p.cpu() for p in model.parameters()]))
    return history


def device_body(rank, world):
    """Delta mode on the backend's device (a GPU on NCCL: the pipelined buckets, with more buckets than
    buffers in flight), against the CPU simulation; and a channels-last model gives the values of a
    contiguous one (the deltas are taken in the parameters' own shapes; on a GPU the two layouts' convolutions
    may round differently, hence the float32 tolerance of the simulation comparison)."""
    dev = distributed.device_for(rank)
    sim = Simulation(world, OPTIMIZERS["adam"])
    model = make_model().to(dev)
    opt = adasum.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), bucket_cap_mb=1e-4)
    history = steps_against(sim, model, opt, 3, rank, dev)

    # gradient mode on the device: the gradients re-made every step (zero_grad), many buckets, the graphs captured
    # and replayed from the later steps on
    sim_gradient = Simulation(world, OPTIMIZERS["sgd"], mode="gradient")
    model_gradient = make_model().to(dev)
    opt_gradient = adasum.DistributedOptimizer(
        OPTIMIZERS["sgd"](model_gradient.parameters()), mode="gradient", bucket_cap_mb=1e-4
    )
    history.append(steps_against(sim_gradient, model_gradient, opt_gradient, 4, rank, dev)[-1])

    def conv_run(memory_format):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))
        net = net.to(dev, memory_format=memory_format)
        opt = adasum.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), bucket_cap_mb=1e-4)
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            opt.zero_grad()
            x = torch.randn(2, 3, 6, 6, generator=g).to(dev, memory_format=memory_format)
            net(x).square().sum().backward()
            opt.step()
        return [p.detach().cpu().contiguous() for p in net.parameters()]

    last = conv_run(torch.channels_last)
    assert next(iter(last)).shape == (4, 3, 3, 3)
    assert all(rel(a, b) < 1e-5 for a, b in zip(last, conv_run(torch.contiguous_format)))
    history.append(to_bytes(last))
    return history


@pytest.mark.nccl
@pytest.mark.parametrize("world", distributed.world_sizes(2))
def test_delta_mode_on_the_backend_device(world):
    results = distributed.run(world, device_body)
    assert all(r == results[0] for r in results)


def test_delta_plan_follows_new_parameter_storage():
    """The delta combiner's per-bucket plan (the parameters' views that one GPU kernel reads and writes in place;
    `adasum.integrations.delta.DeltaCombiner`, behind delta mode and SlowMo) is rebuilt when a parameter gets new
    storage: stale views would write the update into memory the model no longer uses."""
    from adasum.integrations.delta import DeltaCombiner

    params = list(make_model().parameters())
    combiner = DeltaCombiner(adasum.get_reducer("adasum"), None, bucket_cap_bytes=25 << 20)
    first = combiner.plan(params)
    assert combiner.plan(params) is first  # same storage: kept
    with torch.no_grad():
        params[0].data = params[0].data.clone()
    second = combiner.plan(params)
    assert second is not first and second[0][0][0] is params[0]


def mixed_dtype_body(rank, world):
    """Delta mode with parameters of two dtypes (one bucket each): every bucket's delta buffer has its own
    bucket's dtype; against the reference Adasum of the ranks' SGD steps recomputed here (`check_deltas`)."""
    torch.manual_seed(0)
    p32 = torch.nn.Parameter(torch.randn(7))
    p64 = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    start = [p32.detach().clone(), p64.detach().clone()]
    targets = [[torch.randn(7, generator=torch.Generator().manual_seed(10 + r)),
                torch.randn(5, generator=torch.Generator().manual_seed(20 + r), dtype=torch.float64)]
               for r in range(world)]
    opt = adasum.DistributedOptimizer(torch.optim.SGD([p32, p64], lr=0.1))
    (((p32 - targets[rank][0]) ** 2).sum() + ((p64 - targets[rank][1]) ** 2).sum()).backward()
    opt.step()
    local = []
    for r in range(world):  # every rank's local step, as it takes it
        q32, q64 = torch.nn.Parameter(start[0].clone()), torch.nn.Parameter(start[1].clone())
        (((q32 - targets[r][0]) ** 2).sum() + ((q64 - targets[r][1]) ** 2).sum()).backward()
        torch.optim.SGD([q32, q64], lr=0.1).step()
        local.append([q32.detach(), q64.detach()])
    check_deltas([p32, p64], start, local, combine_with_bound)
    return to_bytes([p32.detach(), p64.detach()])


def test_delta_mode_with_parameters_of_two_dtypes():
    results = distributed.run(2, mixed_dtype_body)
    assert results[0] == results[1]


def anchor_body(rank, world):
    """Delta mode takes the next round's starting weights from the combination's own pass (no copy at the round's
    start) while the parameters stay as it left them; a change between steps by a torch op (its version counter),
    or through ``.data`` followed by `resync_anchor`, becomes the starting point. Against the reference Adasum of
    the ranks' SGD steps from the changed weights, recomputed here (`check_deltas`)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(9))
    targets = [torch.randn(9, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    opt = adasum.DistributedOptimizer(torch.optim.SGD([w], lr=0.1))

    def step_and_check():
        x0 = w.detach().clone()
        opt.zero_grad()
        ((w - targets[rank]) ** 2).sum().backward()
        opt.step()
        local = []
        for r in range(world):  # every rank's local step from x0
            q = torch.nn.Parameter(x0.clone())
            ((q - targets[r]) ** 2).sum().backward()
            torch.optim.SGD([q], lr=0.1).step()
            local.append([q.detach()])
        check_deltas([w], [x0], local, combine_with_bound)
        return to_bytes([w.detach()])

    seen = [step_and_check()]
    seen.append(step_and_check())  # nothing changed: the round starts from the anchor the combination wrote
    with torch.no_grad():
        w.mul_(0.5)  # a torch op: counted
    seen.append(step_and_check())
    w.data.add_(1.0)  # through .data: not counted, so say it
    opt.resync_anchor()
    seen.append(step_and_check())
    return seen


def test_delta_mode_anchor_follows_changes_between_steps():
    results = distributed.run(2, anchor_body)
    assert results[0] == results[1]


def test_the_delta_combiners_anchor_is_current_after_a_combination_until_a_parameter_changes():
    """The combination writes the parameters and the next round's anchor in one pass (`DeltaCombiner.combine`,
    ``advance``): the anchor then holds the parameters and `current` says so, so the next round copies nothing;
    an in-place torch op on a parameter (its version counter) makes it stale, and so does `forget` (a change
    torch does not count)."""
    from adasum.integrations.delta import DeltaCombiner

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        w = torch.nn.Parameter(torch.randn(9, generator=torch.Generator().manual_seed(0)))
        combiner = DeltaCombiner(adasum.get_reducer("adasum"), None, bucket_cap_bytes=25 << 20)
        with torch.no_grad():  # as the wrappers' steps run it
            combiner.save([w])
            assert not combiner.current([w])  # a copy, not a combination's pass
            w.add_(1.0)  # a local step
            combiner.combine([w])
            assert combiner.current([w]) and combiner.anchor is not None
            assert torch.equal(combiner.anchor[0], w.detach())
            w.mul_(0.5)  # a torch op: counted
            assert not combiner.current([w])
            combiner.save([w])
            combiner.combine([w])
            assert combiner.current([w])
        combiner.forget()  # after a change through .data (`DistributedOptimizer.resync_anchor`)
        assert not combiner.current([w])
    finally:
        dist.destroy_process_group()


def test_delta_mode_follows_parameters_converted_after_wrapping():
    """``model.double()`` after wrapping keeps the parameters' identity and changes their dtype: the round's
    starting weights follow (at a round's start, and in the middle of a round of local steps), so a float64
    model steps in float64; they were kept in float32, which rounded every combined parameter to float32."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for local_steps, convert_after in ((1, 1), (2, 1), (2, 2)):
            model = make_model()
            plain = copy.deepcopy(model)
            opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=local_steps)
            reference = torch.optim.SGD(plain.parameters(), lr=0.1)
            for step in range(4):
                if step == convert_after:
                    model.double()
                    plain.double()
                    with torch.no_grad():  # from the same weights; below float32's resolution: lost if rounded to it
                        for p, q in zip(model.parameters(), plain.parameters()):
                            p.add_(1e-12)
                            q.copy_(p)
                x = batch(0, step)[0].to(next(model.parameters()).dtype)
                for m, o in ((model, opt), (plain, reference)):
                    o.zero_grad()
                    m(x).pow(2).mean().backward()
                    o.step()
            for p, q in zip(model.parameters(), plain.parameters()):
                assert p.dtype == torch.float64
                assert (p - q).abs().max() < 1e-14, (local_steps, convert_after)
    finally:
        dist.destroy_process_group()


def test_load_state_dict_of_another_reducer_changes_nothing():
    """A state whose reducer state does not fit this wrapper's reducer raises the reducer's ValueError before the
    wrapped optimizer's state or the counters are replaced (they were, and then the reducer refused)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = make_model()
        saver = adasum.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), reducer=adasum.AdaCons(momentum=0.9),
            backward_passes_per_step=2,
        )
        for _ in range(3):
            backward(model, 0, 0)
            saver.step()
        state = saver.state_dict()
        assert state["passes"] == 1
        for reducer in ("adasum", adasum.AdaCons(momentum=0.5)):
            opt = adasum.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), reducer=reducer, backward_passes_per_step=2
            )
            before = copy.deepcopy(opt.state_dict())
            with pytest.raises(ValueError, match=r"load_state_dict: the state (is not this reducer's|has momentum)"):
                opt.load_state_dict(state)
            assert opt.state_dict() == before and opt.param_groups[0]["lr"] == 0.1 and not opt.state
    finally:
        dist.destroy_process_group()
