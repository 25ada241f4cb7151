"""The one-rank warning of the entry points (`adasum.transport.alone`): `adasum.all_reduce`, `DistributedOptimizer`,
`SlowMo` and the DDP hook's state on a process group of one rank warn once per group, at the user's line; the
framework glue's own warning is the only one under it, and a sequential run of the experiment harness says
nothing."""

import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import adasum
from adasum.ddp import AdasumState, adasum_hook

ONE_RANK = "the process group has one rank, so there is nothing to combine"


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ours(caught) -> list:
    return [w for w in caught if ONE_RANK in str(w.message)]


def test_all_reduce_warns_once_per_group_at_the_callers_line(one_rank):
    with pytest.warns(UserWarning, match=f"^adasum.all_reduce: {ONE_RANK}") as caught:
        for _ in range(3):
            adasum.all_reduce([torch.ones(3)])
        adasum.all_reduce_async([torch.ones(2)])
    assert [w.filename for w in _ours(caught)] == [__file__]
    pair = dist.new_group([0])  # another group of one rank: its own warning
    with pytest.warns(UserWarning, match=f"^adasum.all_reduce_async: {ONE_RANK}") as caught:
        adasum.all_reduce_async([torch.ones(2)], group=pair)
    assert [w.filename for w in _ours(caught)] == [__file__]


def test_the_distributed_optimizer_warns_at_construction(one_rank):
    model = torch.nn.Linear(2, 1)
    with pytest.warns(UserWarning, match=f"^adasum.DistributedOptimizer: {ONE_RANK}") as caught:
        opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert [w.filename for w in _ours(caught)] == [__file__]


def test_slowmo_warns_at_construction(one_rank):
    model = torch.nn.Linear(2, 1)
    with pytest.warns(UserWarning, match=f"^adasum.SlowMo: {ONE_RANK}") as caught:
        adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=2)
    assert [w.filename for w in _ours(caught)] == [__file__]


def test_the_hook_state_warns_at_construction_or_at_the_first_bucket(one_rank):
    with pytest.warns(UserWarning, match=f"^adasum.ddp.AdasumState: {ONE_RANK}") as caught:
        state = AdasumState()
    assert [w.filename for w in _ours(caught)] == [__file__]
    unpickled = pickle.loads(pickle.dumps(state))  # as a state made before init_process_group: checked at the hook
    adasum.release()  # the group's warning is forgotten with what adasum kept for it
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    model.register_comm_hook(unpickled, adasum_hook)
    with pytest.warns(UserWarning, match=f"^adasum_hook: {ONE_RANK}") as caught:
        model(torch.ones(4, 3)).sum().backward()
    assert [w.filename for w in _ours(caught)] == [__file__]  # the user's backward(), through torch's frames


def test_a_sequential_run_of_the_harness_says_nothing(one_rank):
    from adasum.experiments.runner import DistributedWorker, RunConfig, make_optimizer

    net = torch.nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = DistributedWorker(net, make_optimizer(RunConfig(), lr=0.1), adasum.get_reducer("adasum"))
        worker.step(torch.ones(1, 4, 2), torch.zeros(1, 4, dtype=torch.int64))
    assert _ours(caught) == [], [str(w.message) for w in caught]
