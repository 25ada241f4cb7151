"""The pre-registered study's statistics and analysis (adasum.experiments.study, stats), and the guards
that keep the results page and its stored rows tied to the code."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest

from adasum.experiments import stats
from adasum.experiments import study as st
from adasum.experiments.stats import detectable_difference, failure_p, sign_flip_p

ROOT = Path(__file__).resolve().parents[1]


# --- the exact tests ----------------------------------------------------------------------------------------


def _sign_flip_reference(d: list[float]) -> float:
    """Every sign pattern, counted one by one."""
    observed = abs(sum(d))
    hits = sum(abs(sum(s * x for s, x in zip(signs, d))) >= observed - 1e-12
               for signs in itertools.product((1, -1), repeat=len(d)))
    return hits / 2 ** len(d)


@pytest.mark.parametrize("n", [2, 3, 6, 9])
def test_sign_flip_equals_the_enumeration(n):
    rng = random.Random(n)
    for _ in range(20):
        d = [rng.gauss(0.5, 1.0) for _ in range(n)]
        assert sign_flip_p(d) == pytest.approx(_sign_flip_reference(d), abs=1e-12)


def test_equal_differences_get_the_smallest_exact_p_not_zero():
    """The t-test's limit gave p = 0 for equal differences, which passes any correction."""
    for n in (2, 5, 10):
        assert sign_flip_p([1.5] * n) == pytest.approx(2 / 2**n)
    assert sign_flip_p([0.0] * 6) == 1.0
    assert math.isnan(sign_flip_p([1.0]))


def test_detectable_difference_matches_the_spec_and_the_normal_approximation():
    """SPEC: n = 3, m = 144 needs about 39 s; n = 5, m = 8 about 2.8 s (the noncentral t a little more);
    n = 10, m = 3 about 1.2 s. The approximation (t_{1-a/2m} + t_{0.8}) s / sqrt(n) is a lower bound."""
    from scipy import stats

    assert detectable_difference(1.0, 3, 144) == pytest.approx(39, abs=1)
    assert 2.8 <= detectable_difference(1.0, 5, 8) <= 3.1
    assert detectable_difference(1.0, 10, 3) == pytest.approx(1.2, abs=0.05)
    for n, m in [(5, 1), (10, 6), (20, 6)]:
        approx = (stats.t.ppf(1 - 0.05 / (2 * m), n - 1) + stats.t.ppf(0.8, n - 1)) / math.sqrt(n)
        found = detectable_difference(1.0, n, m)
        assert approx * 0.97 <= found <= approx * 1.1
        assert detectable_difference(2.0, n, m) == pytest.approx(2 * found, rel=1e-6)  # linear in the spread


def test_detectable_difference_has_the_power_it_claims():
    """A simulated paired t-test at the returned difference rejects in about 80 % of 4,000 draws."""
    import numpy as np
    from scipy import stats

    n, m = 10, 6
    delta = detectable_difference(1.0, n, m)
    rng = np.random.default_rng(0)
    d = rng.normal(delta, 1.0, size=(4000, n))
    p = stats.ttest_1samp(d, 0.0, axis=1).pvalue
    assert abs(float(np.mean(p < 0.05 / m)) - 0.8) < 0.025  # 4 standard errors of a proportion of 4,000


def test_failure_test_is_the_sign_test_on_discordant_seeds():
    assert failure_p([True] * 6 + [False] * 4, [False] * 10) == pytest.approx(2 / 2**6)
    assert failure_p([True, False, True], [True, False, True]) == 1.0  # no seed splits them
    assert failure_p([True, False], [False, True]) == 1.0
    with pytest.raises(ValueError, match="unequal length"):
        failure_p([True], [True, False])


# --- the analysis on rows with a planted answer -------------------------------------------------------------


TOY = replace(
    st.FASHION_CNN,
    name="toy",
    workers=(4,),
    methods=MappingProxyType({"sequential": (0.01, 0.1, 1.0), "mean": (0.01, 0.1, 1.0), "adasum": (0.01, 0.1, 1.0)}),
    only=MappingProxyType({}),
    pilot_seeds=(100, 101),
    confirm_seeds=tuple(range(10)),
    budget=1,
    epochs=2,
    primary=(st.Hypothesis("H1", "adasum beats the mean", "adasum", "mean", 4, budget=1),
             st.Hypothesis("H2", "the rule fails", "mean-scaled", "adasum", 4, kind="failures", budget=1)),
)


def _row(method, workers, lr, seed, accuracy, epochs, val=None, chance=10.0):
    val = accuracy if val is None else val
    history = [{"epoch": e, "val_accuracy": val if e == epochs else val - 5, "test_accuracy": accuracy,
                "val_loss": 0.5, "diverged": False} for e in range(1, epochs + 1)]
    curve = [{"step": 10 * e, "epoch": e, "val_accuracy": h["val_accuracy"]} for e, h in enumerate(history, 1)]
    config = {"task": "fashion-mnist", "model": "cnn", "batch_size": 32, "optimizer": "sgd"}
    return {"method": method, "workers": workers, "lr": lr, "seed": seed, "epochs": epochs, "history": history,
            "curve": curve, "config": config, "chance_accuracy": chance, "steps": 10 * epochs, "epochs_run": epochs,
            "batch_size": 32}


def _pilot(shape):
    """Pilot rows: validation accuracy by cell and rate from `shape`."""
    rows = []
    for (method, workers), scores in shape.items():
        for lr, score in scores.items():
            rows += [_row(method, workers, lr, s, score, TOY.budget) for s in TOY.pilot_seeds]
    return rows


PILOT = {("sequential", 1): {0.01: 80, 0.1: 85, 1.0: 20}, ("mean", 4): {0.01: 70, 0.1: 80, 1.0: 82},
         ("adasum", 4): {0.01: 81, 0.1: 84, 1.0: 10}}


def test_picks_are_on_validation_and_edges_are_extended():
    rows = _pilot(PILOT)
    chosen = st.picks(rows, TOY)
    assert chosen[("adasum", 4)] == (0.1, False) and chosen[("mean", 4)] == (1.0, True)
    assert st.extensions(rows, TOY) == {("mean", 4): [3.16]}
    rows += _pilot({("mean", 4): {3.16: 60}})  # the step past the edge is worse: the pick is now interior
    assert st.picks(rows, TOY)[("mean", 4)] == (1.0, False) and st.extensions(rows, TOY) == {}


def _confirm(rows, effect, rule_failures):
    chosen = st.picks(rows, TOY)
    rng = random.Random(effect)
    out = list(rows)
    for config in st.confirm_runs(TOY, chosen):
        base = 80 + rng.gauss(0, 1.0) + config.seed * 0.3  # seeds differ, pairs share the seed's part
        if config.method == "adasum":
            base += effect
        failed_run = config.method == "mean-scaled" and config.seed < rule_failures
        # a failure judged on validation: validation at chance while the test accuracy looks fine
        out.append(_row(config.method, config.workers, config.lr, config.seed, base, config.epochs,
                        val=10.0 if failed_run else base))
    return out


def test_a_planted_difference_is_found_and_none_is_not_invented():
    rows = _pilot(PILOT)
    found = st.analyze(_confirm(rows, effect=2.0, rule_failures=0), TOY).outcomes[0]
    assert found.verdict == "better" and found.effect == pytest.approx(2.0, abs=0.8) and found.n == 10
    assert found.p == pytest.approx(2 / 2**10) or found.p < 0.01
    none = st.analyze(_confirm(rows, effect=0.0, rule_failures=0), TOY).outcomes[0]
    assert none.verdict == "no difference the test could see"


def test_runs_at_a_pick_the_extension_moved_are_left_out():
    # confirmatory runs made at mean's edge pick (1.0), then the extension moves the pick to 3.16: the runs at
    # 1.0 stay in the rows but no table, test or figure counts them as mean's cell
    rows = _pilot(PILOT)
    stale = [_row("mean", 4, 1.0, s, 99.0, TOY.epochs) for s in TOY.confirm_seeds[:3]]
    rows += _pilot({("mean", 4): {3.16: 90, 10.0: 50}}) + stale
    assert st.picks(rows, TOY)[("mean", 4)] == (3.16, False)
    rows = _confirm(rows, effect=0.0, rule_failures=0)
    cells = {(c.method, c.lr): c.seeds for c in st.analyze(rows, TOY).cells}
    assert ("mean", 1.0) not in cells and cells[("mean", 3.16)] == 10
    assert [k for k in st.groups(rows, TOY) if k[0].startswith("mean ")] == []


def test_failures_are_judged_on_validation_and_tested_exactly():
    rows = _confirm(_pilot(PILOT), effect=0.0, rule_failures=8)
    outcome = st.analyze(rows, TOY).outcomes[1]
    assert outcome.detail.startswith("8/10 failed against 0/10")
    assert outcome.p == pytest.approx(2 / 2**8)
    assert outcome.p_holm == pytest.approx(min(1.0, 2 * outcome.p)) or outcome.p_holm >= outcome.p


def test_steps_to_target_counts_runs_that_never_reach_it():
    from adasum.experiments.figures import censored_median

    assert censored_median([10, 20, None]) == 20
    assert censored_median([10, None, None]) is None
    assert censored_median([]) is None
    row = _row("adasum", 4, 0.1, 0, 80.0, 2)
    assert st.steps_to(row, 74.0) == 10 and st.steps_to(row, 80.0) == 20 and st.steps_to(row, 81.0) is None


def test_the_figures_are_drawn_at_publication_resolution(tmp_path):
    from PIL import Image

    rows = _confirm(_pilot(PILOT), effect=1.0, rule_failures=3)
    written = st.draw(rows, TOY, tmp_path)
    assert {p.name for p in written} == {"toy-curves.png", "toy-steps.png"}
    for path in written:
        dpi = Image.open(path).info.get("dpi", (0, 0))
        assert round(dpi[0]) >= 150


# --- the page and the code stay tied to the rows ------------------------------------------------------------


def test_the_results_page_is_what_its_rows_give():
    done = subprocess.run([sys.executable, "benchmarks/render_results.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_adasum_report_draws_a_study_from_its_rows(tmp_path, capsys):
    """`adasum report --design NAME ROWS` gives the page's tables for that study (every one the page shows) and
    its figures; without --design, the mixed settings of a pilot and a confirmation name the flag to pass."""
    import re

    from adasum.experiments.cli import main

    rows = ROOT / "benchmarks" / "results" / "study-english-word2vec.jsonl.gz"
    assert main(["report", str(rows), "--out", str(tmp_path / "plain")]) == 2
    assert "pass --design english-word2vec" in capsys.readouterr().err
    assert main(["report", "--design", "english-word2vec", str(rows), "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    page = (ROOT / "docs" / "results.md").read_text()
    shown = re.findall(r"<!-- rendered: (english-word2vec-[\w-]+) -->\n\n(.*?)\n\n<!-- end -->", page, re.S)
    assert len(shown) >= 4
    for name, table in shown:
        assert f"<!-- {name} -->\n\n{table}" in report, name
    for figure in ("english-word2vec-curves.png", "english-word2vec-steps.png"):
        assert f"]({figure})" in report and (tmp_path / figure).stat().st_size > 10_000
    assert main(["report", "--design", "fashion-mnist-cnn", str(rows), "--out", str(tmp_path / "other")]) == 2
    assert "pass --design english-word2vec: they are the study english-word2vec's" in capsys.readouterr().err


def test_the_stored_cell_comes_out_of_the_current_code():
    """A small cell of the demo's setting, re-run on CPU: a change that alters training (the dropout change
    that moved the CNN's one-epoch accuracy from 43 % to 68 % did) fails here. The bound: reordering float
    sums (1 against 2 CPU threads) moved the sequential run's test accuracy by 0.3 points and its loss by
    2.5e-4 relative; the tolerances are about 4 times that."""
    import torch

    from adasum.experiments.runner import RunConfig, train

    stored = json.loads((ROOT / "benchmarks" / "results" / "stored-cell.json").read_text())["cells"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for cell in stored:
            result = train(RunConfig(**cell["config"]))
            label = f"{cell['config']['method']} P={cell['config']['workers']}"
            assert result["test_accuracy"] == pytest.approx(cell["test_accuracy"], abs=1.0), label
            assert result["val_accuracy"] == pytest.approx(cell["val_accuracy"], abs=1.0), label
            assert result["test_loss"] == pytest.approx(cell["test_loss"], rel=1e-3), label
            curve = [p["val_accuracy"] for p in result["curve"]]
            assert curve == pytest.approx(cell["curve_val_accuracy"], abs=1.0), label
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(st.DESIGNS))
def test_every_primary_test_can_reach_its_holm_level(name):
    """The exact sign-flip test with n pairs never gives p below 2 / 2^n: a design whose primary cells have too
    few seeds for Holm's first level (0.05 / family) could never give a verdict, whatever the effect."""
    design = st.DESIGNS[name]
    for h in design.primary:
        if h.kind != "accuracy":
            continue
        n = len(set(design.seeds(h.method, h.workers)) & set(design.seeds(h.against, h.workers)))
        assert 2 / 2**n < st.ALPHA / len(design.primary), f"{h.name}: {n} seeds"


def test_added_seeds_go_to_the_primary_cells_only():
    design = replace(TOY, primary_seeds=(77, 78))
    chosen = {("sequential", 1): (0.1, False), ("mean", 4): (0.1, False), ("adasum", 4): (0.1, False),
              ("adacons", 4): (0.1, False)}
    runs = st.confirm_runs(design, chosen)
    extra = {(c.method, c.workers) for c in runs if c.seed in (77, 78)}
    assert extra == {("mean", 4), ("adasum", 4)}


def test_a_design_without_sequential_takes_its_fixed_rate_and_target():
    """A design that borrows sequential training's pick and target from an earlier design runs its rule cells at
    that rate, tests their failures, and counts steps to that target."""
    design = replace(TOY, name="toy-rule", methods=MappingProxyType({}), pilot_seeds=(), rule_lr=0.1, target=80.0)
    runs = st.confirm_runs(design, {})
    assert {(c.method, c.workers, c.lr) for c in runs} == {("mean-scaled", 4, 0.1), ("adasum", 4, 0.1)}
    assert {c.seed for c in runs} == set(design.confirm_seeds)
    rows = [_row(c.method, c.workers, c.lr, c.seed, 85.0 if c.method == "adasum" else 10.0, c.epochs,
                 chance=10.0) for c in runs]
    assert st.target_accuracy(rows, design) == 80.0
    analysis = st.analyze(rows, design)
    failures = next(o for o in analysis.outcomes if o.hypothesis.kind == "failures")
    assert failures.effect == len(design.confirm_seeds)
    assert failures.p == pytest.approx(2 / 2 ** len(design.confirm_seeds))
    assert "an earlier design's pick" in failures.detail


def _scored(row, score):
    """A row whose evaluations record a task score (``scores["wordsim353"]``) beside their accuracy."""
    for point in row["history"]:
        point["scores"] = {"wordsim353": score}
    return row


@pytest.mark.parametrize("shift, verdict", [(0.5, "equivalent within 5 points"), (6.0, "not shown equivalent")])
def test_an_equivalence_test_on_a_task_score(shift, verdict):
    """A design whose metric is a task score tests it (not test accuracy), and an equivalence hypothesis says
    "equivalent" only when the paired differences sit well inside the margin: the same runs with the score moved
    past the margin are not shown equivalent."""
    design = replace(
        TOY, name="toy-score", metric="wordsim353", rule=(),
        primary=(st.Hypothesis("W", "adasum matches sequential", "adasum", "sequential", 4, kind="equivalence",
                               budget=1, margin=5.0),),
    )
    chosen = {("sequential", 1): (0.1, False), ("adasum", 4): (0.1, False), ("mean", 4): (0.1, False)}
    rows = []
    for c in st.confirm_runs(design, chosen):
        jitter = 0.1 * (c.seed % 3)  # unequal differences; accuracy says the opposite of the score
        score = 40.0 + (shift + jitter if c.method == "adasum" else 0.0)
        rows.append(_scored(_row(c.method, c.workers, c.lr, c.seed, 90.0 if c.method != "adasum" else 60.0,
                                 c.epochs), score))
    rows += [_scored(r, 40.0) for r in _pilot({("sequential", 1): {0.1: 85}, ("mean", 4): {0.1: 80},
                                                 ("adasum", 4): {0.1: 84}})]
    outcome = st.analyze(rows, design).outcomes[0]
    assert outcome.effect == pytest.approx(shift + 0.1 * statistics.fmean(s % 3 for s in design.confirm_seeds))
    assert outcome.verdict == verdict
    table = st.render(rows, design)["toy-score-primary"]
    assert "WordSim-353 score after 1 epochs within +-5 points" in table


def test_equivalence_p_is_the_larger_one_sided_p_by_enumeration():
    """`equivalence_p` against a direct enumeration of the sign patterns of the shifted differences."""
    import itertools

    differences, margin = [1.0, -2.0, 0.5, 3.0, -0.5, 1.5, 2.5], 3.0

    def greater(d):
        observed = sum(d)
        patterns = list(itertools.product((1, -1), repeat=len(d)))
        return sum(sum(s * v for s, v in zip(p, d)) >= observed - 1e-12 for p in patterns) / len(patterns)

    expected = max(greater([d + margin for d in differences]), greater([margin - d for d in differences]))
    assert stats.equivalence_p(differences, margin) == pytest.approx(expected, abs=0)
