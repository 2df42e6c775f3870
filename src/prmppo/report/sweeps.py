"""The sweeps behind a report: each sweep directory's command, job statuses, wall time and hardware.

A sweep directory holds Hydra's `multirun.yaml`, whose `hydra.overrides` are the command line
(`task`: the overrides typed, with their comma lists; `hydra`: the `hydra.*` ones typed), and, once the
sweep ended, `sweep_result.json` with every job's status (`sweep.py`). A run outside any sweep
directory is its own entry, its command from `.hydra/overrides.yaml`. Wall time runs from the
first job's start (`run_info.json` `started_at`) to the last job's end (`stage_result.json`
`finished_at`); `job time` adds up each job's own span, so job time / wall time is how many jobs
ran at once on average. Hardware and code are what the runs' `run_info.json` recorded: host, device,
CPUs and CPU model; the git commit of the source (and whether it had uncommitted changes) and the
versions of Python and the packages that decide the numbers.
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from prmppo.report.runs import ReportError, Run, read_json

HYDRA_ADDED = ("hydra.mode=MULTIRUN", "hydra.mode=RUN")  # what Hydra adds to the recorded overrides itself
CODE_PACKAGES = ("python", "torch", "transformers", "peft", "hydra-core")  # shown of `run_info.json` versions


@dataclass
class Sweep:
    path: Path
    command: str
    runs: list[Run]
    statuses: Counter  # status -> jobs, from sweep_result.json when the sweep wrote one, else from the runs
    recorded: bool  # whether sweep_result.json exists
    infos: list[dict] = field(default_factory=list)  # each run's run_info.json ({} where it has none)

    def wall_seconds(self) -> float | None:
        """First start to last end, or None when a run lacks either time."""
        if not self.runs or any(r.started_at is None or r.finished_at is None for r in self.runs):
            return None
        return max(r.finished_at for r in self.runs) - min(r.started_at for r in self.runs)

    def job_seconds(self) -> float | None:
        if not self.runs or any(r.started_at is None or r.finished_at is None for r in self.runs):
            return None
        return sum(r.finished_at - r.started_at for r in self.runs)

    def hardware(self) -> list[str]:
        hosts = {(i.get("hostname"), i.get("device"), i.get("cpu_count"), i.get("cpu_model")) for i in self.infos
                 if "hostname" in i}
        return [f"{name}: {device}, {cpus} CPUs" + (f" ({cpu})" if cpu else "")
                for name, device, cpus, cpu in sorted(hosts, key=str)]

    def code(self) -> list[str]:
        """Each distinct code the runs ran: git commit (`+ uncommitted changes` when dirty) and package versions."""
        seen = set()
        for info in self.infos:
            if "versions" not in info:  # run_info.json of a run made before it recorded the code
                continue
            commit = info["code"]
            where = "not a git checkout" if commit is None else \
                f"`{commit['commit'][:12]}`" + (" + uncommitted changes" if commit["dirty"] else "")
            versions = ", ".join(f"{name} {info['versions'].get(name)}" for name in CODE_PACKAGES)
            seen.add(f"{where}; {versions}")
        return sorted(seen)


def _command(overrides: list[str], multirun: bool) -> str:
    words = [shlex.quote(o) for o in overrides if o not in HYDRA_ADDED]
    return " ".join(["python -m prmppo", *(["-m"] if multirun else []), *words])


def _sweep_command(sweep_dir: Path) -> str:
    path = sweep_dir / "multirun.yaml"
    try:
        # unresolved: an override may hold an interpolation, e.g. hydra.sweep.subdir=${hydra.job.num}
        overrides = OmegaConf.to_container(OmegaConf.load(path).hydra.overrides, resolve=False)
        return _command([str(o) for o in overrides["task"] + overrides["hydra"]], multirun=True)
    except Exception as err:  # yaml's own errors, or a file without hydra.overrides
        raise ReportError(f"{path} cannot be read as Hydra's multirun record: {err}") from None


def _sweep_dir(run: Run) -> Path | None:
    return next((parent for parent in run.path.parents if (parent / "multirun.yaml").exists()), None)


def find_sweeps(runs: list[Run]) -> list[Sweep]:
    """One entry per sweep directory the runs belong to, and one per run outside any, in path order."""
    by_dir: dict[Path, list[Run]] = {}
    for run in runs:
        by_dir.setdefault(_sweep_dir(run) or run.path, []).append(run)
    sweeps = []
    for path, members in sorted(by_dir.items()):
        result_file = path / "sweep_result.json"
        if (path / "multirun.yaml").exists():
            command = _sweep_command(path)
        else:
            command = _command([f"{k}={v}" for k, v in members[0].overrides.items()], multirun=False)
        if result_file.exists():
            statuses = Counter(job.get("status", "?") for job in read_json(result_file).get("jobs", []))
        else:
            statuses = Counter(run.status for run in members)
        infos = [read_json(run.path / "run_info.json") if (run.path / "run_info.json").exists() else {}
                 for run in members]
        sweeps.append(Sweep(path, command, members, statuses, result_file.exists(), infos))
    return sweeps


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "not recorded"
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}h {rest // 60:02d}m {rest % 60:02d}s" if hours else f"{rest // 60}m {rest % 60:02d}s"


def sweeps_section(sweeps: list[Sweep]) -> list[str]:
    """The markdown section: per sweep, the command, job statuses, wall time, summed job time, hardware and code."""
    lines = ["## Sweeps: commands, runtimes, hardware", "",
             "Wall time: first job's start to last job's end (`run_info.json`, `stage_result.json`); job time: the "
             "jobs' own spans added up. `not recorded`: a run lacks those times (made before they were recorded)."]
    for sweep in sweeps:
        statuses = ", ".join(f"{count} {status}" for status, count in sorted(sweep.statuses.items()))
        source = "sweep_result.json" if sweep.recorded else "the runs' stage_result.json; no sweep_result.json"
        lines += ["", f"`{sweep.path}`", "", "```bash", sweep.command, "```", "",
                  f"- jobs: {statuses} (from {source})",
                  f"- wall time: {_duration(sweep.wall_seconds())}; job time: {_duration(sweep.job_seconds())}",
                  f"- hardware: {'; '.join(sweep.hardware()) or 'not recorded'}"]
        codes = sweep.code()
        lines += [f"- code: {codes[0] if codes else 'not recorded'}"] if len(codes) < 2 else \
            [f"- code, {len(codes)} versions:", *(f"  - {code}" for code in codes)]
    return lines
