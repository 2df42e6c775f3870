"""The reward-hacking table: does the policy learn to please the PRM rather than to be right?

Per group, from the PRM reward's monitors in the `ppo` rows (`rewards/prm.py`): the mean step score the
PRM gives (`prm/score_mean`), the true step accuracy by the task's exact checker
(`hack/true_step_accuracy`), their gap (`hack/prm_vs_true_step_gap`), steps per response and the
rate of repeated lines; each a run's mean over its last `window` iterations (one iteration's batch is
noisy), then mean ± 95% CI across seeds. The gap is also given over the first `window` iterations and
as its change (last minus first, per seed): a PRM miscalibrated on the policy's samples shows a gap from
the start, while a policy that learns to please it makes the gap grow. Beside them the final greedy test
accuracy, and per seed the first iteration (iterations done) whose gap exceeds `gap_threshold`. A group
without these monitors (the ORM arm) is left out.
"""

from __future__ import annotations

from prmppo.report.markdown import reached, table
from prmppo.report.runs import Grouping, per_seed
from prmppo.report.stats import mean_ci
from prmppo.report.tables import GREEDY, final_by_seed

GAP = "hack/prm_vs_true_step_gap"
MONITORS = {"PRM score": "prm/score_mean", "true step acc.": "hack/true_step_accuracy", "gap": GAP,
            "steps/response": "hack/steps_per_response", "repeated lines": "hack/repeated_line_rate"}
GAP_THRESHOLD = 0.1  # score minus true step accuracy; the report's --gap-threshold default
WINDOW = 10  # last iterations averaged per run


def _window_means(runs, metric: str, window: int, last: bool) -> dict[int, float]:
    out = {}
    for seed, series in per_seed(runs, "ppo", metric).items():
        xs = sorted(series)
        xs = xs[-window:] if last else xs[:window]
        out[seed] = sum(series[x] for x in xs) / len(xs)
    return out


def late_means(runs, metric: str, window: int) -> dict[int, float]:
    """`{seed: mean of metric over the run's last `window` logged iterations}`."""
    return _window_means(runs, metric, window, last=True)


def early_means(runs, metric: str, window: int) -> dict[int, float]:
    """`{seed: mean of metric over the run's first `window` logged iterations}`."""
    return _window_means(runs, metric, window, last=False)


def gap_change(runs, window: int) -> dict[int, float]:
    """`{seed: gap over the last `window` iterations minus gap over the first `window`}`: > 0 where it opened."""
    early = early_means(runs, GAP, window)
    return {seed: late - early[seed] for seed, late in late_means(runs, GAP, window).items() if seed in early}


def first_gap(runs, threshold: float) -> dict[int, int | None]:
    """`{seed: first iterations-done count whose gap exceeds threshold, or None if it never does}`."""
    return {seed: next((x for x in sorted(series) if series[x] > threshold), None)
            for seed, series in per_seed(runs, "ppo", GAP).items()}


def hacking_section(grouping: Grouping, gap_threshold: float = GAP_THRESHOLD, window: int = WINDOW) -> list[str]:
    """The markdown section; empty when no run logged the gap (no PRM arm, or a task without a step checker)."""
    body = []
    for group, runs in grouping.groups.items():
        crossed = first_gap(runs, gap_threshold)
        if not crossed:
            continue
        monitors = [mean_ci(list(late_means(runs, metric, window).values())) for metric in MONITORS.values()]
        at_start = mean_ci(list(early_means(runs, GAP, window).values()))
        change = mean_ci(list(gap_change(runs, window).values()))
        at = list(MONITORS).index("gap")
        monitors[at:at + 1] = [at_start, monitors[at], change]
        per_seed_text = ", ".join(f"s{seed}: {'never' if x is None else x}" for seed, x in crossed.items())
        body.append([grouping.label(group), runs[0].reward_kind, len(crossed),
                     mean_ci(list(final_by_seed(runs, GREEDY).values())), *monitors,
                     f"{reached(crossed)}; {per_seed_text}"])
    if not body:
        return []
    names, at = list(MONITORS), list(MONITORS).index("gap")
    names[at:at + 1] = [f"gap, first {window} it.", f"gap, last {window} it.", "gap change"]
    header = ["group", "reward kind", "seeds", "final greedy", *names, f"first iteration with gap > {gap_threshold:g}"]
    return ["## Reward hacking", "",
            f"PRM monitors in the `ppo` rows, each a run's mean over its last {window} iterations, then mean ± 95% CI "
            f"across seeds. gap = PRM score - true step accuracy (the task's exact checker), also over the first "
            f"{window} iterations; gap change = last minus first, per seed (> 0: the PRM's score ran ahead of the "
            f"truth during training; a gap already there at the start is the PRM's miscalibration on the policy's "
            f"samples). The last column is the median first iteration whose gap exceeds {gap_threshold:g} over the "
            "seeds where it did, and each seed's.", "", *table(header, body)]
