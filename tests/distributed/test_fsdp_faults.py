"""Faults of a 2-rank job: a rank killed mid-run ends the whole job with a non-zero exit; SIGTERM to the
launcher stops every rank after the same iteration with one consistent checkpoint; either way a relaunch
resumes from the last complete sharded checkpoint (`distributed/checkpoint.py`) to the metrics of an
uninterrupted 2-rank run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from prmppo.ppo.checkpoint import latest_checkpoint, read_meta
from test_fsdp_parity import CPU_RANKS, MOVING, artifacts, differences, ppo_rows  # noqa: F401 (fixture)
from test_ranks import torchrun

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


@pytest.fixture(scope="module")
def reference(artifacts, tmp_path_factory) -> Path:
    """An uninterrupted 2-rank run."""
    run_dir = tmp_path_factory.mktemp("fsdp_reference") / "run"
    done = torchrun(_command(artifacts, run_dir), cwd=run_dir.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir


def _launch(artifacts: Path, run_dir: Path) -> subprocess.Popen:
    """The 2-rank job in the background; its stderr goes to `<run_dir>.stderr` (a pipe could fill and block it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    with open(run_dir.with_name(run_dir.name + ".stderr"), "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 *_command(artifacts, run_dir)], cwd=run_dir.parent, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)


def _stop_waiting(proc: subprocess.Popen, run_dir: Path, timeout: float) -> str:
    """Wait for the job to end (killing it past `timeout`); returns its stderr."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return run_dir.with_name(run_dir.name + ".stderr").read_text()


def test_a_killed_rank_ends_the_job_and_a_relaunch_resumes_to_the_same_metrics(artifacts, reference, tmp_path):
    killed = tmp_path / "killed"
    proc = _launch(artifacts, killed)
    try:
        _wait_for(lambda: (killed / "checkpoints" / "it000002" / "checkpoint.json").is_file(), proc, timeout=300)
        pid = int(re.search(r"rank 1 of 2 .* pid (\d+)", (killed / "rank1.log").read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
    finally:
        stderr = _stop_waiting(proc, killed, timeout=120)  # the others are stopped by torchrun, not left hanging
    assert proc.returncode != 0
    assert "rank 1" in stderr or "local_rank: 1" in stderr, stderr[-3000:]  # torchrun names the failed rank
    resumed_from = latest_checkpoint(killed)
    assert 2 <= read_meta(resumed_from)["next_iteration"] < ITERATIONS

    again = torchrun(_command(artifacts, killed), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from" in (killed / "rank0.log").read_text()
    assert differences(ppo_rows(reference), ppo_rows(killed)) == []


def test_sigterm_to_the_launcher_stops_every_rank_at_one_checkpoint_and_a_relaunch_resumes(artifacts, reference,
                                                                                            tmp_path):
    stopped = tmp_path / "stopped"
    proc = _launch(artifacts, stopped)
    try:
        _wait_for(lambda: (stopped / "checkpoints" / "it000001" / "checkpoint.json").is_file(), proc, timeout=300)
        proc.send_signal(signal.SIGTERM)  # torchrun passes it to every rank
    finally:
        stderr = _stop_waiting(proc, stopped, timeout=120)
    assert proc.returncode != 0  # torchrun reports the ranks' exit code 3 as a failure of its own
    result = json.loads((stopped / "stage_result.json").read_text())
    assert result["status"] == "stopped", stderr[-3000:]
    saved = Path(result["summary"]["checkpoint"])
    assert saved == latest_checkpoint(stopped) and read_meta(saved)["next_iteration"] < ITERATIONS
    assert not list((stopped / "checkpoints").glob("*.partial"))

    again = torchrun(_command(artifacts, stopped), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert differences(ppo_rows(reference), ppo_rows(stopped)) == []
