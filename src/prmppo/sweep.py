"""Sweeps: one Hydra multirun job per config, a failed job recorded instead of ending the sweep.

    python -m prmppo -m arm=prm,orm reward.eta=0.5,1.0 ppo.kl_coef=0.01,0.04 seed=0,1,2
    python -m prmppo -m sweep=optuna                          # optional: pip install 'prmppo[sweeps]'
    python -m prmppo -m sweep=slurm arm=prm,orm seed=0,1,2    # optional: submitit on a SLURM cluster

Each job runs `app.run(cfg)` in its own directory (`hydra.sweep.dir/<num>_<overrides>`). Hydra's
basic launcher would re-raise a job's exception after the batch and end the sweep with a
traceback; here a job that fails (a refusal or a crash) writes `stage_result.json` with
`"status": "failed"` and the error, logs it, and returns nan, so the other jobs run and keep
their records. `SweepRecord` (a Hydra callback, `hydra.callbacks.sweep_record` in
`conf/config.yaml`) then writes `<sweep dir>/sweep_result.json` with every job's status, and the
command exits 1 when any job failed. A coordinated stop (SIGTERM) still ends the whole sweep.

Every job returns the number named by the `objective` key (a dotted path into the stage's
summary, default `eval.ppo.greedy_accuracy`), which is what the Optuna sweeper maximises.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import traceback
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from prmppo.errors import ConfigError, PrmppoError, StopRequested
from prmppo.logger import write_json_atomic

# Hydra imports this module for its callback (conf/config.yaml hydra.callbacks) before any job runs, so
# what brings in torch, transformers and peft is imported when a job needs it, not here


def run(cfg: DictConfig) -> dict:
    """`app.run`: the job itself."""
    from prmppo.app import run as run_app

    return run_app(cfg)

log = logging.getLogger("prmppo")

RESULT_FILE = "sweep_result.json"


def objective_value(summary: dict, path: str) -> float:
    """The number at dotted `path` in `summary`, or nan when it is absent or not a number."""
    node = summary
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return math.nan
        node = node[part]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else math.nan


def override_keys(overrides: list[str]) -> dict[str, str]:
    """`{"reward.eta": "0.5", ...}` from Hydra override strings (`+`, `++` and `~` prefixes dropped)."""
    pairs = {}
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        pairs[key] = value
    return pairs


def warn_inert_overrides(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """Warn about overridden keys that this config never reads (a sweep over them repeats one run)."""
    try:
        from prmppo.config.validate import inert_keys

        never_read = inert_keys(cfg)
    except ConfigError:
        return []  # a reward that cannot be built: validation refuses it with the reason
    inert = [key for key in override_keys(overrides) if key in never_read]
    for key in inert:
        log.warning("%s has no effect on this run (arm=%s, ppo.advantage_estimator=%s): this config never reads it "
                    "(stage_result.json lists it under inert_keys); prmppo.report does not split groups on it",
                    key, cfg.arm.name, cfg.ppo.advantage_estimator)
    return inert


def run_sweep_job(cfg: DictConfig) -> float:
    """Run one multirun job; on failure record it in the job's `stage_result.json` and return nan."""
    try:
        return objective_value(run(cfg), cfg.objective)
    except StopRequested:
        raise
    except Exception as err:  # a refusal or a crash of this job, not of the sweep
        refused = isinstance(err, PrmppoError)
        error = {"type": type(err).__name__, "message": str(err), "refused": refused,
                 "traceback": None if refused else traceback.format_exc()}
        if refused:
            log.error("job refused: %s", err)
        else:
            log.exception("job crashed: %s", err)
        from prmppo.stages.common import write_stage_result

        write_stage_result(Path(cfg.run_dir), cfg, cfg.stage.name, {}, status="failed", error=error)
        return math.nan


def job_status(job_dir: Path) -> dict:
    """A job directory's status from its `stage_result.json` (`missing` when it never wrote one)."""
    result_path = job_dir / "stage_result.json"
    overrides_path = job_dir / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in OmegaConf.load(overrides_path)] if overrides_path.exists() else []
    row = {"job": job_dir.name, "overrides": overrides, "status": "missing"}
    if result_path.exists():
        try:
            result = json.loads(result_path.read_text())
        except json.JSONDecodeError:
            return {**row, "status": "failed", "error": f"{result_path} is not valid JSON"}
        row["status"] = result.get("status", "ok")
        if "error" in result:
            row["error"] = result["error"]["message"].splitlines()[0] if result["error"]["message"] else ""
    return row


class SweepRecord(Callback):
    """After a multirun: `sweep_result.json` with every job's status; exit 1 when any job failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        jobs = sorted((d for d in sweep_dir.iterdir() if (d / ".hydra").is_dir()),
                      key=lambda d: (int(d.name.split("_")[0]) if d.name.split("_")[0].isdigit() else 1 << 30, d.name))
        rows = [job_status(job) for job in jobs]
        failed = [row for row in rows if row["status"] != "ok"]
        write_json_atomic(sweep_dir / RESULT_FILE, {"sweep_dir": str(sweep_dir), "total": len(rows),
                                                    "failed": len(failed), "jobs": rows})
        if failed:
            lines = "; ".join(f"{row['job']}: {row['status']}" + (f" ({row['error']})" if row.get("error") else "")
                              for row in failed)
            print(f"prmppo: sweep finished: {len(failed)} of {len(rows)} jobs did not succeed: {lines} "
                  f"(see {sweep_dir / RESULT_FILE})", file=sys.stderr)
            sys.exit(1)
        log.info("sweep finished: %d jobs succeeded (%s)", len(rows), sweep_dir / RESULT_FILE)
