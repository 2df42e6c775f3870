"""Start-up of `python -m prmppo stage=ppo`, the rollout worker in standby against without, side by side,
and against the bare import of the libraries it stands on, measured in the same run.

    python benchmarks/startup_bench.py debug=smoke          # smoke shapes on this machine, 3 pairs
    python benchmarks/startup_bench.py --pairs 5 topology=gpu model=hf model.path=/tmp/q05 task=gsm8k ...

One untimed run first (it builds the SFT artifact, and the PRM's when the arm needs one, in
`--out/artifacts`), then `--pairs` pairs of the same command with `rollout.standby=true` and
`=false`, alternating, each a fresh process and run dir, each pair followed by one bare import
(`python -c "import torch, transformers, peft"`, a fresh process of the same interpreter, launch to
exit). Per run, in seconds from the moment the process was launched: the worker's "ready" line
(worker.log), the end of the start-up (the trainer's "start-up (s)" line, just before the first
iteration starts; __main__.log), the first PPO iteration's line (logged when it ends), and the
process's exit; plus `banner.json`'s `startup_s` (`total`, from the trainer's own start as /proc
dates it, and `worker_ready`, the trainer's wait for the engine). Medians per side, their ratio
(without / with), and each side's start-up minus the median bare import: what prmppo adds to the
imports it cannot avoid (the bar: 5 s without compile, 15 s with `ppo.compile=true` on a warm
cache). Extra arguments are Hydra overrides for both sides.
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
BARE_IMPORT = "import torch, transformers, peft"
STARTED = "start-up (s):"  # logged by the PPO stage once its start-up laps are done, before the first iteration


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
    startup = first_stamp(run_dir / "__main__.log", STARTED)
    first = first_stamp(run_dir / "__main__.log", f" it 1/{iterations} ")
    return {"worker_ready_at": None if ready is None else ready - started,
            "startup_done_at": None if startup is None else startup - started,
            "first_iteration_at": None if first is None else first - started,
            "exit_at": ended - started, "startup_total": banner["total"], "waited_for_worker": banner["worker_ready"]}


def bare_import() -> float:
    """Seconds from launch to exit of a fresh `python -c "import torch, transformers, peft"`."""
    started = time.time()
    done = subprocess.run([sys.executable, "-c", BARE_IMPORT], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"python -c {BARE_IMPORT!r} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return time.time() - started


def print_against_imports(medians: dict, imports: list[float], overrides: list[str]) -> dict:
    """Each side's start-up (launch to the first iteration's start) minus the median bare import, against
    the bar; returns the figures."""
    bar = 15.0 if "ppo.compile=true" in overrides else 5.0
    bare = statistics.median(imports)
    print(f"\nbare import (python -c {BARE_IMPORT!r}), {len(imports)} fresh processes: median {bare:.2f} s "
          f"(each: {', '.join(f'{t:.2f}' for t in imports)})")
    print(f"| side | start-up done at | bare import | start-up - bare import | within + {bar:g} s |")
    print("|---|---|---|---|---|")
    over = {}
    for side, row in medians.items():
        over[side] = row["startup_done_at"] - bare
        print(f"| {side} | {row['startup_done_at']:.2f} | {bare:.2f} | {over[side]:.2f} | "
              f"{'yes' if over[side] <= bar else 'no'} |")
    return {"bare_import": imports, "bare_import_median": bare, "startup_minus_bare_import": over, "bar_s": bar}


def main() -> int:
    args, overrides = parse_args()
    out = Path(args.out).resolve()
    artifacts = out / "artifacts"
    print(f"untimed first run (artifacts in {artifacts}) ...", flush=True)
    launch(overrides, out / "warm-up", artifacts, args.iterations)
    runs: dict[str, list[dict]] = {"standby": [], "no standby": []}
    imports: list[float] = []
    for pair in range(args.pairs):
        for side, flag in (("standby", "true"), ("no standby", "false")):
            row = launch([*overrides, f"rollout.standby={flag}"], out / f"{pair}-{flag}", artifacts, args.iterations)
            runs[side].append(row)
            print(f"pair {pair} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if v is not None),
                  flush=True)
        imports.append(bare_import())
        print(f"pair {pair} bare import: {imports[-1]:.2f}", flush=True)
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
    against = print_against_imports(medians, imports, overrides)
    (out / "startup_bench.json").write_text(json.dumps({"overrides": overrides, "runs": runs, "medians": medians,
                                                        **against}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
