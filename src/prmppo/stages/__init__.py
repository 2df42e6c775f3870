"""Stage runners: `name -> runner(cfg, run_dir) -> summary dict`, dispatched by `app.run`."""

from prmppo.stages.runners import STAGE_RUNNERS

__all__ = ["STAGE_RUNNERS"]
