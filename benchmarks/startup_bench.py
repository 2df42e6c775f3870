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

    python benchmarks/startup_bench.py --compare compile-cache debug=smoke    # CPU: minutes a run

`--compare compile-cache` puts `ppo.compile=true` on both sides and pits the compile cache kept in the
artifacts dir (`ppo.compile_cache=true`, written by the untimed first run) against a cold compile
(`ppo.compile_cache=false`). Every run, the untimed one included, gets empty local compile caches of
its own (`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR` under `--out`), as on a fresh machine given the
artifacts dir: all a run finds compiled comes from that dir. Each run's FX graph cache hits and misses
(`stage_result.json`) are reported with its times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
BARE_IMPORT = "import torch, transformers, peft"
STARTED = "start-up (s):"  # logged by the PPO stage once its start-up laps are done, before the first iteration
# the two sides of each pair and their overrides, per --compare
SIDES = {"standby": {"standby": ["rollout.standby=true"], "no standby": ["rollout.standby=false"]},
         "compile-cache": {"compile cache": ["ppo.compile=true", "ppo.compile_cache=true"],
                           "cold compile": ["ppo.compile=true", "ppo.compile_cache=false"]}}


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="pairs of the two sides, alternating")
    parser.add_argument("--compare", choices=sorted(SIDES), default="standby",
                        help="standby: the worker in standby or not; compile-cache: with ppo.compile=true, the "
                        "compile cache in the artifacts dir or a cold compile, on empty local caches")
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


def launch(overrides: list[str], run_dir: Path, artifacts: Path, iterations: int, fresh_caches: bool) -> dict:
    """One run from launch to exit; with `fresh_caches`, on empty local compile caches of its own."""
    command = [sys.executable, "-m", "prmppo", "stage=ppo", f"ppo.iterations={iterations}",
               f"artifacts_dir={artifacts}", f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ)
    if fresh_caches:
        env.update(TORCHINDUCTOR_CACHE_DIR=str(run_dir / "inductor"), TRITON_CACHE_DIR=str(run_dir / "triton"))
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    banner = json.loads((run_dir / "banner.json").read_text())["startup_s"]
    ready = first_stamp(run_dir / "worker.log", " ready: serving")
    startup = first_stamp(run_dir / "__main__.log", STARTED)
    first = first_stamp(run_dir / "__main__.log", f" it 1/{iterations} ")
    row = {"worker_ready_at": None if ready is None else ready - started,
           "startup_done_at": None if startup is None else startup - started,
           "first_iteration_at": None if first is None else first - started,
           "exit_at": ended - started, "startup_total": banner["total"], "waited_for_worker": banner["worker_ready"]}
    if fresh_caches:  # the compile caches' hits and misses over the run, and the gate's compiling forward
        summary = json.loads((run_dir / "stage_result.json").read_text())["summary"]
        counts = summary.get("compile_cache") or {}
        row.update(engine_gap_gate=banner["engine_gap_gate"], fxgraph_cache_hit=counts.get("fxgraph_cache_hit"),
                   fxgraph_cache_miss=counts.get("fxgraph_cache_miss"))
    return row


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


def median_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main() -> int:
    args, overrides = parse_args()
    out = Path(args.out).resolve()
    artifacts = out / "artifacts"
    sides, fresh = SIDES[args.compare], args.compare == "compile-cache"
    print(f"untimed first run (artifacts in {artifacts}) ...", flush=True)
    launch([*overrides, *next(iter(sides.values()))], out / "warm-up", artifacts, args.iterations, fresh)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    imports: list[float] = []
    for pair in range(args.pairs):
        for number, (side, side_overrides) in enumerate(sides.items()):
            row = launch([*overrides, *side_overrides], out / f"{pair}-{number}", artifacts, args.iterations, fresh)
            runs[side].append(row)
            print(f"pair {pair} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if v is not None),
                  flush=True)
        imports.append(bare_import())
        print(f"pair {pair} bare import: {imports[-1]:.2f}", flush=True)
    first, second = sides
    keys = list(runs[first][0])
    medians = {side: {k: median_or_none([r[k] for r in rows]) for k in keys} for side, rows in runs.items()}
    print(f"\nmedians of {args.pairs} runs each (s; *_at: from the process launch), overrides: {overrides or 'none'}")
    print("| side | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for side, row in medians.items():
        print(f"| {side} | " + " | ".join("n/a" if row[k] is None else f"{row[k]:.2f}" for k in keys) + " |")
    ratios = {k: medians[second][k] / medians[first][k] for k in keys
              if medians[first][k] and medians[second][k] is not None}
    print(f"| {second} / {first} | " + " | ".join(f"{ratios[k]:.2f}x" if k in ratios else "" for k in keys) + " |")
    against = print_against_imports(medians, imports, [*overrides, *sides[first]])
    (out / "startup_bench.json").write_text(json.dumps({"overrides": overrides, "compare": args.compare, "runs": runs,
                                                        "medians": medians, **against}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
