"""The pilot's tables (README.md here) from its run dirs: SFT vs ORM-PPO per seed, the paired gain, and
accuracy per difficulty, all from each run's eval.json (its per-problem outcomes carry the difficulty).

    mkdir -p /tmp/pilot && tar xzf experiments/prm_vs_orm_flaw/pilot/pilot.tar.gz -C /tmp/pilot
    python experiments/prm_vs_orm_flaw/pilot_table.py /tmp/pilot orm_s          # the 5 seeds at the experiment's LR
    python experiments/prm_vs_orm_flaw/pilot_table.py /tmp/pilot orm_lr5e-3_s   # the 3 seeds at ppo.lr=5e-3

Groups with the same run-name prefix are one setting; the seed is the run's `seed`.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

MEASURES = ("greedy_accuracy", "sampled_accuracy", "pass@8")


def runs(root: Path, prefix: str) -> dict[int, dict]:
    """{seed: eval.json} of the finished runs named `<prefix><seed>`."""
    out = {}
    for run in sorted(root.glob(f"{prefix}*")):
        tail = run.name[len(prefix):]
        if tail.isdigit() and (run / "eval.json").is_file():
            out[int(tail)] = json.loads((run / "eval.json").read_text())
    return out


def per_seed(evals: dict[int, dict]) -> None:
    print("| seed | SFT greedy | SFT sampled | SFT pass@8 | ORM greedy | ORM sampled | ORM pass@8 | gain greedy | gain sampled | gain pass@8 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    gains = defaultdict(list)
    for seed, ev in sorted(evals.items()):
        cells = [f"{ev[p][m]:.3f}" for p in ("sft", "ppo") for m in MEASURES]
        for m in MEASURES:
            gains[m].append(ev["ppo"][m] - ev["sft"][m])
        print(f"| {seed} | " + " | ".join(cells) + " | " + " | ".join(f"{gains[m][-1]:+.3f}" for m in MEASURES) + " |")
    for name, fn in (("median", statistics.median), ("mean", statistics.mean)):
        sft = [fn([ev["sft"][m] for ev in evals.values()]) for m in MEASURES]
        ppo = [fn([ev["ppo"][m] for ev in evals.values()]) for m in MEASURES]
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in sft + ppo) + " | "
              + " | ".join(f"{fn(gains[m]):+.3f}" for m in MEASURES) + " |")
    if len(evals) >= 2:
        print("| sd of the paired gain (n-1) | | | | | | | "
              + " | ".join(f"{statistics.stdev(gains[m]):.3f}" for m in MEASURES) + " |")


def per_difficulty(evals: dict[int, dict]) -> None:
    """Accuracy per carry count and per operand count, pooled over seeds (problems x seeds)."""
    print("| group | problems x seeds | SFT greedy | SFT sampled | SFT pass@8 | ORM greedy | ORM sampled | ORM pass@8 |")
    print("|---|---|---|---|---|---|---|---|")
    groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for ev in evals.values():
        for policy in ("sft", "ppo"):
            for row in ev[policy]["problems"]:
                keys = ["all"] + [f"{k}={v}" for k, v in sorted(row["difficulty"].items())]
                for key in keys:
                    groups[key][policy].append(row)
    for key in sorted(groups, key=lambda k: (k != "all", k)):
        cells = []
        for policy in ("sft", "ppo"):
            rows = groups[key][policy]
            k = rows[0]["k"]
            cells += [sum(r["greedy_correct"] for r in rows) / len(rows),
                      sum(r["correct_of_k"] for r in rows) / (k * len(rows)),
                      sum(r["correct_of_k"] > 0 for r in rows) / len(rows)]
        print(f"| {key} | {len(groups[key]['sft'])} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    evals = runs(Path(argv[0]), argv[1])
    if not evals:
        raise SystemExit(f"no finished run named {argv[1]}<seed> with an eval.json under {argv[0]}")
    per_seed(evals)
    print()
    per_difficulty(evals)


if __name__ == "__main__":
    main(sys.argv[1:])
