"""The harness never loses work and never answers with a traceback: checksummed checkpoints, no
finished file replaced without --overwrite, every row of every seed kept on --resume, one-line
errors for damaged results files and a full disk; and the command line's conventions."""

from __future__ import annotations

import builtins
import errno
import gzip
import io
import json
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from adasum.experiments import checkpoint as ckpt
from adasum.experiments.cli import build_parser, main
from adasum.experiments.progress import ProgressBar
from adasum.experiments.runner import RunConfig, train

pytestmark = pytest.mark.extra("experiments")  # the CLI's tasks, plots and statistics

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--no-progress", "--quiet", "--train-limit", "64", "--batch-size", "8", "--model", "mlp"]


def _train_args(out: Path, *extra: str, epochs: int = 1) -> list[str]:
    return ["train", "--method", "adasum", "--simulate", "2", "--epochs", str(epochs), "--out", str(out),
            *QUICK, *extra]


def _one_line(capsys, status: int, expected: int, *needles: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert status == expected, captured.err
    assert len(lines) == 1 and lines[0].startswith("adasum: error:"), captured.err
    assert "Traceback" not in captured.err + captured.out
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- checkpoints carry a checksum --------------------------------------------------------------


def _flip(data: bytes, position: int) -> bytes:
    return data[:position] + bytes([data[position] ^ 0x10]) + data[position + 1 :]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_a_flipped_byte_in_a_checkpoint_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_train_args(out)) == 0
    path = out / "checkpoint.pt"
    original, good = path.read_bytes(), ckpt.read_checkpoint(path)
    records = [i for i in zipfile.ZipFile(path).infolist() if "/data/" in i.filename and i.file_size > 0]
    assert len(records) >= 4  # weights, momentum buffers, the RNG state
    middles = []
    for info in records:  # a byte in the middle of every stored tensor
        header = original[info.header_offset : info.header_offset + 30]
        names = int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
        middles.append(info.header_offset + 30 + names + info.file_size // 2)
        path.write_bytes(_flip(original, middles[-1]))
        with pytest.raises(ValueError, match="does not match its checksum"):
            ckpt.read_checkpoint(path)
    # anywhere in the file: refused in one line, or (a byte torch never reads) the same contents
    for position in range(0, len(original), max(1, len(original) // 60)):
        path.write_bytes(_flip(original, position))
        try:
            state = ckpt.read_checkpoint(path)
        except ValueError as error:
            assert len(str(error).splitlines()) == 1 and "checkpoint.pt" in str(error)
        else:
            assert _same(state, good), position
    path.write_bytes(_flip(original, middles[0]))
    status = main(_train_args(out, "--resume", epochs=2))
    _one_line(capsys, status, 2, "checkpoint.pt", "checksum")


def test_a_checkpoint_without_its_checksum_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"config": {}, "epoch": 1, "engine": {"w": torch.ones(2)}}, path)
    with pytest.raises(ValueError, match="has no checksum"):
        ckpt.read_checkpoint(path)


# ---- no finished work is lost ------------------------------------------------------------------


def test_train_into_a_finished_run_is_refused_without_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_train_args(out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    _one_line(capsys, main(_train_args(out)), 2, "not empty", "--resume", "--overwrite")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched
    assert main(_train_args(out, "--overwrite", epochs=2)) == 0
    assert json.loads((out / "result.json").read_text())["epochs_run"] == 2
    assert [r["epoch"] for r in _rows(out / "metrics.jsonl") if r.get("kind") == "epoch"] == [1, 2]


def test_the_library_refuses_to_replace_a_run(tmp_path):
    from adasum.experiments.data import load_task

    digits = load_task("digits")
    config = RunConfig(method="adasum", workers=2, epochs=1, batch_size=8, train_limit=64, model="mlp")
    train(config, tmp_path, dataset=digits)
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match="already holds a run"):
        train(config, tmp_path, dataset=digits)
    (tmp_path / "checkpoint.pt").unlink()  # --resume without a checkpoint would start over
    with pytest.raises(ValueError, match="no checkpoint.pt to resume from"):
        train(config, tmp_path, resume=True, dataset=digits)
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
    train(config, tmp_path, resume=True, overwrite=True, dataset=digits)


def _compare(out: Path, seeds: str, *extra: str) -> int:
    return main(["compare", "--methods", "adasum", "--workers", "2", "--lr", "0.05", "--seeds", seeds,
                 "--epochs", "1", "--out", str(out), *QUICK, *extra])


def test_compare_keeps_every_seed_and_refuses_to_empty_results(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert _compare(out, "0,1") == 0
    first = _rows(out / "results.jsonl")
    capsys.readouterr()
    _one_line(capsys, _compare(out, "2"), 2, "not empty")
    assert _rows(out / "results.jsonl") == first
    assert _compare(out, "2", "--resume") == 0
    rows = _rows(out / "results.jsonl")
    assert sorted(r["seed"] for r in rows) == [0, 1, 2]
    assert [r for r in rows if r["seed"] < 2] == first  # the earlier rows, unchanged
    assert "seeds 0, 1, 2" in (out / "report.md").read_text()  # the report covers every seed
    # --overwrite: a fresh sweep replaces the file
    assert _compare(out, "3", "--overwrite") == 0
    assert [r["seed"] for r in _rows(out / "results.jsonl")] == [3]


def test_resume_with_the_default_model_written_out(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--method", "adasum", "--simulate", "2", "--out", str(out), "--no-progress", "--quiet",
            "--train-limit", "64", "--batch-size", "8"]
    assert main([*args, "--epochs", "1"]) == 0
    assert main([*args, "--epochs", "2", "--resume", "--model", "cnn"]) == 0
    assert json.loads((out / "result.json").read_text())["epochs_run"] == 2


# ---- damaged results files: one line ----------------------------------------------------------


GOOD = {"method": "adasum", "workers": 2, "lr": 0.05, "seed": 0, "epochs": 1, "val_accuracy": 50.0,
        "test_accuracy": 50.0, "diverged": False, "collapsed": False, "history": [{"epoch": 1}],
        "orthogonality_trace": [], "config": {"task": "digits"}}


@pytest.mark.parametrize("line, named", [
    ("[1, 2]", "not an object"),
    ('{"method": "adasum"}', "has no 'workers'"),
    (json.dumps({**GOOD, "lr": "fast"}), "'lr'"),
    (json.dumps({**GOOD, "workers": 0}), "'workers'"),
    (json.dumps({**GOOD, "history": []}), "'history'"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "orthogonality_trace"}), "orthogonality_trace"),
    ("{not json", "not JSON"),
])
def test_a_malformed_results_file_is_one_line_in_compare_resume(tmp_path, capsys, line, named):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "results.jsonl").write_text(line + "\n" + json.dumps(GOOD) + "\n")
    _one_line(capsys, _compare(out, "0", "--resume"), 2, "results.jsonl: line 1", named)


@pytest.mark.parametrize("damage", ["truncated", "not gzip", "binary"])
def test_a_damaged_compressed_or_binary_results_file_is_one_error(tmp_path, capsys, damage):
    from adasum.experiments.io import ResultsFileError, read_results

    data = gzip.compress((json.dumps(GOOD) + "\n").encode() * 50)
    path = tmp_path / ("runs.jsonl" if damage == "binary" else "runs.jsonl.gz")
    path.write_bytes({"truncated": data[: len(data) // 2], "not gzip": b"plain text",
                      "binary": b"\xff\xfe\x00garbage"}[damage])
    with pytest.raises(ResultsFileError) as error:
        read_results(path)
    assert len(str(error.value).splitlines()) == 1 and str(path) in str(error.value)
    _one_line(capsys, main(["report", str(path), "--out", str(tmp_path / "report"), "--quiet"]), 2, str(path))


# ---- a full disk -------------------------------------------------------------------------------


class _FullDisk(io.BufferedWriter):
    def write(self, data):  # the device is full from the first byte on
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _full_for_checkpoints(real_open):
    """``open`` on a device that is full for checkpoint files (and their temporaries) only."""

    def opened(path, mode="r", *args, **kwargs):
        if "checkpoint.pt" in str(path) and "w" in mode:
            return _FullDisk(io.FileIO(path, "wb"))
        return real_open(path, mode, *args, **kwargs)

    return opened


def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_last(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(_train_args(out)) == 0
    before = (out / "checkpoint.pt").read_bytes()
    capsys.readouterr()

    monkeypatch.setattr(builtins, "open", _full_for_checkpoints(builtins.open))
    status = main(_train_args(out, "--resume", epochs=2))
    _one_line(capsys, status, 1, "checkpoint.pt", "No space left on device", "unchanged")
    assert (out / "checkpoint.pt").read_bytes() == before
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def _full_disk_on_rank_0(rank: int, world: int, folder: str) -> str:
    path = Path(folder) / "checkpoint.pt"
    if rank == 0:
        builtins.open = _full_for_checkpoints(builtins.open)  # this process only
    try:
        ckpt.save_checkpoint(path, {"config": {}, "epoch": 1}, {"engine": {"w": torch.ones(2)}}, distributed=True)
    except OSError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_full_disk_under_torchrun_stops_every_rank_with_the_same_line(tmp_path):
    import distributed

    got = distributed.run(2, _full_disk_on_rank_0, str(tmp_path))
    assert got[0] == got[1] and got[0].startswith("WriteFailed: cannot write") and "No space left" in got[0]
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left


# ---- the command line's conventions -----------------------------------------------------------


def test_version_and_every_flag_has_help_with_its_default(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == "adasum 0.1.0"
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, (name, action.option_strings)
    text = commands["compare"].format_help()
    assert "(default: 0,1,2,3,4)" in text and "(default: 16)" in text and "(default: digits)" in text


@pytest.mark.parametrize("args, hint", [
    (["train", "--epoch", "2"], "did you mean '--epochs'?"),  # no abbreviations
    (["train", "--seed", "2"], "did you mean '--seeds'?"),  # one spelling for seeds
    (["compare", "--task", "mnist-1d"], "did you mean 'mnist1d'?"),
    (["trian"], "did you mean 'train'?"),
    (["train", "--method", "adsum"], "did you mean 'adasum'?"),
    (["train", "--seeds", "1,2"], "adasum train runs one seed"),
])
def test_typos_are_refused_with_a_suggestion(tmp_path, capsys, args, hint):
    _one_line(capsys, main([*args, "--out", str(tmp_path / "out")] if args != ["trian"] else args), 2, hint)


def test_seeds_one_spelling_and_five_by_default():
    parser = build_parser()
    assert parser.parse_args(["compare"]).seeds == [0, 1, 2, 3, 4]
    assert parser.parse_args(["train", "--seeds", "7"]).seed == 7


def test_train_on_one_worker_gives_a_hint(tmp_path, capsys):
    assert main(["train", "--method", "adasum", "--epochs", "1", "--out", str(tmp_path / "one"), "--no-progress",
                 "--train-limit", "64", "--batch-size", "8", "--model", "mlp"]) == 0
    assert "--simulate P" in capsys.readouterr().err


# ---- terminal output ---------------------------------------------------------------------------


def test_progress_on_a_terminal_logs_through_its_console_and_keeps_one_run_bar():
    from rich.console import Console
    from rich.logging import RichHandler

    log = logging.getLogger("adasum")
    plain = logging.StreamHandler(io.StringIO())
    log.handlers[:], log.level = [plain], logging.INFO
    screen = io.StringIO()
    bar = ProgressBar(True, Console(file=screen, force_terminal=True, width=100))
    with bar:
        assert bar.live and isinstance(log.handlers[0], RichHandler)
        bar.sweep(3)
        bar.skip()  # a run taken from the results file
        advance = bar.task("adasum P=2", total=4)
        advance(4)
        log.info("epoch line")
        bar.task("adasum P=4", total=4)
        bars = bar.bars
        assert [b[0] for b in bars] == ["sweep: 3 runs", "run 3/3: adasum P=4"]  # the finished bar removed
        assert bars[0][1:] == (2, 3)  # the sweep bar: runs done of all
    assert log.handlers == [plain]  # restored when the bars end
    assert "epoch line" in screen.getvalue()


def test_progress_elsewhere_is_plain_lines(caplog):
    from rich.console import Console

    bar = ProgressBar(True, Console(file=io.StringIO()))  # not a terminal
    with caplog.at_level(logging.INFO, logger="adasum"), bar:
        assert not bar.live
        bar.sweep(2)
        bar.task("adasum P=2", total=4)(4)
        bar.task("adasum P=4", total=4)
    assert [r.getMessage() for r in caplog.records] == ["run 1/2: adasum P=2", "run 2/2: adasum P=4"]


# ---- the FSDP example on an odd number of processes --------------------------------------------


def _fsdp_example(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
               str(ROOT / "examples" / "fsdp_transformer.py"), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)


def test_fsdp_example_on_three_processes():
    done = _fsdp_example("--steps", "3")  # 3 replicas of one shard
    assert done.returncode == 0, done.stderr[-3000:]
    assert "parameters identical on 3 ranks: True" in done.stdout
    refused = _fsdp_example("--shards", "2", "--steps", "3")
    assert refused.returncode != 0 and "IndexError" not in refused.stderr
    assert "--shards 2 must divide the 3 processes" in refused.stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run of one epoch, trained once for the tests that alter copies of it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(_train_args(out)) == 0
    return out


def _altered(path: Path, change) -> None:
    """`path`'s checkpoint changed by `change(state)` and checksummed again (a foreign but intact file)."""
    state = ckpt.read_checkpoint(path)
    change(state)
    ckpt.save_atomic(state, path)


def _shrink_first_weight(state):
    model = state["engine"]["model"]
    name = next(k for k in model if k.endswith("weight"))
    model[name] = model[name][:1]


@pytest.mark.parametrize("change, named", [
    (_shrink_first_weight, "holds a state this run cannot take (RuntimeError: Error(s) in loading state_dict"),
    (lambda state: state.pop("history"), "holds a state this run cannot take (KeyError: 'history')"),
    (lambda state: state.update(rng=state["rng"][:10]), "holds a state this run cannot take (RuntimeError:"),
])
def test_a_checkpoint_with_a_valid_checksum_but_foreign_contents_is_one_line(
    tmp_path, capsys, finished_run, change, named
):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    _altered(out / "checkpoint.pt", change)
    capsys.readouterr()
    status = main(_train_args(out, "--resume", epochs=2))
    _one_line(capsys, status, 2, "checkpoint.pt", named)


def test_a_checkpoint_whose_epoch_is_not_a_count_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    ckpt.save_atomic({"config": {}, "epoch": -1, "engine": {}}, path)  # checksummed: only its contents are wrong
    with pytest.raises(ValueError, match=r"checkpoint.pt holds epoch -1, not a count \(an integer >= 0\); it is "
                                         r"not a checkpoint of a run"):
        ckpt.read_checkpoint(path)
