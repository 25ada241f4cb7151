"""Elastic restarts of ``adasum train`` under torchrun: a job stopped in the middle of an epoch (and of a round of
local steps) on 3 ranks resumes from its checkpoint on 2, and a 2-rank one on 3. The resumed run equals, bitwise
on every rank, a fresh run at the new size written out here from that checkpoint with the library's classes:
rank 0's part on every rank (`DistributedOptimizer` / `SlowMo.load_state_dict` apply their resize rules), and the
epoch's permutation going on at the first whole global batch of the new size (`adasum.experiments.runner.
resized_position`, docs/faults.md). Every rank says in one line what did not survive the resize."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import adasum
from adasum.experiments.checkpoint import read_checkpoint
from adasum.experiments.data import load_task
from adasum.experiments.models import build_model
from adasum.experiments.runner import resized_position, worker_batches
from adasum.sim import cross_entropy
from test_cli import _ranks

import distributed

pytestmark = pytest.mark.extra("experiments")  # the CLI's tasks

STOP_AT = str(Path(__file__).parent / "stop_at.py")
SEED, BATCH, LIMIT, LR, MOMENTUM, H = 3, 4, 96, 0.01, 0.5, 4
ARGS = ["train", "--model", "mlp", "--epochs", "1", "--train-limit", str(LIMIT), "--batch-size", str(BATCH),
        "--checkpoint-every", "3", "--deterministic", "--resume", "--no-progress", "--quiet", "--seeds", str(SEED),
        "--timeout", "60"]  # --local-steps: the default, H


def fresh_run(rank, world, path, method, data, first_step):
    """The run at `world` ranks from the checkpoint at `path`, written out: every rank loads rank 0's part into the
    library's optimizer, then trains steps `first_step`... of the epoch's permutation cut for `world` ranks."""
    torch.use_deterministic_algorithms(True)  # as --deterministic
    saved = torch.load(path, weights_only=True)  # each rank its own copy (the optimizer keeps the tensors it loads)
    part = saved["ranks"][0]["engine"]
    train_x, train_y, shape, classes = data
    model = build_model("mlp", shape, classes)
    model.load_state_dict(part["model"])
    base = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if method == "diloco":
        opt = adasum.SlowMo(base, local_steps=H, reducer="mean", nonfinite="propagate",
                            outer_optimizer=adasum.diloco_outer(0.7, 0.9))
    else:
        opt = adasum.DistributedOptimizer(base, reducer="mean", mode="gradient", nonfinite="propagate")
    with pytest.warns(UserWarning, match=f"saved on {len(saved['ranks'])} ranks and loads on {world}"):
        opt.load_state_dict(part["optimizer"])
    order = worker_batches(len(train_x), world, BATCH, epoch=0, seed=SEED)
    for step in range(first_step, len(order)):
        idx = order[step, rank]
        opt.zero_grad(set_to_none=False)
        cross_entropy(model(train_x[idx]), train_y[idx]).backward()
        opt.step()
    return {k: v.numpy().tobytes() for k, v in model.state_dict().items()}  # bytes: the rank exits right after


@pytest.mark.parametrize("method,before,after,first_step", [
    ("mean", 3, 2, 5),  # stopped after step 4 (checkpoint at 3: 36 examples); at 2 x 4, step 5 starts at 40
    ("diloco", 2, 3, 2),  # checkpoint at step 3 of a round of 4 (24 examples): step 2 of 3 x 4; the round restarts
])
def test_train_resumes_on_another_world_size(tmp_path, method, before, after, first_step):
    out = tmp_path / "run"
    args = [*ARGS, "--method", method, "--out", str(out)]
    stopped = _ranks(args, world=before, program=[STOP_AT, "4"], timeout=300)
    assert [status for status, _ in stopped] == [3] * before, stopped[0][1][-2000:]
    saved = read_checkpoint(out / "checkpoint.pt")
    assert saved["step_in_epoch"] == 3 and len(saved["ranks"]) == before
    shutil.copy(out / "checkpoint.pt", tmp_path / "saved.pt")
    resumed = _ranks(args, world=after, timeout=300)
    for rank, (status, err) in enumerate(resumed):
        lines = err.strip().splitlines()
        assert status == 0 and len(lines) == 1, (rank, err[-2000:])
        assert lines[0].startswith(f"adasum train: {out / 'checkpoint.pt'} was written by {before} ranks and "
                                   f"resumes on {after}: every rank starts from rank 0's part"), lines[0]
        assert f"step {first_step} of {LIMIT // (after * BATCH)} at {after} ranks" in lines[0], lines[0]
        if method == "diloco":
            assert "the round in flight (3 of 4 steps) restarts from its start" in lines[0], lines[0]
    final = read_checkpoint(out / "checkpoint.pt")
    assert final["epoch"] == 1 and len(final["ranks"]) == after and final["config"]["workers"] == after
    task = load_task("digits").with_validation(0.1)
    data = (task.train_x[:LIMIT], task.train_y[:LIMIT], task.input_shape, task.classes)
    expected = distributed.run(after, fresh_run, str(tmp_path / "saved.pt"), method, data, first_step, timeout_s=240)
    for rank in range(after):
        model = final["ranks"][rank]["engine"]["model"]
        for key, value in expected[rank].items():
            assert model[key].numpy().tobytes() == value, (rank, key)
    if method == "mean":  # gradient mode: the ranks agree
        distributed.assert_ranks_agree(expected)


def test_resized_position():
    assert resized_position(3, 3, 2, 4, steps=12) == (5, 4)  # 36 examples taken; 40 = 5 x 8: 4 skipped
    assert resized_position(3, 2, 3, 4, steps=8) == (2, 0)
    assert resized_position(0, 3, 2, 4, steps=12) == (0, 0)  # at an epoch's start: nothing changes
    assert resized_position(7, 4, 1, 1, steps=20) == (20, 0)  # past the epoch's last step at the new size: it ends
