"""Results people can trust: seeds as a sweep axis, resume only of exact matches, collapse
detection, the validation split and selection on it, intervals and the learning-rate robustness table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adasum.experiments.cli import build_parser, main
from adasum.experiments.compare import compare
from adasum.experiments.data import load_task
from adasum.experiments.methods import parse_methods
from adasum.experiments.report import picked, robustness, summary_table
from adasum.experiments.runner import Chance, RunConfig, train
from adasum.experiments.stats import Stat

pytestmark = pytest.mark.extra("experiments")  # the CLI's tasks, plots and statistics

QUICK = ["--no-progress", "--quiet", "--train-limit", "128", "--batch-size", "8", "--epochs", "1"]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def digits():
    return load_task("digits")


def test_seeds_are_a_sweep_axis_and_rows_carry_the_named_fields(tmp_path):
    out = tmp_path / "sweep"
    assert main(["compare", "--methods", "sequential,adasum", "--workers", "2", "--lr", "0.05",
                 "--seeds", "0,1", "--out", str(out), *QUICK]) == 0
    got = rows(out)
    assert sorted((r["method"], r["workers"], r["seed"]) for r in got) == [
        ("adasum", 2, 0), ("adasum", 2, 1), ("sequential", 1, 0), ("sequential", 1, 1)]
    for r in got:
        assert {"method", "workers", "lr", "epochs", "seed", "val_accuracy", "test_accuracy", "diverged",
                "collapsed"} <= set(r)
        assert r["config"]["seed"] == r["seed"] and r["config"]["task"] == "digits"
        assert (out / "runs" / f"{r['method']}-P{r['workers']}-lr0.05-seed{r['seed']}" / "result.json").exists()
    adasum = [r for r in got if r["method"] == "adasum"]
    assert adasum[0]["history"] != adasum[1]["history"]  # another seed, another run
    report = (out / "report.md").read_text()
    assert "seeds 0, 1" in report and "| adasum | 2 | 0.05 | 2 |" in report


def test_compare_without_seeds_runs_the_default_five(tmp_path):
    args = build_parser().parse_args(["compare", "--methods", "adasum", "--workers", "2", "--out", str(tmp_path)])
    assert args.seeds == [0, 1, 2, 3, 4]
    seen = []
    compare(parse_methods(args.methods), args.workers, args.lr, RunConfig(epochs=1), tmp_path, seeds=args.seeds,
            train=lambda config, *a, **k: seen.append(config.seed) or _fake(config), plot=lambda results, out: [])
    assert seen == [0, 1, 2, 3, 4]


def _fake(config: RunConfig, val: float = 50.0, test: float = 50.0) -> dict:
    from dataclasses import asdict

    from adasum.experiments.runner import identity

    return {"method": config.method, "workers": config.workers, "lr": config.lr, "effective_lr": config.lr,
            "epochs": config.epochs, "seed": config.seed, "val_accuracy": val, "test_accuracy": test,
            "diverged": False, "collapsed": False, "test_loss": 1.0, "steps": 1, "wall_s": 0.0,
            "history": [{"epoch": 1, "orthogonality": None}], "orthogonality_trace": [],
            "config": identity(asdict(config)), "task": config.task}


def test_resume_skips_exact_matches_only_and_names_what_differs(tmp_path, capsys):
    out = tmp_path / "sweep"
    first = ["compare", "--methods", "adasum", "--workers", "2", "--lr", "0.05", "--seeds", "0", "--out", str(out),
             *QUICK]
    assert main(first) == 0
    before = rows(out)
    # the same sweep plus seed 1: seed 0 is taken as it is (its row, wall time included, unchanged), only seed 1 runs
    assert main([*first[:-len(QUICK) - 2], "--seeds", "0,1", "--out", str(out), "--resume", *QUICK]) == 0
    after = rows(out)
    assert after[0] == before[0] and [r["seed"] for r in after] == [0, 1]
    capsys.readouterr()
    # another batch size, task or momentum: refused, with the differences named, nothing run (no file changed)
    written = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    for extra, named in [(["--batch-size", "4"], "batch_size 8 -> 4"), (["--task", "sklearn-digits"],
                         "task 'digits' -> 'sklearn-digits'"), (["--momentum", "0.9"], "momentum 0.5 -> 0.9")]:
        args = ["compare", "--methods", "adasum", "--workers", "2", "--lr", "0.05", "--seeds", "0,1",
                "--out", str(out), "--resume", *QUICK, *extra]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "another configuration" in err[0] and named in err[0], err
        assert "adasum-P2-lr0.05-seed0" in err[0]
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == written
    # more epochs: not a match, the run continues from its checkpoint (seed 1's row, of another cell, is kept)
    assert main([*first[:-len(QUICK)], "--resume", *QUICK[:-1], "2"]) == 0
    again = rows(out)
    assert again[0]["epochs"] == 2 and len(again[0]["history"]) == 2 and again[1] == after[1]


def test_collapse_is_flagged_as_divergence_is(digits):
    config = RunConfig(method="mean-scaled", workers=4, lr=1.0, epochs=2, batch_size=8, train_limit=256)
    collapsed = train(config, dataset=digits)
    assert not collapsed["diverged"] and collapsed["collapsed"]
    assert collapsed["val_accuracy"] <= collapsed["chance_accuracy"] + 5
    # five times the rate: the training loss blows up to ~1e7 without a NaN, which is divergence, not collapse
    exploded = train(RunConfig(method="mean-scaled", workers=4, lr=5.0, epochs=2, batch_size=8, train_limit=256),
                     dataset=digits)
    assert exploded["diverged"] and not exploded["collapsed"] and exploded["train_loss"] > 1e4
    healthy = train(RunConfig(method="adasum", workers=2, lr=0.05, epochs=2, batch_size=8, train_limit=512),
                    dataset=digits)
    assert not healthy["collapsed"] and healthy["val_accuracy"] > 40


def test_chance_level_rules():
    chance = Chance.of(torch.tensor([0, 1, 2, 3] * 25), torch.tensor([0] * 30 + [1] * 70), 4)
    assert chance.accuracy == pytest.approx(70.0)
    assert chance.noise == pytest.approx(300 * (0.7 * 0.3 / 100) ** 0.5)
    assert chance.loss == pytest.approx(torch.log(torch.tensor(4.0)).item())
    def epoch(val, loss):
        return {"val_accuracy": val, "train_loss": loss}
    assert chance.collapsed([epoch(90, 0.5), epoch(70.5, 0.6)])  # ends at the majority rate
    assert chance.collapsed([epoch(90, 1.39), epoch(90, 1.38)])  # the loss never left chance level
    assert not chance.collapsed([epoch(90, 1.39), epoch(90, 1.0)])
    # diverged: NaN or Inf, or a finite loss blown far past guessing (word2vec once reached 1e19)
    assert chance.diverged(float("nan"), 1.0) and chance.diverged(float("inf")) and chance.diverged(1e19)
    assert not chance.diverged(0.1, 1.39, 50.0)


def test_validation_split_is_fixed_held_out_and_the_same_for_every_run(digits):
    a, b = digits.with_validation(0.1), digits.with_validation(0.1)
    assert len(a.val_y) == 400 and len(a.train_y) == 3600 and torch.equal(a.val_x, b.val_x)
    flat = lambda x: {tuple(row.tolist()) for row in x.flatten(1)}  # noqa: E731
    assert not flat(a.val_x) & flat(a.train_x)  # no example in both
    assert flat(a.val_x) | flat(a.train_x) == flat(digits.train_x)
    with pytest.raises(ValueError, match="validation fraction"):
        digits.with_validation(1.0)


def _result(method, workers, lr, seed, val, test, diverged=False):
    return {"method": method, "workers": workers, "lr": lr, "effective_lr": lr, "seed": seed, "val_accuracy": val,
            "test_accuracy": test, "diverged": diverged, "collapsed": False}


def test_the_learning_rate_is_picked_on_validation_and_only_its_test_accuracy_reported():
    results = [
        # lr 0.1 has the better test accuracy, 0.05 the better validation accuracy: 0.05 is picked
        *[_result("adasum", 8, 0.05, s, 90 + s, 80 + s) for s in range(3)],
        *[_result("adasum", 8, 0.1, s, 85 + s, 95 + s) for s in range(3)],
        # a diverged seed scores 0 on validation
        *[_result("mean-scaled", 8, 0.01, s, 70, 70) for s in range(3)],
        *[_result("mean-scaled", 8, 0.02, s, 99, 99, diverged=s == 0) for s in range(3)],
        *[_result("sequential", 1, 0.05, s, 90 + s, 90 + s) for s in range(3)],
    ]
    best = picked(results)
    assert best[("adasum", 8)][0]["lr"] == 0.05 and best[("mean-scaled", 8)][0]["lr"] == 0.01
    text = summary_table(results)
    assert "| adasum | 8 | 0.05 | 3 | 91.00 | 81.00 (3 runs) | 80.0-82.0 |" in text  # 3 seeds: the range
    # 10 points below sequential on each of 3 seeds: the exact test's p is 2 / 2^3, no verdict from 3 seeds
    assert "-10.00: no detectable difference" in text and "Holm p 0)" not in text
    rob = robustness(results)[("adasum", 8)]
    assert rob.best_lr == 0.05 and rob.best == 91 and (rob.range_lo, rob.range_hi) == (0.05, 0.05)
    assert rob.at_sequential_lr == 91 and rob.at_edge


def test_intervals_over_seeds():
    """Student's t over the seeds; the verdicts between methods are tested in test_report.py."""
    a = Stat.of([90.0, 91.0, 92.0])
    assert (a.mean, a.min, a.max, a.n) == (91.0, 90.0, 92.0, 3)
    assert a.hi - a.mean == pytest.approx(4.303 * 1.0 / 3**0.5, rel=1e-4)
    assert str(Stat.of([1.0])) == "1.00 (1 run)"


def test_report_merges_sweeps_and_counts_a_run_once(tmp_path, capsys):
    def row(method, workers, seed, acc):
        r = _fake(RunConfig(method=method, workers=workers, lr=0.05, seed=seed), val=acc, test=acc)
        r["history"] = [{"epoch": 1, "test_accuracy": acc, "test_loss": 1.0, "orthogonality": None}]
        return json.dumps(r) + "\n"

    a, b = tmp_path / "seq", tmp_path / "P8"
    a.mkdir()
    b.mkdir()
    (a / "results.jsonl").write_text("".join(row("sequential", 1, s, 90 + s) for s in range(3)))
    (b / "results.jsonl").write_text("".join(row("adasum", 8, s, 80 + s) for s in range(3)) + row("adasum", 8, 0, 80))
    import gzip  # the repository keeps its sweeps compressed; the reader takes .gz as it is

    (a / "results.jsonl.gz").write_bytes(gzip.compress((a / "results.jsonl").read_bytes()))
    (a / "results.jsonl").unlink()
    assert main(["report", str(a / "results.jsonl.gz"), str(b / "results.jsonl"), "--out", str(tmp_path / "merged"),
                 "--quiet"]) == 0
    text = (tmp_path / "merged" / "report.md").read_text()
    assert "| adasum | 8 | 0.05 | 3 | 81.00 |" in text and "-10.00: no detectable difference" in text
    assert (tmp_path / "merged" / "accuracy.png").exists()  # one learning rate: no lr.png
    assert main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2


def test_gpu_sweep_lists_every_cell_once_and_filters(tmp_path):
    """benchmarks/sweeps.sh: every (task, P, method, seed) of the GPU sweep is one job, named once;
    JOB_FILTER keeps only matching jobs; SWEEP_DIR (not OUT, which the device tool sets) is where it counts."""
    import os
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sweeps.sh"
    env = {**os.environ, "LIST": "1", "SWEEP_DIR": str(tmp_path), "OUT": "/nonexistent"}

    def listed(**extra) -> list[str]:
        done = subprocess.run(["bash", str(script), "gpu"], env={**env, **extra}, capture_output=True, text=True,
                              check=True)
        return [line.split(":")[0] for line in done.stdout.splitlines()]

    names = listed()
    assert len(names) == len(set(names))
    methods = ["mean-scaled", "mean", "adasum", "adasum-delta", "adacons", "localsgd", "slowmo"]
    for workers in (16, 32, 64, 128):
        for method in methods:
            for seed in (0, 1, 2):
                assert f"mnist1d--P{workers}-{method}-s{seed}" in names
    assert sum(n.startswith("mnist1d--seq-") for n in names) == 3 * 7  # 3 seeds x 7 learning rates
    only = listed(JOB_FILTER="^mnist1d--P16-")
    assert sorted(only) == sorted(n for n in names if n.startswith("mnist1d--P16-")) and len(only) == 21
    (tmp_path / "mnist1d--P16-adasum-s0").mkdir()
    (tmp_path / "mnist1d--P16-adasum-s0" / "results.jsonl").write_text("{}\n{}\n")
    done = subprocess.run(["bash", str(script), "gpu"], env={**env, "JOB_FILTER": "^mnist1d--P16-adasum-s0$"},
                          capture_output=True, text=True, check=True)
    assert done.stdout.startswith("mnist1d--P16-adasum-s0: 2 runs finished")
    # the unscaled methods' grid goes a step higher at 64 and 128 workers (their best rate grows with P)
    full = subprocess.run(["bash", str(script), "gpu"], env=env, capture_output=True, text=True, check=True).stdout
    args = {line.split(":")[0]: line for line in full.splitlines()}
    assert "--lr 0.003,0.01,0.03,0.1,0.3,1,3 " in args["mnist1d--P64-mean-s0"]
    assert "--lr 0.001,0.003,0.01,0.03,0.1,0.3,1 " in args["mnist1d--P64-adasum-s0"]
    assert "--lr 0.001,0.003,0.01,0.03,0.1,0.3,1 " in args["mnist1d--P32-slowmo-s0"]


@pytest.mark.parametrize("seeds, lrs, message", [
    ([0, 0, 1], [0.05], "seeds 0,0,1 repeat 0"),
    ([0], [0.05, 0.05], "learning rates 0.05,0.05 repeat 0.05"),
    ([0], [0.01, 0.01000001], "learning rates 0.01,0.01000001 give 0.01 and 0.01000001 one run name (lr0.01)"),
])
def test_a_sweep_with_a_repeated_seed_or_learning_rate_is_refused_before_any_run(tmp_path, seeds, lrs, message):
    seen = []
    with pytest.raises(ValueError) as error:
        compare(parse_methods("adasum"), [2], lrs, RunConfig(epochs=1), tmp_path, seeds=seeds,
                train=lambda config, *a, **k: seen.append(config) or _fake(config), plot=lambda results, out: [])
    assert str(error.value).startswith(message + ": each is ") and str(error.value).endswith("; give each once")
    assert seen == [] and not (tmp_path / "results.jsonl").exists()


def test_compare_with_a_repeated_seed_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["compare", "--methods", "adasum", "--workers", "2", "--lr", "0.05", "--seeds", "0,0",
                 "--out", str(out), *QUICK]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["adasum: error: seeds 0,0 repeat 0: each is a run of every cell; give each once"]
    assert not (out / "runs").exists()


def test_a_second_sweep_into_a_folder_in_use_is_refused_in_one_line(tmp_path, capsys):
    """While a sweep runs (its first run, here), a second `adasum compare` into its folder is refused at once, in one
    line, exit 2; the first one's rows all land (two sweeps at once lost a finished run)."""
    second = []

    def train_and_meanwhile(config, *args, **kwargs):
        if not second:
            second.append(main(["compare", "--methods", "adasum", "--workers", "2", "--lr", "0.05", "--seeds", "7",
                                "--out", str(tmp_path), "--resume", *QUICK]))
        return _fake(config)

    quick = RunConfig(task="sklearn-digits", epochs=1)
    compare(parse_methods("sequential,adasum"), [2], [0.05], quick, tmp_path, seeds=[0, 1],
            train=train_and_meanwhile, plot=lambda results, out: [])
    err = capsys.readouterr().err.strip().splitlines()
    assert second == [2] and len(err) == 1, (second, err)
    assert err[0] == (f"adasum: error: {tmp_path}: another adasum compare is writing into this folder; wait for it "
                      "to end, or use another --out"), err
    assert sorted((r["method"], r["seed"]) for r in rows(tmp_path)) == [
        ("adasum", 0), ("adasum", 1), ("sequential", 0), ("sequential", 1)]
    # the folder is free again once the sweep ended (the lock is the process's, no file is left)
    compare(parse_methods("adasum"), [2], [0.05], quick, tmp_path, seeds=[7], resume=True,
            train=lambda config, *a, **k: _fake(config), plot=lambda results, out: [])
    assert len(rows(tmp_path)) == 5 and sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "results.jsonl"]


def test_a_full_disk_while_appending_a_row_names_the_results_file(tmp_path, capsys, monkeypatch):
    import builtins
    import errno

    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def opener(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if str(file).endswith("results.jsonl") and mode == "a" else f

    monkeypatch.setattr(builtins, "open", opener)
    quick = RunConfig(task="sklearn-digits", epochs=1)
    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'results.jsonl'}: No space left on device"):
        compare(parse_methods("adasum"), [2], [0.05], quick, tmp_path, seeds=[0],
                train=lambda config, *a, **k: _fake(config), plot=lambda results, out: [])
