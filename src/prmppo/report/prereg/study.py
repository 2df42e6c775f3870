"""A study's runs read from its unpacked archive, laid out as the study file names them:

    <root>/ppo/<arm>/s<seed>/     a PPO pipeline run: metrics.jsonl (`ppo_eval` rows), eval.json (the final
                                  evaluation of the SFT and PPO policies), ppo_eval/iteration_<n:05d>.json (the
                                  per-problem outcomes of the test evaluation after n PPO iterations)
    <root>/prm/<id>/s<seed>/      a PRM-stage run: stage_result.json's summary.eval (held-out step accuracy,
                                  best-of-N against majority vote)
    <root>/sft/s<seed>/           an SFT run (not read: each PPO run's eval.json holds its SFT policy's outcomes)

A run the study names that is absent, did not finish (`status` other than `ok`) or lacks an evaluation
an endpoint reads is listed as missing, with why, and its seed drops out of what needs it; it is never
replaced. A run the study does not name is listed as not analysed. A run whose config has another seed
than its directory, or whose per-problem outcomes disagree with its `ppo_eval` row, is refused: the
pairing by seed and the bootstrap would be wrong without a sign of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from prmppo.report.prereg.spec import LAST, Spec, SpecError
from prmppo.report.runs import ReportError, Run, read_json, read_run
from prmppo.report.stats import curve_area
from prmppo.report.sweeps import CODE_PACKAGES

X_KEY = "eval/ppo_iterations"
EVAL_STAGE = "ppo_eval"
ITERATIONS_DIR = "ppo_eval"
AGREE = 1e-9  # |accuracy of the ppo_eval row - mean of the per-problem outcomes| allowed


def metric_key(metric: str) -> str:
    """The `ppo_eval` row's key of a study metric (greedy, sampled, pass@K)."""
    return f"eval/test_{metric}_accuracy" if metric in ("greedy", "sampled") else f"eval/test_{metric}"


def problem_value(row: dict, metric: str) -> float:
    """One problem's outcome for a metric: greedy verdict, fraction of its k samples right, or any right."""
    if metric == "greedy":
        return float(row["greedy_correct"])
    return row["correct_of_k"] / row["k"] if metric == "sampled" else float(row["correct_of_k"] > 0)


@dataclass
class PolicyRun:
    """A PPO run of the study that finished."""
    arm: str
    seed: int
    name: str  # `ppo/<arm>/s<seed>`, its place in the archive
    run: Run
    outcomes: dict[int, list[dict]]  # iterations done -> per-problem outcomes of the test evaluation then
    final: dict | None  # eval.json: {"sft": ..., "ppo": ..., "delta": ...}, None when absent
    code: str  # what code and where it ran (run_info.json), as `code_text` words it

    def curve(self, metric: str) -> dict[int, float]:
        """`{iterations done: accuracy}` of the test evaluation during PPO."""
        return self.run.series(EVAL_STAGE, metric_key(metric), X_KEY)

    def value(self, metric: str, at) -> float | None:
        """The metric at an iteration, at the `last` evaluation, or the area over a tuple of iterations."""
        curve = self.curve(metric)
        if isinstance(at, tuple):
            return curve_area({x: curve[x] for x in at}) if all(x in curve for x in at) else None
        if at == LAST:
            return curve[max(curve)] if curve else None
        return curve.get(at)

    def problems(self, at) -> list[dict] | None:
        """The per-problem outcomes at an iteration (or the `last` evaluation), None when not written."""
        curve = self.curve("greedy")
        at = max(curve, default=None) if at == LAST else at
        return self.outcomes.get(at)


@dataclass(frozen=True)
class Missing:
    name: str  # `ppo/<arm>/s<seed>` or `prm/<id>/s<seed>`
    why: str


@dataclass
class Study:
    spec: Spec
    ppo: dict[str, dict[int, PolicyRun]]  # arm -> seed -> run
    prm: dict[str, dict[int, dict]]  # PRM id -> seed -> its stage_result summary's `eval`
    missing: list[Missing] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)  # runs in the archive the study does not name

    def values(self, arm: str, metric: str, at, seeds) -> dict[int, float]:
        """`{seed: value}` over `seeds` where the arm's run has it."""
        runs = self.ppo.get(arm, {})
        found = {seed: runs[seed].value(metric, at) for seed in seeds if seed in runs}
        return {seed: v for seed, v in found.items() if v is not None and not math.isnan(v)}


def code_text(info: dict) -> str:
    """The code a run ran and where, from its run_info.json: git commit (`+ uncommitted changes` when dirty),
    the versions of `CODE_PACKAGES`, the device."""
    code = info.get("code")
    where = f"`{code['commit'][:12]}`" + (" + uncommitted changes" if code.get("dirty") else "") \
        if isinstance(code, dict) and "commit" in code else "commit not recorded"
    versions = info.get("versions") or {}
    packages = ", ".join(f"{name} {versions[name]}" for name in CODE_PACKAGES if versions.get(name))
    return "; ".join(part for part in (where, packages, f"device {info['device']}" if "device" in info else "") if part)


def _outcomes(path: Path) -> dict[int, list[dict]]:
    out = {}
    for file in sorted((path / ITERATIONS_DIR).glob("iteration_*.json")):
        data = read_json(file)
        try:
            iteration, problems = int(data["ppo_iterations"]), data["problems"]
        except (KeyError, TypeError, ValueError):
            raise ReportError(f"{file} is not a test evaluation during PPO (ppo_iterations, problems)") from None
        if file.name != f"iteration_{iteration:05d}.json":
            raise ReportError(f"{file} holds the evaluation after {iteration} iterations; its name says otherwise")
        out[iteration] = problems
    return out


def _check_agreement(record: PolicyRun, file_dir: Path) -> None:
    """Each per-problem file against its `ppo_eval` row: greedy and, where the row has it, pass@k."""
    for iteration, problems in sorted(record.outcomes.items()):
        ks = {row["k"] for row in problems if "k" in row}
        for metric in ("greedy", *(f"pass@{k}" for k in ks)):
            logged = record.curve(metric).get(iteration)
            if logged is None or not problems:
                continue
            mean = sum(problem_value(row, metric) for row in problems) / len(problems)
            if abs(mean - logged) > AGREE:
                raise ReportError(f"{file_dir / f'iteration_{iteration:05d}.json'}: {metric} over its problems is "
                                  f"{mean:.6f}, the ppo_eval row after {iteration} iterations logged {logged:.6f}")


def _ppo_run(top: Path, arm: str, seed: int, missing: list[Missing]) -> PolicyRun | None:
    name = f"ppo/{arm}/s{seed}"
    path = top / name
    if not (path / ".hydra" / "config.yaml").is_file():
        missing.append(Missing(name, "no run"))
        return None
    run = read_run(path)
    if run.seed != seed:
        raise ReportError(f"{path / '.hydra' / 'config.yaml'}: seed {run.seed}, but its directory says s{seed}")
    if run.status != "ok":
        why = f"status {run.status}" + (f": {run.error.splitlines()[0]}" if run.error else "")
        missing.append(Missing(name, why))
        return None
    final = read_json(path / "eval.json") if (path / "eval.json").is_file() else None
    info = read_json(path / "run_info.json") if (path / "run_info.json").is_file() else {}
    record = PolicyRun(arm, seed, name, run, _outcomes(path), final, code_text(info))
    _check_agreement(record, path / ITERATIONS_DIR)
    return record


def _needed(spec: Spec, arm: str) -> tuple[dict[str, set[int]], set[int], bool]:
    """({metric: iterations whose `ppo_eval` row an endpoint of `arm` reads}, iterations whose per-problem
    outcomes a bootstrap reads, whether the compute-matched comparison reads its last evaluation)."""
    rows: dict[str, set[int]] = {}
    files = set()
    if arm in (spec.baseline, spec.primary) or any(arm in (c.arm, c.against) for c in spec.secondary):
        for e in spec.endpoints:
            rows.setdefault(e.metric, set()).update(e.area if e.area else {e.iteration})
            files |= set() if e.area else {e.iteration}
    m = spec.compute_matched
    if m and arm == m.arm:
        for metric in m.metrics:
            rows.setdefault(metric, set()).add(m.iteration)
        files.add(m.iteration)
    return rows, files, bool(m and arm == m.against)


def _lacking(record: PolicyRun, spec: Spec) -> list[str]:
    """What the run lacks that the study reads, in words."""
    rows, files, last = _needed(spec, record.arm)
    logged = set(record.curve("greedy"))
    files |= {max(logged)} if last and logged else set()
    lacks = []
    for metric, iterations in sorted(rows.items()):
        if absent := sorted(iterations - set(record.curve(metric))):
            lacks.append(f"no {metric_key(metric)} in the ppo_eval rows after {', '.join(map(str, absent))} "
                         "iterations")
    if last and not logged:
        lacks.append("no ppo_eval row at all")
    if absent := sorted(files - set(record.outcomes)):
        lacks.append(f"no per-problem outcomes ({ITERATIONS_DIR}/) after {', '.join(map(str, absent))} iterations")
    if record.final is None:
        lacks.append("no eval.json (final evaluation)")
    return lacks


def _prm_run(top: Path, prm_id: str, seed: int, missing: list[Missing]) -> dict | None:
    name = f"prm/{prm_id}/s{seed}"
    result_file = top / name / "stage_result.json"
    if not result_file.is_file():
        missing.append(Missing(name, "no run" if not (top / name).is_dir() else "no stage_result.json"))
        return None
    result = read_json(result_file)
    if result.get("status") != "ok":
        missing.append(Missing(name, f"status {result.get('status')}"))
        return None
    evaluation = (result.get("summary") or {}).get("eval")
    if not isinstance(evaluation, dict):
        missing.append(Missing(name, "no summary.eval in stage_result.json (the PRM stage's evaluation)"))
        return None
    return evaluation


def _unexpected(top: Path, spec: Spec) -> list[str]:
    named = {f"ppo/{arm}/s{seed}" for arm in spec.arms() for seed in spec.seeds_of(arm)}
    named |= {f"prm/{q.id}/s{seed}" for q in spec.prm_quality for seed in q.seeds}
    found = {marker.parent.parent.relative_to(top).as_posix() for marker in top.rglob(".hydra/config.yaml")}
    return sorted(name for name in found - named if not name.startswith("sft/"))


def read_study(unpacked: Path, spec: Spec) -> Study:
    """Every run the study names, from the directory an archive was unpacked into (its top `spec.root`)."""
    top = unpacked / spec.root
    if not top.is_dir():
        present = sorted(p.name for p in unpacked.iterdir()) if unpacked.is_dir() else []
        raise SpecError(f"the study file's root {spec.root!r} is not a directory of the archive (it holds: "
                        f"{', '.join(present) or 'nothing'})")
    study = Study(spec, {}, {})
    for arm in spec.arms():
        for seed in spec.seeds_of(arm):
            record = _ppo_run(top, arm, seed, study.missing)
            if record is None:
                continue
            study.ppo.setdefault(arm, {})[seed] = record
            study.missing += [Missing(record.name, why) for why in _lacking(record, spec)]
    for quality in spec.prm_quality:
        for seed in quality.seeds:
            if (evaluation := _prm_run(top, quality.id, seed, study.missing)) is not None:
                study.prm.setdefault(quality.id, {})[seed] = evaluation
    study.unexpected = _unexpected(top, spec)
    study.missing.sort(key=lambda m: (m.name.split("/")[:2], int(m.name.rsplit("/s", 1)[1]), m.why))
    return study
