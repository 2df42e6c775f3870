"""The stages `python -m prmppo stage=<name>` runs: `name -> run(cfg, run_dir) -> summary dict`.

Every stage module has the same shape: `ensure_<artifact>(...)` makes or reuses its artifact from
values (sft, prm, band, ppo's `train_ppo`), and `run(cfg, run_dir)` runs it as a stage and writes
`stage_result.json`. Shared plumbing lives in `stages/common.py`; `config/build.py` below both.
"""

from prmppo.stages import band, eval as eval_stage, pipeline, ppo, prm, sft

STAGES = {"sft": sft.run, "prm": prm.run, "band": band.run, "ppo": ppo.run, "eval": eval_stage.run,
          "pipeline": pipeline.run}

__all__ = ["STAGES"]
