"""The rollout worker runs in the engine's own environment (vLLM's), which has no omegaconf or Hydra: the
worker's imports must not reach them."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_the_worker_imports_without_omegaconf_or_hydra():
    code = ("import sys; sys.modules['omegaconf'] = None; sys.modules['hydra'] = None\n"
            "import prmppo.rollout.worker\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
