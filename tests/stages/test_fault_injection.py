"""Fault injection on a CPU smoke PPO run: SIGKILL the trainer or the rollout worker, relaunch the
same command, and the run reads as one uninterrupted run.

Every run here is a `python -m prmppo stage=ppo debug=smoke ppo.iterations=4 ...` subprocess with
its own `hydra.run.dir`, sharing one artifacts dir (the SFT checkpoint is trained once). The
reference run is a subprocess too, so both sides run with the same BLAS thread setup.

Metrics are compared within 1e-6 rather than exactly: on CPU the runs are bitwise equal in practice
(same seeds, data order a function of the iteration index, same kernels), but float sums in BLAS
kernels may be reordered between launches (thread count, memory alignment), which is not an error.

The kill during a checkpoint write is SIMULATED, not raced: production code has no test hooks, and
a real SIGKILL cannot be aimed at the few milliseconds of a smoke save. The test leaves behind what
such a kill would (an `it<N>.partial` dir with partial files, a checkpoint dir whose
`checkpoint.json` marker is missing, a metrics row logged after the last complete checkpoint)
and relaunches. `save_checkpoint` writes under `.partial`, then the marker, then renames, so these
are the only states a kill mid-write can leave (`tests/ppo/test_checkpoint.py` covers the pieces).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prmppo.ppo.checkpoint import latest_checkpoint, read_meta

# kills trainers and workers mid-run and relaunches them to the end: minutes
pytestmark = pytest.mark.slow

# the moving setup of tests/stages/test_resume.py, with a critic (gae) whose state must travel too:
# a resume that lost state would show
MOVING = ["stage=ppo", "debug=smoke", "ppo.iterations=4", "ppo.lr=0.05", "ppo.warmup_steps=0",
          "ppo.entropy_coef=1.0", "ppo.advantage_estimator=gae"]
COMPARED = ("rollout/accuracy", "ppo/policy_loss", "ppo/kl_ref", "value/loss")
HEARTBEAT_TIMEOUT_S = 5


def _cmd(artifacts: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "prmppo", *MOVING, f"artifacts_dir={artifacts}", f"hydra.run.dir={run_dir}",
            f"rollout.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}", *extra]


def _launch(cmd: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)


def _run_to_end(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _ppo_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if row["stage"] == "ppo"]


def _wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if ready():
                return
        except (OSError, json.JSONDecodeError):  # a file caught mid-write
            pass
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"never saw {what}; rc={proc.poll()} stderr:\n{proc.communicate()[1][-3000:]}")


def _worker_pid(run_dir: Path) -> int:
    return json.loads((run_dir / "spool" / "heartbeat.json").read_text())["pid"]


def _assert_gone(pid: int, within_s: float = 15.0) -> None:
    """The worker exits once its parent is gone (worker.py polls getppid); give it a few seconds."""
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"rollout worker {pid} outlived its trainer by {within_s}s")


def _assert_equal_runs(run_dir: Path, reference: Path) -> None:
    rows, expected = _ppo_rows(run_dir), _ppo_rows(reference)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [0, 1, 2, 3]
    assert abs(expected[3]["ppo/kl_ref"]) > 1e-3, "the policy did not move: the comparison would prove nothing"
    for got, want in zip(rows, expected):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], abs=1e-6), (got["step"], key)
        assert got["rollout/engine_logprob_abs_diff"] < 1e-4  # the engine served the resumed weights
    summary = json.loads((run_dir / "stage_result.json").read_text())["summary"]
    assert "stopped" not in summary and summary["policy_steps"] == summary["planned_policy_steps"]
    assert (run_dir / "checkpoints" / "final" / "config.json").exists()
    assert not list((run_dir / "checkpoints").glob("*.partial"))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(artifacts dir, reference run dir): one uninterrupted run, which also trains the shared SFT."""
    root = tmp_path_factory.mktemp("fault")
    _run_to_end(_cmd(root / "artifacts", root / "reference"), root)
    return root / "artifacts", root / "reference"


def _kill_during_iteration_2(artifacts: Path, run_dir: Path, cwd: Path) -> None:
    """SIGKILL the trainer during the rollout/update of iteration 2: after iteration 1's row and its
    checkpoint (every iteration is a checkpoint boundary at 4 iterations) are on disk."""
    proc = _launch(_cmd(artifacts, run_dir), cwd)
    _wait_for(proc, lambda: [r["step"] for r in _ppo_rows(run_dir)] == [0, 1]
              and (run_dir / "checkpoints" / "it000002" / "checkpoint.json").exists(), "iteration 1 checkpointed")
    worker = _worker_pid(run_dir)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert len(_ppo_rows(run_dir)) < 4, "the run finished before the kill: nothing was tested"
    _assert_gone(worker)


def test_sigkill_during_iteration_then_relaunch_equals_uninterrupted(ref, tmp_path):
    artifacts, reference = ref
    run_dir = tmp_path / "run"
    _kill_during_iteration_2(artifacts, run_dir, tmp_path)
    assert latest_checkpoint(run_dir).name == "it000002"
    _run_to_end(_cmd(artifacts, run_dir), tmp_path)  # the same command again
    _assert_equal_runs(run_dir, reference)


def test_sigkill_during_checkpoint_write_simulated_then_relaunch_equals_uninterrupted(ref, tmp_path):
    artifacts, reference = ref
    run_dir = tmp_path / "run"
    _kill_during_iteration_2(artifacts, run_dir, tmp_path)
    checkpoints = run_dir / "checkpoints"
    good = latest_checkpoint(run_dir)
    assert good.name == "it000002"
    # simulated: what a kill while saving it000003 would leave, one state per save phase
    partial = checkpoints / "it000003.partial"  # killed before the marker: partial files
    shutil.copytree(good, partial)
    (partial / "checkpoint.json").unlink()
    with open(partial / "value_head.safetensors", "r+b") as handle:
        handle.truncate(7)
    (partial / "optim.pt").unlink()
    unmarked = checkpoints / "it000004"  # a checkpoint dir without its marker (never picked)
    shutil.copytree(good, unmarked)
    (unmarked / "checkpoint.json").unlink()
    with (run_dir / "metrics.jsonl").open("a") as handle:  # iteration 2 was logged before the save
        handle.write(json.dumps({**_ppo_rows(run_dir)[-1], "step": 2, "ppo/kl_ref": 123.0}) + "\n")
    assert latest_checkpoint(run_dir) == good

    _run_to_end(_cmd(artifacts, run_dir), tmp_path)
    _assert_equal_runs(run_dir, reference)
    assert read_meta(checkpoints / "it000004")["next_iteration"] == 4  # re-saved complete over the torn one


def test_killed_worker_fails_the_run_within_the_timeout_with_its_log_then_relaunch_resumes(ref, tmp_path):
    artifacts, reference = ref
    run_dir = tmp_path / "run"
    proc = _launch(_cmd(artifacts, run_dir), tmp_path)
    _wait_for(proc, lambda: [r["step"] for r in _ppo_rows(run_dir)] == [0]
              and (run_dir / "checkpoints" / "it000001" / "checkpoint.json").exists(), "iteration 0 checkpointed")
    os.kill(_worker_pid(run_dir), signal.SIGKILL)
    killed_at = time.time()
    _, stderr = proc.communicate(timeout=60)
    elapsed = time.time() - killed_at
    assert proc.returncode not in (0, None, -signal.SIGKILL), stderr[-2000:]
    # a dead worker is seen by its exit status, well inside the heartbeat timeout; the margin is
    # for the trainer's own shutdown (interpreter exit) on a loaded 2-core machine
    assert elapsed < HEARTBEAT_TIMEOUT_S + 20, elapsed
    assert str(run_dir / "worker.log") in stderr
    assert len(_ppo_rows(run_dir)) < 4
    assert latest_checkpoint(run_dir) is not None

    _run_to_end(_cmd(artifacts, run_dir), tmp_path)  # relaunch: a fresh worker, resumed weights
    _assert_equal_runs(run_dir, reference)
