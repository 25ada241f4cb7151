"""The statistics behind a report's verdicts: intervals over seeds, paired differences, Holm's correction.

Runs of one seed share the data order and the initialisation, so two methods are compared seed by
seed: the mean of the paired differences, its 95% Student-t interval and a two-sided p-value, from the
exact sign-flip (paired permutation) test up to `EXACT_UP_TO` pairs (`sign_flip_p`: no normality
assumed, and never 0: its smallest value is 2 / 2^n, so fewer than 6 seeds can never show a
difference at 0.05), from the t-test (`scipy.stats.ttest_1samp`) beyond. A report makes many such
comparisons; `holm` adjusts their p-values so that the chance of any false "better" or "worse" among
them stays at `ALPHA` (Holm 1979, step-down Bonferroni).

>>> str(Stat.of([90.0, 91.0, 92.0]))
'91.00 [88.5, 93.5]'
>>> [round(p, 3) for p in holm([Paired.of([91, 92, 93], [90, 90, 90]).p, 0.2])]
[0.4, 0.4]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ALPHA = 0.05
FEW_SEEDS = 5
"""Verdicts on fewer paired seeds than this are labelled as such."""
EXACT_UP_TO = 20
"""Paired comparisons of up to this many pairs take the exact sign-flip test's p (2^n sign patterns)."""


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
            raise ValueError("no values; pass at least one value")
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
            raise ValueError(
                f"paired values of unequal length: {len(a)} and {len(b)}; pass one value per seed, the same seeds in "
                "both"
            )
        d = tuple(float(x) - float(y) for x, y in zip(a, b))
        n = len(d)
        if n == 0:
            return cls(math.nan, math.nan, math.nan, 0, math.nan)
        mean = sum(d) / n
        if n < 2:
            return cls(mean, mean, mean, n, math.nan, d)
        exact = sign_flip_p(d) if n <= EXACT_UP_TO else math.nan
        if max(d) == min(d):  # no spread: no t-interval; the exact test still has its p (never 0)
            return cls(mean, mean, mean, n, exact if n <= EXACT_UP_TO else (1.0 if mean == 0 else 0.0), d)
        from scipy import stats

        test = stats.ttest_1samp(d, 0.0)
        ci = test.confidence_interval(1 - ALPHA)
        lo, hi = max(bounds[0], float(ci.low)), min(bounds[1], float(ci.high))
        return cls(mean, lo, hi, n, exact if n <= EXACT_UP_TO else float(test.pvalue), d)


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


def sign_flip_p(differences: Sequence[float]) -> float:
    """The exact two-sided p-value of "no difference" by the paired permutation (sign-flip) test: the share
    of the 2^n sign patterns of the differences whose mean is at least as far from 0 as the observed one.
    It needs no normality and never gives 0: its smallest value is 2 / 2^n (n differences all of one sign),
    so n >= 6 is needed to reach p < 0.05 at all. NaN under 2 differences (no test).

    >>> sign_flip_p([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    0.03125
    >>> sign_flip_p([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])   # equal differences: the smallest p of 6, not 0
    0.03125
    >>> sign_flip_p([1.0, -1.0, 2.0, -2.0])
    1.0
    """
    patterns = _sign_patterns(differences)
    if patterns is None:
        return math.nan
    sums, observed, tolerance = patterns
    return float((abs(sums) >= abs(observed) - tolerance).mean())


def _sign_patterns(differences: Sequence[float]) -> tuple[Any, float, float] | None:
    """The sums of the differences under all 2^n sign patterns (a NumPy array), the observed sum, and the
    rounding within which a pattern's sum ties with it; None under 2 differences (no test)."""
    import numpy as np

    d = np.asarray([float(v) for v in differences], dtype=np.float64)
    n = len(d)
    if n < 2:
        return None
    if n > 20:
        raise ValueError(
            f"the exact sign-flip test enumerates 2^n patterns; {n} differences are too many: pass at most "
            f"{EXACT_UP_TO} (Paired.of gives its t-test alone beyond that)"
        )
    signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    # a pattern ties with the observed sum within rounding of the sums of n values
    return signs @ d, float(d.sum()), 1e-9 * max(1.0, float(np.abs(d).sum()))


def sign_flip_p_greater(differences: Sequence[float]) -> float:
    """The exact one-sided p-value of "the mean difference is not above 0" by the sign-flip test: the share of
    the 2^n sign patterns whose sum is at least the observed one. Its smallest value is 1 / 2^n; NaN under 2
    differences.

    >>> sign_flip_p_greater([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    0.015625
    >>> sign_flip_p_greater([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])
    1.0
    """
    patterns = _sign_patterns(differences)
    if patterns is None:
        return math.nan
    sums, observed, tolerance = patterns
    return float((sums >= observed - tolerance).mean())


def equivalence_p(differences: Sequence[float], margin: float) -> float:
    """The p-value of "the mean paired difference lies outside +-`margin`" by two one-sided exact sign-flip
    tests (TOST): the larger of the p of "not above -margin" (the differences plus the margin) and of "not below
    +margin" (the margin minus the differences). Below the level, the two are equivalent within the margin.

    >>> equivalence_p([0.5, -0.5, 1.0, -1.0, 0.2, 0.1, -0.3, 0.4], 5.0)   # small differences, a wide margin
    0.00390625
    >>> equivalence_p([6.0, 7.0, 5.5, 6.5, 8.0, 6.0, 7.0, 6.0], 5.0)       # all beyond the margin
    1.0
    """
    if not margin > 0:
        raise ValueError(f"an equivalence margin must be a positive number of points, got {margin}; pass margin=")
    low = sign_flip_p_greater([d + margin for d in differences])
    high = sign_flip_p_greater([margin - d for d in differences])
    return max(low, high)


def detectable_difference(sd: float, n: int, family: int = 1, power: float = 0.8, alpha: float = ALPHA) -> float:
    """The smallest true mean paired difference that a two-sided paired t-test on `n` pairs of spread `sd`
    finds at `power`, at the first step of Holm's correction over a family of `family` tests (level
    alpha / family): solved on the noncentral t distribution (the approximation
    ``(t_{1-a/2, n-1} + t_{power, n-1}) sd / sqrt(n)`` is a little small at small n).

    >>> round(detectable_difference(1.0, 10, family=4), 2)
    1.28
    """
    from scipy import optimize, stats

    if n < 2 or not sd > 0:
        return math.nan
    level = alpha / family
    critical = float(stats.t.ppf(1 - level / 2, n - 1))

    def shortfall(delta: float) -> float:
        shift = delta * math.sqrt(n) / sd
        reached = float(stats.nct.sf(critical, n - 1, shift) + stats.nct.cdf(-critical, n - 1, shift))
        return (1.0 if math.isnan(reached) else reached) - power  # scipy's tail is NaN far past the critical value

    return float(optimize.brentq(shortfall, 1e-9 * sd, 100 * sd))


def failure_p(failed_a: Sequence[bool], failed_b: Sequence[bool]) -> float:
    """Two-sided exact p-value that two methods fail equally often, paired by seed: the sign test (exact
    binomial, p = 1/2) on the seeds where exactly one of them failed; 1 when no seed splits them.

    >>> failure_p([True] * 8 + [False] * 2, [False] * 10)
    0.0078125
    """
    from scipy import stats

    if len(failed_a) != len(failed_b):
        raise ValueError(
            f"paired outcomes of unequal length: {len(failed_a)} and {len(failed_b)}; pass one outcome per seed, "
            "the same seeds in both"
        )
    only_a = sum(1 for a, b in zip(failed_a, failed_b) if a and not b)
    only_b = sum(1 for a, b in zip(failed_a, failed_b) if b and not a)
    if only_a + only_b == 0:
        return 1.0
    return float(stats.binomtest(only_a, only_a + only_b, 0.5).pvalue)
