"""Finding, reading and grouping runs for reports: a run is a directory with `.hydra/config.yaml`.

A run's files: `.hydra/config.yaml` and `.hydra/overrides.yaml` (what Hydra composed and what the
user typed), `stage_result.json` (status `ok` / `stopped` / `failed`, the error, `finished_at`),
`metrics.jsonl` (the source of truth: `ppo` rows per iteration, `ppo_eval` rows with test
accuracy during PPO, `eval` rows with the pipeline's final evaluation), and `run_info.json` (start
time and hardware). Runs group by arm and by the swept keys (override keys whose values differ
between the runs, `seed` excepted: seeds are the replicates). A swept key that a run never reads
(`config.validate.inert_keys`, e.g. `reward.eta` for the ORM arm) shows as `-` for that run and
does not split its group; runs of one group that share a seed are averaged into one replicate.
A swept `reward` choice (e.g. `arm=prm reward=prm_oracle` beside `arm=orm`) labels the group but
belongs to the arm, so such PRM groups are still compared with the matching ORM groups.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from prmppo.config.build import build_quietly
from prmppo.config.validate import inert_keys
from prmppo.errors import PrmppoError

log = logging.getLogger("prmppo")

NOT_GROUPING = ("seed", "artifacts_dir", "run_dir", "max_wall_seconds")  # replicates and locations
INERT = "-"  # group value of a swept key that the run never reads
# keys the arm itself chooses (arm=prm selects reward=prm): part of an arm's identity, so they never
# keep a PRM group from being compared with the ORM groups
ARM_KEYS = ("reward",)


class ReportError(PrmppoError):
    """Report inputs that cannot be read; the message names the file (and line)."""


@dataclass
class Run:
    path: Path
    arm: str
    seed: int
    status: str  # ok | stopped | failed | incomplete (no stage_result.json)
    overrides: dict[str, str]
    config: DictConfig
    inert: list[str]
    rows: list[dict] = field(repr=False)
    error: str | None = None
    choices: dict[str, str] = field(default_factory=dict)  # config group -> option (`.hydra/hydra.yaml`)
    # ORM | learned PRM | oracle PRM | likelihood control: asked of the run's reward (`reward_kind`)
    reward_kind: str = "ORM"
    started_at: float | None = None  # unix seconds (`run_info.json`), None for runs made before it existed
    finished_at: float | None = None  # unix seconds (`stage_result.json`)
    host: dict = field(default_factory=dict)  # hostname, cpu_count, device (`run_info.json`)

    def series(self, stage: str, metric: str, x_key: str | None = None) -> dict[int, float]:
        """`{x: value}` of `metric` in rows of `stage`; x is `x_key`'s value or, by default, iterations done
        (`step + 1`, since row `step` is the 0-based iteration just finished)."""
        out = {}
        for row in self.rows:
            if row["stage"] == stage and isinstance(row.get(metric), (int, float)):
                x = row[x_key] if x_key else row["step"] + 1
                out[int(x)] = float(row[metric])
        return out


def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # the last line without a newline: a write cut by a kill
                log.warning("%s: ignoring the torn last line %d", path, number)
                continue
            raise ReportError(f"{path} line {number} is not valid JSON ({err.msg}): {line[:80]!r}") from None
        if not isinstance(row, dict) or "stage" not in row or "step" not in row:
            raise ReportError(f"{path} line {number} is not a metrics row (a JSON object with 'stage' and 'step')")
        rows.append(row)
    return rows


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ReportError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None


def reward_kind(config: DictConfig) -> str:
    """`ORM` (no step scores), `learned PRM` (a trained PRM scores steps), `oracle PRM` (the task's exact
    step checker does) or `likelihood control` (the SFT model's untrained step_logprobs rule does), asked of
    the reward the run's config builds."""
    reward = build_quietly(config.reward, seed=config.seed)
    if not reward.needs_step_scorer:
        return "ORM"
    if reward.needs_learned_prm:
        return "learned PRM"
    return "oracle PRM" if reward.needs_step_checker else "likelihood control"


def read_run(path: Path) -> Run:
    """One run directory (it must hold `.hydra/config.yaml`)."""
    try:
        config = OmegaConf.load(path / ".hydra" / "config.yaml")
        overrides_file = path / ".hydra" / "overrides.yaml"
        overrides = [str(o) for o in OmegaConf.load(overrides_file)] if overrides_file.exists() else []
        hydra_file = path / ".hydra" / "hydra.yaml"
        choices = OmegaConf.to_container(OmegaConf.load(hydra_file).hydra.runtime.choices) if hydra_file.exists() \
            else {}
    except Exception as err:  # yaml's own error types
        raise ReportError(f"{path / '.hydra'} cannot be read: {err}") from None
    result = read_json(path / "stage_result.json") if (path / "stage_result.json").exists() else {}
    error = result.get("error", {}).get("message") if result else None
    info = read_json(path / "run_info.json") if (path / "run_info.json").exists() else {}
    try:
        kind = reward_kind(config)
    except PrmppoError as err:
        raise ReportError(f"{path / '.hydra' / 'config.yaml'}: its reward cannot be built ({err})") from None
    pairs = {}
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        pairs[key] = value
    return Run(path=path, arm=str(config.arm.name), seed=int(config.seed), status=result.get("status", "incomplete"),
               overrides=pairs, config=config, inert=inert_keys(config), rows=_read_metrics(path / "metrics.jsonl"),
               error=error, choices={str(k): str(v) for k, v in choices.items()}, reward_kind=kind,
               started_at=info.get("started_at"), finished_at=result.get("finished_at"),
               host={k: info[k] for k in ("hostname", "cpu_count", "device") if k in info})


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Every run under `paths` (run dirs or sweep dirs, searched recursively), sorted by path."""
    found: set[Path] = set()
    for given in map(Path, paths):
        if not given.exists():
            raise ReportError(f"{given} does not exist")
        found.update(marker.parent.parent for marker in given.rglob(".hydra/config.yaml"))
    if not found:
        raise ReportError(f"no runs under {', '.join(map(str, paths))}: a run directory holds .hydra/config.yaml "
                          "(written by python -m prmppo)")
    return [read_run(path) for path in sorted(found)]


def swept_keys(runs: list[Run]) -> list[str]:
    """Override keys whose values differ between the runs (seed, locations and `arm` excepted)."""
    keys = sorted({key for run in runs for key in run.overrides})
    swept = []
    for key in keys:
        if key in NOT_GROUPING or key == "arm" or key.startswith("hydra."):
            continue
        if len({_value(run, key) for run in runs}) > 1:
            swept.append(key)
    return swept


def _value(run: Run, key: str) -> str:
    """The run's value of a swept key: as typed, else the group option Hydra recorded, else its config
    value; a key this run's config does not have (another arm's reward key) is inert."""
    if key in run.overrides:
        return run.overrides[key]
    if key in run.choices:  # a config group's option, e.g. reward=orm chosen by arm=orm
        return run.choices[key]
    missing = object()
    selected = OmegaConf.select(run.config, key, default=missing, throw_on_missing=False)
    if selected is missing:
        return INERT
    return "default" if isinstance(selected, DictConfig) else str(selected)


@dataclass
class Grouping:
    keys: list[str]  # swept keys, after `arm`
    groups: dict[tuple[str, ...], list[Run]]  # (arm, value per key) -> its ok runs
    not_ok: list[Run]  # failed, stopped and incomplete runs

    def label(self, group: tuple[str, ...]) -> str:
        parts = [f"arm={group[0]}"] + [f"{k}={v}" for k, v in zip(self.keys, group[1:]) if v != INERT]
        return " ".join(parts)


def group_runs(runs: list[Run]) -> Grouping:
    """Group the runs that finished (`status: ok`) by arm and swept keys; the rest go to `not_ok`."""
    keys = swept_keys(runs)
    groups: dict[tuple[str, ...], list[Run]] = defaultdict(list)
    for run in runs:
        if run.status == "ok":
            values = tuple(INERT if key in run.inert else _value(run, key) for key in keys)
            groups[(run.arm, *values)].append(run)
    return Grouping(keys, dict(sorted(groups.items())), [run for run in runs if run.status != "ok"])


def per_seed(runs: list[Run], stage: str, metric: str, x_key: str | None = None) -> dict[int, dict[int, float]]:
    """`{seed: {x: value}}`, averaging runs that share a seed (the same replicate run twice)."""
    by_seed: dict[int, list[dict[int, float]]] = defaultdict(list)
    for run in runs:
        series = run.series(stage, metric, x_key)
        if series:
            by_seed[run.seed].append(series)
    out = {}
    for seed, all_series in sorted(by_seed.items()):
        xs = set.intersection(*(set(s) for s in all_series))
        out[seed] = {x: sum(s[x] for s in all_series) / len(all_series) for x in sorted(xs)}
    return out
