"""Sweeps: the documented multirun composes for every job, a failed job is recorded and the sweep goes
on, inert swept keys are flagged, the optional Optuna sweeper and SLURM launcher compose and run."""

from __future__ import annotations

import itertools
import json
import logging
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from conftest import CONF_DIR, compose_config, run_prmppo
from prmppo.config.store import register_schemas
from prmppo.config.validate import inert_keys
from prmppo.validate import validate_config
from prmppo.sweep import objective_value, override_keys, warn_inert_overrides

ISSUE_SWEEP = {"arm": ["prm", "orm"], "reward.eta": ["0.5", "1.0"], "ppo.kl_coef": ["0.01", "0.04"],
               "seed": ["0", "1", "2"]}


def test_the_documented_sweep_composes_and_validates_for_every_job():
    # python -m prmppo -m arm=prm,orm reward.eta=0.5,1.0 ppo.kl_coef=0.01,0.04 seed=0,1,2: Hydra composes
    # every job before launching any, so this is what decides whether the command runs
    jobs = list(itertools.product(*ISSUE_SWEEP.values()))
    assert len(jobs) == 24
    for values in jobs:
        overrides = [f"{k}={v}" for k, v in zip(ISSUE_SWEEP, values)]
        cfg = compose_config(overrides)
        validate_config(cfg)
        assert cfg.reward.eta == float(values[1]) and cfg.ppo.kl_coef == float(values[2])
        # eta is the clip transform's threshold: with the default transform (plain) neither arm reads it
        assert "reward.eta" in inert_keys(cfg)


def test_eta_is_live_only_for_the_clip_transform():
    assert "reward.eta" not in inert_keys(compose_config(["arm=prm", "reward.transform=clip"]))
    assert "reward.eta" in inert_keys(compose_config(["arm=orm"]))
    reward_keys = [k for k in inert_keys(compose_config(["arm=prm", "reward.transform=min_form"]))
                   if k.startswith("reward.")]
    assert reward_keys == ["reward.eta"]


def test_a_swept_key_the_run_never_reads_is_warned_about(caplog):
    cfg = compose_config(["arm=orm", "reward.eta=0.5"])
    with caplog.at_level(logging.WARNING, logger="prmppo"):
        assert warn_inert_overrides(cfg, ["arm=orm", "reward.eta=0.5", "++ppo.kl_coef=0.04"]) == ["reward.eta"]
    assert "reward.eta has no effect on this run (arm=orm" in caplog.text
    assert override_keys(["+a.b=1", "~c", "d=x=y"]) == {"a.b": "1", "c": "", "d": "x=y"}


def test_objective_is_a_dotted_path_into_the_summary():
    summary = {"eval": {"ppo": {"greedy_accuracy": 0.25}}, "flag": True}
    assert objective_value(summary, "eval.ppo.greedy_accuracy") == 0.25
    assert math.isnan(objective_value(summary, "eval.sft.greedy_accuracy"))
    assert math.isnan(objective_value(summary, "flag"))


@pytest.mark.slow  # a multirun of subprocess jobs
def test_a_failed_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    # job 0 is refused by config validation at run time, job 1 trains; the sweep must run both
    sweep_dir = tmp_path / "multirun"
    proc = run_prmppo(["-m", "stage=sft", "debug=smoke", "sft.steps=2", "sft.warmup_steps=1", "sft.eval_problems=0",
                       "task.rl.min_operands=1,4", f"artifacts_dir={tmp_path / 'artifacts'}",
                       f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "1 of 2 jobs did not succeed" in proc.stderr
    (failed_dir,) = sweep_dir.glob("0_*")
    (ok_dir,) = sweep_dir.glob("1_*")
    failed = json.loads((failed_dir / "stage_result.json").read_text())
    assert failed["status"] == "failed" and failed["error"]["refused"] is True
    assert "task.rl.min_operands=1" in failed["error"]["message"]
    ok = json.loads((ok_dir / "stage_result.json").read_text())
    assert ok["status"] == "ok" and (ok_dir / "metrics.jsonl").exists()
    record = json.loads((sweep_dir / "sweep_result.json").read_text())
    assert record["total"] == 2 and record["failed"] == 1
    assert [job["status"] for job in record["jobs"]] == ["failed", "ok"]
    assert "task.rl.min_operands=4" in record["jobs"][1]["overrides"]


def test_a_crashing_job_records_its_traceback(smoke_cfg, monkeypatch):
    from prmppo import sweep

    def crash(cfg):
        raise RuntimeError("boom in the trainer")

    monkeypatch.setattr(sweep, "run", crash)  # the app's run, as the sweep job calls it
    run_sweep_job = sweep.run_sweep_job
    cfg = smoke_cfg("stage=sft")
    assert math.isnan(run_sweep_job(cfg))
    result = json.loads((Path(cfg.run_dir) / "stage_result.json").read_text())
    assert result["status"] == "failed" and result["error"]["type"] == "RuntimeError"
    assert result["error"]["refused"] is False and "boom in the trainer" in result["error"]["traceback"]


def _compose_with_hydra(overrides: list[str]):
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def test_optional_optuna_sweeper_and_slurm_launcher_compose():
    optuna = _compose_with_hydra(["sweep=optuna"])
    assert optuna.hydra.sweeper._target_ == "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert optuna.hydra.sweeper.direction == "maximize" and "ppo.kl_coef" in optuna.hydra.sweeper.params
    slurm = _compose_with_hydra(["sweep=slurm", "experiment=math_shepherd_gsm8k", "model.path=/ckpt/m"])
    assert slurm.hydra.launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert slurm.hydra.launcher.gpus_per_node == 1 and slurm.ppo.kl_coef == 0.04
    validate_config(slurm)


@pytest.mark.slow  # a multirun of subprocess jobs
def test_optuna_sweeper_runs_trials_on_the_jobs_objective(tmp_path):
    sweep_dir = tmp_path / "optuna"
    proc = run_prmppo(["-m", "sweep=optuna", "stage=sft", "debug=smoke", "sft.steps=2", "sft.warmup_steps=1",
                       "sft.eval_problems=4", "objective=test.greedy_accuracy", "sft.lr=interval(0.001,0.01)",
                       "hydra.sweeper.n_trials=2", f"artifacts_dir={tmp_path / 'artifacts'}",
                       f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from omegaconf import OmegaConf

    results = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    trials = [json.loads((d / "stage_result.json").read_text()) for d in sorted(sweep_dir.glob("[0-9]_*"))]
    assert len(trials) == 2
    # the best value Optuna reports is the best objective the jobs returned
    assert results.best_value == max(t["summary"]["test"]["greedy_accuracy"] for t in trials)
    assert 0.001 <= results.best_params["sft.lr"] <= 0.01


@pytest.mark.slow  # a multirun of subprocess jobs
def test_parallel_launcher_runs_jobs_at_once_and_they_share_one_sft(tmp_path):
    # two jobs of one seed start together under the joblib launcher: one trains the SFT checkpoint,
    # the other waits on its build lock and reuses it
    sweep_dir, artifacts = tmp_path / "parallel", tmp_path / "artifacts"
    proc = run_prmppo(["-m", "sweep=parallel", "hydra.launcher.n_jobs=2", "stage=ppo", "debug=smoke", "arm=orm",
                       "ppo.iterations=1", "ppo.kl_coef=0.01,0.02", f"artifacts_dir={artifacts}",
                       f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((sweep_dir / "sweep_result.json").read_text())
    assert [job["status"] for job in record["jobs"]] == ["ok", "ok"], record
    assert len(list(artifacts.glob("sft-*"))) == 1 and len(list(artifacts.glob(".locks/sft-*.lock"))) == 1
    reused = ["reusing SFT checkpoint" in (d / "__main__.log").read_text() for d in sorted(sweep_dir.glob("[0-9]_*"))]
    assert sorted(reused) == [False, True], reused
    started = [json.loads((d / "run_info.json").read_text())["started_at"] for d in sorted(sweep_dir.glob("[0-9]_*"))]
    finished = [json.loads((d / "stage_result.json").read_text())["finished_at"] for d in sorted(sweep_dir.glob("[0-9]_*"))]
    assert max(started) < min(finished)  # they overlapped
