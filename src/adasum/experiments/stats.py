"""The statistics behind a report's verdicts: intervals over seeds, paired differences, Holm's correction.

Runs of one seed share the data order and the initialisation, so two methods are compared seed by
seed: the mean of the paired differences, its 95% Student-t interval and a two-sided p-value
(`scipy.stats.ttest_1samp` on the differences). A report makes many such comparisons; `holm`
adjusts their p-values so that the chance of any false "better" or "worse" among them stays at
`ALPHA` (Holm 1979, step-down Bonferroni).

>>> str(Stat.of([90.0, 91.0, 92.0]))
'91.00 [88.5, 93.5]'
>>> [round(p, 3) for p in holm([Paired.of([91, 92, 93], [90, 90, 90]).p, 0.2])]
[0.148, 0.2]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ALPHA = 0.05
FEW_SEEDS = 5
"""Verdicts on fewer paired seeds than this are labelled as such."""


def _t_half_width(sd: float, n: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(1 - ALPHA / 2, n - 1)) * sd / math.sqrt(n)


def _sd(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@dataclass(frozen=True)
class Stat:
    """Mean of n values with its 95% Student-t interval, clipped to `bounds` (an accuracy cannot leave
    [0, 100]), and their range."""

    mean: float
    lo: float
    hi: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float], bounds: tuple[float, float] = (0.0, 100.0)) -> Stat:
        """The statistics of `values` (class doc), the interval clipped to `bounds`."""
        values = [float(v) for v in values]
        if not values:
            raise ValueError("no values")
        n, mean = len(values), sum(values) / len(values)
        half = _t_half_width(_sd(values), n) if n > 1 else 0.0
        return cls(mean, max(bounds[0], mean - half), min(bounds[1], mean + half), min(values), max(values), n)

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:.2f} (1 run)"
        return f"{self.mean:.2f} [{self.lo:.1f}, {self.hi:.1f}]"


@dataclass(frozen=True)
class Paired:
    """The mean of the differences a_i - b_i over n pairs, its 95% t-interval clipped to `bounds` (a difference
    of accuracies lies in [-100, 100]), the two-sided p-value of "no difference" (NaN under 2 pairs: no test),
    and the differences themselves (their range and signs say more than an interval over a few).

    >>> d = Paired.of([91.0, 95.0, 30.0], [90.0, 90.0, 90.0])
    >>> (d.lo, round(d.hi, 1)), (d.higher, d.min, d.max)     # the t-interval would start at -108.5
    ((-100.0, 72.5), (2, -60.0, 5.0))
    """

    mean: float
    lo: float
    hi: float
    n: int
    p: float
    differences: tuple[float, ...] = ()

    @property
    def higher(self) -> int:
        """The pairs in which a is higher than b."""
        return sum(d > 0 for d in self.differences)

    @property
    def min(self) -> float:
        """The smallest difference (NaN without pairs)."""
        return min(self.differences, default=math.nan)

    @property
    def max(self) -> float:
        """The largest difference (NaN without pairs)."""
        return max(self.differences, default=math.nan)

    @classmethod
    def of(cls, a: Sequence[float], b: Sequence[float], bounds: tuple[float, float] = (-100.0, 100.0)) -> Paired:
        """The paired comparison of `a` and `b` (class doc), the interval clipped to `bounds`."""
        if len(a) != len(b):
            raise ValueError(f"paired values of unequal length: {len(a)} and {len(b)}")
        d = tuple(float(x) - float(y) for x, y in zip(a, b))
        n = len(d)
        if n == 0:
            return cls(math.nan, math.nan, math.nan, 0, math.nan)
        mean = sum(d) / n
        if n < 2:
            return cls(mean, mean, mean, n, math.nan, d)
        if max(d) == min(d):  # no spread: the t statistic is 0/0 or +-inf, and p is its limit as the spread goes to 0
            return cls(mean, mean, mean, n, 1.0 if mean == 0 else 0.0, d)
        from scipy import stats

        test = stats.ttest_1samp(d, 0.0)
        ci = test.confidence_interval(1 - ALPHA)
        lo, hi = max(bounds[0], float(ci.low)), min(bounds[1], float(ci.high))
        return cls(mean, lo, hi, n, float(test.pvalue), d)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's adjusted p-values, in the order given; NaN (no test) stays NaN and is not counted.

    >>> holm([0.01, 0.04, 0.03])
    [0.03, 0.06, 0.06]
    """
    tested = sorted((i for i, p in enumerate(p_values) if not math.isnan(p)), key=lambda i: p_values[i])
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, i in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p_values[i]))
        adjusted[i] = round(running, 12)
    return adjusted
