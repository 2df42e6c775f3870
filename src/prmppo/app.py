"""`run(cfg)`: the whole application behind `python -m prmppo`, callable without Hydra.

Order of work, cheapest first, so a bad launch fails in milliseconds:
  1. validate the composed config (`validate.py`): ranges and cross-field arithmetic (`config/validate.py`),
     each choice against the list of the module that implements it;
  2. check every `_target_` against the allowed module prefixes (`config/build.py`);
  3. check the launch against the topology (`distributed/launch.py`: `topology=fsdp` under torchrun with
     WORLD_SIZE == topology.train_world_size, any other topology on one process);
  4. dispatch to the stage named by `stage.name` (`stages.STAGES`), which builds its components
     and does the work.
Imports run one way: app -> stages -> (config, models, ppo, rewards, rollout, guards, ...).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import DictConfig
from transformers.utils import logging as hf_logging

from prmppo.validate import validate_config
from prmppo.distributed.launch import check_launch
from prmppo.stages import STAGES
from prmppo.logger import laps
from prmppo.stages.common import record_start

log = logging.getLogger("prmppo")


def cuda_allocator_settings(conf: str) -> str | None:
    """Put `conf` in PYTORCH_CUDA_ALLOC_CONF (read when CUDA starts, in this process and in the rollout worker,
    which inherits it) unless the variable is set already or `conf` is empty; returns the value in force."""
    if conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        import torch

        if torch.cuda.is_initialized():  # a sweep worker's earlier job started CUDA: too late for this process
            log.warning("CUDA already started in this process; topology.cuda_alloc_conf=%r applies to its "
                        "rollout worker only", conf)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


def run(cfg: DictConfig) -> dict:
    """Validate `cfg` and run the stage it names; returns the stage's result summary."""
    laps.job_started()  # a sweep worker that runs several jobs counts each one's start-up from its start
    validate_config(cfg)  # also refuses a `_target_` outside the allowed packages
    stage = STAGES[cfg.stage.name]  # validate_config refused stages without a runner
    check_launch(cfg.topology.name, cfg.topology.train_world_size)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cuda_allocator_settings(cfg.topology.cuda_alloc_conf)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record_start(run_dir, cfg.topology.train_device)  # run_info.json: start time and hardware, for reports
    log.info("stage %s, run dir %s", cfg.stage.name, run_dir)
    return stage(cfg, run_dir)
