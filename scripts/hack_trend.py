"""How each PPO run's PRM monitors and response shape moved: the first and the last iterations side by side.

    python scripts/hack_trend.py SWEEP_OR_RUN_DIR [...] [--window 10]
    python scripts/hack_trend.py multirun/prm_vs_orm_sparse

One line per finished run (the report's run discovery, `prmppo.report.find_runs`): for each of the PRM
score, the true step accuracy, their gap, steps per response, the response length and the truncated
fraction, the mean over the first `--window` iterations -> the mean over the last. A run without a
metric (the ORM arm logs no PRM monitors) shows `-`. The report's hacking table gives the same
monitors across seeds; this gives them per run, to see whether every seed moved the same way.
"""

from __future__ import annotations

import argparse

from prmppo.report import find_runs

METRICS = {"PRM score": "prm/score_mean", "true step acc.": "hack/true_step_accuracy",
           "gap": "hack/prm_vs_true_step_gap", "steps/response": "hack/steps_per_response",
           "length": "rollout/response_length", "truncated": "rollout/truncated_fraction"}


def trend(series: dict[int, float], window: int) -> str:
    if not series:
        return "-"
    xs = sorted(series)
    first, last = xs[:window], xs[-window:]
    return (f"{sum(series[x] for x in first) / len(first):.3f} -> "
            f"{sum(series[x] for x in last) / len(last):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", help="run or sweep directories (searched recursively)")
    parser.add_argument("--window", type=int, default=10, help="iterations averaged at each end")
    args = parser.parse_args()
    print("| run | " + " | ".join(METRICS) + " |")
    print("|---" * (len(METRICS) + 1) + "|")
    for run in find_runs(args.dirs):
        if run.status != "ok":
            continue
        cells = [trend(run.series("ppo", metric), args.window) for metric in METRICS.values()]
        print(f"| {run.path.parent.name}/{run.path.name.split('_')[0]} {run.arm} seed {run.seed} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
