"""How a PPO run credited its responses: the per-quarter advantage of right responses, the critic's
explained variance and the rollout accuracy, read from the runs' `metrics.jsonl`.

    python scripts/credit_by_quarter.py RUN_DIR [RUN_DIR ...]
    python scripts/credit_by_quarter.py runs/default/*/

For each run dir, one line: `adv/right_q1..q4` (the mean advantage of right responses in each
quarter of their length, logged every iteration by `ppo/loop.py`) as its minimum and its mean over
the iterations; the mean `value/explained_variance` of the last 50 iterations (a critic only runs
under `ppo.advantage_estimator=gae`); the rollout accuracy of the first 10 and the last 20
iterations. A right response credited by position rather than quality shows as a negative
late-quarter minimum.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

QUARTERS = [f"adv/right_q{q}" for q in range(1, 5)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(run_dir: Path) -> dict:
    """The figures above for one run dir (its `stage: ppo` rows of metrics.jsonl)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ppo = [row for row in rows if row.get("stage") == "ppo"]
    if not ppo:
        raise ValueError(f"{run_dir}/metrics.jsonl has no PPO rows")
    quarters = {key: [row[key] for row in ppo if key in row] for key in QUARTERS}
    explained = [row["value/explained_variance"] for row in ppo[-50:]
                 if row.get("value/explained_variance") is not None]
    return {"iterations": len(ppo),
            "right_min": [min(v) if v else None for v in quarters.values()],
            "right_mean": [_mean(v) for v in quarters.values()],
            "explained_variance_last50": _mean(explained),
            "accuracy_first10": _mean([row["rollout/accuracy"] for row in ppo[:10]]),
            "accuracy_last20": _mean([row["rollout/accuracy"] for row in ppo[-20:]])}


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for run_dir in map(Path, argv):
        s = summarise(run_dir)
        print(f"{run_dir}: {s['iterations']} its | right-response advantage min q1-q4 "
              f"{' '.join(map(_fmt, s['right_min']))} (mean {' '.join(map(_fmt, s['right_mean']))}) | "
              f"explained variance last 50 {_fmt(s['explained_variance_last50'])} | "
              f"rollout accuracy {_fmt(s['accuracy_first10'])} -> {_fmt(s['accuracy_last20'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
