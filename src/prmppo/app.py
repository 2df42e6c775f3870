"""`run(cfg)`: the whole application behind `python -m prmppo`, callable without Hydra.

Order of work, cheapest first, so a bad launch fails in milliseconds:
  1. validate the composed config (`config/validate.py`): ranges and cross-field arithmetic;
  2. check every `_target_` against the allowed module prefixes;
  3. dispatch to the stage named by `stage.name`, which builds components and does the work.
Every component is built by `build`, which logs the `_target_` it instantiates. Components
never see `cfg`; only this module and the stage runners read it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig

from prmppo.config.validate import ConfigError, validate_config

log = logging.getLogger("prmppo")

# `_target_` values may only name classes in these packages: a config file is data, and
# instantiating an arbitrary importable callable from it would make it code.
ALLOWED_TARGET_PREFIXES = ("prmppo.",)


def check_targets(cfg: DictConfig, path: str = "") -> None:
    """Refuse any `_target_` outside `ALLOWED_TARGET_PREFIXES`, naming the key."""
    for key, value in cfg.items_ex(resolve=False):
        where = f"{path}.{key}" if path else str(key)
        if key == "_target_" and not str(value).startswith(ALLOWED_TARGET_PREFIXES):
            raise ConfigError(f"{where}={value!r} is outside the allowed packages {ALLOWED_TARGET_PREFIXES}")
        if isinstance(value, DictConfig):
            check_targets(value, where)


def build(node: DictConfig, what: str, **kwargs):
    """Instantiate a component from its config node, logging what is built."""
    log.info("building %s: %s", what, node._target_)
    return instantiate(node, _convert_="all", **kwargs)


def run_dir_of(cfg: DictConfig) -> Path:
    path = Path(cfg.run_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def run(cfg: DictConfig) -> dict:
    """Validate `cfg` and run the stage it names; returns the stage's result summary."""
    validate_config(cfg)
    check_targets(cfg)
    from prmppo.stages import STAGE_RUNNERS

    runner = STAGE_RUNNERS[cfg.stage.name]  # validate_config refused stages without a runner
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _quiet_transformers()
    run_dir = run_dir_of(cfg)
    log.info("stage %s, run dir %s", cfg.stage.name, run_dir)
    return runner(cfg, run_dir)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

