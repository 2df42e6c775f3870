"""The study's runs (PREREGISTRATION.md): every job of the primary and secondary arms on one machine with a
GPU and many cores, as many at once as `--slots`, each a `python -m prmppo` process of its own.

    python experiments/prm_vs_orm_flaw/final.py ROOT --budget 540 --slots 16            # one call
    python experiments/prm_vs_orm_flaw/final.py ROOT --list                             # the jobs, nothing run

Jobs, in the order they are started when their inputs exist:
  sft/s<S>            stage=sft, seeds 0-23
  prm/default/s<S>    stage=prm arm=prm (the default learned PRM), seeds 0-23
  prm/mc/s<S>         the same with prm_train.label_source=monte_carlo, seeds 0-4
  ppo/<arm>/s<S>      the pipeline (PPO from that seed's SFT and PRM artifacts, then the final evaluation):
                      orm and prm on seeds 0-23 (primary), the secondary arms (`SECONDARY`) on seeds 0-4, and
                      orm_matched (the compute-matched ORM) once the PRM stages and ORM runs of seeds 0-4 are done

Every job runs `experiment=prm_vs_orm_flaw topology=<--topology>`, writes its run dir `ROOT/final/<job>` and
shares `ROOT/artifacts`, so the PPO runs of a seed start from the same SFT checkpoint and PRM. A job that
exits 0 is done, and a later call with the same ROOT skips it (`ROOT/status.json`): the study can span several
calls. A job still running when the budget ends is stopped (SIGTERM, SIGKILL 20 s later) and its run dir
removed, so that the next call starts it afresh; one that fails is started once more, then given up.
Each job runs with OMP_NUM_THREADS=1 pinned to one core (`taskset`), job j on core j % cores; its rollout
worker inherits the pinning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PRIMARY_SEEDS = range(24)
SECONDARY_SEEDS = range(5)
# secondary arm -> its overrides beside the experiment's (PREREGISTRATION.md, "Secondary analyses")
SECONDARY = {
    "oracle": ["arm=prm", "reward=prm_oracle"],
    "oracle_noise0.1": ["arm=prm", "reward=prm_oracle", "reward.label_noise=0.1"],
    "oracle_noise0.3": ["arm=prm", "reward=prm_oracle", "reward.label_noise=0.3"],
    "prm_mc": ["arm=prm", "prm_train.label_source=monte_carlo"],
    "prm_w0": ["arm=prm", "reward.w_outcome=0"],
    "prm_w0.1": ["arm=prm", "reward.w_outcome=0.1"],
    "likelihood": ["arm=prm", "reward=prm_likelihood_control"],
    "prm_min_form": ["arm=prm", "reward.transform=min_form"],
    "orm_gae": ["arm=orm", "ppo.advantage_estimator=gae", "ppo.lam_actor=0.95"],
    "prm_gae": ["arm=prm", "ppo.advantage_estimator=gae", "ppo.lam_actor=0.95"],
}
# which PRM stage job a PPO arm reads (none: no PRM stage)
PRM_OF = {"prm": "default", "prm_mc": "mc", "prm_w0": "default", "prm_w0.1": "default",
          "prm_min_form": "default", "prm_gae": "default"}
PRM_STAGE = {"default": ["arm=prm"], "mc": ["arm=prm", "prm_train.label_source=monte_carlo"]}
MATCHED_OF = range(5)  # orm_matched's k comes from these seeds' PRM stages and ORM runs
BASE_ITERATIONS = 100


@dataclass
class Job:
    name: str  # its run dir below ROOT/final
    overrides: list[str]
    needs: list[str] = field(default_factory=list)
    matched: bool = False  # orm_matched: its ppo.iterations is decided when it starts


def jobs() -> list[Job]:
    out = [Job(f"sft/s{s}", ["stage=sft", f"seed={s}"]) for s in PRIMARY_SEEDS]
    for s in PRIMARY_SEEDS:
        out.append(Job(f"prm/default/s{s}", ["stage=prm", *PRM_STAGE["default"], f"seed={s}"], [f"sft/s{s}"]))
        if s in SECONDARY_SEEDS:
            out.append(Job(f"prm/mc/s{s}", ["stage=prm", *PRM_STAGE["mc"], f"seed={s}"], [f"sft/s{s}"]))
    for s in PRIMARY_SEEDS:
        out.append(Job(f"ppo/orm/s{s}", ["arm=orm", f"seed={s}"], [f"sft/s{s}"]))
        out.append(Job(f"ppo/prm/s{s}", ["arm=prm", f"seed={s}"], [f"sft/s{s}", f"prm/default/s{s}"]))
    for arm, overrides in SECONDARY.items():
        for s in SECONDARY_SEEDS:
            needs = [f"sft/s{s}"] + ([f"prm/{PRM_OF[arm]}/s{s}"] if arm in PRM_OF else [])
            out.append(Job(f"ppo/{arm}/s{s}", [*overrides, f"seed={s}"], needs))
    matched_needs = [f"prm/default/s{s}" for s in MATCHED_OF] + [f"ppo/orm/s{s}" for s in MATCHED_OF]
    for s in SECONDARY_SEEDS:
        out.append(Job(f"ppo/orm_matched/s{s}", ["arm=orm", f"seed={s}"], [f"sft/s{s}", *matched_needs],
                       matched=True))
    return out


def matched_iterations(root: Path, status: dict) -> tuple[int, dict]:
    """100 + k: k = the PRM stage's mean wall seconds over seeds 0-4 / the ORM arm's mean seconds per PPO
    iteration over the same seeds (`train_seconds / iterations` of its stage_result, the evaluations during
    PPO included), rounded up to a multiple of 25 (PREREGISTRATION.md)."""
    prm_s = [status[f"prm/default/s{s}"]["seconds"] for s in MATCHED_OF]
    per_it = []
    for s in MATCHED_OF:
        ppo = json.loads((root / "final" / f"ppo/orm/s{s}" / "stage_result.json").read_text())["summary"]["ppo"]
        per_it.append(ppo["train_seconds"] / ppo["iterations"])
    k = (sum(prm_s) / len(prm_s)) / (sum(per_it) / len(per_it))
    iterations = BASE_ITERATIONS + 25 * math.ceil(k / 25)
    return iterations, {"prm_stage_seconds": prm_s, "orm_seconds_per_iteration": per_it, "k": k,
                        "iterations": iterations}


def needed_artifacts(root: Path, todo: list[Job]) -> list[str]:
    """The SFT and PRM artifact dirs of every seed that has a job not yet done."""
    status = read_status(root)
    seeds = {int(j.name.rsplit("/s", 1)[1]) for j in todo if status.get(j.name, {}).get("rc") != 0}
    out = []
    for meta in sorted((root / "artifacts").glob("*/artifact.json")):
        record = json.loads(meta.read_text())
        if record["stage"] in ("sft", "prm") and record["config"]["seed"] in seeds:
            out.append(str(meta.parent.relative_to(root)))
    return out


def read_status(root: Path) -> dict:
    path = root / "status.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write_status(root: Path, status: dict) -> None:
    tmp = root / "status.json.tmp"
    tmp.write_text(json.dumps(status, indent=1, sort_keys=True))
    tmp.replace(root / "status.json")


def command(job: Job, root: Path, args, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "prmppo", "experiment=prm_vs_orm_flaw", "logger.console=false",
            f"topology={args.topology}", f"artifacts_dir={root / 'artifacts'}",
            f"hydra.run.dir={root / 'final' / job.name}", *job.overrides, *extra, *args.extra]


class Pool:
    """`--slots` jobs at once, each pinned to one core; stops them all at the deadline."""

    def __init__(self, root: Path, args):
        self.root, self.args = root, args
        self.running: dict[str, tuple[subprocess.Popen, float, int]] = {}
        self.cores = os.cpu_count() or 1
        self.next_core = 0

    def start(self, job: Job, extra: list[str]) -> None:
        run_dir = self.root / "final" / job.name
        if run_dir.exists():  # a stopped or failed attempt: start afresh
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        core = self.next_core % self.cores
        self.next_core += 1
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = command(job, self.root, self.args, extra)
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", str(core), *cmd]
        log = open(run_dir / "job.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.running[job.name] = (proc, time.time(), core)

    def finished(self) -> list[tuple[str, int, float]]:
        done = []
        for name, (proc, start, _) in list(self.running.items()):
            if proc.poll() is not None:
                done.append((name, proc.returncode, time.time() - start))
                del self.running[name]
        return done

    def stop_all(self) -> list[str]:
        for proc, _, _ in self.running.values():
            with_group(proc, signal.SIGTERM)
        end = time.time() + 20
        while time.time() < end and any(p.poll() is None for p, _, _ in self.running.values()):
            time.sleep(0.5)
        for proc, _, _ in self.running.values():
            with_group(proc, signal.SIGKILL)
        stopped = list(self.running)
        for name in stopped:
            shutil.rmtree(self.root / "final" / name, ignore_errors=True)
        self.running.clear()
        return stopped


def with_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds from the start, then stop")
    parser.add_argument("--slots", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--topology", default="gpu")
    parser.add_argument("--only", default="", help="comma-separated job-name prefixes to run (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--needed", action="store_true",
                        help="print the SFT and PRM artifact dirs (relative to ROOT) that unfinished jobs read")
    parser.add_argument("--extra", action="append", default=[], help="an override added to every job (repeat it)")
    args = parser.parse_args()
    todo = [j for j in jobs() if not args.only or j.name.startswith(tuple(args.only.split(",")))]
    if args.list:
        print("\n".join(f"{j.name}: {' '.join(j.overrides)}" for j in todo))
        return 0
    root = args.root.resolve()
    if args.needed:
        print("\n".join(needed_artifacts(root, todo)))
        return 0
    root.mkdir(parents=True, exist_ok=True)
    return schedule(root, args, todo, time.time() + args.budget)


def schedule(root: Path, args, todo: list[Job], deadline: float) -> int:
    status = read_status(root)
    pool = Pool(root, args)
    events = open(root / "events.log", "a")

    def note(text: str) -> None:
        events.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        events.flush()

    note(f"start: {sum(status.get(j.name, {}).get('rc') == 0 for j in todo)} of {len(todo)} jobs done before")
    while time.time() < deadline:
        for name, rc, seconds in pool.finished():
            tries = status.get(name, {}).get("tries", 0) + 1
            status[name] = {"rc": rc, "seconds": round(seconds, 1), "tries": tries}
            note(f"{name} rc={rc} {seconds:.0f}s")
        write_status(root, status)
        ready = [j for j in todo if j.name not in pool.running and status.get(j.name, {}).get("rc") != 0
                 and status.get(j.name, {}).get("tries", 0) < 2
                 and all(status.get(n, {}).get("rc") == 0 for n in j.needs)]
        if not ready and not pool.running:
            break
        for job in ready[: max(0, args.slots - len(pool.running))]:
            extra = []
            if job.matched:
                iterations, record = matched_iterations(root, status)
                (root / "matched.json").write_text(json.dumps(record, indent=1, sort_keys=True))
                extra = [f"ppo.iterations={iterations}"]
            pool.start(job, extra)
            note(f"{job.name} started {' '.join(extra)}")
        time.sleep(1.0)
    stopped = pool.stop_all()
    for name in stopped:
        note(f"{name} stopped at the budget")
    write_status(root, status)
    left = [j.name for j in todo if status.get(j.name, {}).get("rc") != 0]
    note(f"end: {len(todo) - len(left)} of {len(todo)} done; left: {' '.join(left)}")
    print(f"{len(todo) - len(left)} of {len(todo)} jobs done; {len(left)} left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
