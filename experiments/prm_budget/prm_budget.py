"""How much PRM training the default task needs: PRM configs trained side by side, one table.

Each named config is one `python -m prmppo stage=prm` process (the real stage: labels, training,
held-out step evaluation, best-of-N), all on the same SFT checkpoint (reused from `--artifacts`,
or trained once by the first job before the others start), run `--parallel` at a time with
`--threads` torch threads each. Prints per config: optimizer steps x rows, held-out step
accuracy, first-error F1, best-of-N with `min` aggregation against majority vote, and the
labelling and training seconds from the stage's own summary.

    python experiments/prm_budget/prm_budget.py --parallel 2 --threads 1                # the built-in grid
    python experiments/prm_budget/prm_budget.py --only classifier_default,lr1e-2_s600 topology=gpu  # on a GPU
    python experiments/prm_budget/prm_budget.py --sft-ready --parallel 5 --threads 2 --pin --only sl_s150,sl_s200

Extra arguments are overrides for every job (e.g. `topology=gpu`, `seed=1`). Seconds are only
comparable between jobs of one run (the jobs share the machine). The figures: README.md here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# the classifier-head PRM the first two runs measured (the default before the step_logprobs head):
# 3000 steps, labels on 10,000 problems; every name up to `s1000_tokens` starts from it
CLASSIFIER = ["prm_train.head=classifier", "prm_train.steps=3000", "prm_train.train_problems=10000"]
# name -> prm_train overrides, the first one run alone first (it builds the SFT checkpoint)
GRID: dict[str, list[str]] = {
    "classifier_default": CLASSIFIER,
    "s1000": [*CLASSIFIER, "prm_train.steps=1000"],
    "s600": [*CLASSIFIER, "prm_train.steps=600"],
    "lr1e-2_s600": [*CLASSIFIER, "prm_train.steps=600", "prm_train.lr=1e-2"],
    "lr1e-2_s1000": [*CLASSIFIER, "prm_train.steps=1000", "prm_train.lr=1e-2"],
    "lr3e-2_s600": [*CLASSIFIER, "prm_train.steps=600", "prm_train.lr=3e-2"],
    "lr1e-2_s600_r32": [*CLASSIFIER, "prm_train.steps=600", "prm_train.lr=1e-2", "prm_train.r=32",
                        "prm_train.alpha=64"],
    "lr1e-2_s600_neg4": [*CLASSIFIER, "prm_train.steps=600", "prm_train.lr=1e-2", "prm_train.negative_weight=4"],
    "lr1e-2_s1200_b128": [*CLASSIFIER, "prm_train.steps=1200", "prm_train.batch_rows=128", "prm_train.lr=1e-2"],
    "lr1e-2_s2400_b64": [*CLASSIFIER, "prm_train.steps=2400", "prm_train.batch_rows=64", "prm_train.lr=1e-2"],
    "lr1e-2_s600_sp0": [*CLASSIFIER, "prm_train.steps=600", "prm_train.lr=1e-2", "prm_train.samples_per_problem=0"],
    "lr1e-2_s600_sp1": [*CLASSIFIER, "prm_train.steps=600", "prm_train.lr=1e-2", "prm_train.samples_per_problem=1"],
    "lr1e-2_s600_tokens": [*CLASSIFIER, "prm_train.steps=600", "prm_train.lr=1e-2", "prm_train.head=label_tokens"],
    "lr1e-2_s400": [*CLASSIFIER, "prm_train.steps=400", "prm_train.lr=1e-2"],
    "s1500": [*CLASSIFIER, "prm_train.steps=1500"],
    "s1000_b512": [*CLASSIFIER, "prm_train.steps=1000", "prm_train.batch_rows=512"],
    "s2000_b128": [*CLASSIFIER, "prm_train.steps=2000", "prm_train.batch_rows=128"],
    "s1000_sp0": [*CLASSIFIER, "prm_train.steps=1000", "prm_train.samples_per_problem=0"],
    "s1500_sp0": [*CLASSIFIER, "prm_train.steps=1500", "prm_train.samples_per_problem=0"],
    "s1000_neg4": [*CLASSIFIER, "prm_train.steps=1000", "prm_train.negative_weight=4"],
    "s1000_r32": [*CLASSIFIER, "prm_train.steps=1000", "prm_train.r=32", "prm_train.alpha=64"],
    "s1000_lr5e-3": [*CLASSIFIER, "prm_train.steps=1000", "prm_train.lr=5e-3"],
    "s1000_lr1e-3": [*CLASSIFIER, "prm_train.steps=1000", "prm_train.lr=1e-3"],
    "s1000_tokens": [*CLASSIFIER, "prm_train.steps=1000", "prm_train.head=label_tokens"],
    # the embedded default since it runs in 12 CPU minutes: the step_logprobs head, 200 steps, 3000 problems
    "default": [],
    "cls_s300_p3000": ["prm_train.head=classifier", "prm_train.steps=300", "prm_train.train_problems=3000"],
    "sl_s150": ["prm_train.head=step_logprobs", "prm_train.steps=150", "prm_train.train_problems=3000"],
    "sl_s200": ["prm_train.head=step_logprobs", "prm_train.steps=200", "prm_train.train_problems=3000"],
    "sl_s300": ["prm_train.head=step_logprobs", "prm_train.steps=300", "prm_train.train_problems=3000"],
    "sl_s200_p2000": ["prm_train.head=step_logprobs", "prm_train.steps=200", "prm_train.train_problems=2000"],
}


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/prm_budget", help="one run dir per config below this")
    parser.add_argument("--artifacts", default="artifacts", help="artifacts dir shared by the jobs")
    parser.add_argument("--parallel", type=int, default=1, help="jobs at a time")
    parser.add_argument("--threads", type=int, default=0, help="torch/OMP threads per job; 0: torch's default")
    parser.add_argument("--pin", action="store_true",
                        help="pin job k of the run to its own --threads cores (taskset), k = 0, 1, ... in turn")
    parser.add_argument("--only", default="", help="comma-separated config names of GRID")
    parser.add_argument("--json", default="", help="also write the table as JSON here")
    parser.add_argument("--sft-ready", action="store_true",
                        help="the SFT checkpoint is already in --artifacts: start every job at once")
    return parser.parse_known_args()


def run_job(name: str, overrides: list[str], args, extra: list[str], slot: int = 0) -> dict:
    run_dir = Path(args.out).resolve() / name
    command = [sys.executable, "-m", "prmppo", "stage=prm", f"hydra.run.dir={run_dir}",
               f"artifacts_dir={Path(args.artifacts).resolve()}", "logger.console=false", *overrides, *extra]
    if args.pin:
        width = max(args.threads, 1)
        first = (slot * width) % (os.cpu_count() or 1)
        command = ["taskset", "-c", f"{first}-{first + width - 1}", *command]
    env = dict(os.environ)
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(run_dir / "job.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    result_file = run_dir / "stage_result.json"
    summary = json.loads(result_file.read_text()).get("summary", {}) if result_file.is_file() else {}
    return {"name": name, "overrides": overrides, "exit_code": code, "wall_seconds": time.time() - start,
            "summary": summary}


def row(result: dict) -> str:
    s = result["summary"]
    ev, train, labels = s.get("eval", {}), s.get("train", {}), s.get("labels", {})
    if result["exit_code"] or not ev:
        return f"| {result['name']} | failed (exit {result['exit_code']}, see {result['name']}/job.log) |"
    return (f"| {result['name']} | {ev.get('step_accuracy', float('nan')):.3f} | "
            f"{ev.get('first_error_f1', float('nan')):.3f} | {ev.get('bon/min_accuracy', float('nan')):.3f} | "
            f"{ev.get('bon/majority_accuracy', float('nan')):.3f} | {labels.get('positive_fraction', float('nan')):.2f} | "
            f"{labels.get('seconds', float('nan')):.0f} | {train.get('train_seconds', float('nan')):.0f} | "
            f"{result['wall_seconds']:.0f} |")


def main() -> None:
    args, extra = parse_args()
    names = [n for n in args.only.split(",") if n] or list(GRID)
    unknown = [n for n in names if n not in GRID]
    if unknown:
        sys.exit(f"--only names {unknown}, not in {list(GRID)}")
    # unless --sft-ready, the first job makes (or reuses) the SFT checkpoint alone; the rest reuse it
    first = [] if args.sft_ready else [run_job(names[0], GRID[names[0]], args, extra)]
    rest = names[len(first):]
    with ThreadPoolExecutor(max_workers=max(args.parallel, 1)) as pool:
        slots = range(len(rest))
        results = first + list(pool.map(lambda k: run_job(rest[k], GRID[rest[k]], args, extra, k % args.parallel),
                                        slots))
    print("| config | step accuracy | first-error F1 | best-of-N min | majority vote | right-step label fraction | "
          "label s | train s | job wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for result in results:
        print(row(result))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
