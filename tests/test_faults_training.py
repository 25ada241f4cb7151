"""Faults inside a training step (gloo): a NaN or Inf on one rank under the nonfinite policies of
DistributedOptimizer, SlowMo and the DDP hook; a dead or stalled peer in DistributedOptimizer.step()
and in a DDP-hooked backward; bad input (parameters differing across ranks, a hook registered twice).
Several checks share each spawned group."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import adasum
from adasum.ddp import AdasumState, adasum_hook

import distributed

TIMEOUT_S = 3
NO_HANG_S = TIMEOUT_S + 20  # a bound on hanging, not a speed check


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _backward(model: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> bytes:
    """Parameters and every optimizer state tensor, as bytes (bitwise comparison)."""
    parts = [p.detach().reshape(-1).clone() for p in model.parameters()]
    for p in model.parameters():
        for name in sorted(opt.state.get(p, {})):
            value = opt.state[p][name]
            if isinstance(value, torch.Tensor):
                parts.append(value.detach().reshape(-1).double().clone())
    return b"".join(t.double().numpy().tobytes() for t in parts)


def nonfinite_body(rank, world, victim, bad):
    out = {}
    value = float(bad)
    for mode in ("gradient", "delta"):
        for policy in ("raise", "skip"):
            model = _model()
            base = torch.optim.Adam(model.named_parameters(), lr=0.01)  # names reach the message
            opt = adasum.DistributedOptimizer(base, reducer="adasum", mode=mode, nonfinite=policy)
            _backward(model, rank, 0)
            opt.step()
            opt.zero_grad()
            before = _snapshot(model, opt)
            _backward(model, rank, 1)
            if rank == victim:
                model[2].weight.grad[1, 2] = value
                model[0].bias.grad[0] = value  # index 1: the first non-finite tensor in order
            key = f"{mode}-{policy}"
            try:
                opt.step()
                out[key] = {"raised": None}
            except adasum.NonFiniteError as error:
                out[key] = {"raised": str(error), "found": (error.found.index, error.found.rank, error.found.kind)}
            out[key]["unchanged"] = _snapshot(model, opt) == before
            out[key]["skipped"] = opt.skipped_steps
            opt.zero_grad()
            _backward(model, rank, 2)  # a clean step afterwards goes through
            opt.step()
            # delta mode: the optimizer state is local to each rank; the parameters agree
            out[key]["after"] = (
                _snapshot(model, opt) if mode == "gradient" else _snapshot(model, torch.optim.SGD([torch.zeros(1)]))
            )
            out[key]["state_step"] = float(base.state[next(model.parameters())]["step"])
    # SlowMo: a rank's local model turns non-finite during a round
    for policy in ("raise", "skip"):
        model = _model()
        slow = adasum.SlowMo(
            torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9),
            local_steps=2,
            slow_momentum=0.5,
            reducer="adasum",
            nonfinite=policy,
        )
        for step in range(2):  # one clean round
            _backward(model, rank, step)
            slow.step()
            slow.zero_grad()
        saved = slow.state_dict()  # references to its anchor and slow momentum: copied here
        anchor = [a.clone() for a in saved["anchor"]]
        momentum = [m.clone() for m in saved["momentum"]]
        _backward(model, rank, 3)
        slow.step()
        slow.zero_grad()
        _backward(model, rank, 4)
        if rank == victim:  # after the backward: only this parameter is non-finite at the sync
            with torch.no_grad():
                model[2].bias[1] = value
        key = f"slowmo-{policy}"
        try:
            slow.step()  # the sync
            out[key] = {"raised": None}
        except adasum.NonFiniteError as error:
            out[key] = {"raised": str(error)}
        out[key]["skipped"] = slow.skipped_steps
        if policy == "skip":
            out[key]["at_anchor"] = all(torch.equal(p, a) for p, a in zip(model.parameters(), anchor))
            out[key]["momentum_kept"] = all(torch.equal(m, n) for m, n in zip(slow.state_dict()["momentum"], momentum))
            out[key]["params"] = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    # DDP hook with nonfinite="raise": backward raises on every rank
    model = _model()
    ddp = DDP(model)
    ddp.register_comm_hook(AdasumState(nonfinite="raise", named_parameters=ddp.named_parameters()), adasum_hook)
    if rank == victim:
        model[2].weight.register_hook(lambda g: g * value)
    try:
        _backward(ddp, rank, 0)
        out["ddp"] = None
    except Exception as error:  # any error: what the user sees from backward
        out["ddp"] = f"{type(error).__name__}: {error}"
    return out


@pytest.mark.parametrize("world,bad", [(2, "nan"), (3, "inf")])
def test_nonfinite_policies_in_training_steps(world, bad):
    victim = world - 1
    kind = "NaN" if bad == "nan" else "Inf"
    results = distributed.run(world, nonfinite_body, victim, bad)
    for mode in ("gradient", "delta"):
        raised = [r[f"{mode}-raise"] for r in results]
        for r in raised:  # every rank raises, naming the first non-finite parameter and the rank
            assert r["found"] == (1, victim, kind), r
            assert f"the gradient of parameter 1 ('0.bias') has {kind} on rank {victim}" in r["raised"], r["raised"]
            assert r["raised"].startswith("adasum.DistributedOptimizer.step:") and "\n" not in r["raised"]
            assert r["unchanged"] and r["skipped"] == 0
        skipped = [r[f"{mode}-skip"] for r in results]
        for r in skipped:
            assert r["raised"] is None and r["unchanged"] and r["skipped"] == 1, r
            assert r["state_step"] == 2.0  # Adam's step counter: the skipped step never reached it
        # bitwise identical on every rank, after the skip and after the next clean step
        assert len({r["after"] for r in skipped}) == 1
        assert len({r["after"] for r in raised}) == 1
    for r in results:
        assert r["slowmo-raise"]["raised"].startswith("adasum.SlowMo.sync: parameter 3 ('2.bias') has"), r
        assert f"has {kind} on rank {victim}" in r["slowmo-raise"]["raised"]
        skip = r["slowmo-skip"]
        assert skip["raised"] is None and skip["skipped"] == 1 and skip["at_anchor"] and skip["momentum_kept"]
        assert "adasum_hook: the gradient (bucket 0) of parameter" in r["ddp"], r["ddp"]
        assert "('module.2.weight')" in r["ddp"], r["ddp"]
        assert f"has NaN on rank {victim}" in r["ddp"] or f"has {kind} on rank {victim}" in r["ddp"]
    assert len({r["slowmo-skip"]["params"] for r in results}) == 1


def bad_input_body(rank, world):
    out = {}
    model = _model(seed=rank if rank == 1 else 0)  # rank 1 differs
    try:
        adasum.SlowMo(torch.optim.SGD(model.named_parameters(), lr=0.1), local_steps=2)
        out["slowmo"] = None
    except ValueError as error:
        out["slowmo"] = str(error)
    ddp = DDP(_model())
    ddp.register_comm_hook(AdasumState(), adasum_hook)
    try:
        ddp.register_comm_hook(AdasumState(), adasum_hook)
        out["twice"] = None
    except RuntimeError as error:
        out["twice"] = str(error)
    try:
        AdasumState(nonfinite="skip")
        out["hook_skip"] = None
    except ValueError as error:
        out["hook_skip"] = str(error)
    return out


def test_bad_input_in_training_wrappers():
    for r in distributed.run(2, bad_input_body):
        assert r["slowmo"] is not None and r["slowmo"].startswith("adasum.SlowMo: parameter '0.weight'"), r
        assert "differs across ranks" in r["slowmo"]
        # torch refuses a second hook itself, with a clear message
        assert r["twice"] is not None and "can only be called once" in r["twice"], r["twice"]
        assert "not available in a DDP hook" in r["hook_skip"]


def fault_body(rank, world, victim, action, where):
    dist.barrier()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    dist.barrier(group=group)
    model = _model()
    if where == "optimizer":
        opt = adasum.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), group=group, mode="delta", nonfinite="raise"
        )
        _backward(model, rank, 0)
    else:
        ddp = DDP(model, process_group=group)
        ddp.register_comm_hook(AdasumState(group), adasum_hook)
    if rank == victim:
        if action == "exit":
            os._exit(17)
        time.sleep(TIMEOUT_S + 4)
    start = time.monotonic()
    try:
        if where == "optimizer":
            opt.step()
        else:
            _backward(ddp, rank, 0)
    except Exception as error:  # noqa: BLE001
        return {
            "error": type(error).__name__,
            "message": str(error),
            "seconds": time.monotonic() - start,
            "collective": isinstance(error, adasum.CollectiveError),
        }
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("where,world,action", [("optimizer", 3, "exit"), ("ddp", 2, "stall")])
def test_dead_or_stalled_peer_in_a_training_step(where, world, action):
    victim = 1
    results = distributed.run(world, fault_body, victim, action, where, allow_exit=True)
    if action == "exit":
        assert results[victim] == distributed.Exited(17)
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert r["error"] is not None, r
        assert r["seconds"] < NO_HANG_S, r
        assert f"on rank {rank} of {world}" in r["message"] and f"group timeout {TIMEOUT_S} s" in r["message"], r
        if where == "optimizer":
            # the first collective of the step is the non-finite check (the test passes nonfinite="raise")
            assert r["collective"] and r["message"].startswith("adasum.find_nonfinite"), r
        else:
            # DDP passes the hook's exception up through backward: the combination's, or the per-call check's when
            # the stall is met there first (the hook checks each new batch of buckets across ranks)
            named = "adasum.all_reduce" in r["message"] or r["message"].startswith("adasum_hook on rank")
            assert named and "CollectiveError" in r["error"] + r["message"], r


def _typed_backward(model: nn.Module, rank: int, step: int) -> None:
    """`_backward` in the model's own dtype (a model converted on one rank takes its inputs in its dtype)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    dtype = next(model.parameters()).dtype
    x, y = torch.randn(6, 5, generator=g).to(dtype), torch.randint(0, 3, (6,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()


def converted_on_one_rank_body(rank, world):
    """Each wrapper takes a step, then the last rank converts its model to float64 and the ranks step again:
    the same ValueError on every rank (before: gloo aborted the peer on a buffer of another size)."""
    out = {}
    makers = {
        "gradient": lambda m: adasum.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), mode="gradient"),
        "delta": lambda m: adasum.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01), mode="delta"),
        "delta-rounds": lambda m: adasum.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), local_steps=2),
        "slowmo": lambda m: adasum.SlowMo(torch.optim.SGD(m.parameters(), lr=0.1), local_steps=1, reducer="adasum"),
    }
    for name, make in makers.items():
        model = _model()
        opt = make(model)
        for step in range(2):
            _typed_backward(model, rank, step)
            opt.step()
            opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        if rank == world - 1:
            model.double()
        _typed_backward(model, rank, 2)
        with pytest.raises(ValueError) as caught:
            opt.step()
            if name == "delta-rounds":  # the round's first step is local; its second combines
                opt.zero_grad()
                _typed_backward(model, rank, 3)
                opt.step()
        message = str(caught.value)
        assert "\n" not in message and "rank" in message, message
        if name in ("gradient", "delta"):  # nothing changed (the check comes before the step; SlowMo's base step
            # and the first local step of a round are local, before the combination's check)
            assert all(torch.equal(p.detach().to(b.dtype), b) for p, b in zip(model.parameters(), before)), name
        out[name] = message
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_model_converted_on_one_rank_is_the_same_error_on_every_rank(world):
    results = distributed.run(world, converted_on_one_rank_body)
    distributed.assert_ranks_agree(results)
    assert "parameter" in results[0]["delta"] and "float64" in results[0]["delta"], results[0]["delta"]
    assert "float64" in results[0]["gradient"], results[0]["gradient"]


def test_a_delta_mode_state_is_refused_by_gradient_mode():
    """Delta mode's optimizer state is per rank: loaded into gradient mode (which assumes it equal) it would step
    the ranks apart, so it is refused, naming the fix; a gradient-mode state loads into delta mode."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        states = {}
        for mode in ("delta", "gradient"):
            model = _model()
            opt = adasum.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), mode=mode)
            _backward(model, 0, 0)
            opt.step()
            states[mode] = opt.state_dict()
            assert states[mode]["mode"] == mode
        gradient = adasum.DistributedOptimizer(torch.optim.Adam(_model().parameters(), lr=0.01), mode="gradient")
        before = gradient.state_dict()
        with pytest.raises(ValueError, match=r"mode='delta'.*broadcast_optimizer_state"):
            gradient.load_state_dict(states["delta"])
        assert gradient.state_dict()["optimizer"]["state"] == before["optimizer"]["state"]  # nothing changed
        delta = adasum.DistributedOptimizer(torch.optim.Adam(_model().parameters(), lr=0.01), mode="delta")
        delta.load_state_dict(states["gradient"])
        old = {k: v for k, v in states["delta"].items() if k != "mode"}  # saved before the mode was recorded
        gradient.load_state_dict(old)
    finally:
        dist.destroy_process_group()
