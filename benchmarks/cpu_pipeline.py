"""Where the embedded default's time goes: one `python -m prmppo` run, each stage's wall time and the figures.

    python benchmarks/cpu_pipeline.py                       # a fresh artifacts dir: every stage runs
    python benchmarks/cpu_pipeline.py arm=orm               # overrides go to `python -m prmppo`
    python benchmarks/cpu_pipeline.py --run-dir runs/default/<time>   # read a finished pipeline run

Prints per stage (SFT, PRM labels / training / evaluation, PPO, the final evaluation) the seconds
from the stage summaries (`stage_result.json` and the artifacts' `artifact.json`), the whole run's
wall time, and the figures the default must keep: PRM held-out step accuracy, best-of-N with `min`
aggregation against majority vote, and sampled test accuracy of the SFT and PPO policies.
A stage reused from an existing artifact shows the seconds of the run that made it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="", help="summarise this finished pipeline run instead of launching one")
    parser.add_argument("--out", default="runs/cpu_pipeline", help="run dir of the launched pipeline")
    parser.add_argument("--artifacts", default="", help="artifacts dir (default: a fresh one, so every stage runs)")
    parser.add_argument("--json", default="", help="also write the figures as JSON here")
    return parser.parse_known_args()


def launch(args, overrides: list[str]) -> tuple[Path, float]:
    artifacts = args.artifacts or tempfile.mkdtemp(prefix="prmppo-artifacts-")
    run_dir = Path(args.out).resolve()
    command = [sys.executable, "-m", "prmppo", f"hydra.run.dir={run_dir}", f"artifacts_dir={artifacts}", *overrides]
    print("running:", " ".join(command), flush=True)
    start = time.time()
    code = subprocess.run(command).returncode
    if code:
        sys.exit(f"python -m prmppo exited with {code}; see {run_dir}")
    return run_dir, time.time() - start


def _artifact_summary(path: str | None) -> dict:
    manifest = Path(path) / "artifact.json" if path else None
    return json.loads(manifest.read_text())["summary"] if manifest and manifest.is_file() else {}


def figures(run_dir: Path) -> dict:
    """The stage seconds and the quality figures of one pipeline run dir."""
    result = json.loads((run_dir / "stage_result.json").read_text())
    summary = result["summary"]
    sft = summary["sft"] if not summary["sft"].get("reused") else _artifact_summary(summary["sft"]["checkpoint"])
    prm = summary.get("prm") or {}  # None for a reward without a learned PRM
    prm = _artifact_summary(prm["prm_dir"]) if prm.get("reused") else prm
    ev = summary["eval"]
    return {
        "arm": result.get("arm"),
        "seconds": {"sft": sft.get("train_seconds", 0.0) + sft.get("eval_seconds", 0.0),
                    "prm_labels": prm.get("labels", {}).get("seconds", 0.0),
                    "prm_train": prm.get("train", {}).get("train_seconds", 0.0),
                    "prm_eval": prm.get("eval", {}).get("seconds", 0.0),
                    "ppo": summary["ppo"].get("train_seconds", 0.0),
                    "eval": ev["sft"].get("eval_seconds", 0.0) + ev["ppo"].get("eval_seconds", 0.0),
                    "pipeline_wall": summary.get("wall_seconds", 0.0)},
        "prm_step_accuracy": prm.get("eval", {}).get("step_accuracy"),
        "best_of_n_min": prm.get("eval", {}).get("bon/min_accuracy"),
        "majority_vote": prm.get("eval", {}).get("bon/majority_accuracy"),
        "sft_sampled": ev["sft"]["sampled_accuracy"], "ppo_sampled": ev["ppo"]["sampled_accuracy"],
        "sft_greedy": ev["sft"]["greedy_accuracy"], "ppo_greedy": ev["ppo"]["greedy_accuracy"],
    }


def report(found: dict, wall: float | None) -> None:
    print("| stage | seconds |")
    print("|---|---|")
    for name, seconds in found["seconds"].items():
        print(f"| {name} | {seconds:.0f} |")
    if wall is not None:
        print(f"| whole command | {wall:.0f} |")
    print()
    for key in ("prm_step_accuracy", "best_of_n_min", "majority_vote", "sft_greedy", "ppo_greedy", "sft_sampled",
                "ppo_sampled"):
        value = found[key]
        print(f"{key}: {'-' if value is None else f'{value:.3f}'}")
    gain = found["ppo_sampled"] - found["sft_sampled"]
    print(f"PPO sampled-accuracy gain: {100 * gain:+.1f} points")


def main() -> None:
    args, overrides = parse_args()
    if args.run_dir:
        run_dir, wall = Path(args.run_dir), None
    else:
        run_dir, wall = launch(args, overrides)
    found = figures(run_dir)
    found["whole_command_seconds"] = wall
    report(found, wall)
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
