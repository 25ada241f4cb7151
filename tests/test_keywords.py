"""The public constructors take only their documented keyword names: the old spellings are gone."""

import pytest
import torch

import adasum
from adasum.ddp import AdasumState


def make_sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


@pytest.mark.parametrize(
    "build",
    [
        lambda: adasum.DistributedOptimizer(make_sgd(), reduce="mean"),
        lambda: AdasumState(process_group=None),
        lambda: adasum.SlowMo(make_sgd(), sync_every=2),
        lambda: adasum.SlowMo(make_sgd()),
    ],
    ids=["optimizer-reduce", "state-process-group", "slowmo-sync-every", "slowmo-no-local-steps"],
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
