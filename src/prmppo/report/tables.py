"""The report's numbers: final test accuracy per group, PRM - ORM differences, iterations to a threshold.

Two sources of accuracy, each a column only when some run logged it (`measures`):
  - the test evaluation during PPO (`ppo_eval` rows: `eval/test_greedy_accuracy`,
    `eval/test_sampled_accuracy`, `eval/test_pass@k` after `eval/ppo_iterations` iterations, on the
    first `eval.during_ppo_problems` test problems); a run's final value is the one at its last
    evaluation (after the last iteration);
  - the final evaluation of the PPO policy by the pipeline's `eval` step (`eval` rows:
    `eval/ppo/greedy_accuracy`, `eval/ppo/sampled_accuracy`, `eval/ppo/pass@k`, the numbers of
    `eval.json` on `eval.n_problems` test problems with `eval.k` samples), columns `final ...`,
    and the same of the SFT policy it started from (`eval/sft/...`), columns `SFT ...`: the baseline,
    never differenced between arms.
For pass@k the largest k logged is shown (pass@2 is logged beside pass@8).

Differences: every PRM group against each ORM group that matches it on the swept keys (`reward`
excepted: it belongs to the arm), labelled by what scores the steps (`learned PRM - ORM`,
`oracle PRM - ORM`), paired by seed when both ran the same seeds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from prmppo.report.runs import ARM_KEYS, INERT, Grouping, Run, per_seed
from prmppo.report.stats import Estimate, difference_ci, mean_ci

ACCURACY = {"greedy": "eval/test_greedy_accuracy", "sampled": "eval/test_sampled_accuracy"}
X_KEY = "eval/ppo_iterations"
EVAL_STAGE = "ppo_eval"
FINAL_STAGE = "eval"
_PASS_AT = re.compile(r"pass@(\d+)$")
# (rows' stage, metric prefix, x key, column prefix, where the numbers come from)
SOURCES = ((EVAL_STAGE, "eval/test_", X_KEY, "",
            "the last test evaluation during PPO (`ppo_eval` rows of metrics.jsonl; the first "
            "`eval.during_ppo_problems` test problems, `eval.during_ppo_k` samples)"),
           (FINAL_STAGE, "eval/ppo/", None, "final ",
            "the final evaluation of the PPO policy after training (`eval` rows of metrics.jsonl, as in eval.json; "
            "`eval.n_problems` test problems, `eval.k` samples)"),
           (FINAL_STAGE, "eval/sft/", None, "SFT ",
            "the same final evaluation of the SFT policy PPO started from (the baseline; not compared between arms)"))
BASELINE = "SFT "  # column prefix of measures that describe the start, not an arm


@dataclass(frozen=True)
class Measure:
    name: str  # column label, e.g. "greedy" or "final pass@8"
    stage: str  # the rows it is read from
    metric: str
    x_key: str | None  # None: iterations done (`step + 1`)


GREEDY = Measure("greedy", EVAL_STAGE, ACCURACY["greedy"], X_KEY)


def measures(runs: list[Run]) -> list[Measure]:
    """The accuracy columns some run logged: greedy, sampled and the largest pass@k, per source."""
    out = []
    for stage, prefix, x_key, label, _ in SOURCES:
        keys = {key for run in runs for row in run.rows if row["stage"] == stage for key in row}
        ks = sorted(int(m.group(1)) for key in keys if key.startswith(prefix) and (m := _PASS_AT.search(key)))
        names = ["greedy_accuracy", "sampled_accuracy"] + ([f"pass@{ks[-1]}"] if ks else [])
        out += [Measure(label + name.removesuffix("_accuracy"), stage, prefix + name, x_key)
                for name in names if prefix + name in keys]
    return out


def final_by_seed(runs, measure: Measure) -> dict[int, float]:
    """`{seed: the measure at the run's last evaluation}`."""
    series = per_seed(runs, measure.stage, measure.metric, measure.x_key)
    return {seed: values[max(values)] for seed, values in series.items() if values}


def iterations_to(runs, metric: str, threshold: float) -> dict[int, int | None]:
    """`{seed: first evaluated iteration count with metric >= threshold, or None if never}`."""
    return {seed: next((x for x in sorted(series) if series[x] >= threshold), None)
            for seed, series in per_seed(runs, EVAL_STAGE, metric, X_KEY).items()}


@dataclass
class GroupRow:
    group: tuple[str, ...]
    seeds: list[int]
    runs: int
    values: dict[str, Estimate]  # measure name -> mean and 95% CI across seeds
    to_threshold: dict[int, int | None]
    kind: str = ""  # ORM | learned PRM | oracle PRM | likelihood control

    @property
    def greedy(self) -> Estimate:
        return self.values.get("greedy", Estimate(math.nan, math.nan, 0))

    @property
    def sampled(self) -> Estimate:
        return self.values.get("sampled", Estimate(math.nan, math.nan, 0))


def group_rows(grouping: Grouping, threshold: float) -> list[GroupRow]:
    """One row per group that logged any test accuracy (a group without one, e.g. `eval.every=0`, is left out)."""
    columns = measures([run for runs in grouping.groups.values() for run in runs])
    rows = []
    for group, runs in grouping.groups.items():
        finals = {m.name: final_by_seed(runs, m) for m in columns}
        seeds = sorted({seed for values in finals.values() for seed in values})
        if not seeds:
            continue
        rows.append(GroupRow(group, seeds, len(runs), {name: mean_ci(list(v.values())) for name, v in finals.items()},
                             iterations_to(runs, ACCURACY["greedy"], threshold), runs[0].reward_kind))
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
    label: str = "PRM - ORM"  # `learned PRM - ORM` or `oracle PRM - ORM`
    measure: str = field(default=GREEDY.name)

    def interval(self) -> str:
        d = self.difference
        return "n/a" if math.isnan(d.half_width) else f"[{d.mean - d.half_width:+.3f}, {d.mean + d.half_width:+.3f}]"

    def excludes_zero(self) -> bool:
        """Whether the 95% interval lies wholly on one side of 0 (only then is there a difference to claim)."""
        d = self.difference
        return not math.isnan(d.half_width) and abs(d.mean) > d.half_width


def compared(runs: list[Run]) -> list[Measure]:
    """The measures PRM and ORM are compared on: every one but the SFT baseline's."""
    return [m for m in measures(runs) if not m.name.startswith(BASELINE)]


def difference_rows(grouping: Grouping, measure: Measure = GREEDY) -> list[DifferenceRow]:
    """PRM - ORM of `measure` for every PRM group and each ORM group that matches it on the swept keys (a key
    inert in either group matches any value; `reward` belongs to the arm and matches any value)."""
    finals = {group: final_by_seed(runs, measure) for group, runs in grouping.groups.items()}
    rows = []
    for prm, prm_final in finals.items():
        if prm[0] != "prm" or not prm_final:
            continue
        kind = grouping.groups[prm][0].reward_kind
        for orm, orm_final in finals.items():
            if orm[0] == "orm" and orm_final and _compatible(grouping, prm, orm):
                estimate, pairing = difference_ci(prm_final, orm_final)
                rows.append(DifferenceRow(prm, orm, estimate, pairing, mean_ci(list(prm_final.values())).mean,
                                          mean_ci(list(orm_final.values())).mean, f"{kind} - ORM", measure.name))
    return rows
