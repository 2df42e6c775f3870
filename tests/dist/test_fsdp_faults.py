"""A rank killed mid-run ends the whole 2-rank job with a non-zero exit, and a relaunch resumes from the
last complete sharded checkpoint (`dist/checkpoint.py`) to the metrics of an uninterrupted 2-rank run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO
from test_fsdp_parity import CPU_RANKS, MOVING, artifacts, differences, ppo_rows  # noqa: F401 (fixture)
from test_ranks import torchrun

from prmppo.ppo.checkpoint import latest_checkpoint, read_meta

ITERATIONS = 4  # a checkpoint after every iteration (checkpoint_every(4, 1) == 1)


def _command(artifacts_dir: Path, run_dir: Path) -> list[str]:
    return ["-m", "prmppo", *MOVING, f"ppo.iterations={ITERATIONS}", "arm=orm", f"artifacts_dir={artifacts_dir}",
            *CPU_RANKS, f"hydra.run.dir={run_dir}"]


def _wait_for(predicate, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before the condition held"
        assert time.time() < deadline, "timed out waiting for the run to reach the kill point"
        time.sleep(0.2)


def test_a_killed_rank_ends_the_job_and_a_relaunch_resumes_to_the_same_metrics(artifacts, tmp_path):
    reference = tmp_path / "reference"
    done = torchrun(_command(artifacts, reference), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]

    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             *_command(artifacts, killed)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (killed / "checkpoints" / "it000002" / "checkpoint.json").is_file(), proc, timeout=300)
        pid = int(re.search(r"rank 1 of 2 .* pid (\d+)", (killed / "rank1.log").read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)  # the others are stopped by torchrun, not left hanging
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "rank 1" in stderr or "local_rank: 1" in stderr, stderr[-3000:]  # torchrun names the failed rank
    resumed_from = latest_checkpoint(killed)
    assert 2 <= read_meta(resumed_from)["next_iteration"] < ITERATIONS

    again = torchrun(_command(artifacts, killed), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from" in (killed / "rank0.log").read_text()
    assert differences(ppo_rows(reference), ppo_rows(killed)) == []
