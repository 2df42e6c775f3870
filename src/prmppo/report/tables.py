"""The report's numbers: final test accuracy per group, the PRM - ORM difference, iterations to a threshold.

Accuracy is the test evaluation during PPO (`ppo_eval` rows: `eval/test_greedy_accuracy` and
`eval/test_sampled_accuracy` after `eval/ppo_iterations` iterations); a run's final accuracy is its
value at the last evaluation (after the last iteration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prmppo.report.runs import ARM_KEYS, INERT, Grouping, per_seed
from prmppo.report.stats import Estimate, difference_ci, mean_ci

ACCURACY = {"greedy": "eval/test_greedy_accuracy", "sampled": "eval/test_sampled_accuracy"}
X_KEY = "eval/ppo_iterations"
EVAL_STAGE = "ppo_eval"


def final_by_seed(runs, metric: str) -> dict[int, float]:
    """`{seed: metric at the run's last evaluation}`."""
    return {seed: series[max(series)] for seed, series in per_seed(runs, EVAL_STAGE, metric, X_KEY).items() if series}


def iterations_to(runs, metric: str, threshold: float) -> dict[int, int | None]:
    """`{seed: first evaluated iteration count with metric >= threshold, or None if never}`."""
    return {seed: next((x for x in sorted(series) if series[x] >= threshold), None)
            for seed, series in per_seed(runs, EVAL_STAGE, metric, X_KEY).items()}


@dataclass
class GroupRow:
    group: tuple[str, ...]
    seeds: list[int]
    runs: int
    greedy: Estimate
    sampled: Estimate
    to_threshold: dict[int, int | None]


def group_rows(grouping: Grouping, threshold: float) -> list[GroupRow]:
    rows = []
    for group, runs in grouping.groups.items():
        greedy = final_by_seed(runs, ACCURACY["greedy"])
        if not greedy:
            continue  # no test evaluation during PPO in these runs (eval.every=0, or not PPO runs)
        rows.append(GroupRow(group, sorted(greedy), len(runs), mean_ci(list(greedy.values())),
                             mean_ci(list(final_by_seed(runs, ACCURACY["sampled"]).values())),
                             iterations_to(runs, ACCURACY["greedy"], threshold)))
    return rows


def _compatible(grouping: Grouping, a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return all(x == y or INERT in (x, y) or key in ARM_KEYS for key, x, y in zip(grouping.keys, a[1:], b[1:]))


@dataclass
class DifferenceRow:
    prm: tuple[str, ...]
    orm: tuple[str, ...]
    difference: Estimate
    pairing: str
    prm_mean: float
    orm_mean: float


def difference_rows(grouping: Grouping, metric: str = ACCURACY["greedy"]) -> list[DifferenceRow]:
    """PRM - ORM final accuracy for every PRM group and each ORM group that matches it on the swept keys
    (a key inert in either group matches any value)."""
    finals = {group: final_by_seed(runs, metric) for group, runs in grouping.groups.items()}
    rows = []
    for prm, prm_final in finals.items():
        if prm[0] != "prm" or not prm_final:
            continue
        for orm, orm_final in finals.items():
            if orm[0] == "orm" and orm_final and _compatible(grouping, prm, orm):
                estimate, pairing = difference_ci(prm_final, orm_final)
                rows.append(DifferenceRow(prm, orm, estimate, pairing, mean_ci(list(prm_final.values())).mean,
                                          mean_ci(list(orm_final.values())).mean))
    return rows


def _reached(values: dict[int, int | None]) -> str:
    hit = sorted(v for v in values.values() if v is not None)
    if not hit:
        return f"never (0/{len(values)})"
    median = hit[len(hit) // 2] if len(hit) % 2 else (hit[len(hit) // 2 - 1] + hit[len(hit) // 2]) / 2
    return f"{median:g} ({len(hit)}/{len(values)} seeds)"


def markdown(grouping: Grouping, threshold: float, figures: list[str], sources: list[str]) -> str:
    """The report as markdown: groups, final accuracy with 95% CIs, PRM - ORM, failed runs, figures."""
    rows = group_rows(grouping, threshold)
    keys = grouping.keys
    total = sum(len(r) for r in grouping.groups.values()) + len(grouping.not_ok)
    lines = ["# prmppo report", "",
             f"{total} runs from {', '.join(f'`{s}`' for s in sources)}; grouped by arm"
             + (f" and the swept keys {', '.join(f'`{k}`' for k in keys)}" if keys else "")
             + f"; seeds are the replicates. `{INERT}`: the key has no effect on that arm's runs "
               "(not split on). Intervals: 95% Student-t across seeds.", "",
             "## Final test accuracy", "",
             "| arm | " + " | ".join(keys) + (" | " if keys else "")
             + f"seeds | runs | greedy | sampled | iterations to greedy >= {threshold:g} |",
             "|" + "---|" * (len(keys) + 6)]
    for row in rows:
        lines.append(f"| {row.group[0]} | " + " | ".join(row.group[1:]) + (" | " if keys else "")
                     + f"{','.join(map(str, row.seeds))} | {row.runs} | {row.greedy} | {row.sampled} | "
                     + f"{_reached(row.to_threshold)} |")
    if not rows:
        lines.append("\nNo finished run logged test accuracy during PPO (`ppo_eval` rows; `eval.every` > 0).")
    diffs = difference_rows(grouping)
    if diffs:
        lines += ["", "## PRM - ORM (final greedy test accuracy)", "",
                  "| PRM group | ORM group | PRM | ORM | difference (95% CI) | pairing |", "|---|---|---|---|---|---|"]
        for d in diffs:
            ci = "n/a" if math.isnan(d.difference.half_width) else \
                f"[{d.difference.mean - d.difference.half_width:+.3f}, {d.difference.mean + d.difference.half_width:+.3f}]"
            lines.append(f"| {grouping.label(d.prm)} | {grouping.label(d.orm)} | {d.prm_mean:.3f} | {d.orm_mean:.3f} | "
                         f"{d.difference.mean:+.3f} {ci} | {d.pairing} (n={d.difference.n}) |")
    if grouping.not_ok:
        lines += ["", "## Runs that did not finish", "", "| run | status | error |", "|---|---|---|"]
        for run in grouping.not_ok:
            error = (run.error or "").splitlines()[0] if run.error else ""
            lines.append(f"| `{run.path}` | {run.status} | {error.replace('|', '/')} |")
    for figure in figures:
        lines += ["", f"![{figure}]({figure})"]
    return "\n".join(lines) + "\n"
