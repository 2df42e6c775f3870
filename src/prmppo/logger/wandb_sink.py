"""`WandbSink`: mirrors the rows of one `MetricsLogger` (one stage of one job) into a W&B run.

One W&B run per stage execution: its config is the job's resolved Hydra config, its `group` the
experiment, its `job_type` the stage, its tags the arm, the stage and the seed; so a dashboard
filters `job_type=ppo`, groups by `arm.name` and sweeps on any config key. Metric names keep
their namespace (`rollout/`, `reward/`, `prm/`, `ppo/`, `value/`, `perf/`, `canary/`, `hack/`,
`eval/`, `sft/`), which W&B shows as panel sections. The run lives under `<run_dir>/wandb/`.

`metrics.jsonl` stays the source of truth: a W&B error while logging is reported once and the
sink turns itself off, never the run; a W&B error at start is a refusal (the user asked for W&B).
Offline runs are uploaded later with `wandb sync <run_dir>/wandb/offline-run-*`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prmppo.errors import PrmppoError

log = logging.getLogger("prmppo")


class WandbSink:
    """Opens a W&B run at construction; `log(step, row)` forwards numeric metrics; `close()` finishes it."""

    def __init__(self, *, run_dir: str | Path, project: str, entity: str | None, mode: str, config: dict,
                 group: str, job_type: str, tags: list[str], name: str):
        import wandb

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # console capture off: tqdm and the console summary stay ours; no git/system-stats probes
        settings = wandb.Settings(console="off", silent=True, disable_git=True, x_disable_stats=True)
        try:
            self.run = wandb.init(dir=str(run_dir), project=project, entity=entity, mode=mode, config=config,
                                  group=group, job_type=job_type, tags=tags, name=name, settings=settings,
                                  reinit="create_new")
        except Exception as err:  # wandb raises its own UsageError/CommError types
            raise PrmppoError(f"logger.wandb=true: W&B could not start a run in {mode} mode under {run_dir}: "
                              f"{err}") from err
        self.mode = mode

    def log(self, step: int, row: dict[str, Any]) -> None:
        if self.run is None:
            return
        metrics = {key: value for key, value in row.items()
                   if key not in ("stage", "step", "time") and isinstance(value, (int, float))}
        try:
            self.run.log(metrics, step=step)
        except Exception as err:  # never let the dashboard kill the training run
            log.warning("W&B logging failed (%s); metrics.jsonl goes on, W&B is off for this stage", err)
            self.run = None

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
