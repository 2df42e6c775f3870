"""Start-up of `python -m prmppo stage=ppo`, the rollout worker in standby against without, side by side.

    python benchmarks/startup_bench.py                      # debug=smoke shapes on this machine, 3 pairs
    python benchmarks/startup_bench.py --pairs 5 topology=gpu model=hf model.path=/tmp/q05 task=gsm8k ...

One untimed run first (it builds the SFT artifact, and the PRM's when the arm needs one, in
`--out/artifacts`), then `--pairs` pairs of the same command with `rollout.standby=true` and
`=false`, alternating, each a fresh process and run dir. Per run, in seconds from the moment the
process was launched: the worker's "ready" line (worker.log), the first PPO iteration's line
(__main__.log), and the process's exit; plus `banner.json`'s `startup_s` (`total`, from the
trainer's own start, and `worker_ready`, the trainer's wait for the engine). Medians per side and
their ratio (without / with). Extra arguments are Hydra overrides for both sides.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="standby-on / standby-off pairs, alternating")
    parser.add_argument("--out", default="runs/startup_bench", help="run dirs and the shared artifacts dir")
    parser.add_argument("--iterations", type=int, default=1, help="ppo.iterations of each run")
    args, overrides = parser.parse_known_args()
    if args.pairs < 1:
        parser.error("--pairs must be >= 1")
    return args, overrides


def first_stamp(path: Path, needle: str) -> float | None:
    """The wall-clock time of the first line of `path` containing `needle` (None when there is none)."""
    if not path.is_file():
        return None
    for line in path.read_text(errors="replace").splitlines():
        if needle in line and (found := STAMP.search(line)):
            return datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def launch(overrides: list[str], run_dir: Path, artifacts: Path, iterations: int) -> dict:
    command = [sys.executable, "-m", "prmppo", "stage=ppo", f"ppo.iterations={iterations}",
               f"artifacts_dir={artifacts}", f"hydra.run.dir={run_dir}", *overrides]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    banner = json.loads((run_dir / "banner.json").read_text())["startup_s"]
    ready = first_stamp(run_dir / "worker.log", " ready: serving")
    first = first_stamp(run_dir / "__main__.log", f" it 1/{iterations} ")
    return {"worker_ready_at": None if ready is None else ready - started,
            "first_iteration_at": None if first is None else first - started,
            "exit_at": ended - started, "startup_total": banner["total"], "waited_for_worker": banner["worker_ready"]}


def main() -> int:
    args, overrides = parse_args()
    out = Path(args.out).resolve()
    artifacts = out / "artifacts"
    print(f"untimed first run (artifacts in {artifacts}) ...", flush=True)
    launch(overrides, out / "warm-up", artifacts, args.iterations)
    runs: dict[str, list[dict]] = {"standby": [], "no standby": []}
    for pair in range(args.pairs):
        for side, flag in (("standby", "true"), ("no standby", "false")):
            row = launch([*overrides, f"rollout.standby={flag}"], out / f"{pair}-{flag}", artifacts, args.iterations)
            runs[side].append(row)
            print(f"pair {pair} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if v is not None),
                  flush=True)
    keys = list(runs["standby"][0])
    medians = {side: {k: statistics.median(r[k] for r in rows if r[k] is not None) for k in keys}
               for side, rows in runs.items()}
    print(f"\nmedians of {args.pairs} runs each (s; *_at: from the process launch), overrides: {overrides or 'none'}")
    print("| side | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for side, row in medians.items():
        print(f"| {side} | " + " | ".join(f"{row[k]:.2f}" for k in keys) + " |")
    ratios = {k: medians["no standby"][k] / medians["standby"][k] for k in keys if medians["standby"][k] > 0}
    print("| without / with | " + " | ".join(f"{ratios[k]:.2f}x" if k in ratios else "" for k in keys) + " |")
    (out / "startup_bench.json").write_text(json.dumps({"overrides": overrides, "runs": runs, "medians": medians},
                                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
