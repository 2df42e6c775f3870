"""The pre-registered tests: one arm against another, paired by seed, per endpoint, Holm-adjusted per family.

For each endpoint, over the seeds where both arms have it (`Study.values`):
  - the mean paired difference arm - against with its 95% t interval (`stats.paired_difference`);
  - for an endpoint at one iteration, the prompt x seed bootstrap interval from the per-problem outcomes of
    that evaluation (`stats.prompt_seed_bootstrap`, the study file's resamples and seed), over the seeds
    where both arms wrote them; an area has none;
  - the two-sided paired t test's p (`stats.paired_t_p`) and its Holm adjustment over the family
    (`stats.holm`; an endpoint without a p, fewer than 2 seeds, enters the family as p = 1, so the family
    keeps its pre-registered size);
  - TOST against +-margin at alpha (`stats.tost`).
The verdict: `superior` / `inferior` where the Holm-adjusted p < alpha (by the sign of the mean),
`equivalent` where TOST rejects both one-sided nulls, both when both hold (a difference shown to exist and
shown smaller than the margin), else `inconclusive`; `n/a` below 2 seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from prmppo.report.prereg.spec import LAST, Endpoint
from prmppo.report.prereg.study import Study
from prmppo.report.runs import ReportError
from prmppo.report.stats import (Equivalence, Interval, holm, outcome_grid, paired_difference, paired_t_p,
                                 prompt_seed_bootstrap, tost)


@dataclass(frozen=True)
class Result:
    endpoint: Endpoint
    arm: str
    against: str
    per_seed: dict[int, tuple[float, float]]  # seed -> (arm's value, against's value)
    t: Interval
    bootstrap: Interval | None  # None for an area, or when no seed has per-problem outcomes in both arms
    p: float  # nan below 2 seeds
    equivalence: Equivalence
    p_holm: float = math.nan
    verdict: str = "n/a"

    @property
    def seeds(self) -> list[int]:
        return sorted(self.per_seed)

    def mean(self, which: int) -> float:
        """The arm's (0) or the against arm's (1) mean over the paired seeds."""
        values = [pair[which] for pair in self.per_seed.values()]
        return sum(values) / len(values) if values else math.nan


def _bootstrap(study: Study, endpoint: Endpoint, arm: str, at, against: str, against_at,
               seeds: list[int]) -> Interval | None:
    """The prompt x seed bootstrap over `seeds` with per-problem outcomes in both arms, None without any."""
    if isinstance(at, tuple):
        return None
    runs, others = study.ppo.get(arm, {}), study.ppo.get(against, {})
    a = {s: runs[s].problems(at) for s in seeds}
    b = {s: others[s].problems(against_at) for s in seeds}
    both = [s for s in seeds if a[s] is not None and b[s] is not None]
    if not both:
        return None
    outcome, metric = endpoint.outcome, endpoint.metric
    if endpoint.k is not None:
        other_k = sorted({row["k"] for rows in (*a.values(), *b.values()) if rows for row in rows} - {endpoint.k})
        if other_k:
            raise ReportError(f"{metric} of {arm} / {against}: the per-problem outcomes hold {other_k[0]} samples a "
                              f"problem, so they give pass@{other_k[0]}, not {metric}")
    try:
        _, ids_a, grid_a = outcome_grid({s: a[s] for s in both}, outcome)
        _, ids_b, grid_b = outcome_grid({s: b[s] for s in both}, outcome)
    except ValueError as err:
        raise ReportError(f"{arm} / {against}: {err}") from None
    if ids_a != ids_b:
        raise ReportError(f"{arm} and {against} were evaluated on other test problems; the prompt x seed "
                          "bootstrap pairs them problem by problem")
    return prompt_seed_bootstrap(grid_a, grid_b, n_resamples=study.spec.bootstrap_resamples,
                                 rng_seed=study.spec.bootstrap_seed)


def compare(study: Study, endpoint: Endpoint, arm: str, against: str, seeds, at=None, against_at=None) -> Result:
    """One endpoint of `arm` against `against` over `seeds` (each arm at `at` / `against_at`, both by default
    the endpoint's iteration or area), before the family's adjustment."""
    default = endpoint.area if endpoint.area else endpoint.iteration
    at = default if at is None else at
    against_at = default if against_at is None else against_at
    a = study.values(arm, endpoint.metric, at, seeds)
    b = study.values(against, endpoint.metric, against_at, seeds)
    common = sorted(set(a) & set(b))
    per_seed = {s: (a[s], b[s]) for s in common}
    a, b = {s: a[s] for s in common}, {s: b[s] for s in common}
    diffs = [a[s] - b[s] for s in common]
    t = paired_difference(a, b) if common else Interval(math.nan, math.nan, math.nan, 0, "t")
    return Result(endpoint, arm, against, per_seed, t,
                  _bootstrap(study, endpoint, arm, at, against, against_at, common),
                  paired_t_p(diffs), tost(diffs, study.spec.margin, study.spec.alpha))


def verdict(result: Result, alpha: float) -> str:
    if len(result.per_seed) < 2:
        return "n/a"
    shown = []
    if result.p_holm < alpha:
        shown.append("superior" if result.t.mean > 0 else "inferior")
    if result.equivalence.equivalent:
        shown.append("equivalent")
    return " and ".join(shown) or "inconclusive"


def family(results: list[Result], alpha: float) -> list[Result]:
    """The results with their Holm-adjusted p over the family and their verdicts."""
    adjusted = holm([1.0 if math.isnan(r.p) else r.p for r in results])
    out = []
    for result, p_holm in zip(results, adjusted):
        result = replace(result, p_holm=math.nan if math.isnan(result.p) else p_holm)
        out.append(replace(result, verdict=verdict(result, alpha)))
    return out


def primary(study: Study) -> list[Result]:
    spec = study.spec
    return family([compare(study, e, spec.primary, spec.baseline, spec.seeds) for e in spec.endpoints], spec.alpha)


def secondary(study: Study) -> list[list[Result]]:
    """Per secondary comparison, its endpoints as one family."""
    spec = study.spec
    return [family([compare(study, e, c.arm, c.against, c.seeds) for e in spec.endpoints], spec.alpha)
            for c in spec.secondary]


def matched(study: Study) -> list[Result]:
    """The compute-matched comparison: the arm at its iteration against the other at its last evaluation, one
    family over the metrics."""
    m = study.spec.compute_matched
    if m is None:
        return []
    endpoints = [Endpoint(metric, f"{metric}, {m.arm} at {m.iteration} / {m.against} at its last", metric,
                          m.iteration, None) for metric in m.metrics]
    return family([compare(study, e, m.arm, m.against, m.seeds, m.iteration, LAST) for e in endpoints],
                  study.spec.alpha)
