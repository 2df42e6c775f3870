"""Where prmppo finds its config, and what relative paths in the config are relative to.

The config directory: `conf_dir()`. The repo's top-level `conf/` is packaged as `prmppo.conf`
(see setup.py), so a wheel, `pip install .` and `pip install -e .` all find it by that name; a
source checkout run without installing (`PYTHONPATH=src`) falls back to the checkout's `conf/`.

Paths in the config: two OmegaConf resolvers, registered by `register_path_resolvers()` (which
`config.store.register_schemas()` calls), make the shipped defaults absolute against a named
base, never against whatever directory the process happens to be in:

    ${prmppo.from_launch_dir:PATH}  PATH against the launch directory: the directory
                                    `python -m prmppo` was started in (Hydra's
                                    `hydra.runtime.cwd`, also under `hydra.job.chdir=true`;
                                    the current directory when composing without Hydra's runtime)
    ${prmppo.beside_env:PATH}       PATH against the directory that holds the trainer's Python
                                    environment (the parent of `sys.prefix`): with the trainer in
                                    <repo>/.venv, `.venv-vllm/bin/python` is
                                    <repo>/.venv-vllm/bin/python, where
                                    `scripts/setup_vllm_env.sh` creates the engine environment

An absolute PATH is returned as it is; `~` is expanded. The defaults that use them, each with an
environment variable that takes precedence:

    task.data_dir   (conf/task/gsm8k.yaml)    $PRMPPO_DATA_DIR/gsm8k, else ../shared/data/gsm8k,
                                              from the launch directory
    rollout.python  (conf/rollout/vllm.yaml)  $PRMPPO_VLLM_PYTHON, else .venv-vllm/bin/python
                                              beside the trainer's environment

A path given on the command line (`task.data_dir=data/gsm8k`) replaces the whole default; a
relative one is taken from the directory the process runs in, which is the launch directory
because prmppo keeps `hydra.job.chdir=false`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

CONF_PACKAGE = "prmppo.conf"


def conf_dir() -> Path:
    """The directory holding prmppo's Hydra config (`config.yaml` and one folder per group)."""
    spec = importlib.util.find_spec(CONF_PACKAGE)  # located, not imported
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    checkout_conf = Path(__file__).resolve().parents[3] / "conf"  # <repo>/src/prmppo/config/paths.py
    if (checkout_conf / "config.yaml").is_file():
        return checkout_conf
    raise FileNotFoundError(
        f"prmppo's config is missing: there is no package {CONF_PACKAGE} and no {checkout_conf}/config.yaml; "
        "install prmppo with pip (`pip install .` or `pip install -e .` from the repo), which ships it"
    )


def launch_dir() -> Path:
    """The directory `python -m prmppo` was started in (the current one outside Hydra's runtime)."""
    if HydraConfig.initialized():
        cwd = HydraConfig.get().runtime.cwd
        if cwd:
            return Path(cwd)
    return Path.cwd()


def python_env_parent() -> Path:
    """The directory that holds the running interpreter's environment (a venv's parent directory)."""
    return Path(sys.prefix).parent


def absolute_against(base: Path, path: str) -> str:
    """`path` (with `~` expanded) if absolute, else `base / path`, normalised; "" stays ""."""
    if not path:
        return path
    expanded = Path(path).expanduser()
    return os.path.normpath(expanded if expanded.is_absolute() else base / expanded)


def from_launch_dir(path: str) -> str:
    return absolute_against(launch_dir(), str(path))


def beside_env(path: str) -> str:
    return absolute_against(python_env_parent(), str(path))


def register_path_resolvers() -> None:
    """Register `prmppo.from_launch_dir` and `prmppo.beside_env` with OmegaConf (idempotent)."""
    OmegaConf.register_new_resolver("prmppo.from_launch_dir", from_launch_dir, replace=True)
    OmegaConf.register_new_resolver("prmppo.beside_env", beside_env, replace=True)
