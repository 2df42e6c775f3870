"""The stages `python -m prmppo stage=<name>` runs: `name -> run(cfg, run_dir) -> summary dict`.

A stage module is its `run`: inputs, make, publish, in the open. Stage modules import no other stage
module; what several stages share lives beside them: `common.py` (plumbing, `make_or_reuse` of an
artifact: lock, reuse, build, publish), `sft_training.py` (the SFT checkpoint every later stage starts
from), `inputs.py` (PPO's inputs: SFT checkpoint, PRM, band, made in that order) and `ppo_training.py`
(PPO from an SFT checkpoint), which the `ppo` and `pipeline` stages both call. `config/build.py` sits
below all of them.
"""

from prmppo.stages import band, eval as eval_stage, pipeline, ppo, prm, sft

STAGES = {"sft": sft.run, "prm": prm.run, "band": band.run, "ppo": ppo.run, "eval": eval_stage.run,
          "pipeline": pipeline.run}

__all__ = ["STAGES"]
