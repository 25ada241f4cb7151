"""The pre-registered study of convergence speed against the global batch (``docs/protocol.md``).

A `Design` says everything a task's part of the study runs, fixed before its runs: the methods, the worker
counts (global batch = workers x examples per worker), the learning-rate grids, the seeds of the pilot and
of the confirmatory runs, the budgets and the primary hypotheses. The study has two phases:

1. **Pilot** (`pilot_runs`): every tuned method at every worker count over its grid, on the pilot seeds,
   for the primary budget. `picks` takes, per method and worker count, the base learning rate of the
   highest mean validation accuracy at that budget; a pick on the grid's edge is extended by one
   half-decade step (`extensions`) until it is interior (at most `Design.max_extensions` steps).
2. **Confirmation** (`confirm_runs`): the picked rates (and the fixed-rule cells) on new seeds, with
   learning curves (`RunConfig.evals_per_epoch`).

`analyze` reads the rows of both phases: accuracy at fixed budgets, steps to a target validation
accuracy set from sequential training's curve, failures judged on validation data, the primary family
under Holm's correction with the exact sign-flip test, the failure hypotheses with the exact sign test,
and the power of each primary test from the pilot's spread. `render` writes the tables of
``docs/results.md``; `adasum.experiments.figures` draws its figures. Everything is a function of the rows.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from adasum.experiments.figures import censored_median, steps_to, target_below
from adasum.experiments.report import cells as by_cell  # runs by (method, workers, lr)
from adasum.experiments.runner import RunConfig
from adasum.experiments.stats import (
    ALPHA,
    Paired,
    Stat,
    detectable_difference,
    equivalence_p,
    failure_p,
    holm,
    sign_flip_p,
)

Row = dict[str, Any]
Cell = tuple[str, int]  # (method, workers)

HALF_DECADE = math.sqrt(10.0)


@dataclass(frozen=True)
class Hypothesis:
    """One test of the study: `method` against `against` at `workers`, paired by seed.

    kind "accuracy": the paired difference of the design's test metric (`Design.metric`: test accuracy unless
    the design names another; points) at `budget` epochs, exact sign-flip test; kind "equivalence": the same
    differences shown to lie within `margin` points either side of 0 (two one-sided exact sign-flip tests on the
    differences shifted by the margin, `equivalence_p`); kind "failures": the failure counts at the fixed-rule
    cells (`Design.rule`), exact sign test.
    """

    name: str
    claim: str
    method: str
    against: str
    workers: int
    kind: str = "accuracy"
    budget: int = 2
    margin: float = math.nan  # kind "equivalence": the margin in points


@dataclass(frozen=True)
class Design:
    """One task's part of the study (module doc); every field is fixed before the runs."""

    name: str
    task: str
    model: str | None
    workers: tuple[int, ...]
    methods: Mapping[str, tuple[float, ...]]  # tuned method -> its base learning-rate grid
    pilot_seeds: tuple[int, ...]
    confirm_seeds: tuple[int, ...]
    budget: int  # the primary budget in epochs: the pilot's length and the pick's epoch
    epochs: int  # the confirmatory runs' length; budgets reported: 1, budget, epochs
    primary: tuple[Hypothesis, ...] = ()
    batch_size: int = 32
    optimizer: str = "sgd"
    momentum: float = 0.5
    warmup_epochs: float = 0.0
    evals_per_epoch: int = 8
    local_steps: int = 4
    slow_momentum: float = 0.5
    # method -> the worker counts it runs at (a read-only mapping: the designs are module-level constants)
    only: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))
    rule: tuple[str, ...] = ("mean-scaled", "adasum")  # run at sequential's picked base rate, untuned
    max_extensions: int = 2
    data_dir: str | None = None
    # sequential training's confirmatory length (None: `epochs`); it sets the target after one epoch, and one
    # step of 32 examples is the slow part of a simulated study on a GPU
    sequential_epochs: int | None = None
    # more confirmatory seeds for the cells of the primary hypotheses only (`seeds`)
    primary_seeds: tuple[int, ...] = ()
    # a design without sequential training of its own: the target validation accuracy and the rule cells'
    # base rate, fixed before its runs from an earlier design's (`target_accuracy`, `rule_rate`)
    target: float | None = None
    rule_lr: float | None = None
    # the test metric: "test_accuracy", or a task score the rows record per evaluation (`scores`, e.g. the
    # word2vec task's "wordsim353"); picks, targets and failures stay on validation accuracy
    metric: str = "test_accuracy"

    def seeds(self, method: str, workers: int) -> tuple[int, ...]:
        """The confirmatory seeds of a cell: `confirm_seeds`, and `primary_seeds` for a primary test's cells."""
        if any((method, workers) in ((h.method, h.workers), (h.against, h.workers)) for h in self.primary):
            return self.confirm_seeds + self.primary_seeds
        return self.confirm_seeds

    @property
    def metric_label(self) -> str:
        """The test metric as the page names it."""
        return METRIC_LABELS.get(self.metric, self.metric)

    def length(self, method: str) -> int:
        """The confirmatory runs' length in epochs for `method`."""
        return self.sequential_epochs if method == "sequential" and self.sequential_epochs else self.epochs

    def base(self) -> RunConfig:
        """The configuration every run of this design shares."""
        return RunConfig(
            task=self.task, model=self.model, batch_size=self.batch_size, optimizer=self.optimizer,
            momentum=self.momentum, warmup_epochs=self.warmup_epochs, local_steps=self.local_steps,
            slow_momentum=self.slow_momentum,
            data_dir=self.data_dir,
        )

    def cells(self) -> list[Cell]:
        """Every tuned (method, workers) cell; sequential is (sequential, 1)."""
        out: list[Cell] = []
        for method in self.methods:
            counts = (1,) if method == "sequential" else self.only.get(method, self.workers)
            out += [(method, w) for w in counts]
        return out


METRIC_LABELS: Mapping[str, str] = MappingProxyType({
    "test_accuracy": "test accuracy", "wordsim353": "WordSim-353 score", "simlex999": "SimLex-999 score",
    "analogy": "analogy accuracy",
})


def metric_of(point: Mapping[str, Any], design: Design) -> float:
    """The design's test metric (`Design.metric`) of one evaluation record, in points."""
    if design.metric == "test_accuracy":
        return point["test_accuracy"]
    return point["scores"][design.metric]


CNN_GRID = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
FASHION_CNN = Design(
    name="fashion-mnist-cnn",
    task="fashion-mnist",
    model="cnn",
    workers=(4, 16, 32, 64),
    methods=MappingProxyType({
        "sequential": (0.003, 0.01, 0.03, 0.1, 0.3),
        "mean": (0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
        "adasum": CNN_GRID,
        "adacons": (0.0003, 0.001, 0.003, 0.01, 0.03),  # lr x P (a weighted mean: the mean's recipe)
        "localsgd": (0.003, 0.01, 0.03, 0.1, 0.3),
        "slowmo": (0.003, 0.01, 0.03, 0.1, 0.3),
    }),
    only=MappingProxyType({"adacons": (16, 32, 64), "localsgd": (16, 32, 64), "slowmo": (16, 32, 64)}),
    pilot_seeds=(100, 101),
    confirm_seeds=tuple(range(1000, 1020)),
    budget=2,
    epochs=4,
    primary=(
        Hypothesis("H1", "tuned Adasum converges faster than tuned averaging at 16 workers (slides)",
                   "adasum", "mean", 16),
        Hypothesis("H2", "tuned Adasum converges faster than tuned averaging at 32 workers (slides)",
                   "adasum", "mean", 32),
        Hypothesis("H3", "at the largest batch (64 x 32 = 2,048) Adasum gets further than averaging (paper)",
                   "adasum", "mean", 64),
        Hypothesis("H4", "AdaCons beats averaging (arXiv 2411.03742)", "adacons", "mean", 16),
        Hypothesis("H5", "SlowMo beats its base algorithm, local SGD at the same tau (ICLR 2020)",
                   "slowmo", "localsgd", 16),
        Hypothesis("H6", "Horovod's recipe (lr x P at sequential's rate) fails at 16 workers where Adasum "
                   "at that rate does not (slides)", "mean-scaled", "adasum", 16, kind="failures"),
    ),
)
DIGITS_CNN = Design(
    name="digits-cnn",
    task="digits",
    model="cnn",
    workers=(16, 32),
    methods=MappingProxyType({
        "sequential": (0.003, 0.01, 0.03, 0.1, 0.3),
        "mean": (0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
        "adasum": CNN_GRID,
    }),
    pilot_seeds=(100, 101),
    confirm_seeds=tuple(range(1000, 1020)),
    budget=8,
    epochs=16,
)
# --- the second family: registered after the first's runs, before its own (docs/protocol.md, part 2) ------
FASHION_RESNET = Design(
    name="fashion-mnist-resnet",
    task="fashion-mnist",
    model="resnet",
    workers=(16, 64),
    methods=MappingProxyType({
        "sequential": (0.003, 0.01, 0.03),
        "mean": (0.03, 0.1, 0.3, 1.0),
        "adasum": (0.01, 0.03, 0.1, 0.3),
        "adacons": (0.001, 0.003, 0.01),  # lr x P
    }),
    only=MappingProxyType({"adacons": (64,)}),
    momentum=0.9,
    warmup_epochs=1.0,
    pilot_seeds=(200, 201),
    confirm_seeds=tuple(range(2000, 2005)),  # 8 before the pilot (amended: device time)
    primary_seeds=tuple(range(2005, 2010)),  # amended after the confirmatory runs: 5 pairs cannot give p < 0.05
    budget=4,
    epochs=4,  # 8 before the pilot (amended: device time)
    sequential_epochs=1,
    rule=(),
    primary=(
        Hypothesis("R1", "at the largest batch (64 x 32 = 2,048), momentum SGD with warm-up, Adasum gets further "
                   "than averaging (the ResNet-50 claim, paper)", "adasum", "mean", 64, budget=4),
        Hypothesis("R2", "AdaCons beats averaging at the largest batch (arXiv 2411.03742)", "adacons", "mean", 64,
                   budget=4),
    ),
)
ENGLISH_LAMB = Design(
    name="english-lm-lamb",
    task="english",
    model="transformer",
    workers=(16, 64),
    methods=MappingProxyType({
        "sequential": (0.001, 0.003, 0.01),
        "mean": (0.003, 0.01, 0.03, 0.1),
        "adasum": (0.001, 0.003, 0.01, 0.03),
    }),
    optimizer="lamb",
    pilot_seeds=(200, 201),
    confirm_seeds=tuple(range(2000, 2005)),  # 6 before the pilot (amended: device time)
    primary_seeds=tuple(range(2005, 2010)),  # amended after the confirmatory runs: 5 pairs cannot give p < 0.05
    budget=3,
    epochs=3,  # 6 before the pilot (amended: device time)
    sequential_epochs=1,
    rule=(),
    primary=(
        Hypothesis("L1", "with LAMB at the largest batch (64 x 32 sequences), Adasum gets further than averaging "
                   "(LAMB + Adasum in 30 % fewer steps, paper)", "adasum", "mean", 64, budget=3),
    ),
)
ENGLISH_ADAM = replace(
    ENGLISH_LAMB,
    name="english-lm-adam",
    optimizer="adam",
    primary=(
        Hypothesis("L2", "with Adam at the largest batch (64 x 32 sequences), Adasum gets further than averaging "
                   "(Adam with Adasum scales to 64K, paper)", "adasum", "mean", 64, budget=3),
    ),
)
FASHION_DILOCO = Design(
    name="fashion-mnist-diloco",
    task="fashion-mnist",
    model="cnn",
    workers=(16,),
    methods=MappingProxyType({
        "sequential": (0.0003, 0.001, 0.003),
        "diloco": (0.0003, 0.001, 0.003, 0.01),
        "adasum-diloco": (0.0003, 0.001, 0.003, 0.01),
        "adacons-diloco": (0.0003, 0.001, 0.003, 0.01),
    }),
    optimizer="adam",
    local_steps=8,
    pilot_seeds=(200, 201),
    confirm_seeds=tuple(range(2000, 2008)),  # 12 before the pilot (amended: device time)
    budget=2,
    epochs=2,  # 4 before the pilot (amended: device time)
    sequential_epochs=1,
    rule=(),
    primary=(
        Hypothesis("D1", "DiLoCo (inner Adam, tau = 8, outer Nesterov 0.7 / 0.9) with Adasum's combine of the "
                   "pseudo-gradients beats DiLoCo's mean at 16 workers", "adasum-diloco", "diloco", 16),
        Hypothesis("D2", "the same with AdaCons' combine", "adacons-diloco", "diloco", 16),
    ),
)
# --- the third part: registered after part 2's runs, before its own (docs/protocol.md, part 3) ---------------
ENGLISH_ADAM_BATCHES = Design(
    name="english-lm-adam-batches",
    task="english",
    model="transformer",
    workers=(64, 128, 256),
    methods=MappingProxyType({
        "mean": (0.003, 0.01, 0.03, 0.1),
        "adasum": (0.001, 0.003, 0.01, 0.03),
        "adacons": (0.00003, 0.0001, 0.0003, 0.001),  # lr x P: 0.002-0.064 at 64 workers
        "localsgd": (0.001, 0.003, 0.01, 0.03),
        "slowmo": (0.001, 0.003, 0.01, 0.03),
    }),
    only=MappingProxyType({"adacons": (64,), "localsgd": (64,), "slowmo": (64,)}),
    optimizer="adam",
    pilot_seeds=(300, 301),
    confirm_seeds=tuple(range(3000, 3010)),
    budget=3,
    epochs=6,
    rule=(),
    target=49.0,  # english-lm-adam's: sequential training's one-epoch validation accuracy, rounded down
    primary=(
        Hypothesis("L3", "AdaCons beats averaging on the LM with Adam at 64 x 32 sequences (arXiv 2411.03742)",
                   "adacons", "mean", 64, budget=3),
        Hypothesis("L4", "SlowMo beats local SGD at the same tau on the LM with Adam, 64 workers (ICLR 2020)",
                   "slowmo", "localsgd", 64, budget=3),
        Hypothesis("L5", "past 2,048: with Adam at 128 x 32 = 4,096 sequences, Adasum gets further than averaging "
                   "(Adam with Adasum scales to 64K, paper)", "adasum", "mean", 128, budget=3),
    ),
)
FASHION_RESNET_RULE = replace(
    FASHION_RESNET,
    name="fashion-mnist-resnet-rule",
    methods=MappingProxyType({}),
    only=MappingProxyType({}),
    pilot_seeds=(),
    confirm_seeds=tuple(range(3000, 3010)),
    primary_seeds=(),
    sequential_epochs=None,
    rule=("mean-scaled", "adasum"),
    rule_lr=0.0949,  # fashion-mnist-resnet's sequential pick
    target=81.5,  # fashion-mnist-resnet's target
    primary=(
        Hypothesis("R3", "Horovod's recipe (the mean at lr x P, sequential's base rate) fails at 16 workers where "
                   "Adasum at the same base rate does not (slides), on the ResNet with momentum 0.9 and warm-up",
                   "mean-scaled", "adasum", 16, kind="failures", budget=4),
    ),
)
# --- the fourth part: registered after part 3's runs, before its own (docs/protocol.md, part 4) ------------
FASHION_RESNET_SLOWMO = replace(
    FASHION_RESNET,
    name="fashion-mnist-resnet-slowmo",
    methods=MappingProxyType({
        "localsgd": (0.01, 0.03, 0.1, 0.3),
        "slowmo": (0.01, 0.03, 0.1, 0.3),
    }),
    only=MappingProxyType({}),
    pilot_seeds=(400, 401),
    confirm_seeds=tuple(range(4000, 4010)),
    primary_seeds=(),
    sequential_epochs=None,
    rule=(),
    target=81.5,  # fashion-mnist-resnet's target
    primary=(
        Hypothesis("R4", "SlowMo beats local SGD at the same tau on the ResNet (momentum SGD, warm-up) at 64 "
                   "workers (ICLR 2020)", "slowmo", "localsgd", 64, budget=4),
    ),
)
# --- word2vec: registered after its task was shown to learn, before its runs (docs/protocol.md, part 4) -------
ENGLISH_WORD2VEC = Design(
    name="english-word2vec",
    task="english-word2vec",
    model="skipgram-neg",
    workers=(32,),
    methods=MappingProxyType({
        "sequential": (0.0003, 0.001, 0.003, 0.01),
        "mean": (0.001, 0.003, 0.01, 0.03),
        "adasum": (0.001, 0.003, 0.01, 0.03),
        "adacons": (0.00003, 0.0001, 0.0003, 0.001),  # lr x P: 0.001-0.032 at 32 workers
        "localsgd": (0.0003, 0.001, 0.003, 0.01),
        "slowmo": (0.0003, 0.001, 0.003, 0.01),
    }),
    batch_size=128,
    optimizer="adam",
    pilot_seeds=(400, 401),
    confirm_seeds=tuple(range(4000, 4010)),
    budget=1,  # 2 in the first registration; cut before any run: the device time left
    epochs=1,
    rule=(),
    metric="wordsim353",
    primary=(
        Hypothesis("W1", "word2vec with Adasum at 32 workers matches sequential training (slides)", "adasum",
                   "sequential", 32, kind="equivalence", budget=1, margin=5.0),
        Hypothesis("W2", "Adasum gets further than averaging at 32 workers", "adasum", "mean", 32, budget=1),
        Hypothesis("W3", "AdaCons beats averaging (arXiv 2411.03742), on word2vec", "adacons", "mean", 32, budget=1),
        Hypothesis("W4", "SlowMo beats local SGD at the same tau (ICLR 2020), on word2vec", "slowmo", "localsgd", 32,
                   budget=1),
    ),
)
DESIGNS: Mapping[str, Design] = MappingProxyType({
    d.name: d for d in (FASHION_CNN, DIGITS_CNN, FASHION_RESNET, ENGLISH_LAMB, ENGLISH_ADAM, FASHION_DILOCO,
                        ENGLISH_ADAM_BATCHES, FASHION_RESNET_RULE, FASHION_RESNET_SLOWMO,
                        ENGLISH_WORD2VEC)
})


def _config(design: Design, method: str, workers: int, lr: float, seed: int, epochs: int, curve: bool) -> RunConfig:
    return replace(
        design.base(), method=method, workers=workers, lr=lr, seed=seed, epochs=epochs,
        evals_per_epoch=design.evals_per_epoch if curve else None,
    )


def pilot_runs(design: Design, lrs: Mapping[Cell, Sequence[float]] | None = None) -> list[RunConfig]:
    """The pilot's runs: every cell over its grid (or over `lrs`, per cell), on the pilot seeds."""
    runs = []
    for method, workers in lrs if lrs is not None else design.cells():
        rates = lrs[(method, workers)] if lrs is not None else design.methods[method]
        for lr in rates:
            runs += [_config(design, method, workers, lr, s, design.budget, False) for s in design.pilot_seeds]
    return runs


def _mean_val(runs: Sequence[Row], epoch: int) -> float:
    return statistics.fmean(_score(at_epoch(r, epoch)) for r in runs)


def _score(point: Mapping[str, Any] | None) -> float:
    """Validation accuracy for the pick; a diverged or missing point scores 0."""
    if point is None or point.get("diverged") or not math.isfinite(point.get("val_accuracy", math.nan)):
        return 0.0
    return float(point["val_accuracy"])


def rows_of(rows: Sequence[Row], design: Design, seeds: Sequence[int]) -> list[Row]:
    """The rows of `design` (its task, model, batch and optimizer) on `seeds`."""
    wanted = design.base()
    keep = []
    for r in rows:
        c = r["config"]
        setting = (c.get("task"), c.get("batch_size"), c.get("optimizer"), c.get("warmup_epochs", 0.0))
        if setting != (wanted.task, wanted.batch_size, wanted.optimizer, wanted.warmup_epochs):
            continue
        if (c.get("model") or "cnn") != (design.model or "cnn") or r["seed"] not in seeds:
            continue
        keep.append(r)
    return keep


def grid_scores(rows: Sequence[Row], design: Design) -> dict[Cell, dict[float, float]]:
    """Mean pilot validation accuracy at the primary budget, per cell and base learning rate."""
    out: dict[Cell, dict[float, float]] = {}
    for (method, workers, lr), runs in by_cell(rows_of(rows, design, design.pilot_seeds)).items():
        if len({r["seed"] for r in runs}) == len(design.pilot_seeds):  # complete: every pilot seed
            out.setdefault((method, workers), {})[lr] = _mean_val(runs, design.budget)
    return out


def picks(rows: Sequence[Row], design: Design) -> dict[Cell, tuple[float, bool]]:
    """Per cell: the picked base learning rate (highest mean validation accuracy at the budget; ties: the
    smaller rate) and whether it lies on the edge of the rates run."""
    out = {}
    for cell, scores in grid_scores(rows, design).items():
        lr = max(scores, key=lambda v: (scores[v], -v))
        out[cell] = (lr, lr in (min(scores), max(scores)))
    return out


def extensions(rows: Sequence[Row], design: Design) -> dict[Cell, list[float]]:
    """The next rates to run for every cell whose pick is on its grid's edge: one half-decade step past it,
    while fewer than `Design.max_extensions` steps were added on that side."""
    out: dict[Cell, list[float]] = {}
    scores = grid_scores(rows, design)
    for cell, (lr, edge) in picks(rows, design).items():
        if not edge:
            continue
        grid = design.methods[cell[0]]
        run = sorted(scores[cell])
        lower = lr == run[0]
        added = sum(1 for v in run if (v < min(grid) if lower else v > max(grid)))
        if added < design.max_extensions:
            out[cell] = [float(f"{lr / HALF_DECADE if lower else lr * HALF_DECADE:.3g}")]
    return out


def confirm_runs(design: Design, chosen: Mapping[Cell, tuple[float, bool]]) -> list[RunConfig]:
    """The confirmatory runs: each cell at its picked rate, and the fixed-rule cells (`Design.rule`, at
    sequential's picked base rate), on the confirmatory seeds, with learning curves."""
    runs = []
    for (method, workers), (lr, _) in chosen.items():
        runs += [_config(design, method, workers, lr, s, design.length(method), True)
                 for s in design.seeds(method, workers)]
    base = rule_rate(design, chosen)
    if base is not None:
        for method in design.rule:
            for workers in design.workers:
                if chosen.get((method, workers), (None,))[0] == base:
                    continue  # that run is already the tuned cell's
                runs += [_config(design, method, workers, base, s, design.epochs, True)
                         for s in design.confirm_seeds]
    return runs


def rule_rate(design: Design, chosen: Mapping[Cell, tuple[float, bool]]) -> float | None:
    """The fixed-rule cells' base rate: sequential training's pick, or `Design.rule_lr` for a design without
    sequential training of its own; None before the pick."""
    sequential = chosen.get(("sequential", 1))
    return sequential[0] if sequential is not None else design.rule_lr


# --- reading the curves ------------------------------------------------------------------------------------


def at_epoch(row: Row, epoch: int) -> dict[str, Any] | None:
    """The run's state after `epoch` epochs: its epoch record (validation and test accuracy, losses, the
    diverged flag); None when the run stopped earlier (a diverged run stops)."""
    for h in row["history"]:
        if h["epoch"] == epoch:
            return h
    return None


VALIDATION_FAILURE_SD = 3.0


def failed(row: Row, epoch: int) -> bool:
    """Failed by `epoch`, judged on validation data: diverged (the run stopped, or its loss is non-finite or
    exploded), or its validation accuracy within 3 binomial standard deviations of chance (the
    majority class's share)."""
    point = at_epoch(row, epoch)
    if point is None or point.get("diverged") or not math.isfinite(point["val_loss"]):
        return True
    chance = row.get("chance_accuracy")
    if chance is None:
        return False
    noise = row.get("chance_noise")  # the runner's: 3 binomial standard deviations over its validation set
    if noise is None:
        n = _validation_size(row)
        noise = 100 * VALIDATION_FAILURE_SD * math.sqrt(chance / 100 * (1 - chance / 100) / n)
    return point["val_accuracy"] <= chance + noise


def _validation_size(row: Row) -> int:
    """The validation set's size, for rows written before the runner recorded `chance_noise`."""
    sizes = {"fashion-mnist": 6000, "mnist": 6000, "digits": 400}
    return sizes.get(row["config"].get("task"), 1000)


def target_accuracy(rows: Sequence[Row], design: Design) -> float | None:
    """The target validation accuracy: sequential training's (tuned) mean validation accuracy after one
    epoch over the confirmatory seeds, rounded down to a half point; None without those runs. A design without
    sequential training of its own has its `Design.target`, fixed before its runs."""
    chosen = picks(rows, design).get(("sequential", 1))
    if chosen is None:
        return design.target
    runs = [r for r in rows_of(rows, design, design.confirm_seeds)
            if r["method"] == "sequential" and r["lr"] == chosen[0]]
    points = [at_epoch(r, 1) for r in runs]
    return target_below([p["val_accuracy"] for p in points if p is not None])


# --- the analysis ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CellSummary:
    """A confirmatory cell: its runs' accuracy at each budget, failures and steps to target."""

    method: str
    workers: int
    lr: float
    tuned: bool
    seeds: int
    global_batch: int
    test: Mapping[int, Stat | None]  # budget (epochs) -> test accuracy over the runs that did not fail
    failed: Mapping[int, int]  # budget -> runs failed by then
    reached: int  # runs that reached the target within the confirmatory runs' length
    steps: float | None  # median steps to target, runs that never reached it counted as never (`censored_median`)
    epochs_to_target: float | None


@dataclass(frozen=True)
class Outcome:
    """One hypothesis tested on the confirmatory runs."""

    hypothesis: Hypothesis
    n: int
    effect: float  # points (accuracy) or failed_a - failed_b (failures)
    lo: float
    hi: float
    p: float
    p_holm: float
    detectable: float  # the smallest difference found at 80 % power (points), from the pilot's spread
    detail: str
    spread: float = math.nan  # the standard deviation of the paired differences (points)

    @property
    def verdict(self) -> str:
        """Better / worse (Holm's p below `ALPHA`), no difference the test could see, or not tested; for an
        equivalence test: equivalent within its margin, or not shown equivalent."""
        if math.isnan(self.p_holm):
            return "not tested"
        if self.hypothesis.kind == "equivalence":
            return (f"equivalent within {self.hypothesis.margin:g} points" if self.p_holm < ALPHA
                    else "not shown equivalent")
        if self.p_holm >= ALPHA:
            return "no difference the test could see"
        return "better" if self.effect > 0 else "worse"


@dataclass
class Analysis:
    """Everything the results page shows for one design."""

    design: Design
    picks: dict[Cell, tuple[float, bool]]
    target: float | None
    cells: list[CellSummary]
    outcomes: list[Outcome]
    pilot_sd: float
    pilot_runs: int
    exploratory: list[Outcome]


def _confirm_cells(rows: Sequence[Row], design: Design) -> dict[tuple[str, int, float], list[Row]]:
    """The confirmatory runs of the cells that `confirm_runs` plans from the pilot's picks. Runs at a rate
    that is no longer planned (a pick the pilot's extension moved after they ran) stay in the rows but are
    left out of every table, test and figure."""
    planned = {(c.method, c.workers, c.lr) for c in confirm_runs(design, picks(rows, design))}
    confirm = rows_of(rows, design, design.confirm_seeds + design.primary_seeds)
    return by_cell([r for r in confirm if r["epochs"] == design.length(r["method"])
                    and (r["method"], r["workers"], r["lr"]) in planned
                    and r["seed"] in design.seeds(r["method"], r["workers"])])


def pilot_spread(rows: Sequence[Row], design: Design) -> tuple[float, int]:
    """The pooled standard deviation of one run's test accuracy at the budget within the pilot's cells at
    their picked rates (runs that did not fail), and the runs it pooled. (Every rate's cells would count the
    unstable rates next to divergence, whose spread the picked rates do not have.)"""
    chosen = picks(rows, design)
    by: dict[tuple[str, int, float], list[float]] = {}
    for r in rows_of(rows, design, design.pilot_seeds):
        if chosen.get((r["method"], r["workers"]), (None,))[0] == r["lr"] and not failed(r, design.budget):
            point = at_epoch(r, design.budget)
            assert point is not None
            by.setdefault((r["method"], r["workers"], r["lr"]), []).append(metric_of(point, design))
    squares, dof, count = 0.0, 0, 0
    for values in by.values():
        if len(values) > 1:
            mean = statistics.fmean(values)
            squares += sum((v - mean) ** 2 for v in values)
            dof += len(values) - 1
            count += len(values)
    return (math.sqrt(squares / dof) if dof else math.nan), count


def _pair(design: Design, a: list[Row], b: list[Row], budget: int) -> tuple[list[float], list[float], int, int]:
    """The test metric at `budget` (`metric_of`) paired by seed where neither failed; the runs each lost to
    failure."""
    by_a = {r["seed"]: r for r in a}
    by_b = {r["seed"]: r for r in b}
    xs, ys, lost_a, lost_b = [], [], 0, 0
    for seed in sorted(set(by_a) & set(by_b)):
        fa, fb = failed(by_a[seed], budget), failed(by_b[seed], budget)
        lost_a += fa
        lost_b += fb
        if not (fa or fb):
            pa, pb = at_epoch(by_a[seed], budget), at_epoch(by_b[seed], budget)
            assert pa is not None and pb is not None
            xs.append(metric_of(pa, design))
            ys.append(metric_of(pb, design))
    return xs, ys, lost_a, lost_b


def _cell_runs(cells: Mapping[tuple[str, int, float], list[Row]], chosen: Mapping[Cell, tuple[float, bool]],
               method: str, workers: int, rule_lr: float | None) -> list[Row]:
    lr = rule_lr if rule_lr is not None else chosen.get((method, workers), (math.nan,))[0]
    return cells.get((method, workers, lr), [])


def _test(design: Design, h: Hypothesis, cells: Mapping[tuple[str, int, float], list[Row]],
          chosen: Mapping[Cell, tuple[float, bool]], sd: float, family: int) -> Outcome:
    if h.kind == "failures":
        base = rule_rate(design, chosen)
        rule_lr = base if base is not None else math.nan
        a = _cell_runs(cells, chosen, h.method, h.workers, rule_lr)
        b = _cell_runs(cells, chosen, h.against, h.workers, rule_lr)
        seeds = sorted({r["seed"] for r in a} & {r["seed"] for r in b})
        fa = [failed(next(r for r in a if r["seed"] == s), h.budget) for s in seeds]
        fb = [failed(next(r for r in b if r["seed"] == s), h.budget) for s in seeds]
        p = failure_p(fa, fb) if seeds else math.nan
        detail = (f"{sum(fa)}/{len(seeds)} failed against {sum(fb)}/{len(seeds)}, both at base rate {rule_lr:g} "
                  f"({'sequential' if ('sequential', 1) in chosen else 'an earlier design'}'s pick; {h.method} gets "
                  f"x {h.workers})")
        effect = float(sum(fa) - sum(fb))
        return Outcome(h, len(seeds), effect, math.nan, math.nan, p, math.nan, math.nan, detail)
    a = _cell_runs(cells, chosen, h.method, h.workers, None)
    b = _cell_runs(cells, chosen, h.against, 1 if h.against == "sequential" else h.workers, None)
    xs, ys, lost_a, lost_b = _pair(design, a, b, h.budget)
    paired = Paired.of(xs, ys)
    differences = [x - y for x, y in zip(xs, ys)]
    if len(xs) < 2:
        p = math.nan
    elif h.kind == "equivalence":
        p = equivalence_p(differences, h.margin)
    else:
        p = sign_flip_p(differences)
    detail = f"failed: {lost_a} and {lost_b} of {len({r['seed'] for r in a} & {r['seed'] for r in b})}"
    detectable = detectable_difference(math.sqrt(2) * sd, max(len(xs), 2), family)
    spread = statistics.stdev([x - y for x, y in zip(xs, ys)]) if len(xs) >= 2 else math.nan
    return Outcome(h, paired.n, paired.mean, paired.lo, paired.hi, p, math.nan, detectable, detail, spread)


def _summaries(design: Design, cells: Mapping[tuple[str, int, float], list[Row]],
               chosen: Mapping[Cell, tuple[float, bool]], target: float | None) -> list[CellSummary]:
    out = []
    budgets = sorted({1, design.budget, design.epochs})
    for (method, workers, lr), runs in sorted(cells.items(), key=lambda kv: (kv[0][1], _order(kv[0][0]), kv[0][2])):
        test, lost = {}, {}
        length = design.length(method)
        for b in budgets:
            good = [at_epoch(r, b) for r in runs if not failed(r, b)] if b <= length else []
            values = [metric_of(p, design) for p in good if p is not None]
            test[b] = Stat.of(values) if values else None
            lost[b] = sum(failed(r, min(b, length)) for r in runs)  # a shorter cell: failed by its end
        steps = [steps_to(r, target) for r in runs] if target is not None else []
        per_epoch = runs[0]["steps"] / runs[0]["epochs_run"] if runs[0]["epochs_run"] else math.nan
        median = censored_median(steps)
        out.append(CellSummary(
            method, workers, lr, chosen.get((method, workers), (None,))[0] == lr, len(runs),
            workers * design.batch_size, MappingProxyType(test), MappingProxyType(lost),
            sum(s is not None for s in steps), median,
            median / per_epoch if median is not None else None,
        ))
    return out


ORDER = ("sequential", "mean", "mean-scaled", "adasum", "adasum-delta", "adacons", "localsgd", "slowmo", "diloco",
         "adasum-diloco", "adacons-diloco")


def _order(method: str) -> int:
    return ORDER.index(method) if method in ORDER else len(ORDER)


def _reachable(outcome: Outcome, family: int) -> Outcome:
    """A primary test on too few pairs for its exact test to reach Holm's first level (the smallest p of n pairs is
    2 / 2^n, one-sided 1 / 2^n) is "not tested", not "no difference": runs cut short (the device time) leave its
    cells incomplete."""
    if outcome.hypothesis.kind == "failures" or math.isnan(outcome.p):
        return outcome
    smallest = (1.0 if outcome.hypothesis.kind == "equivalence" else 2.0) / 2**outcome.n
    if smallest < ALPHA / family:
        return outcome
    return replace(outcome, p_holm=math.nan,
                   detail=f"{outcome.detail}; {outcome.n} pairs: too few for the test to reach its level")


def analyze(rows: Sequence[Row], design: Design) -> Analysis:
    """The study's results for `design` from `rows` (pilot and confirmatory; other rows are ignored)."""
    chosen = picks(rows, design)
    cells = _confirm_cells(rows, design)
    target = target_accuracy(rows, design)
    sd, pooled = pilot_spread(rows, design)
    family = len(design.primary)
    outcomes = [_test(design, h, cells, chosen, sd, family) for h in design.primary]
    adjusted = holm([o.p for o in outcomes])
    outcomes = [_reachable(replace(o, p_holm=q), family) for o, q in zip(outcomes, adjusted)]
    explore = []
    primary = {(h.method, h.against, h.workers) for h in design.primary}
    for method, against in (("adasum", "mean"), ("adacons", "mean"), ("slowmo", "localsgd"), ("mean", "sequential"),
                            ("adasum", "sequential"),
                            ("adasum-diloco", "diloco"), ("adacons-diloco", "diloco")):
        for workers in design.workers:
            if (method, against, workers) in primary or (method, workers) not in chosen:
                continue
            if (against, 1 if against == "sequential" else workers) not in chosen:
                continue  # (a design without sequential training of its own has no cell to compare with)
            # against sequential training, at the epochs both ran (sequential may stop early: `sequential_epochs`)
            budget = min(design.budget, design.length(against))
            h = Hypothesis(f"E-{method}-{against}-{workers}", "", method, against, workers, budget=budget)
            explore.append(_test(design, h, cells, chosen, sd, 1))
    if rule_rate(design, chosen) is not None and len(design.rule) == 2:
        for workers in design.workers:
            if (design.rule[0], design.rule[1], workers) not in primary:
                h = Hypothesis(f"E-failures-{workers}", "", design.rule[0], design.rule[1], workers,
                               kind="failures", budget=design.budget)
                explore.append(_test(design, h, cells, chosen, sd, 1))
    return Analysis(design, chosen, target, _summaries(design, cells, chosen, target), outcomes, sd, pooled, explore)


# --- the page's tables -------------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _p(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3g}"


def primary_table(analysis: Analysis) -> str:
    """The primary family: claim, test, effect with its 95 % interval, p, Holm's p, verdict, power."""
    lines = [
        "| | claim | stand-in and test | verdict | effect [95% interval] | seeds | p | Holm p | "
        "detectable at 80% power |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for o in analysis.outcomes:
        h = o.hypothesis
        label = analysis.design.metric_label
        if h.kind == "failures":
            test = f"{h.method} vs {h.against}, P = {h.workers}, failures by epoch {h.budget} (exact sign test)"
            effect = o.detail
            power = "-"
        elif h.kind == "equivalence":
            test = (f"{h.method} - {h.against}, P = {h.workers}, {label} after {h.budget} epochs within "
                    f"+-{h.margin:g} points (two one-sided exact sign-flip tests)")
            effect = f"{o.effect:+.2f} [{o.lo:+.2f}, {o.hi:+.2f}] points ({o.detail})" if o.n else "-"
            power = "-"
        else:
            test = (f"{h.method} - {h.against}, P = {h.workers}, {label} after {h.budget} epochs "
                    "(exact sign-flip test)")
            effect = f"{o.effect:+.2f} [{o.lo:+.2f}, {o.hi:+.2f}] points ({o.detail})" if o.n else "-"
            power = f"{o.detectable:.2f} points" if math.isfinite(o.detectable) else "-"
        stand_in = f"{analysis.design.task}, {analysis.design.model}: {test}"
        lines.append(f"| {h.name} | {h.claim} | {stand_in} | **{o.verdict}** | {effect} | {o.n} | {_p(o.p)} | "
                     f"{_p(o.p_holm)} | {power} |")
    return "\n".join(lines)


def exploratory_table(analysis: Analysis) -> str:
    """The other paired comparisons at the primary budget, unadjusted (exploratory)."""
    lines = ["| comparison | P | seeds | difference [95% interval] | p (unadjusted) | failed |",
             "| --- | ---: | ---: | --- | ---: | --- |"]
    for o in analysis.exploratory:
        h = o.hypothesis
        if h.kind == "failures":
            lines.append(f"| failures by epoch {h.budget}: {h.method} vs {h.against} | {h.workers} | {o.n} | - | "
                         f"{_p(o.p)} (exact sign test) | {o.detail} |")
            continue
        diff = f"{o.effect:+.2f} [{o.lo:+.2f}, {o.hi:+.2f}]" if o.n >= 2 else "-"
        when = "" if h.budget == analysis.design.budget else f" (after {h.budget} ep.)"
        lines.append(f"| {h.method} - {h.against}{when} | {h.workers} | {o.n} | {diff} | {_p(o.p)} | "
                     f"{o.detail[8:]} |")
    return "\n".join(lines)


def cells_table(analysis: Analysis) -> str:
    """Every confirmatory cell: rate, accuracy at each budget, failures, steps and epochs to target."""
    d = analysis.design
    budgets = sorted({1, d.budget, d.epochs})
    short = "test acc." if d.metric == "test_accuracy" else d.metric_label
    head = " | ".join(f"{short} after {b} ep. [95%]" for b in budgets)
    lines = [f"| method | P | global batch | base lr | seeds | {head} | failed (by {d.epochs} ep.) | "
             f"reached target | median steps to target | epochs to target |",
             "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in budgets)
             + " | --- | ---: | ---: | ---: |"]
    for c in analysis.cells:
        rate = f"{c.lr:g}" + ("" if c.tuned else " (rule)")
        accs = " | ".join(str(c.test[b]) if c.test[b] is not None else "-" for b in budgets)
        lines.append(
            f"| {c.method} | {c.workers} | {c.global_batch:,} | {rate} | {c.seeds} | {accs} | "
            f"{c.failed[d.epochs]}/{c.seeds} | {c.reached}/{c.seeds} | {_num(c.steps, 0)} | "
            f"{_num(c.epochs_to_target)} |"
        )
    return "\n".join(lines)


def picks_table(rows: Sequence[Row], design: Design) -> str:
    """The pilot's grid: mean validation accuracy at the budget per rate, the pick in bold."""
    scores = grid_scores(rows, design)
    chosen = picks(rows, design)
    lines = ["| method | P | validation accuracy after the budget, by base learning rate (pick in bold) |",
             "| --- | ---: | --- |"]
    for cell in sorted(scores, key=lambda c: (c[1], _order(c[0]))):
        parts = []
        for lr in sorted(scores[cell]):
            text = f"{lr:g}: {scores[cell][lr]:.1f}"
            parts.append(f"**{text}**" if chosen[cell][0] == lr else text)
        edge = " (on the edge of the rates run)" if chosen[cell][1] else ""
        lines.append(f"| {cell[0]} | {cell[1]} | {', '.join(parts)}{edge} |")
    return "\n".join(lines)


def render(rows: Sequence[Row], design: Design) -> dict[str, str]:
    """The page's tables for `design`, by marker name: ``{design}-primary``, ``-cells``, ``-picks``,
    ``-explore`` and ``-facts`` (the target, the pilot's spread and run counts)."""
    a = analyze(rows, design)
    facts = (
        f"Pilot: {a.pilot_runs} runs at the picked rates pooled; one run's {design.metric_label} after {design.budget} "
        f"epochs has a spread (pooled standard deviation within cells) of {_num(a.pilot_sd)} points, so the "
        f"difference of two uncorrelated runs has {_num(math.sqrt(2) * a.pilot_sd)} (the power column's "
        "assumption). "
        f"Target validation accuracy (sequential training's mean after one epoch, rounded down to a half "
        f"point): {_num(a.target, 1)} %."
    )
    spreads = [o for o in a.outcomes if o.hypothesis.kind == "accuracy" and math.isfinite(o.spread)]
    if spreads:
        pooled = math.sqrt(statistics.fmean(o.spread**2 for o in spreads))
        n = min(o.n for o in spreads)
        found = detectable_difference(pooled, n, len(design.primary))
        first, last = spreads[0].hypothesis.name, spreads[-1].hypothesis.name
        names = f"{first}-{last}" if len(spreads) > 1 else first
        facts += (f" The confirmatory runs' own paired differences ({names}) have a pooled spread of "
                  f"{pooled:.2f} points, for which the test at level 0.05 / {len(design.primary)} with {n} pairs "
                  f"finds {found:.2f} points at 80 % power (after the runs, for reading the verdicts; the "
                  "protocol's power column stays as planned).")
    name = design.name
    before: dict[str, str] = {}
    if design.primary_seeds:  # the primary tests on the confirmatory seeds alone, before seeds were added
        before[f"{name}-primary-first"] = primary_table(analyze(rows, replace(design, primary_seeds=())))
    return {
        **before,
        f"{name}-primary": primary_table(a),
        f"{name}-cells": cells_table(a),
        f"{name}-picks": picks_table(rows, design),
        f"{name}-explore": exploratory_table(a),
        f"{name}-facts": facts,
    }


def groups(rows: Sequence[Row], design: Design) -> dict[tuple[str, int], list[Row]]:
    """The confirmatory cells for the figures, by (name, workers): tuned cells under their method's name,
    the fixed-rule cells as "NAME (rule)" (Horovod's recipe: ``mean-scaled (rule)``)."""
    chosen = picks(rows, design)
    out: dict[tuple[str, int], list[Row]] = {}
    for (method, workers, lr), runs in _confirm_cells(rows, design).items():
        tuned = chosen.get((method, workers), (None,))[0] == lr
        out[(method if tuned else f"{method} (rule)", workers)] = runs
    return out


def draw(rows: Sequence[Row], design: Design, out: Any) -> list[Any]:
    """Write the design's figures into folder `out`: ``{name}-curves.png`` (validation accuracy against
    epochs, bands over seeds) and ``{name}-steps.png`` (steps to the target against the global batch)."""
    from pathlib import Path

    from adasum.experiments import figures

    folder = Path(out)
    cells = groups(rows, design)
    title = f"{design.task}, {design.model}: validation accuracy, median and min-max over seeds"
    written = [figures.curves(cells, folder, lambda r: failed(r, min(design.epochs, r["epochs"])),
                              filename=f"{design.name}-curves.png", title=title)]
    target = target_accuracy(rows, design)
    if target is not None:
        tuned = {k: v for k, v in cells.items() if "(rule)" not in k[0]}
        written.append(figures.steps_to_target(tuned, target, folder, filename=f"{design.name}-steps.png",
                                               title=f"{design.task}: median steps to {target:g} % validation "
                                               "accuracy (dotted: critical batch)"))
    return [p for p in written if p is not None]


def designs_of(rows: Sequence[Row]) -> list[str]:
    """The names of the designs that every row belongs to (its task, model, batch, optimizer and one of its
    seeds): the designs whose study these rows can be."""
    names = []
    for name, design in DESIGNS.items():
        seeds = design.pilot_seeds + design.confirm_seeds + design.primary_seeds
        if rows and len(rows_of(rows, design, seeds)) == len(rows):
            names.append(name)
    return names


REPORT_ORDER = ("primary-first", "primary", "facts", "explore", "cells", "picks")
"""The order of a design's tables in its report (``render``'s names without the design's)."""


def write_report(rows: Sequence[Row], design: Design, out: Any, title: str | None = None) -> Any:
    """Write `design`'s study from `rows` into folder `out`, as the results page has it: ``report.md`` with
    every table of `render` (in `REPORT_ORDER`) and the figures of `draw`. Returns the report's path."""
    from pathlib import Path

    folder = Path(out)
    tables = render(rows, design)
    pictures = draw(rows, design, folder)
    parts = [f"# {title or f'The {design.name} study'}",
             f"Rows: {len(rows)} ({len(rows_of(rows, design, design.pilot_seeds))} of the pilot). Tables and figures "
             "as `adasum.experiments.study` renders them; verdicts from the confirmatory runs only."]
    for suffix in REPORT_ORDER:
        name = f"{design.name}-{suffix}"
        if name in tables:
            parts.append(f"<!-- {name} -->\n\n{tables[name]}")
    parts += [f"![{p.stem}]({p.name})" for p in pictures]
    report = folder / "report.md"
    report.write_text("\n\n".join(parts) + "\n")
    return report
