"""How a rollout worker process is started: its interpreter, its environment, and the directory that
lets it import the trainer's `prmppo` and nothing else of the trainer's environment. Used by the
client (`rollout/client.py`) and by the standby the entry point starts (`rollout/standby.py`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import prmppo


def package_dir() -> Path:
    """The directory of the `prmppo` package the trainer runs (a source tree, or site-packages/prmppo)."""
    package_file = getattr(prmppo, "__file__", None)
    return (Path(package_file).parent if package_file else Path(next(iter(prmppo.__path__)))).resolve()


def worker_import_dir(directory: Path) -> str:
    """`directory`, made to hold only `prmppo`, a link to the trainer's package: the worker's PYTHONPATH.

    Not the package's parent: under a non-editable install that is the trainer's site-packages,
    whose torch and transformers would shadow the engine environment's own (vLLM pins its torch).
    """
    link, target = directory / "prmppo", package_dir()
    directory.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() and link.resolve() == target):
        link.unlink(missing_ok=True)
        link.symlink_to(target, target_is_directory=True)
    return str(directory)


def worker_env(import_dir: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker process: `base` (default: this one) with `import_dir` first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    existing = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = import_dir + (os.pathsep + existing if existing else "")
    return env


def resolve_python(python: str) -> str:
    """An interpreter path made absolute against the working directory (under `python -m prmppo`, the
    launch directory: hydra.job.chdir stays false); "" means this interpreter.

    Symlinks are kept: a venv's bin/python is a link whose target would lose the venv.
    """
    return os.path.abspath(python) if python else sys.executable
