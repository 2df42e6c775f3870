"""Confidence intervals across seeds: Student-t intervals for a mean and for a difference of means.

With n seeds the 95% interval of the mean is mean +- t(0.975, n - 1) * sd / sqrt(n) (sd with
ddof=1); one seed has no interval (nan). The PRM - ORM difference is paired by seed when both
arms ran the same seeds (same SFT policy and prompt order per seed, so the pairing removes the
seed's own effect), else Welch's interval with Welch-Satterthwaite degrees of freedom.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from scipy import stats

LEVEL = 0.95


class Estimate(NamedTuple):
    mean: float
    half_width: float  # nan when it cannot be estimated (fewer than 2 values)
    n: int

    def __str__(self) -> str:
        if math.isnan(self.mean):
            return "n/a"
        if math.isnan(self.half_width):
            return f"{self.mean:.3f} (n={self.n})"
        return f"{self.mean:.3f} ± {self.half_width:.3f}"


def mean_ci(values: list[float], level: float = LEVEL) -> Estimate:
    data = np.asarray(values, dtype=float)
    n = len(data)
    if n == 0:
        return Estimate(math.nan, math.nan, 0)
    if n == 1:
        return Estimate(float(data[0]), math.nan, 1)
    sem = data.std(ddof=1) / math.sqrt(n)
    return Estimate(float(data.mean()), float(stats.t.ppf(0.5 + level / 2, n - 1) * sem), n)


def difference_ci(a: dict[int, float], b: dict[int, float], level: float = LEVEL) -> tuple[Estimate, str]:
    """(a - b with its interval, "paired" | "welch") from `{seed: value}` of each arm."""
    if set(a) == set(b):
        return mean_ci([a[seed] - b[seed] for seed in sorted(a)], level), "paired"
    x, y = np.asarray(list(a.values()), float), np.asarray(list(b.values()), float)
    diff = float(x.mean() - y.mean()) if len(x) and len(y) else math.nan
    if len(x) < 2 or len(y) < 2:
        return Estimate(diff, math.nan, min(len(x), len(y))), "welch"
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = math.sqrt(vx + vy)
    if se == 0:
        return Estimate(diff, 0.0, min(len(x), len(y))), "welch"
    df = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    return Estimate(diff, float(stats.t.ppf(0.5 + level / 2, df) * se), min(len(x), len(y))), "welch"
