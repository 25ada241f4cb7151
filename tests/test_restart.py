"""Restart without loss: ``adasum train`` under ``torchrun --max-restarts`` with a rank SIGKILLed in
the middle of an epoch resumes from the last (mid-epoch) checkpoint and ends bitwise equal to an
uninterrupted run; checkpoints are written atomically and a damaged or foreign file gives one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adasum.experiments import checkpoint as ckpt
from adasum.experiments.cli import main

pytestmark = pytest.mark.extra("experiments")  # the CLI's tasks, plots and statistics

SRC = str(Path(__file__).parent.parent / "src")
KILL_AT = Path(__file__).parent / "kill_at.py"
# 256 examples / (2 ranks x 8) = 16 steps per epoch, 32 in all; checkpoints every 5 steps
TRAIN = ["--epochs", "2", "--train-limit", "256", "--batch-size", "8", "--checkpoint-every", "5",
         "--deterministic", "--resume", "--no-progress", "--quiet", "--seeds", "3",
         "--timeout", "30"]


def _same(a, b) -> bool:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _torchrun(out: Path, method: str, kill: list[str], max_restarts: int) -> subprocess.CompletedProcess:
    """`kill`: [RANK, STEP, MARKER] of the kill point (tests/kill_at.py), or [] for none."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    program = [str(KILL_AT), *kill] if kill else ["-m", "adasum"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           f"--max-restarts={max_restarts}", "--monitor-interval", "0.2",
           *program, "train", "--method", method, "--out", str(out), *TRAIN]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("method", ["adacons"])  # gradient mode with reducer state (AdaCons momentum)
def test_torchrun_restart_after_sigkill_resumes_bitwise(tmp_path, method):
    straight = _torchrun(tmp_path / "straight", method, [], max_restarts=0)
    assert straight.returncode == 0, straight.stderr[-3000:]
    marker = tmp_path / "killed"
    # rank 1 kills itself after global step 23 (mid epoch 2; the last checkpoint is at step 20)
    killed = _torchrun(tmp_path / "killed-run", method, ["1", "23", str(marker)], max_restarts=3)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert marker.read_text() == "killed rank 1 after step 23\n"  # the first attempt did die there
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "killed-run" / "checkpoint.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 2 and len(b["ranks"]) == 2
    for rank in range(2):  # model, optimizer state, reducer state, step counter, RNG: every rank's
        sa, sb = a["ranks"][rank], b["ranks"][rank]
        for key, value in sa["engine"]["model"].items():
            assert torch.equal(value, sb["engine"]["model"][key]), (rank, key)
        # the DistributedOptimizer's state: the wrapped optimizer's, counters, the reducer's
        optimizer_a, optimizer_b = sa["engine"]["optimizer"], sb["engine"]["optimizer"]
        assert optimizer_a["optimizer"]["state"], "the wrapped optimizer has momentum state"
        assert _same(optimizer_a, optimizer_b), rank
        reducer_a, reducer_b = sa["engine"]["reducer"], sb["engine"]["reducer"]
        assert reducer_a.keys() == reducer_b.keys() and reducer_a, reducer_a
        assert _same(reducer_a, reducer_b)
        assert sa["engine"]["steps"] == sb["engine"]["steps"] == 32
        assert torch.equal(sa["rng"], sb["rng"])
    ra = json.loads((tmp_path / "straight" / "result.json").read_text())
    rb = json.loads((tmp_path / "killed-run" / "result.json").read_text())
    strip = lambda h: {k: v for k, v in h.items() if k != "wall_s"}  # noqa: E731
    assert [strip(h) for h in ra["history"]] == [strip(h) for h in rb["history"]]
    epochs = [json.loads(line)["epoch"] for line in (tmp_path / "killed-run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("kind") == "epoch"]
    assert epochs == [1, 2]


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    ckpt.save_atomic({"config": {}, "epoch": 1, "engine": {"w": torch.ones(3)}}, path)
    real_save = torch.save

    def torn_save(obj, f, *args, **kwargs):  # half a file, then the process "dies"
        f.write(b"PK\x03\x04 half written")  # into the temporary file of the one atomic writer
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_atomic({"config": {}, "epoch": 2, "engine": {"w": torch.zeros(3)}}, path)
    monkeypatch.setattr(torch, "save", real_save)
    state = ckpt.read_checkpoint(path)
    assert state["epoch"] == 1 and torch.equal(state["engine"]["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left


@pytest.mark.parametrize("content,message", [
    (b"PK\x03\x04 truncated zip", "is not a readable checkpoint"),
    (None, "is not an adasum training checkpoint"),  # a valid torch file, not ours
])
def test_damaged_or_foreign_checkpoint_is_one_line(tmp_path, capsys, content, message):
    out = tmp_path / "run"
    out.mkdir()
    if content is None:
        torch.save({"weights": torch.ones(2)}, out / "checkpoint.pt")
    else:
        (out / "checkpoint.pt").write_bytes(content)
    status = main(["train", "--method", "adasum", "--simulate", "2", "--epochs", "1", "--train-limit", "64",
                   "--batch-size", "8", "--out", str(out), "--resume", "--no-progress", "--quiet"])
    err = capsys.readouterr().err
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adasum: error:") and message in lines[0], err
    assert "checkpoint.pt" in lines[0] and "Traceback" not in err


def test_simulated_mid_epoch_resume_is_exact(tmp_path):
    """--checkpoint-every: a run stopped mid-epoch (the kill point, in-process) resumes exactly."""
    args = ["train", "--method", "adasum", "--simulate", "2", "--epochs", "1", "--train-limit", "128",
            "--batch-size", "8", "--checkpoint-every", "3", "--resume", "--no-progress", "--quiet",
            "--nonfinite", "skip"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    # stop after step 5 (checkpoint at 3): the resumed run replays steps 4 and 5
    def stop(rank, step):
        if step == 5:
            raise SystemExit(9)  # stops the run where the kill point would, without killing pytest

    with pytest.raises(SystemExit):
        main([*args, "--out", str(tmp_path / "b")], on_step=stop)
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["step_in_epoch"] == 3
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    for key, value in a["engine"]["model"].items():
        assert torch.equal(value, b["engine"]["model"][key]), key
    ra = json.loads((tmp_path / "a" / "result.json").read_text())
    rb = json.loads((tmp_path / "b" / "result.json").read_text())
    assert ra["skipped_steps"] == rb["skipped_steps"] == 0 and ra["history"][0]["skipped_steps"] == 0
    assert ra["test_accuracy"] == rb["test_accuracy"] and ra["train_loss"] == rb["train_loss"]


def test_an_interrupted_saves_temporary_file_is_removed_at_the_next_save(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".checkpoint.pt.tmp{int(dead.stdout)}"  # a kill during torch.save left it
    stale.write_bytes(b"PK\x03\x04 half written")
    other = tmp_path / ".result.json.tmp1"  # another file's temporary: not this writer's to remove
    other.write_text("{")
    ckpt.save_atomic({"config": {}, "epoch": 1, "engine": {}}, tmp_path / "checkpoint.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".result.json.tmp1", "checkpoint.pt"]


def _sim_args(out: Path, epochs: int) -> list[str]:
    return ["train", "--method", "adasum", "--simulate", "2", "--epochs", str(epochs), "--train-limit", "64",
            "--batch-size", "8", "--out", str(out), "--resume", "--no-progress", "--quiet"]


def test_a_torn_last_line_of_metrics_is_dropped_on_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_sim_args(out, 1)) == 0
    metrics = out / "metrics.jsonl"
    complete = metrics.read_text()
    with open(metrics, "a") as f:  # the process died in the middle of an append
        f.write('{"epoch": 2, "step": 5, "lo')
    capsys.readouterr()
    assert main(_sim_args(out, 2)) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "torn last line" in line]
    assert len(warned) == 1 and warned[0].startswith(f"{metrics}: dropped its torn last line 6"), warned
    text = metrics.read_text()
    assert text.startswith(complete) and '"lo\n' not in text
    assert [json.loads(line)["epoch"] for line in text.splitlines() if '"kind": "epoch"' in line] == [1, 2]
    # damage anywhere but the last line is not an interrupted append: one line naming file and line
    lines = text.splitlines()
    metrics.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    assert main(_sim_args(out, 3)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{metrics}: line 2 is not JSON" in err[0], err


def test_a_checkpoint_of_the_other_kind_is_refused_in_one_line_on_every_rank(tmp_path, capsys):
    """A simulated run's checkpoint resumed under torchrun, and a torchrun job's resumed simulated."""
    from test_cli import _ranks

    simulated = tmp_path / "simulated"
    assert main(_sim_args(simulated, 1)) == 0
    capsys.readouterr()
    real = ["train", "--method", "adasum", "--epochs", "1", "--train-limit", "64", "--batch-size", "8",
            "--resume", "--no-progress", "--quiet", "--timeout", "30"]
    for status, err in _ranks([*real, "--out", str(simulated)]):
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1, err
        assert "was written by a simulated run, this is a torchrun job" in lines[0], err
    torchrun = tmp_path / "torchrun"
    assert [s for s, _ in _ranks([*real, "--out", str(torchrun)])] == [0, 0]
    assert main(_sim_args(torchrun, 2)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "was written by a torchrun job, this is a simulated run" in lines[0], lines
    # damage that rank 0 alone finds (its metrics.jsonl) ends every rank, with rank 0's line
    metrics = torchrun / "metrics.jsonl"
    first, *rest = metrics.read_text().splitlines()
    metrics.write_text("\n".join([first, "garbage", *rest]) + "\n")
    more = [a if a != "1" else "2" for a in real]  # --epochs 2
    for status, err in _ranks([*more, "--out", str(torchrun)]):
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and f"{metrics}: line 2 is not JSON" in lines[0], err
