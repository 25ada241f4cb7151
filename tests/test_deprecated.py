"""Issue 11 "one name per concept": the new names work, and each old public name still works for
one release with a DeprecationWarning that names the new one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import adasum
from adasum.ddp import AdasumState
from adasum.sim import SimulatedWorkers

import distributed


def deprecated_body(rank, world):
    model = nn.Linear(3, 2)
    with pytest.warns(DeprecationWarning, match="reduce= is deprecated, use reducer="):
        opt = adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reduce="mean")
    assert isinstance(opt.reducer, adasum.reducers.Mean)
    with pytest.raises(TypeError, match="pass reducer= only"):
        with pytest.warns(DeprecationWarning):
            adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reduce="mean", reducer="sum")
    assert isinstance(
        adasum.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reducer="sum").reducer,
        adasum.reducers.Sum,
    )
    with pytest.warns(DeprecationWarning, match="process_group= is deprecated, use group="):
        state = AdasumState(process_group=None)
    assert state.group is None and state.process_group is None
    with pytest.warns(DeprecationWarning, match="sync_every= is deprecated, use local_steps="):
        slow = adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=3)
    assert slow.local_steps == 3
    with pytest.warns(DeprecationWarning, match="skipped_syncs is deprecated"):
        assert slow.skipped_syncs == 0
    with pytest.warns(DeprecationWarning, match="sync_every is deprecated"):
        assert slow.sync_every == 3
    with pytest.raises(TypeError, match="needs local_steps"):
        adasum.SlowMo(torch.optim.SGD(model.parameters(), lr=0.1))
    # the state of an older SlowMo (skipped_syncs) loads into skipped_steps
    saved = slow.state_dict()
    saved["skipped_syncs"] = saved.pop("skipped_steps") + 4
    slow.load_state_dict(saved)
    assert slow.skipped_steps == 4
    return True


def test_deprecated_keywords_warn_and_work():
    assert distributed.run(1, deprecated_body) == [True]


def test_simulated_workers_combine_names():
    model = nn.Sequential(nn.Linear(3, 2))
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    for old, new in (("gradients", "gradient"), ("deltas", "delta")):
        with pytest.warns(DeprecationWarning, match=f"combine='{old}' is deprecated, use '{new}'"):
            assert SimulatedWorkers(model, 2, sgd, combine=old).combine == new
        assert SimulatedWorkers(model, 2, sgd, combine=new).combine == new


def test_reducer_traits_are_on_the_class():
    from adasum.reducers import AdaCons, Adasum, Mean, Sum

    assert Sum.per_tensor and Mean.per_tensor and not Sum.exact_average and Mean.exact_average
    assert Adasum().per_tensor and not Adasum(per_tensor=False).per_tensor and not Adasum.exact_average
    assert not AdaCons().per_tensor and AdaCons(per_tensor=True).per_tensor and not AdaCons.exact_average
    assert not hasattr(AdaCons, "reset")
    from adasum.reducers.base import check_workers

    assert check_workers([[torch.zeros(1)], [torch.zeros(1)]]) == 1
