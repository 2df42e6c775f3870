"""`build(node, what, **runtime)`: the one way a component comes to life, and the `_target_` allow-list.

Every component (task, model source, reward, policy, step scorer, rollout engine) is a class named
by its config node's `_target_` and built here, which logs what it instantiates. Runtime
dependencies (a built model, a tokenizer, the run dir) are passed as keyword arguments; nothing
is attached after construction.
"""

from __future__ import annotations

import logging

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from prmppo.errors import ConfigError

log = logging.getLogger("prmppo")

# `_target_` values may only name classes in these packages: a config file is data, and
# instantiating an arbitrary importable callable from it would make it code.
ALLOWED_TARGET_PREFIXES = ("prmppo.",)


def check_targets(cfg: DictConfig, path: str = "") -> None:
    """Refuse any `_target_` of the run's config outside `ALLOWED_TARGET_PREFIXES`, naming the key."""
    for key, value in cfg.items_ex(resolve=False):
        if not path and key == "hydra":
            continue  # Hydra's own node (launcher, sweeper plugins) is Hydra's to instantiate
        where = f"{path}.{key}" if path else str(key)
        if key == "_target_" and not str(value).startswith(ALLOWED_TARGET_PREFIXES):
            raise ConfigError(f"{where}={value!r} is outside the allowed packages {ALLOWED_TARGET_PREFIXES}")
        if isinstance(value, DictConfig):
            check_targets(value, where)


def build(node: DictConfig, what: str, **runtime):
    """Instantiate a component from its config node, logging what is built."""
    log.info("building %s: %s", what, node._target_)
    return instantiate(node, _convert_="all", **runtime)


def build_quietly(node: DictConfig, **runtime):
    """`build` for questions asked of a cheap component (validation, reports): allow-list checked, not
    logged, and a constructor's refusal raised as a `ConfigError` with its own sentence."""
    check_targets(node)
    try:
        return instantiate(node, _convert_="all", **runtime)
    except InstantiationException as err:
        cause = err.__cause__ if isinstance(err.__cause__, (ValueError, TypeError)) else err
        raise ConfigError(str(cause)) from err
