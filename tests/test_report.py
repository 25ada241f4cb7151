"""The report's verdicts: paired comparisons by seed with Holm's correction, failed runs counted apart,
bounded intervals, one setting per report, one-line messages for malformed rows."""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import pytest

from adasum.experiments.cli import main
from adasum.experiments.report import comparisons, load_results, plot, summary_table, write_report
from adasum.experiments.runner import RunConfig, identity
from adasum.experiments.stats import Paired, Stat, holm


def run(method: str, workers: int, seed: int, test: float, *, lr: float = 0.05, collapsed: bool = False,
        diverged: bool = False, **setting) -> dict:
    """A row as `adasum compare` writes it (validation accuracy = test accuracy)."""
    config = RunConfig(method=method, workers=workers, lr=lr, seed=seed, **setting)
    return {"method": method, "workers": workers, "lr": lr, "effective_lr": lr, "seed": seed,
            "epochs": config.epochs, "val_accuracy": test, "test_accuracy": test, "test_loss": 1.0,
            "diverged": diverged, "collapsed": collapsed, "steps": 10, "wall_s": 0.1, "chance_accuracy": 10.0,
            "history": [{"epoch": 1, "test_accuracy": test, "test_loss": 1.0, "orthogonality": None}],
            "orthogonality_trace": [], "config": identity(asdict(config)), "task": config.task}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def synthetic_study(effect: float, seeds: int = 8, seed_sd: float = 3.0, noise_sd: float = 0.3,
                    draw: int = 0) -> list[dict]:
    """Sequential, the scaled mean and Adasum at 8 workers; a seed moves every method alike (seed_sd),
    each run adds its own noise (noise_sd); Adasum is `effect` points above the scaled mean, which
    equals sequential training."""
    rng = random.Random(draw)
    rows = []
    for s in range(seeds):
        shared = 90.0 + rng.gauss(0.0, seed_sd)
        rows += [run("sequential", 1, s, shared + rng.gauss(0.0, noise_sd)),
                 run("mean-scaled", 8, s, shared + rng.gauss(0.0, noise_sd)),
                 run("adasum", 8, s, shared + effect + rng.gauss(0.0, noise_sd))]
    return rows


def found(rows: list[dict]) -> dict[tuple[str, str], object]:
    return {(c.method, c.against): c for c in comparisons(rows)}


def test_a_known_true_difference_is_detected_by_pairing_seeds():
    rows = synthetic_study(effect=2.0)
    got = found(rows)
    win = got[("adasum", "mean-scaled")]
    assert win.verdict == "better" and win.diff.lo < 2.0 < win.diff.hi and win.diff.n == 8
    assert got[("mean-scaled", "sequential")].verdict == "no detectable difference"
    text = summary_table(rows)
    line = next(x for x in text.splitlines() if x.startswith("| adasum | 8 |"))
    assert line.count(": better ([+") == 2 and "seeds)" not in line  # 8 seeds: no label
    assert "3 tested comparisons" in text and "2 of the 3 paired comparisons show a difference" in text
    # over 20 such studies pairs find the 2 points almost always; non-overlapping intervals over
    # seeds (3 points of spread) almost never
    paired = overlap = 0
    for draw in range(20):
        rows = synthetic_study(effect=2.0, draw=draw)
        paired += found(rows)[("adasum", "mean-scaled")].verdict == "better"
        acc = {m: Stat.of([r["test_accuracy"] for r in rows if r["method"] == m]) for m in ("adasum", "mean-scaled")}
        overlap += acc["adasum"].lo > acc["mean-scaled"].hi
    assert paired >= 18 and overlap <= 2, (paired, overlap)
    # no true difference: nothing is called
    assert {c.verdict for c in comparisons(synthetic_study(effect=0.0))} == {"no detectable difference"}


def test_holm_adjusts_over_the_comparisons_of_one_report():
    assert holm([0.01, 0.04, 0.03, float("nan")])[:3] == [0.03, 0.06, 0.06]
    # one raw p of 0.015 among 20 comparisons: significant alone, not after the correction
    ps = holm([0.015] + [0.5] * 19)
    assert ps[0] == pytest.approx(0.3) and all(p >= 0.5 for p in ps[1:])
    d = Paired.of([91.0, 92.0, 93.0, 90.5], [90.0, 90.0, 90.0, 90.0])
    from scipy import stats

    assert d.p == pytest.approx(2 / 2**4)  # the exact sign-flip test: all 4 differences of one sign
    assert d.p > stats.ttest_rel([91.0, 92.0, 93.0, 90.5], [90.0] * 4).pvalue  # the t-test claims more
    # no spread, a difference: the exact test's smallest p for 2 pairs, not the t-test's limit of 0
    assert Paired.of([91.0, 92.0], [90.0, 91.0]).p == 0.5
    many = [90.0 + 0.1 * i for i in range(25)]  # past the exact test's reach: the t-test
    assert Paired.of(many, [x - 1.0 + 0.01 * (i % 3) for i, x in enumerate(many)]).p < 1e-10
    assert Paired.of([91.0], [90.0]).n == 1 and Paired.of([91.0], [90.0]).p != Paired.of([91.0], [90.0]).p


def test_fewer_than_five_seeds_are_labelled():
    text = summary_table(synthetic_study(effect=3.0, seeds=3))
    assert "of 3 seeds, " in text and "With 3 seeds (fewer than 5" in text


def test_few_seeds_show_their_range_and_counts_not_a_t_interval():
    """Over 2 or 3 seeds a t-interval says next to nothing ([0.0, 100.0]): cells give the mean and the count of
    runs beside their min-max, comparisons the seeds on which the method is higher and the range of the
    differences."""
    rows = [run("sequential", 1, s, acc) for s, acc in enumerate([95.0, 96.0, 94.0])]
    rows += [run("adasum", 8, s, acc) for s, acc in enumerate([96.5, 95.0, 97.0])]
    text = summary_table(rows)
    line = next(x for x in text.splitlines() if x.startswith("| adasum | 8 |"))
    assert "| 96.17 (3 runs) | 95.0-97.0 |" in line, line
    assert "+1.17: no detectable difference (higher on 2 of 3 seeds, -1.0 to +3.0, Holm p" in line, line
    assert "[" not in line.split("|")[6], line  # no interval in the accuracy cell
    assert "above sequential training by 1.17 points (higher on 2 of 3 seeds)" in text  # the conclusion
    two = summary_table([run("sequential", 1, s, 95.0 + s) for s in range(2)])
    assert "| 95.50 (2 runs) | 95.0-96.0 |" in two and "[0.0, 100.0]" not in two
    five = summary_table(synthetic_study(effect=2.0, seeds=5))
    assert "(5 runs)" not in five and "([+" in five  # from 5 seeds on: the t-intervals


def test_paired_intervals_are_clipped_to_the_possible_differences():
    d = Paired.of([91.0, 95.0, 30.0], [90.0, 90.0, 90.0])  # the t-interval would start at -108.5
    assert d.lo == -100.0 and d.hi < 100.0 and (d.higher, d.min, d.max) == (2, -60.0, 5.0)
    assert Paired.of([100.0, 0.0, 100.0, 0.0, 100.0], [0.0] * 5).hi == 100.0


def test_a_run_still_learning_is_not_called_collapsed():
    """The runner flags a 1-epoch run at 21.8 % (10 classes) at chance: its training loss never fell below
    guessing's over the epoch; the report calls it not learnt yet, apart from a run that really ends at chance."""
    rows = [run("sequential", 1, s, 95.0 + 0.1 * s) for s in range(5)]
    rows += [run("mean-scaled", 16, s, acc, collapsed=acc < 25) for s, acc in enumerate([21.8, 11.0, 93.0, 92.0, 94.0])]
    line = next(x for x in summary_table(rows).splitlines() if x.startswith("| mean-scaled | 16 |"))
    assert "2/5 failed (1 at chance, 1 not learnt yet)" in line, line
    from adasum.experiments.cli import failure_note

    learning = run("adasum", 4, 0, 21.8, collapsed=True)
    assert failure_note(learning) == " (not learnt yet: more epochs would tell)"
    assert failure_note({**learning, "test_accuracy": 11.0}) == " (collapsed to chance)"


def test_robustness_does_not_reward_a_method_equally_bad_at_every_rate(tmp_path):
    """The scaled mean at 42 % at both rates used to get the widest range (within 1 point of its own best);
    against the best method's best (Adasum's 95) it has none, and Adasum's range is its own."""
    from adasum.experiments.report import robustness, robustness_table

    rows = []
    for s in range(3):
        rows += [run("sequential", 1, s, 96.0, lr=lr) for lr in (0.01, 0.1)]
        rows += [run("mean-scaled", 8, s, 42.0, lr=lr) for lr in (0.01, 0.1)]
        rows += [run("adasum", 8, s, acc, lr=lr) for lr, acc in ((0.01, 94.5), (0.1, 95.0))]
    rob = robustness(rows)
    assert rob[("mean-scaled", 8)].width is None and rob[("mean-scaled", 8)].reference == 95.0
    assert (rob[("adasum", 8)].range_lo, rob[("adasum", 8)].range_hi, rob[("adasum", 8)].width) == (0.01, 0.1, 10.0)
    table = robustness_table(rows)
    assert "| mean-scaled | 8 | 42.00 | 42.00 | 0.01 (grid edge) | 95.00 | none | - |" in table, table
    assert "| adasum | 8 |" in table and "| 0.01-0.1 | 10 |" in table
    assert "lr range within 1 point of it" in write_report(rows, tmp_path).read_text()


def test_plurals_and_the_setting_of_one_epoch():
    from adasum.experiments.report import setting_line

    one = setting_line(
        [{"task": "digits", "model": "cnn", "batch_size": 8, "epochs": 1, "seed": 0, "optimizer": "sgd"}]
    )
    assert "1 epoch," in one and "1 epochs" not in one
    text = summary_table([run("sequential", 1, 0, 95.0), run("adasum", 8, 0, 96.0)])
    assert "With 1 seed (" in text and "1 seeds" not in text


def test_the_terminal_gets_the_summary_rendered_and_a_pipe_gets_markdown():
    import io

    from adasum.experiments.report import to_terminal

    text = summary_table(synthetic_study(effect=2.0))
    piped, shown = io.StringIO(), io.StringIO()
    to_terminal(text, piped)  # not a terminal: the markdown as report.md has it
    assert piped.getvalue() == text + "\n"
    to_terminal(text, shown, terminal=True)
    out = shown.getvalue()
    assert "| --- |" not in out and "| adasum | 8 |" not in out and "─" in out  # a drawn table, no markdown
    assert "Conclusion." in out and "**Conclusion.**" not in out


def test_a_bimodal_cell_counts_failures_apart_with_a_bounded_interval():
    rows = [run("sequential", 1, s, 95.0 + 0.2 * s) for s in range(5)]
    rows += [run("adasum", 16, s, 94.0 + 0.1 * s) for s in range(5)]
    # the scaled mean: two good seeds, two flagged at chance, one at 23.5 % that no flag caught
    scaled = {0: 9.0, 1: 73.4, 2: 23.5, 3: 11.0, 4: 93.0}
    rows += [run("mean-scaled", 16, s, acc, collapsed=acc < 12) for s, acc in scaled.items()]
    text = summary_table(rows)
    line = next(x for x in text.splitlines() if x.startswith("| mean-scaled | 16 |"))
    assert "3/5 failed (2 at chance, 1 near chance)" in line
    good = Stat.of([73.4, 93.0])
    assert good.hi == 100.0 and good.lo >= 0.0  # 83.2 +- 124 clipped to [0, 100]
    assert f"{good.mean:.2f} (2 runs) | 73.4-93.0" in line  # two runs: their range, no interval
    adasum = next(x for x in text.splitlines() if x.startswith("| adasum | 16 |"))
    assert "failed 0/5 vs 3/5" in adasum and "0/5 failed" in adasum
    assert "mean-scaled at 16 workers failed in 3 of 5 runs and every other row in none" in text
    # a threshold set by the user replaces the midpoint rule
    assert "2/5 failed (2 at chance)" in summary_table(rows, fail_below=20.0)
    assert "4/5 failed (2 at chance, 2 below 80%)" in summary_table(rows, fail_below=80.0)


def test_one_learning_rate_hides_the_learning_rate_views(tmp_path):
    rows = synthetic_study(effect=1.0)
    assert [p.name for p in plot(rows, tmp_path)] == ["accuracy.png", "loss.png", "orthogonality.png"]
    report = write_report(rows, tmp_path).read_text()
    assert "robustness" not in report and "lr.png" not in report and "picked on val." not in report
    assert "*orthogonality*:" in report and "**Conclusion.**" in report and "Columns:" in report
    more = rows + [run("adasum", 8, s, 50.0, lr=0.5) for s in range(5)]
    assert "lr.png" in [p.name for p in plot(more, tmp_path)]
    assert "## Learning-rate robustness" in write_report(more, tmp_path).read_text()


def test_report_refuses_runs_of_different_settings(tmp_path, capsys):
    a = write_rows(tmp_path / "a" / "results.jsonl", [run("adasum", 4, s, 90.0, epochs=8) for s in range(3)])
    b = write_rows(tmp_path / "b.jsonl", [run("sequential", 1, s, 91.0, epochs=2, train_limit=512)
                                          for s in range(3)])
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another setting" in err[0] and "train_limit None -> 512" in err[0], err
    assert "epochs 8 -> 2" in err[0] and f"{b}: row 1" in err[0]
    with pytest.raises(ValueError, match="another setting"):
        write_report(load_results([a]) + load_results([b]), tmp_path)
    # the same setting in two files: one report, a run found twice counted once
    c = write_rows(tmp_path / "c.jsonl", [run("sequential", 1, s, 91.0, epochs=8) for s in range(3)] + [
        run("adasum", 4, 0, 90.0, epochs=8)])
    assert len(load_results([a.parent, c])) == 6


@pytest.mark.parametrize("damage, named", [
    (lambda r: r.pop("orthogonality_trace"), "row 2: lacks orthogonality_trace"),
    (lambda r: r.pop("seed"), "row 2: lacks seed"),
    (lambda r: r.update(test_accuracy="high"), "row 2: test_accuracy is 'high', not int or float"),
    (lambda r: r.update(workers=True), "row 2: workers is True, not int"),
    (lambda r: r["history"][0].pop("test_loss"), "row 2: an epoch of its history lacks"),
    (lambda r: r.clear() or r.update(text=[1]), "row 2: lacks method"),
])
def test_malformed_rows_give_one_line_messages(tmp_path, capsys, damage, named):
    rows = [run("adasum", 4, s, 90.0) for s in range(3)]
    damage(rows[1])
    path = write_rows(tmp_path / "results.jsonl", rows)
    assert main(["report", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and str(path) in err[0], err


def test_bad_json_and_non_objects_give_one_line_messages(tmp_path, capsys):
    good = json.dumps(run("adasum", 4, 0, 90.0))
    for text, named in [(f"{good}\n{{not json\n{good}\n", "line 2 is not JSON"),
                        (f"{good}\n[1, 2]\n", "line 2 is a JSON list, not an object")]:
        path = tmp_path / "results.jsonl"
        path.write_text(text)
        assert main(["report", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0], err


def test_comparisons_outside_the_summary_join_the_family():
    from adasum.experiments.report import adjust, pair

    rows = synthetic_study(effect=2.0)
    extra = pair(rows, ("adasum", 8), ("sequential", 1))
    assert extra.p_holm != extra.p_holm and extra.diff.n == 8  # not adjusted until its family is known
    family = adjust([*comparisons(rows), extra])
    assert family[-1].p_holm >= extra.diff.p and family[-1].verdict == "better"


def test_the_setting_line_names_momentum_only_where_the_optimizer_takes_it():
    """An Adam or LAMB run records no momentum (None): the report's setting line leaves it out; SGD's is named."""
    from adasum.experiments.report import setting_line

    run = {"task": "digits", "model": "cnn", "batch_size": 8, "epochs": 2, "seed": 0}
    assert "(momentum 0.9)" in setting_line([{**run, "optimizer": "sgd", "momentum": 0.9}])
    adam = setting_line([{**run, "optimizer": "adam", "momentum": None}])
    assert "momentum" not in adam and "optimizer `adam`, 8 examples per worker" in adam


def test_sweeps_that_differ_only_in_epochs_are_refused_not_merged(tmp_path, capsys):
    a = write_rows(tmp_path / "a.jsonl", [run("adasum", 4, s, 90.0, epochs=4) for s in range(3)])
    b = write_rows(tmp_path / "b.jsonl", [run("adasum", 4, s, 80.0, epochs=2) for s in range(3)])
    for order in ((a, b), (b, a)):
        assert main(["report", *map(str, order), "--out", str(tmp_path / "out"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "another setting" in err[0] and "epochs" in err[0], err


@pytest.mark.parametrize("hostile, named", [
    ("workers", "the results hold 65 distinct values of workers; a report takes at most 64"),
    ("nested", "line 2 nests too deeply to be a result"),
    ("newline", "row 2: method is 'adasum\\n## injected', not a method name (letters, digits, _ . + -)"),
])
def test_hostile_results_files_cost_little_and_end_in_one_line(tmp_path, capsys, hostile, named):
    import time

    rows = [run("adasum", 4, 0, 90.0)]
    if hostile == "workers":
        rows += [run("adasum", w, 0, 90.0) for w in range(5, 69)]
    path = write_rows(tmp_path / "results.jsonl", rows)
    if hostile == "nested":
        path.write_text(path.read_text() + "[" * 100_000 + "]" * 100_000 + "\n")
    if hostile == "newline":
        rows.append(run("adasum", 4, 1, 90.0))
        rows[-1]["method"] = "adasum\n## injected"
        write_rows(path, rows)
    start = time.monotonic()
    assert main(["report", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert time.monotonic() - start < 10 and not (tmp_path / "out" / "report.md").exists()


class _Writes:
    """A stderr that records each write call (under torchrun every rank's lines share one stream)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_full_disk_while_drawing_names_the_folder_in_one_whole_line(tmp_path, monkeypatch):
    import errno
    import sys

    import matplotlib.figure

    path = write_rows(tmp_path / "results.jsonl", [run("adasum", 4, s, 90.0) for s in range(3)])

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    writes = _Writes()
    monkeypatch.setattr(sys, "stderr", writes)
    assert main(["report", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    assert writes.calls == [f"adasum: error: cannot write the figures in {tmp_path / 'out'}: No space left on "
                            "device\n"], writes.calls  # one write: the message and its newline together


def test_failures_are_judged_on_validation_and_their_counts_tested():
    """A run whose validation accuracy sits near chance failed, whatever its test accuracy; one with a low test
    accuracy but a sound validation accuracy did not. Differing failure counts carry an exact sign test."""
    from adasum.experiments.report import failures

    rows = [run("sequential", 1, s, 90.0) for s in range(6)]
    bad_val = [{**run("mean-scaled", 8, s, 90.0), "val_accuracy": 12.0 if s < 5 else 90.0} for s in range(6)]
    low_test = [{**run("adasum", 8, s, 89.0), "test_accuracy": 40.0 if s == 0 else 89.0} for s in range(6)]
    rows += bad_val + low_test
    failed = failures(rows)
    assert all(id(r) in failed for r in bad_val[:5]) and id(bad_val[5]) not in failed
    assert not any(id(r) in failed for r in low_test)
    cell = next(c for c in comparisons(rows) if (c.method, c.against) == ("mean-scaled", "sequential")).cell()
    assert "failed 5/6 vs 0/6 (exact sign test p 0.0625, unadjusted)" in cell, cell


def test_the_conclusion_counts_failures_at_rates_that_were_not_picked():
    from adasum.experiments.report import conclusion

    rows = [run("sequential", 1, s, 90.0 + s) for s in range(3)]
    rows += [run("adasum", 8, s, 89.0 + s) for s in range(3)]
    rows += [run("adasum", 8, s, 10.0, lr=1.0, collapsed=True) for s in range(3)]  # a rate that was not picked
    text = conclusion(rows, comparisons(rows))
    assert "no run at the picked learning rates failed (3 of the 3 runs at other rates did)" in text, text


def test_figure_colours_follow_a_fixed_order_not_a_sets():
    # labels outside the method list ("... (rule)") tie on their place; the label breaks the tie, so the
    # order, and with it each line's colour, is the same in every process (str hashes are randomised)
    from adasum.experiments.figures import method_order

    labels = ["slowmo", "mean-scaled (rule)", "adasum (rule)", "sequential", "adasum", "custom-b", "custom-a"]
    expected = ["sequential", "mean-scaled (rule)", "adasum", "adasum (rule)", "slowmo", "custom-a", "custom-b"]
    for shift in range(len(labels)):
        assert sorted(labels[shift:] + labels[:shift], key=method_order) == expected
