"""The public constructors take only their documented keyword names: the old spellings are gone; Horovod's and
torch's own spellings (``op=``, ``process_group=``) work, and a misspelt name gets a suggestion."""

import pytest
import torch
import torch.distributed as dist

import adasum
from adasum.ddp import AdasumState


def make_sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


@pytest.mark.parametrize(
    "build",
    [
        lambda: adasum.DistributedOptimizer(make_sgd(), reduce="mean"),
        lambda: adasum.SlowMo(make_sgd(), sync_every=2),
        lambda: adasum.SlowMo(make_sgd()),
    ],
    ids=["optimizer-reduce", "slowmo-sync-every", "slowmo-no-local-steps"],
)
def test_old_keyword_is_a_type_error(build):
    with pytest.raises(TypeError):
        build()


@pytest.mark.parametrize("old", ["gradients", "deltas"])
def test_simulator_takes_only_the_singular_combine(old):
    with pytest.raises(ValueError, match="combine must be one of"):
        adasum.SimulatedWorkers(torch.nn.Linear(2, 1), 2, lambda p: torch.optim.SGD(p, lr=0.1), combine=old)


def test_slowmo_has_no_old_attribute_names():
    opt = adasum.SlowMo(make_sgd(), local_steps=2)
    assert opt.local_steps == 2 and opt.skipped_steps == 0
    assert not hasattr(opt, "sync_every") and not hasattr(opt, "skipped_syncs")


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "op, name", [("Adasum", "Adasum"), ("Average", "Mean"), ("sum", "Sum"), ("adacons", "AdaCons"), (None, "Adasum")]
)
def test_optimizer_takes_horovods_op(one_rank, op, name):
    opt = adasum.DistributedOptimizer(make_sgd(), op=op)
    assert type(opt.reducer).__name__ == name


def test_optimizer_refuses_an_op_without_a_reducer(one_rank):
    with pytest.raises(ValueError, match=r"op=5 has no reducer; pass reducer='adasum', 'mean' or 'sum'"):
        adasum.DistributedOptimizer(make_sgd(), op=5)  # Horovod's Max
    with pytest.raises(ValueError, match=r"pass reducer= or Horovod's op=, not both"):
        adasum.DistributedOptimizer(make_sgd(), reducer="mean", op="Sum")
    with pytest.raises(ValueError, match=r"unknown reducer 'Min'"):
        adasum.DistributedOptimizer(make_sgd(), op="Min")


def test_optimizer_without_a_process_group_says_how_to_start_one():
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group\('nccl'\) \(or 'gloo'"):
        adasum.DistributedOptimizer(make_sgd())
    with pytest.raises(RuntimeError, match=r"adasum.all_reduce needs torch.distributed to be initialised: call"):
        adasum.all_reduce(torch.ones(2))


def test_state_takes_torchs_process_group(one_rank):
    group = dist.new_group([0])
    assert AdasumState(process_group=group).group is group
    assert AdasumState(process_group=group).process_group is group
    with pytest.raises(ValueError, match=r"pass group= or torch's process_group=, not both"):
        AdasumState(group, process_group=group)


@pytest.mark.parametrize("typo, suggestion", [("AdaSum", "adasum"), ("adacon", "adacons"), ("Mean", "mean")])
def test_misspelt_reducer_gets_a_suggestion(typo, suggestion):
    with pytest.raises(ValueError, match=rf"unknown reducer '{typo}' \(did you mean '{suggestion}'\?\)"):
        adasum.get_reducer(typo)


def test_dir_shows_only_public_names():
    names = dir(adasum)
    assert not {"importlib", "ModuleType", "ON_ACCESS", "_importlib"} & set(names)
    assert set(adasum.__all__) <= set(names) and {"fsdp", "jax", "lightning", "loggers"} <= set(names)


def test_optimizer_takes_horovods_own_constants(one_rank, monkeypatch):
    import sys
    import types

    hvd = types.SimpleNamespace(Average=object(), Sum=object(), Adasum=object(), Min=object())
    monkeypatch.setitem(sys.modules, "horovod.torch", hvd)  # as after `import horovod.torch as hvd`
    names = {k: type(adasum.DistributedOptimizer(make_sgd(), op=getattr(hvd, k)).reducer).__name__
             for k in ("Average", "Sum", "Adasum")}
    assert names == {"Average": "Mean", "Sum": "Sum", "Adasum": "Adasum"}
    with pytest.raises(ValueError, match=r"has no reducer; pass reducer='adasum', 'mean' or 'sum'"):
        adasum.DistributedOptimizer(make_sgd(), op=hvd.Min)
