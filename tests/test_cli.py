"""The ``adasum`` command line: compare end to end, --resume, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adasum.experiments.cli import main

pytestmark = pytest.mark.extra("experiments")  # the CLI's tasks, plots and statistics

QUICK = ["--no-progress", "--quiet", "--train-limit", "256", "--batch-size", "8"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _shown_help(parser, prog, action) -> str:
    """`action`'s help as ``--help`` prints it (the parser's formatter, lines wide enough not to wrap)."""
    formatter = parser.formatter_class(prog=prog, width=10_000, max_help_position=10_000)
    formatter.add_argument(action)
    line = formatter.format_help().strip()
    return line.split("  ", 1)[1].strip() if line else ""  # past the flags' column (none: a hidden flag)


def test_every_flag_with_a_default_shows_it_in_its_help():
    """A zero default is shown (a switch's False and an unset None are not): `--weight-decay` 0.0, `train --seeds`
    0; every other flag whose default is set shows it too."""
    import argparse

    from adasum.experiments.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    shown = 0
    for name, sub in subs.choices.items():
        helps = {a.dest: (a, _shown_help(sub, name, a)) for a in sub._actions}
        for action, text in helps.values():
            unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
            hidden = action.help is argparse.SUPPRESS  # not in --help at all
            if action.option_strings and not unset and not hidden:
                assert "(default" in text, (name, action.option_strings, text)
                shown += 1
        if name == "train":
            assert helps["seed"][1].endswith("(default: 0)")
        if "weight_decay" in helps:
            assert helps["weight_decay"][1].endswith("(default: 0.0)"), helps["weight_decay"][1]
    assert shown > 20


def test_compare_end_to_end(tmp_path, capsys):
    out = tmp_path / "sweep"
    status = main(["compare", "--methods", "sequential,adasum", "--workers", "2,4", "--lr", "0.01,0.02",
                   "--epochs", "2", "--seeds", "0", "--out", str(out), *QUICK])
    assert status == 0
    results = read_jsonl(out / "results.jsonl")
    cells = sorted((r["method"], r["workers"], r["lr"]) for r in results)
    expected = sorted([("sequential", 1, lr) for lr in (0.01, 0.02)]
                      + [("adasum", w, lr) for w in (2, 4) for lr in (0.01, 0.02)])
    assert cells == expected
    for r in results:
        assert {"method", "workers", "lr", "epochs", "test_accuracy", "history"} <= set(r)
        assert r["epochs"] == 2 and len(r["history"]) == 2
        assert [h["epoch"] for h in r["history"]] == [1, 2]
    report = (out / "report.md").read_text()
    assert "| adasum | 4 |" in report and "| sequential | 1 |" in report
    for name in ("accuracy.png", "loss.png", "orthogonality.png", "lr.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| adasum | 2 |" in printed  # the table goes to stdout


def test_pinned_compare_command_on_default_data(tmp_path):
    out = tmp_path / "pinned"
    assert (
        main(
            [
                "compare",
                "--methods",
                "mean,adasum",
                "--workers",
                "16",
                "--epochs",
                "1",
                "--out",
                str(out),
                "--no-progress",
                "--quiet",
            ]
        )
        == 0
    )
    results = read_jsonl(out / "results.jsonl")
    assert [(r["method"], r["workers"], r["epochs"], r["seed"]) for r in results] == [
        (m, 16, 1, seed) for m in ("mean", "adasum") for seed in (0, 1, 2, 3, 4)  # the default seeds
    ]
    assert all(r["task"] == "digits" and 0 <= r["test_accuracy"] <= 100 for r in results)


def _train(out: Path, epochs: int, *extra: str) -> dict:
    args = [
        "train",
        "--method",
        "adasum-delta",
        "--simulate",
        "3",
        "--optimizer",
        "adam",
        "--lr",
        "0.003",
        "--epochs",
        str(epochs),
        "--out",
        str(out),
        *QUICK,
        *extra,
    ]
    assert main(args) == 0
    return json.loads((out / "result.json").read_text())


def test_resume_continues_exactly(tmp_path):
    straight = _train(tmp_path / "straight", 3)
    assert straight["momentum"] is None and straight["optimizer"] == "adam"  # SGD's momentum is not Adam's
    _train(tmp_path / "resumed", 2)
    resumed = _train(tmp_path / "resumed", 3, "--resume")
    strip = lambda h: {k: v for k, v in h.items() if k != "wall_s"}  # noqa: E731
    assert [strip(h) for h in resumed["history"]] == [strip(h) for h in straight["history"]]
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 3
    for key, value in a["engine"]["model"].items():
        assert torch.equal(value, b["engine"]["model"][key]), key
    epochs = [
        line["epoch"] for line in read_jsonl(tmp_path / "resumed" / "metrics.jsonl") if line.get("kind") == "epoch"
    ]
    assert epochs == [1, 2, 3]
    # no temporary files are left next to the checkpoint
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["checkpoint.pt", "metrics.jsonl", "result.json"]


def test_resume_of_another_run_is_refused(tmp_path, capsys):
    _train(tmp_path / "run", 1)
    capsys.readouterr()
    status = main(
        [
            "train",
            "--method",
            "adasum-delta",
            "--simulate",
            "3",
            "--optimizer",
            "adam",
            "--lr",
            "0.01",
            "--epochs",
            "2",
            "--out",
            str(tmp_path / "run"),
            "--resume",
            *QUICK,
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and "another run (lr" in err


def test_resume_with_fewer_epochs_than_the_checkpoint_is_refused(tmp_path, capsys):
    _train(tmp_path / "run", 2)
    capsys.readouterr()
    args = ["train", "--method", "adasum-delta", "--simulate", "3", "--optimizer", "adam", "--lr", "0.003",
            "--epochs", "1", "--out", str(tmp_path / "run"), "--resume", *QUICK]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is at epoch 2, past --epochs 1" in err[0], err


def _blocked_dir(tmp_path: Path) -> str:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return str(blocker / "out")  # below a regular file: unwritable for anyone, root included


@pytest.mark.parametrize(
    "args,message",
    [
        (["compare", "--methods", "mean,median"], "unknown method 'median'"),
        (["train", "--method", "median"], "unknown method 'median'"),
        (["compare", "--workers", "0"], "must be >= 1"),
        (["compare", "--workers", "4,-2"], "must be >= 1"),
        (["train", "--simulate", "0"], "must be >= 1"),
        (["compare", "--lr", "0"], "must be > 0"),
        (["train", "--lr", "-0.1"], "must be > 0"),
        (["compare", "--lr", "fast"], "not a number"),
        (["compare", "--task", "mnist", "--data-dir", "/nonexistent/mnist"], "does not exist"),
        (["compare", "--task", "mnist"], "--data-dir"),
        (["compare", "--out", "BLOCKED"], "cannot write to output directory"),
        (["train", "--out", "BLOCKED"], "cannot write to output directory"),
        (["compare", "--model", "vgg"], "invalid choice"),
        (["train", "--nonfinite", "ignore"], "invalid choice"),
        (["train", "--checkpoint-every", "0"], "must be >= 1"),
        (["train", "--device", "foo"], "unknown device 'foo'"),
        (["train", "--device", "meta"], "cannot train on device 'meta'"),
        (["compare", "--device", "cuda:7"], "device 'cuda:7'"),
        (["train", "--method", "mean-scaled", "--simulate", "4", "--lr", "1e308"], "more than float32 holds"),
        (["compare", "--lr", "1e39"], "more than float32 holds"),
        (["train", "--timeout", "1e14"], "at most 2592000 seconds"),
        (["compare", "--seeds", "0,x"], "not an integer: 'x'"),
        (["compare", "--seeds", "-1"], "seed must be in"),
        (["train", "--val-fraction", "0.9"], "validation fraction must be in (0, 0.5]"),
        ([], "required"),
        # a flag given where it has no effect (the audit's command: the first such flag is named)
        (["train", "--method", "adasum", "--local-steps", "8", "--slow-momentum", "0.9", "--slow-lr", "3",
          "--optimizer", "adam", "--momentum", "0.9", "--chunk-size", "7"],
         "adasum: error: --local-steps applies to localsgd, adasum-localsgd, slowmo, diloco, adasum-diloco, "
         "adacons-diloco and streaming-diloco, not adasum"),
        (["train", "--method", "slowmo", "--outer-lr", "0.5"],
         "adasum: error: --outer-lr applies to diloco, adasum-diloco, adacons-diloco and streaming-diloco, not slowmo"),
        (["train", "--method", "diloco", "--fragments", "2"],
         "adasum: error: --fragments applies to streaming-diloco, not diloco"),
        (["train", "--method", "localsgd", "--slow-momentum", "0.9"],
         "adasum: error: --slow-momentum applies to slowmo, not localsgd"),
        (["train", "--method", "adasum-localsgd", "--slow-lr", "3"],
         "adasum: error: --slow-lr applies to slowmo, not adasum-localsgd"),
        (["train", "--optimizer", "lamb", "--momentum", "0.9"],
         "adasum: error: --momentum applies to --optimizer sgd, not lamb"),
        (["train", "--momentum", "0.5", "--optimizer", "adam"],  # the default value, given, is refused too
         "adasum: error: --momentum applies to --optimizer sgd, not adam"),
        (["train", "--method", "adasum", "--chunk-size", "7"],
         "adasum: error: --chunk-size applies to several simulated workers (--simulate P with P > 1), not to one"),
        (["train", "--method", "sequential", "--simulate", "4"],
         "adasum: error: --simulate applies to methods of several workers, not sequential (one worker)"),
        (["compare", "--methods", "adasum,mean", "--local-steps", "8"],
         "adasum: error: --local-steps applies to localsgd, adasum-localsgd, slowmo, diloco, adasum-diloco, "
         "adacons-diloco and streaming-diloco, not adasum or mean"),
        (["compare", "--methods", "localsgd,adasum-localsgd", "--slow-lr", "2"],
         "adasum: error: --slow-lr applies to slowmo, not localsgd or adasum-localsgd"),
        (["compare", "--optimizer", "adam", "--momentum", "0.9"],
         "adasum: error: --momentum applies to --optimizer sgd, not adam"),
        (["compare", "--methods", "sequential", "--chunk-size", "4"],
         "adasum: error: --chunk-size applies to several simulated workers (--workers P with P > 1), not to one"),
        (["compare", "--methods", "adasum", "--workers", "1", "--chunk-size", "4"],
         "adasum: error: --chunk-size applies to several simulated workers (--workers P with P > 1), not to one"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(tmp_path, capsys, args, message):
    args = [_blocked_dir(tmp_path) if a == "BLOCKED" else a for a in args]
    if args and "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    status = main(args)
    captured = capsys.readouterr()
    assert status == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adasum: error:") and message in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--method", "slowmo", "--simulate", "4", "--local-steps", "2", "--slow-momentum", "0.3",
         "--slow-lr", "2", "--momentum", "0.9", "--chunk-size", "2"],
        ["train", "--method", "sequential", "--simulate", "1"],
        ["train", "--optimizer", "adam", "--local-steps", "4", "--method", "localsgd", "--weight-decay", "0.1"],
        # a sweep: a flag that applies to one of its methods or cells is fine
        ["compare", "--methods", "adasum,localsgd", "--local-steps", "8"],
        ["compare", "--methods", "mean,slowmo", "--slow-momentum", "0.9", "--slow-lr", "2"],
        ["compare", "--methods", "sequential,adasum", "--workers", "1,4", "--chunk-size", "2"],
        ["compare", "--optimizer", "adam"],  # --momentum's default is not a flag given
    ],
)
def test_flags_that_apply_to_a_run_are_accepted(args):
    from adasum.experiments.cli import build_parser, check_flags_apply
    from adasum.experiments.methods import get_method, parse_methods

    parsed = build_parser().parse_args(args)
    if parsed.command == "train":
        check_flags_apply(parsed, [get_method(parsed.method)], [parsed.simulate] if parsed.simulate else [])
    else:
        check_flags_apply(parsed, parse_methods(parsed.methods), parsed.workers)


def test_nonfinite_raise_stops_a_diverging_run_with_one_line(tmp_path, capsys):
    status = main(
        [
            "train",
            "--method",
            "sum",
            "--simulate",
            "2",
            "--lr",
            "1e6",
            "--momentum",
            "0",
            "--epochs",
            "3",
            "--nonfinite",
            "raise",
            "--out",
            str(tmp_path / "run"),
            *QUICK,
        ]
    )
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 1 and len(lines) == 1, err
    assert lines[0].startswith("adasum: error: simulated step ") and "on worker" in lines[0], err


def test_python_dash_m_entry_point_reports_bad_input_without_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "adasum", "compare", "--methods", "nope", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "adasum: error: unknown method 'nope'; choose from sequential, mean-scaled, mean, sum, adasum, "
        "adasum-delta, adacons, localsgd, adasum-localsgd, slowmo, diloco, adasum-diloco, adacons-diloco, "
        "streaming-diloco"
    ]


def test_import_adasum_needs_only_torch():
    code = (
        "import sys, adasum, adasum.experiments.cli; "
        "extras = {'matplotlib', 'rich', 'mlxtend', 'mnist1d', 'pytorch_optimizer', 'sklearn'}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in extras))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ---- every rank of a torchrun job: the same one line and exit status ------------------------

SRC = str(Path(__file__).parent.parent / "src")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(args: list[str], world: int = 2, env_extra: dict | None = None, timeout: float = 120,
           program: list[str] | None = None) -> list:
    """Run ``python -m adasum ARGS`` (or ``python PROGRAM ARGS``) as `world` ranks of one job (torchrun's
    environment, without torchrun's own reporting): [(exit status, stderr)] per rank."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), **(env_extra or {})}
        procs.append(subprocess.Popen([sys.executable, *(program or ["-m", "adasum"]), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        out.append((p.returncode, err))
    return out


@pytest.mark.parametrize("case", ["out-is-a-file", "timeout", "device"])
def test_bad_flags_under_torchrun_are_one_line_and_exit_2_on_every_rank(tmp_path, case):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["train", "--method", "adasum", "--epochs", "1", "--train-limit", "64", "--batch-size", "8",
            "--no-progress", "--quiet", "--timeout", "20", "--out", str(tmp_path / "run")]
    expected = {
        "out-is-a-file": (["--out", str(blocker)], "cannot write to output directory"),
        "timeout": (["--timeout", "1e14"], "at most 2592000 seconds"),
        "device": (["--device", "meta"], "cannot train on device 'meta'"),
    }[case]
    for status, err in _ranks([*args, *expected[0]]):
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1, err
        assert lines[0].startswith("adasum: error:") and expected[1] in lines[0], err


def test_a_dead_peer_is_one_line_and_exit_1(tmp_path):
    """Rank 1 dies (SIGKILL, the test's kill point) after step 3: rank 0 ends with one line naming
    the failed collective, exit status 1 (a failed run: torchrun --max-restarts would restart it)."""
    args = ["train", "--method", "adasum", "--epochs", "1", "--train-limit", "256", "--batch-size", "8",
            "--no-progress", "--quiet", "--timeout", "20", "--out", str(tmp_path / "run")]
    kill_at = [str(Path(__file__).parent / "kill_at.py"), "1", "3", str(tmp_path / "marker")]
    (status0, err0), (status1, _) = _ranks(args, program=kill_at)
    assert status1 == -9
    lines = err0.strip().splitlines()
    assert status0 == 1 and len(lines) == 1, err0
    assert lines[0].startswith("adasum: error:") and "rank 0 of 2" in lines[0] and "failed" in lines[0], err0


def test_the_runners_own_all_reduce_names_a_failure(monkeypatch):
    """A transport failure in the runner's all-reduce of the step's loss is a CollectiveError."""
    import torch.distributed as dist

    from adasum.experiments import runner
    from adasum.reducers import get_reducer
    from adasum.transport.errors import CollectiveError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 2)
        worker = runner.DistributedWorker(model, lambda ps: torch.optim.SGD(ps, lr=0.1), get_reducer("mean"))
        real = dist.all_reduce

        def broken(tensor, *args, **kwargs):  # only the runner's one-element all-reduce of the loss
            if tensor.numel() != 1:
                return real(tensor, *args, **kwargs)
            raise RuntimeError("[gloo/pair.cc:1] Timed out waiting 5000ms for recv operation to complete")

        monkeypatch.setattr(dist, "all_reduce", broken)  # torch's own: the runner calls it
        with pytest.raises(CollectiveError, match="the all-reduce of step 1's loss failed.*Timed out waiting"):
            worker.step(torch.randn(1, 4, 3), torch.randint(0, 2, (1, 4)))
    finally:
        dist.destroy_process_group()


def test_config_replays_a_run_and_flags_override_it(tmp_path, capsys):
    """``--config result.json`` runs the same run again (the same history, bit for bit, but the wall times);
    a flag given beside it wins."""
    first = _train(tmp_path / "first", 1)
    assert main(["train", "--config", str(tmp_path / "first" / "result.json"), "--out", str(tmp_path / "again"),
                 "--no-progress", "--quiet"]) == 0
    again = json.loads((tmp_path / "again" / "result.json").read_text())
    strip = lambda h: {k: v for k, v in h.items() if k != "wall_s"}  # noqa: E731
    assert again["config"] == first["config"] and again["epochs"] == first["epochs"] == 1
    assert [strip(h) for h in again["history"]] == [strip(h) for h in first["history"]]
    assert main(["train", "--config", str(tmp_path / "first" / "result.json"), "--lr", "0.006",
                 "--out", str(tmp_path / "faster"), "--no-progress", "--quiet"]) == 0
    faster = json.loads((tmp_path / "faster" / "result.json").read_text())
    assert faster["lr"] == 0.006 and faster["workers"] == 3 and faster["optimizer"] == "adam"


def test_config_from_toml_for_a_sweep(tmp_path):
    config = tmp_path / "sweep.toml"
    config.write_text('methods = "sequential,adasum"\nworkers = [2]\nlr = [0.01]\nseeds = [0]\nepochs = 1\n'
                      'train-limit = 128\nbatch_size = 8\nno-progress = true\nquiet = true\n')
    assert main(["compare", "--config", str(config), "--workers", "3", "--out", str(tmp_path / "out")]) == 0
    rows = read_jsonl(tmp_path / "out" / "results.jsonl")
    cells = sorted((r["method"], r["workers"], r["lr"], r["epochs"]) for r in rows)
    assert cells == [("adasum", 3, 0.01, 1), ("sequential", 1, 0.01, 1)]  # --workers 3 overrides the file's 2


@pytest.mark.parametrize(
    "text, name, message",
    [
        ('{"lrate": 0.1}', "x.json", "adasum: error: --config: 'lrate' is not a setting of adasum train "
                                     "(did you mean '--lr'?)"),
        ('{"lr": "fast"}', "x.json", "adasum: error: argument --lr: not a number: 'fast'"),
        ("[1, 2]", "x.json", "must hold a table of settings, got a list"),
        ("lr = ", "x.toml", "is not valid TOML"),
        ("{", "x.json", "is not valid JSON"),
        (None, "missing.json", "cannot read --config"),
    ],
)
def test_a_bad_config_is_one_line(tmp_path, capsys, text, name, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_missing_package_gives_the_checkout_form_too(monkeypatch, capsys):
    import adasum.experiments.cli as cli

    def needs_sklearn(args):
        raise ModuleNotFoundError("No module named 'sklearn'", name="sklearn")

    monkeypatch.setattr(cli, "cmd_train", needs_sklearn)
    assert main(["train"]) == 2
    assert capsys.readouterr().err.strip() == (
        "adasum: error: missing package 'sklearn': pip install 'adasum[experiments]' "
        "(from a checkout: pip install '.[experiments]')"
    )
