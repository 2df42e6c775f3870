"""Coordinated stop and resume of a CPU smoke PPO run: a stopped and relaunched run reads as one run."""

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

from conftest import compose_config
from prmppo.app import run
from prmppo.errors import EXIT_STOPPED, StopRequested
from prmppo.ppo.checkpoint import latest_checkpoint, read_meta

# stopped, resumed and uninterrupted PPO runs side by side, each a subprocess: minutes
pytestmark = pytest.mark.slow

# a large LR and an entropy bonus move the smoke policy every iteration, so a resume that lost
# any state (weights, Adam moments, LR schedule, engine weights) would show in the metrics
MOVING = ["stage=ppo", "ppo.iterations=4", "ppo.lr=0.05", "ppo.warmup_steps=0", "ppo.entropy_coef=1.0"]
COMPARED = ("rollout/accuracy", "ppo/policy_loss", "ppo/kl_ref")


def _ppo_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["stage"] == "ppo"]


# the worker engine is sent the resumed weights; the in-process engine samples with the policy they were loaded into
@pytest.mark.parametrize("rollout", ["hf", "inprocess"])
def test_stopped_then_relaunched_run_equals_an_uninterrupted_one(tmp_path, rollout):
    def cfg(run_dir: Path, *extra: str):
        return compose_config(["debug=smoke", f"artifacts_dir={tmp_path / 'artifacts'}", f"rollout={rollout}", *MOVING,
                               *extra], run_dir=run_dir)

    reference = tmp_path / "reference"
    run(cfg(reference))
    resumed = tmp_path / "resumed"
    # any positive budget is spent by the end of iteration 0: stop there
    with pytest.raises(StopRequested) as stop:
        run(cfg(resumed, "max_wall_seconds=1e-6"))
    assert stop.value.reason == "max_wall_seconds"
    result = json.loads((resumed / "stage_result.json").read_text())["summary"]
    assert result["stopped"] == "max_wall_seconds" and result["policy_steps"] == 2
    checkpoint = latest_checkpoint(resumed)
    assert checkpoint.name == "it000001" and result["checkpoint"] == str(checkpoint)
    assert read_meta(checkpoint)["next_iteration"] == 1
    assert not (resumed / "checkpoints" / "final").exists()
    # what a SIGKILL right after logging iteration 1, during its checkpoint write, would leave behind
    with (resumed / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps({**_ppo_rows(resumed)[0], "step": 1, "ppo/kl_ref": 123.0}) + "\n")
    shutil.copytree(checkpoint, resumed / "checkpoints" / "it000002.partial")

    summary = run(cfg(resumed))  # the same command again, without the budget
    rows, expected = _ppo_rows(resumed), _ppo_rows(reference)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [0, 1, 2, 3]  # duplicates dropped
    assert abs(expected[3]["ppo/kl_ref"]) > 1e-3, "the policy did not move: the comparison would prove nothing"
    # Within 1e-6 rather than exactly: on CPU the runs are bitwise equal in practice (same seeds, same
    # data order by iteration index, same kernels), but a BLAS thread-count change between launches
    # may reorder float sums; accuracy is 0 throughout on the smoke model, so the losses carry the test.
    for got, want in zip(rows, expected):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], abs=1e-6), (got["step"], key)
        assert got["rollout/engine_logprob_abs_diff"] < 1e-4  # the engine served the resumed weights
    assert summary["policy_steps"] == summary["planned_policy_steps"] == 8
    assert (resumed / "checkpoints" / "final" / "config.json").exists()
    assert not list((resumed / "checkpoints").glob("*.partial"))
    assert "stopped" not in json.loads((resumed / "stage_result.json").read_text())["summary"]


# the oracle scorer (no PRM to train) with label noise: every iteration flips some step scores
NOISY = ["arm=prm", "reward=prm_oracle", "reward.label_noise=0.2", "seed=7"]
NOISE_COMPARED = ("prm/flipped_fraction", "prm/score_mean", "reward/total_mean")


def test_resumed_run_flips_the_steps_the_uninterrupted_run_flips(tmp_path, monkeypatch):
    from prmppo.rewards.prm import ProcessReward

    built_with_seeds, init = [], ProcessReward.__init__

    def recording_init(self, *args, seed: int = 0, **kwargs):
        built_with_seeds.append(seed)
        init(self, *args, seed=seed, **kwargs)

    monkeypatch.setattr(ProcessReward, "__init__", recording_init)

    def cfg(run_dir: Path, *extra: str):
        return compose_config(["debug=smoke", f"artifacts_dir={tmp_path / 'artifacts'}", *MOVING, *NOISY, *extra],
                              run_dir=run_dir)

    reference = tmp_path / "reference"
    run(cfg(reference))
    resumed = tmp_path / "resumed"
    with pytest.raises(StopRequested):  # stopped after iteration 0, as above
        run(cfg(resumed, "max_wall_seconds=1e-6"))
    assert latest_checkpoint(resumed).name == "it000001"
    run(cfg(resumed))
    rows, expected = _ppo_rows(resumed), _ppo_rows(reference)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [0, 1, 2, 3]
    assert all(0 < r["prm/flipped_fraction"] < 1 for r in expected), "no noise drawn: the test would prove nothing"
    # A relaunch that restarted the noise generator would flip, at iteration 1, the draws of iteration 0.
    # Same tolerance as above: the flips are exact, the scores and rewards are sums of floats.
    for got, want in zip(rows, expected):
        for key in NOISE_COMPARED:
            assert got[key] == pytest.approx(want[key], abs=1e-6), (got["step"], key)
    assert set(built_with_seeds) == {7}  # the runner seeds every reward it builds with the run's seed


def test_sigterm_stops_with_exit_code_3_and_a_resumable_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "prmppo", "stage=ppo", "debug=smoke", "ppo.iterations=200",
           f"artifacts_dir={tmp_path / 'artifacts'}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and '"stage": "ppo"' in metrics.read_text():
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED == 3, stderr[-2000:]
    assert "stopped by sigterm" in stderr
    checkpoint = latest_checkpoint(run_dir)
    meta = read_meta(checkpoint)  # complete: every listed file present at its size
    assert 1 <= meta["next_iteration"] < 200 and checkpoint.name == f"it{meta['next_iteration']:06d}"
    # the stop happened at an iteration boundary: the log ends at the checkpointed iteration
    assert _ppo_rows(run_dir)[-1]["step"] == meta["next_iteration"] - 1
    result = json.loads((run_dir / "stage_result.json").read_text())["summary"]
    assert result["stopped"] == "sigterm" and result["checkpoint"] == str(checkpoint)
    heartbeat = json.loads((run_dir / "spool" / "heartbeat.json").read_text())
    with pytest.raises(ProcessLookupError):  # the worker was closed, not orphaned
        os.kill(heartbeat["pid"], 0)


def test_canary_alarm_pins_the_best_checkpoint_against_pruning(tmp_path, monkeypatch):
    # the smoke policy's real canary accuracy is 0 throughout: script it. Best at iteration 1
    # (checkpoint it000002), a drop at iteration 2 (alarm: pin it), a new best at iteration 3.
    import prmppo.stages.ppo_training as ppo_training

    accuracies, real_canary = iter([0.5, 0.9, 0.3, 1.0]), ppo_training._canary

    def scripted_canary(*args, **kwargs):
        canary = real_canary(*args, **kwargs)
        canary.evaluate = lambda problems: next(accuracies)
        return canary

    monkeypatch.setattr(ppo_training, "_canary", scripted_canary)
    run_dir = tmp_path / "run"
    cfg = compose_config(["debug=smoke", f"artifacts_dir={tmp_path / 'artifacts'}", "stage=ppo", "ppo.iterations=4",
                          "ppo.keep_checkpoints=1", "canary.every=1", "canary.max_drop=0.1", "canary.n_problems=2"],
                         run_dir=run_dir)
    summary = run(cfg)
    pinned = run_dir / "checkpoints" / "it000002"
    assert [a["iteration"] for a in summary["alarms"] if a["tripwire"] == "canary"] == [2]
    assert summary["pinned_checkpoints"] == [str(pinned)]
    # keep 1: the newest (it000004, also the new best) and the pinned one survive; it000001/3 are pruned
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["final", "it000002", "it000004"]
    assert read_meta(run_dir / "checkpoints" / "it000004")["extra"]["pinned"] == [str(pinned)]
    assert read_meta(pinned)["next_iteration"] == 2
