"""Issue 12, items 2, 3, 11 in the training wrappers: `DistributedOptimizer.add_param_group` checks
the added parameters across ranks as construction does; `SlowMo(buffers="average")` matches the
base optimizer's state by parameter and key and refuses differing state on every rank; sparse
gradients are refused clearly on every rank. Every case: the same error on every rank, at once."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import adasum

import distributed

FAST_S = 3.0


def _timed(out: dict, key: str, call) -> None:
    start = time.monotonic()
    try:
        call()
        out[key] = None
    except (ValueError, TypeError) as error:
        out[key] = (type(error).__name__, str(error))
    assert time.monotonic() - start < FAST_S, (key, time.monotonic() - start)


def _bits(tensors) -> bytes:
    return b"".join(t.detach().reshape(-1).numpy().tobytes() for t in tensors)


def add_group_body(rank, world, mode):
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    body, head = nn.Linear(4, 3), nn.Linear(3, 2)
    torch.manual_seed(rank)  # a differently initialised second head on every rank
    other = nn.Linear(3, 2)
    opt = adasum.DistributedOptimizer(
        torch.optim.SGD(body.named_parameters(), lr=0.1), reducer="mean", mode=mode, group=group
    )
    out: dict = {}
    _timed(out, "differing", lambda: opt.add_param_group({"params": list(other.named_parameters())}))
    out["groups after refusal"] = len(opt.param_groups)
    _timed(out, "same", lambda: opt.add_param_group({"params": list(head.named_parameters())}))
    out["groups"] = len(opt.param_groups)
    x = torch.full((5, 4), float(rank + 1))
    for _ in range(2):
        head(body(x)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    out["after"] = _bits([*body.parameters(), *head.parameters()])
    return out


def test_add_param_group_checks_the_added_parameters():
    for mode in ("gradient", "delta"):
        results = distributed.run(2, add_group_body, mode, timeout_s=60)
        distributed.assert_ranks_agree(results)
        r = results[0]
        assert r["differing"][0] == "ValueError", r
        assert r["differing"][1].startswith("adasum.DistributedOptimizer.add_param_group: parameter 'weight'"), r
        assert "differs across ranks" in r["differing"][1]
        assert r["groups after refusal"] == 1 and r["same"] is None and r["groups"] == 2


def average_state_body(rank, world):
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    out: dict = {}

    def run(branch_of_rank, out=None):
        opt = torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9)
        slow = adasum.SlowMo(opt, local_steps=1, buffers="average", group=group)
        x = torch.full((2, 3), float(rank + 1))
        model[branch_of_rank(rank)](x).sum().backward()
        if out is None:
            slow.step()
        else:  # time the failing sync alone (the group's first collectives set up its connections)
            _timed(out, "different branches", slow.step)
        slow.zero_grad()
        return opt

    # ranks train different branches: their momentum belongs to different parameters
    run(lambda r: "a" if r == 0 else "b", out)
    # the same branch: momentum averaged parameter by parameter
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    opt = run(lambda r: "b")
    buffers = [opt.state[p]["momentum_buffer"] for p in model["b"].parameters()]
    assert all(p not in opt.state for p in model["a"].parameters())
    # the gradient of b.weight on rank r is (r + 1) * 2 per entry: the mean over ranks
    expected = sum((r + 1) * 2.0 for r in range(world)) / world
    assert torch.equal(buffers[0], torch.full((3, 3), expected)), buffers[0]
    out["averaged"] = _bits(buffers)
    return out


def test_slowmo_average_matches_state_by_parameter():
    results = distributed.run(2, average_state_body, timeout_s=60)
    distributed.assert_ranks_agree(results)
    kind, message = results[0]["different branches"]
    assert kind == "ValueError" and message.startswith("adasum.SlowMo: optimizer state entries differ across ranks")
    assert "rank 0 has parameter 0 ('a.weight') momentum_buffer float32 [3, 3]" in message, message
    assert "rank 1 has parameter 2 ('b.weight') momentum_buffer" in message, message


def sparse_body(rank, world):
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=rank == 1)  # sparse gradients on rank 1 only
    out: dict = {}
    opt = adasum.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), mode="gradient", group=group)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    _timed(out, "gradient mode", opt.step)
    # delta mode combines parameter deltas (dense): sparse gradients work, the non-finite check too
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = adasum.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=0.1), mode="delta", group=group, nonfinite="raise"
    )
    emb(torch.tensor([1, 2, rank + 3])).sum().backward()
    _timed(out, "delta mode", opt.step)
    out["delta"] = _bits(emb.parameters())
    return out


def test_sparse_gradients_are_refused_on_every_rank():
    results = distributed.run(2, sparse_body, timeout_s=60)
    distributed.assert_ranks_agree(results)
    kind, message = results[0]["gradient mode"]
    assert kind == "TypeError", message
    assert message.startswith("adasum.DistributedOptimizer.step: on rank 1, the gradient of parameter 0 is sparse")
    assert results[0]["delta mode"] is None


def module_buffers_body(rank, world):
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    if rank == 1:
        model.register_buffer("extra", torch.zeros(2))  # a buffer rank 0 does not have
    try:
        adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=2, module=model, group=group)
        return None
    except ValueError as error:
        return str(error)


def test_slowmo_checks_module_buffers_at_construction():
    results = distributed.run(2, module_buffers_body, timeout_s=60)
    distributed.assert_ranks_agree(results)
    assert results[0] is not None, results
    assert results[0].startswith("adasum.SlowMo: module buffers differ across ranks"), results


def one_rank_adds_body(rank, world, mode):
    torch.manual_seed(0)  # the default group (its timeout: 3 s), whose checks run on their own group
    body, head = nn.Linear(4, 3), nn.Linear(3, 2)
    opt = adasum.DistributedOptimizer(torch.optim.SGD(body.named_parameters(), lr=0.1), reducer="mean", mode=mode)
    body(torch.ones(5, 4)).sum().backward()
    opt.step()  # one good step on every rank (the gradient layout is agreed on here)
    opt.zero_grad()
    start = time.monotonic()
    try:
        if rank == 0:  # rank 0 alone adds a parameter group; rank 1 goes on to its next step
            opt.add_param_group({"params": list(head.named_parameters())})
        else:
            body(torch.ones(5, 4)).sum().backward()
            opt.step()
        return None
    except Exception as error:  # what each rank sees: an error, not a signal death
        return type(error).__name__, str(error), time.monotonic() - start


def test_one_rank_adding_a_param_group_fails_on_every_rank_without_a_signal():
    """The check of the added group runs on the checks' own group (`control_group`), so it cannot
    pair with the peer's gradient all-reduce (which aborted the process inside gloo, SIGABRT): both
    ranks fail within the group's timeout instead."""
    for mode in ("gradient", "delta"):
        results = distributed.run(2, one_rank_adds_body, mode, timeout_s=3)
        for rank, r in enumerate(results):
            assert r is not None, (mode, rank, "no error")
            name, message, elapsed = r
            assert name in ("ValueError", "CollectiveError"), (mode, rank, r)
            assert elapsed < 3 * 3.0, (mode, rank, r)
