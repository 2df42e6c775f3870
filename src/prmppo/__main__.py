"""`python -m prmppo [group=option ...] [key=value ...]`: the Hydra entry point.

A thin shell around `prmppo.app.run(cfg)`, which holds all the logic and is testable without
Hydra. `python -m prmppo --help` lists the config groups and their options; `--cfg job`
prints the composed config. `python -m prmppo -m key=a,b ...` runs a sweep (see `prmppo.sweep`).

Exit codes: 0 success; 1 crash (a bug or an unexpected failure, with a traceback), or a sweep in
which some job failed (each job's `stage_result.json` says why; `sweep_result.json` lists them);
2 refused (bad config, bad input file, failed launch gate: one line saying why);
3 stopped (SIGTERM or `max_wall_seconds`: a checkpoint was saved; relaunch the same command with
the same run dir, `hydra.run.dir=<dir>`, to resume).

It runs from any directory under any install (`pip install .`, a wheel, `pip install -e .`): the
config ships inside the package, and its relative paths resolve against documented bases, not
the working directory (see `prmppo.config.paths`). Relative `hydra.run.dir` and `artifacts_dir`
(`runs/...`, `artifacts`) are outputs, written under the directory you launch from.
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from prmppo.config.paths import conf_dir
from prmppo.config.store import register_schemas
from prmppo.errors import EXIT_REFUSED, EXIT_STOPPED, PrmppoError, StopRequested
from prmppo.rollout import standby
from prmppo.sweep import objective_value, run_sweep_job, warn_inert_overrides

# torch, transformers and peft come in with prmppo.app, imported in main() once the config is composed
# and a `stage=ppo` run's rollout worker has started importing the same beside this process

# the packaged config (`prmppo.conf`, built from the repo's conf/), wherever prmppo is installed
CONF_DIR = str(conf_dir())

register_schemas()


def _check_run_dir_given(hydra_overrides: list[str]) -> None:
    """Several torchrun processes must share one run dir: Hydra's default (a timestamp) differs between them."""
    from prmppo.distributed.launch import LaunchError, torchrun_world_size

    world = torchrun_world_size()
    if world is not None and world > 1 and not any(o.startswith("hydra.run.dir=") for o in hydra_overrides):
        raise LaunchError(f"torchrun started {world} processes but no hydra.run.dir=<dir> was given: the default run "
                          "dir is a timestamp, which differs between processes; give one, e.g. hydra.run.dir=runs/<name>")


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.RUN:
        standby.start_for(cfg)  # the rollout worker's imports run beside the ones below
    from prmppo.app import run

    warn_inert_overrides(cfg, list(hydra_cfg.overrides.task))
    try:
        _check_run_dir_given(list(hydra_cfg.overrides.hydra))
        if hydra_cfg.mode == RunMode.MULTIRUN:
            return run_sweep_job(cfg)  # a failed job is recorded and the sweep goes on
        return objective_value(run(cfg), cfg.objective)
    except PrmppoError as err:
        print(f"prmppo: refused: {err}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    except StopRequested as stop:
        print(f"prmppo: {stop}", file=sys.stderr)
        sys.exit(EXIT_STOPPED)


if __name__ == "__main__":
    main()
