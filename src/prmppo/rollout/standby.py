"""A rollout worker started before the trainer's own imports, adopted when the trainer launches one.

`python -m prmppo stage=ppo` spends its first seconds importing torch, transformers and peft, and
the rollout worker it launches then spends its first seconds importing the same. `start_for(cfg)`,
called by the entry point as soon as Hydra has composed the config, starts the worker process in
standby: it imports the engine's module and waits for its arguments on stdin
(`worker.standby_main`). `RolloutClient.launch` adopts it (`take`, `activate`) when interpreter
and engine match, so the two processes import side by side; otherwise, or when the standby has
died, the client starts a worker as before, which then reports any failure the usual way.

Only the built-in engine (`rollout.engine=hf`) on one training process (no torchrun) gets a
standby: vLLM decides its devices from the environment at import time. A standby nobody takes
is killed when the trainer exits, and exits by itself when its stdin closes.

This module stays light (no torch): the entry point imports it before anything heavy.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from prmppo.rollout.process import resolve_python, worker_env, worker_import_dir

STANDBY_ENGINES = ("hf",)
_WAITING: dict[tuple[str, str], subprocess.Popen] = {}  # (interpreter, engine) -> a standby not yet taken
_IMPORT_DIRS: list[Path] = []


def start(python: str, engine: str, env: dict[str, str] | None, model_type: str = "") -> subprocess.Popen | None:
    """A standby worker for `engine` run by `python` with `env` (None: this process's), importing
    `model_type`'s modeling module too when given; None for an engine without standby, or when the
    interpreter cannot be started (the trainer's own checks then say why)."""
    if engine not in STANDBY_ENGINES:
        return None
    waiting = _WAITING.get((python, engine))
    if waiting is not None and waiting.poll() is None:
        return waiting
    import_dir = Path(tempfile.mkdtemp(prefix="prmppo-standby-"))
    _IMPORT_DIRS.append(import_dir)
    try:
        proc = subprocess.Popen([python, "-m", "prmppo.rollout.worker", "--standby", engine,
                                 *([model_type] if model_type else [])],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=worker_env(worker_import_dir(import_dir), env), start_new_session=True)
    except OSError:
        return None
    _WAITING[(python, engine)] = proc
    return proc


def start_for(cfg) -> subprocess.Popen | None:
    """The standby a `stage=ppo` run on one process will adopt, started with the environment the
    run gives its worker (`app.run`: TOKENIZERS_PARALLELISM, `topology.cuda_alloc_conf`). Any other
    stage, a torchrun launch, `rollout.standby=false`, or a config without these keys: None
    (validation reports bad keys)."""
    try:
        if not cfg.rollout.standby or cfg.stage.name != "ppo" or os.environ.get("WORLD_SIZE", "1") != "1":
            return None
        engine, python, alloc_conf = cfg.rollout.engine, cfg.rollout.python, cfg.topology.cuda_alloc_conf
    except Exception:  # noqa: BLE001 - a malformed config is validate_config's to name, not this
        return None
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    return start(resolve_python(python), engine, env, model_type(cfg.model))


TINY_MODEL_TYPE = "mistral"  # what `model=tiny` builds (models/tiny.py: MistralForCausalLM)


def model_type(model_cfg) -> str:
    """The transformers `model_type` of the model a config names, read without importing transformers:
    `model=tiny` builds a Mistral; `model=hf` names a directory whose config.json says; "" for any other
    model source, a path not given yet or an unreadable directory (the standby then imports less, nothing
    else changes; validation names a missing path). The config's modules are imported here, not at the
    top: the rollout package is also imported by the worker in the engine's own environment, which has no
    omegaconf."""
    from omegaconf import OmegaConf

    from prmppo.config.schema import HFModelConfig, TinyModelConfig

    if model_cfg._target_ == TinyModelConfig._target_:
        return TINY_MODEL_TYPE
    if model_cfg._target_ != HFModelConfig._target_ or OmegaConf.is_missing(model_cfg, "path"):
        return ""
    try:
        return str(json.loads((Path(model_cfg.path) / "config.json").read_text())["model_type"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def take(python: str, engine: str) -> subprocess.Popen | None:
    """The live standby for (`python`, `engine`), removed from the waiting list; None if there is none."""
    proc = _WAITING.pop((python, engine), None)
    return proc if proc is not None and proc.poll() is None else None


def activate(proc: subprocess.Popen, argv: list[str], log_path: str | os.PathLike) -> bool:
    """Give the standby its worker arguments and its log file; False if it died before reading them."""
    order = json.dumps({"argv": list(argv), "log": str(log_path)})
    try:
        proc.stdin.write(order.encode() + b"\n")
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        return False
    return True


@atexit.register
def _discard() -> None:
    for proc in _WAITING.values():
        if proc.poll() is None:
            proc.kill()
    _WAITING.clear()
    for directory in _IMPORT_DIRS:
        shutil.rmtree(directory, ignore_errors=True)
