"""Statistics across seeds (and prompts) for reports and pre-registered comparisons.

With n seeds the 95% interval of the mean is mean +- t(0.975, n - 1) * sd / sqrt(n) (sd with
ddof=1); one seed has no interval (nan). The PRM - ORM difference is paired by seed when both
arms ran the same seeds (same SFT policy and prompt order per seed, so the pairing removes the
seed's own effect), else Welch's interval with Welch-Satterthwaite degrees of freedom.

For a pre-registered study (every formula is in its function's docstring):
  - `paired_difference`: a - b paired by seed, with a Student-t or a percentile-bootstrap interval;
  - `prompt_seed_bootstrap`: a - b over a [seeds, prompts] grid of per-prompt outcomes (`outcome_grid`
    makes one from eval.json), resampling seeds and prompts independently (both arms see the same
    seeds and the same test prompts);
  - `paired_t_p`: the two-sided paired t test's p value of a list of paired differences;
  - `tost`: equivalence within +-margin by two one-sided t tests on paired differences;
  - `holm`: Holm-Bonferroni adjusted p values of a family of tests;
  - `curve_area`: the area under an accuracy-vs-iteration curve, normalised by its span;
  - `paired_t_power` and `seeds_needed`: the power of a paired t test, and the seeds it needs.
Bootstrap intervals draw from numpy's PCG64 seeded with `rng_seed`: the same inputs give the same
interval on every machine with the same numpy.
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


class Interval(NamedTuple):
    """A point estimate with an interval that need not be symmetric (a bootstrap's)."""
    mean: float
    low: float
    high: float
    n: int  # seeds (pairs) behind it
    method: str  # "t" | "bootstrap" | "prompt x seed bootstrap"

    def __str__(self) -> str:
        if math.isnan(self.low):
            return f"{self.mean:+.3f} (n={self.n})"
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def paired_differences(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """`a[seed] - b[seed]` in seed order; both arms must have run the same seeds."""
    if set(a) != set(b):
        raise ValueError(f"a paired difference needs the same seeds in both arms: only in a {sorted(set(a) - set(b))}, "
                         f"only in b {sorted(set(b) - set(a))}")
    return [a[seed] - b[seed] for seed in sorted(a)]


def paired_difference(a: dict[int, float], b: dict[int, float], level: float = LEVEL, method: str = "t",
                      n_resamples: int = 10_000, rng_seed: int = 0) -> Interval:
    """a - b paired by seed (`{seed: value}` each), with its interval across seeds:
    `t`: mean +- t(1 - alpha/2, n - 1) * sd / sqrt(n) of the per-seed differences (`mean_ci`);
    `bootstrap`: the alpha/2 and 1 - alpha/2 quantiles of the mean of n differences drawn with
    replacement, `n_resamples` times (percentile bootstrap)."""
    diffs = np.asarray(paired_differences(a, b), dtype=float)
    if method == "t":
        est = mean_ci(list(diffs), level)
        return Interval(est.mean, est.mean - est.half_width, est.mean + est.half_width, est.n, "t")
    if method != "bootstrap":
        raise ValueError(f"method must be 't' or 'bootstrap', got {method!r}")
    if len(diffs) < 2:
        return Interval(float(diffs.mean()) if len(diffs) else math.nan, math.nan, math.nan, len(diffs), method)
    rng = np.random.default_rng(rng_seed)
    means = diffs[rng.integers(0, len(diffs), size=(n_resamples, len(diffs)))].mean(axis=1)  # [R]
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(diffs.mean()), float(low), float(high), len(diffs), method)


def prompt_seed_means(diff: np.ndarray, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap replicates of the grid's mean: each draws seeds (rows) and prompts (columns) with replacement,
    independently, and averages the cells they select. For an additive grid d[s, p] = u[s] + v[p] their variance
    is var(u) / S + var(v) / P (population variances), the two sources of noise a comparison has."""
    seeds, prompts = diff.shape
    rows = rng.integers(0, seeds, size=(n_resamples, seeds))  # [R, S]
    cols = rng.integers(0, prompts, size=(n_resamples, prompts))  # [R, P]
    # the mean over the selected cells is the mean over the drawn seeds of each seed's mean on the drawn prompts;
    # a seed's mean on the drawn prompts is its row weighted by how often each prompt was drawn
    row_means = np.empty((n_resamples, seeds))  # [R, S]
    for start in range(0, n_resamples, 1024):  # [1024, P] draw counts at a time
        chunk = cols[start:start + 1024]
        counts = np.zeros((len(chunk), prompts))
        np.add.at(counts, (np.arange(len(chunk))[:, None], chunk), 1.0)
        row_means[start:start + 1024] = counts @ diff.T / prompts
    return np.take_along_axis(row_means, rows, axis=1).mean(axis=1)  # [R]


OUTCOMES = ("greedy", "sampled", "pass")  # what `outcome_grid` reads from a per-problem row


def outcome_grid(problems_by_seed: dict[int, list[dict]], outcome: str = "greedy") -> tuple[list[int], list[str],
                                                                                         np.ndarray]:
    """`(seeds, problem ids, grid [seeds, prompts])` from each seed's per-problem outcomes (eval.json's
    `<policy>.problems`), seeds and problems in sorted order: `greedy` is the greedy verdict as 0/1, `sampled`
    the fraction of the k samples that were right, `pass` whether any of the k was (pass@k with n = k samples,
    as `evaluation.pass_at_k(k, c, k)`: 1 when c > 0). Every seed must have evaluated the same problems."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {', '.join(map(repr, OUTCOMES))}, got {outcome!r}")
    seeds = sorted(problems_by_seed)
    by_id = {seed: {row["id"]: row for row in problems_by_seed[seed]} for seed in seeds}
    ids = sorted(by_id[seeds[0]]) if seeds else []
    for seed in seeds:
        if sorted(by_id[seed]) != ids:
            raise ValueError(f"seed {seed} evaluated other problems than seed {seeds[0]}: a prompt x seed grid "
                             "needs the same test problems in every run")

    def value(row: dict) -> float:
        if outcome == "greedy":
            return float(row["greedy_correct"])
        return row["correct_of_k"] / row["k"] if outcome == "sampled" else float(row["correct_of_k"] > 0)

    return seeds, ids, np.array([[value(by_id[seed][i]) for i in ids] for seed in seeds], dtype=float).reshape(
        len(seeds), len(ids))


def prompt_seed_bootstrap(a, b, level: float = LEVEL, n_resamples: int = 10_000, rng_seed: int = 0) -> Interval:
    """a - b from per-prompt outcomes on a [seeds, prompts] grid each (e.g. greedy verdicts as 0/1, or right
    samples / k), rows in the same seed order and columns in the same prompt order in both arms, so each cell
    pairs the arms on one seed and one prompt. The interval is the percentile bootstrap of
    `prompt_seed_means`: it counts the test set's sampling noise as well as the seeds'."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 2 or 0 in a.shape:
        raise ValueError(f"both arms need the same non-empty [seeds, prompts] grid, got {a.shape} and {b.shape}")
    diff = a - b  # [S, P]
    means = prompt_seed_means(diff, n_resamples, np.random.default_rng(rng_seed))
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(diff.mean()), float(low), float(high), a.shape[0], "prompt x seed bootstrap")


def paired_t_p(differences: list[float]) -> float:
    """The two-sided p value of the paired t test of H0 mean difference = 0: with mean m, se = sd / sqrt(n)
    (ddof=1) and df = n - 1, p = 2 P(T_df >= |m| / se). Fewer than 2 differences: nan; all differences equal:
    1 when they are 0, else 0 (no spread, so any non-zero mean is certain)."""
    data = np.asarray(differences, dtype=float)
    n = len(data)
    if n < 2:
        return math.nan
    mean, se = float(data.mean()), float(data.std(ddof=1) / math.sqrt(n))
    if se == 0:
        return float(mean == 0)
    return float(2 * stats.t.sf(abs(mean) / se, n - 1))


class Equivalence(NamedTuple):
    mean: float  # mean paired difference
    margin: float
    p_lower: float  # H0: difference <= -margin
    p_upper: float  # H0: difference >= +margin
    equivalent: bool  # both nulls rejected at alpha
    n: int

    @property
    def p(self) -> float:
        """The TOST p value: the larger of the two one-sided ones."""
        return max(self.p_lower, self.p_upper)


def tost(differences: list[float], margin: float, alpha: float = 0.05) -> Equivalence:
    """Two one-sided t tests of equivalence on paired differences (Schuirmann 1987). With mean m, se = sd /
    sqrt(n) and df = n - 1: p_lower = P(T_df >= (m + margin) / se) tests H0 m <= -margin, p_upper =
    P(T_df <= (m - margin) / se) tests H0 m >= +margin; equivalent when both are below alpha, i.e. when
    the 1 - 2 alpha interval of m lies inside (-margin, +margin). Fewer than 2 differences: nan, not
    equivalent; all differences equal: p is 0 or 1 by which side of each bound m lies."""
    if margin <= 0:
        raise ValueError(f"the equivalence margin must be > 0, got {margin}")
    data = np.asarray(differences, dtype=float)
    n = len(data)
    if n < 2:
        return Equivalence(float(data.mean()) if n else math.nan, margin, math.nan, math.nan, False, n)
    mean, se = float(data.mean()), float(data.std(ddof=1) / math.sqrt(n))
    if se == 0:
        p_lower, p_upper = float(mean <= -margin), float(mean >= margin)
    else:
        p_lower = float(stats.t.sf((mean + margin) / se, n - 1))
        p_upper = float(stats.t.cdf((mean - margin) / se, n - 1))
    return Equivalence(mean, margin, p_lower, p_upper, p_lower < alpha and p_upper < alpha, n)


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p values, in the order given: with the m p values sorted ascending,
    p_adj(i) = max over j <= i of min(1, (m - j + 1) p(j)) (1-based ranks). Rejecting where p_adj <= alpha
    controls the family-wise error rate at alpha."""
    p = np.asarray(p_values, dtype=float)
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"p values must lie in [0, 1], got {list(p_values)}")
    m = len(p)
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])  # rank j (0-based) multiplied by m - j
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(scaled)
    return [float(x) for x in adjusted]


def curve_area(curve: dict[int, float]) -> float:
    """The area under an accuracy-vs-iteration curve (`{iterations done: accuracy}`) by the trapezoid rule over
    the evaluated iterations, divided by their span (last - first): the curve's mean height, in accuracy
    units. Compare runs only over the same evaluated iterations. Fewer than 2 points: nan."""
    xs = sorted(curve)
    if len(xs) < 2:
        return math.nan
    area = sum((x1 - x0) * (curve[x0] + curve[x1]) / 2 for x0, x1 in zip(xs, xs[1:]))
    return area / (xs[-1] - xs[0])


def paired_t_power(n: int, difference: float, sd: float, alpha: float = 0.05) -> float:
    """The power of a two-sided paired t test with n pairs to detect a mean difference `difference` when the
    paired differences have standard deviation `sd`: P(|T| > t(1 - alpha/2, n - 1)) with T noncentral t,
    df = n - 1 and noncentrality difference / sd * sqrt(n)."""
    if n < 2:
        return math.nan
    critical = stats.t.ppf(1 - alpha / 2, n - 1)
    shift = abs(difference) / sd * math.sqrt(n)
    return float(stats.nct.sf(critical, n - 1, shift) + stats.nct.cdf(-critical, n - 1, shift))


def seeds_needed(difference: float, sd: float, power: float = 0.8, alpha: float = 0.05) -> int:
    """Seeds (pairs) a two-sided paired t test needs to detect `difference` with `power` at `alpha`, given the
    standard deviation `sd` of the paired differences (a pilot's). Start from the normal approximation
    n = ((z(1 - alpha/2) + z(power)) * sd / difference)^2, which undercounts because t has heavier tails than
    the normal, then move to the smallest n >= 2 whose exact power (`paired_t_power`) reaches `power`.
    E.g. difference = sd: the normal approximation says 7.85, the t test needs 10."""
    if difference == 0 or sd <= 0:
        raise ValueError(f"need a difference != 0 and a positive sd, got difference={difference}, sd={sd}")
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    n = max(2, math.ceil((z * sd / abs(difference)) ** 2))
    while n > 2 and paired_t_power(n - 1, difference, sd, alpha) >= power:
        n -= 1
    while paired_t_power(n, difference, sd, alpha) < power:
        n += 1
    return n
