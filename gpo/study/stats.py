"""Confidence intervals for replicated runs: pure functions, no MLflow, no plotting.

Intervals are t-based (Student's t with n-1 degrees of freedom, 95% two-sided), the textbook choice for the
handful of seeds a study affords; a bootstrap needs far more replicates than 3-5 seeds to mean anything.
- a mean over seeds: mean +- t * s / sqrt(n);
- a difference against the baseline (accuracy): paired by seed, the t interval of the per-seed differences;
- a speed-up (baseline time / run time): paired by seed, the t interval of the log ratios, mapped back with exp,
  so the centre is the geometric mean of the per-seed speed-ups and the interval is never negative.
With fewer than 2 values there is no interval (low = high = None).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    n: int
    centre: float | None
    low: float | None = None
    high: float | None = None

    def excludes(self, value: float) -> bool | None:
        """True when the whole interval lies on one side of `value`; None without an interval."""
        if self.low is None or self.high is None:
            return None
        return value < self.low or value > self.high


def t_quantile(df: int, level: float = LEVEL) -> float:
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, df))


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    n = len(values)
    if n == 0:
        return Interval(0, None)
    mean = sum(values) / n
    if n < 2:
        return Interval(n, mean)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1, level) * sd / math.sqrt(n)
    return Interval(n, mean, mean - half, mean + half)


def paired(baseline: dict[str, float], other: dict[str, float]) -> list[tuple[float, float]]:
    """(baseline, other) for every seed both have, in seed order."""
    return [(baseline[s], other[s]) for s in sorted(set(baseline) & set(other), key=_seed_order)]


def difference_interval(pairs: Sequence[tuple[float, float]], level: float = LEVEL) -> Interval:
    """other - baseline, paired."""
    return mean_interval([o - b for b, o in pairs], level)


def speedup_interval(pairs: Sequence[tuple[float, float]], level: float = LEVEL) -> Interval:
    """baseline / other (times: > 1 means faster than the baseline), paired, on the log scale."""
    logs = [math.log(b / o) for b, o in pairs if b > 0 and o > 0]
    inner = mean_interval(logs, level)
    if inner.centre is None:
        return Interval(0, None)
    if inner.low is None or inner.high is None:
        return Interval(inner.n, math.exp(inner.centre))
    return Interval(inner.n, math.exp(inner.centre), math.exp(inner.low), math.exp(inner.high))


def verdict(interval: Interval, no_difference: float, more: str, less: str) -> str:
    """Plain words for the table: which side of `no_difference` the interval lies on, or that it includes it."""
    if interval.n == 0:
        return ""
    if interval.low is None:
        return "one seed: no interval"
    if not interval.excludes(no_difference):
        return f"no difference shown (95% CI includes {no_difference:g})"
    return more if interval.low > no_difference else less


def _seed_order(seed: str) -> tuple[int, float | str]:
    try:
        return (0, float(seed))
    except ValueError:
        return (1, seed)
